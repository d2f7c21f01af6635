"""Frozen configuration dataclasses for the engine, validated at creation.

Every per-family difference of the Llama family is a field of `ModelConfig`, so there is one model
implementation (`engine/models/llama.py`) and no `if family == ...` branches outside `from_hf_config`.
Mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral) are that model with some MLPs replaced by
a sparse MoE block; what differs between them (routing, shared expert, weight names, which layers are
sparse) is a `MoeConfig` (engine/moe_config.py). DeepSeek-V2/V3 are that MoE model with multi-head
latent attention in place of GQA: an `MlaConfig` (engine/mla_config.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.kv_tiers.types import TierConfig
from engine.mla_config import MlaConfig, mla_config_from_hf, yarn_mscale
from engine.moe_config import MOE_ARCHITECTURES, MoeConfig, moe_config_from_hf
from engine.quant.config import QUANTIZATION_METHODS, Fp8Config, checkpoint_fp8_config
from engine.sampling_params import MAX_DRAFT_TOKENS

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)
_QKV_BIAS_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
ATTENTION_BACKENDS = ("torch", "triton")
DISTRIBUTED_BACKENDS = ("nccl", "gloo")
# Decode batch sizes captured as CUDA graphs (vLLM-like ladder); a decode batch runs the smallest
# captured size that holds it, so each size up to 128 wastes at most a third of its rows on padding.
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.x frequency-dependent RoPE scaling ("llama3" rope_type); `None` means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN ("yarn" rope_type, DeepSeek): interpolate low frequencies by `factor`, keep high ones, ramp
    between the `beta_fast`/`beta_slow` rotation counts; cos/sin are scaled by `attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2/2.5; Llama with attention_bias)
    o_proj_bias: bool = False  # bias on o_proj too (Llama's attention_bias; Qwen2 has none there)
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None  # None: every layer has a dense MLP of `intermediate_size`
    mla: MlaConfig | None = None  # DeepSeek's latent attention; `head_dim` is then its rotary dim
    fp8: Fp8Config | None = None  # the checkpoint's own FP8 weight format (its quantization_config)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.moe is not None and any(i >= self.num_layers for i in self.moe.sparse_layers):
            raise ConfigError(f"MoE layers {self.moe.sparse_layers} out of range for {self.num_layers} layers")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the mixture of experts (else the dense MLP of `intermediate_size`)."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (the only place family differences are read)."""
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        num_heads = hf["num_attention_heads"]
        mla = mla_config_from_hf(arch, hf, _rope_params(hf))
        head_dim = mla.qk_rope_head_dim if mla else hf.get("head_dim") or hf["hidden_size"] // num_heads
        if mla is not None and hf.get("attention_bias"):
            raise ConfigError(f"{arch} with attention_bias is not supported")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if mla else hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch in _QKV_BIAS_ARCHITECTURES or bool(hf.get("attention_bias", False)),
            o_proj_bias=arch not in _QKV_BIAS_ARCHITECTURES and bool(hf.get("attention_bias", False)),
            qk_norm=arch in _QK_NORM_ARCHITECTURES,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=moe_config_from_hf(arch, hf),
            mla=mla,
            fp8=checkpoint_fp8_config(hf),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        try:
            return cls.from_hf_config(json.loads(cfg_path.read_text()))
        except FileNotFoundError as e:
            raise ConfigError(f"no config.json in {path}") from e
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ConfigError(f"invalid config.json in {path}: {e}") from e


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 moved rope settings into `rope_parameters`; older configs use `rope_scaling`.
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_theta(hf: dict[str, Any]) -> float:
    return float(hf.get("rope_theta") or _rope_params(hf).get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | YarnScaling | None:
    rs = _rope_params(hf)
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind == "yarn":
        return _yarn_scaling(rs, hf)
    if kind != "llama3":
        raise ConfigError(f"unsupported rope scaling {kind!r}; supported: default, llama3, yarn")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


def _yarn_scaling(rs: dict[str, Any], hf: dict[str, Any]) -> YarnScaling:
    """transformers' `_compute_yarn_parameters` inputs; DeepSeek's attention factor is
    mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    original = int(rs.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048))
    factor = float(rs.get("factor") or hf.get("max_position_embeddings", original) / original)
    attention = rs.get("attention_factor")
    if attention is None:
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor, 1.0))
    if rs.get("truncate") is False:
        raise ConfigError("yarn rope scaling with truncate=false is not supported")
    return YarnScaling(factor=factor, original_max_position_embeddings=original,
                       beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                       attention_factor=float(attention))


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing: `num_blocks` wins; otherwise the pool is sized from `memory_bytes`."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int = 512 * 1024**2
    enable_prefix_caching: bool = True
    # "auto": the model's dtype; "fp8_e4m3": one byte per value with per-layer K and V scales, twice
    # the tokens in the same memory (engine/kv_cache.py).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; valid: {', '.join(KV_CACHE_DTYPES)}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")


@dataclass(frozen=True)
class BatcherConfig:
    """Iteration-level scheduling limits."""

    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_prefill_chunk: int = 512  # longest prefill chunk of one sequence in one step

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("max_num_batched_tokens must be >= max_num_seqs so every decode fits a step")


@dataclass(frozen=True)
class SpeculativeConfig:
    """N-gram (prompt-lookup) speculative decoding (engine/speculative).

    A decoding sequence drafts up to `num_draft_tokens` tokens by finding the latest earlier
    occurrence of its last n tokens (n from `ngram_max` down to `ngram_min`) in its prompt + output
    and copying what followed; one forward pass verifies them. `num_draft_tokens` is the default of
    requests that do not set their own (0: speculation off unless a request asks for it).
    """

    num_draft_tokens: int = 0
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if not 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor, pipeline or expert parallelism inside one worker: one process per GPU, rank 0 drives.

    Expert parallelism (`expert_parallel_size`, MoE models) gives each rank `num_experts / ep` of
    every MoE block's experts; attention and dense layers are replicated (engine/parallel/expert.py).
    The two do not compose yet: one of the sizes must be 1.

    Pipeline parallelism (`pipeline_parallel_size`) splits the layers over stages; it composes with
    tensor parallelism: world rank = stage * tensor_parallel_size + tensor rank (engine/parallel/pipeline.py).
    With `pipeline_overlap` (the default) the engine keeps up to one batch per stage in flight, each
    on its own stage, so no stage idles between steps (engine/parallel/pipeline_rounds.py); off, each
    step goes through the stages alone, in `pipeline_microbatches` pieces (None: one per stage).

    Ranks meet over TCP at `master_addr:master_port` (None: rank 0 picks a free port). The model's
    collectives use `distributed_backend` (None: NCCL on CUDA, gloo on CPU); control messages (the
    step's plan) always go over gloo, so they never queue behind GPU work.
    """

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_microbatches: int | None = None  # step-at-a-time schedule only (pipeline_overlap off)
    pipeline_overlap: bool = True  # batches in flight across steps under pipeline parallelism
    distributed_backend: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    timeout_s: float = 600.0  # a rank that dies mid-collective fails the others after this long
    # NVLink multicast (NVLS) stays off unless asked for: on shared hosts it has put every GPU of the
    # node out of service, and TP all-reduces of decode-sized messages gain little from it.
    allow_nvls: bool = False

    @property
    def world_size(self) -> int:
        """Processes (and GPUs) of the worker's group."""
        return self.tensor_parallel_size * self.expert_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.expert_parallel_size < 1:
            raise ConfigError(f"expert_parallel_size must be >= 1, got {self.expert_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pipeline_microbatches is not None and self.pipeline_microbatches < 1:
            raise ConfigError(f"pipeline_microbatches must be >= 1, got {self.pipeline_microbatches}")
        if self.pipeline_parallel_size > 1 and self.expert_parallel_size > 1:
            raise ConfigError("pipeline and expert parallelism together are not supported: set one of "
                              f"pipeline_parallel_size ({self.pipeline_parallel_size}) and expert_parallel_size "
                              f"({self.expert_parallel_size}) to 1")
        if self.tensor_parallel_size > 1 and self.expert_parallel_size > 1:
            raise ConfigError("tensor and expert parallelism together are not supported: set one of "
                              f"tensor_parallel_size ({self.tensor_parallel_size}) and expert_parallel_size "
                              f"({self.expert_parallel_size}) to 1")
        if self.distributed_backend not in (None, *DISTRIBUTED_BACKENDS):
            raise ConfigError(f"unknown distributed_backend {self.distributed_backend!r}; valid: None (auto), "
                              f"{', '.join(DISTRIBUTED_BACKENDS)}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s}")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # HF safetensors dir, .gguf file, or a config.json dir with load_format="dummy"
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "torch"
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    # "fp8": quantize an unquantized checkpoint's dense projections to FP8 at load (engine/quant/); an
    # FP8 checkpoint runs as stored either way. None: as the checkpoint is.
    quantization: str | None = None
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    cache_dir: str | None = None  # where the default model is prepared (None: ~/.cache/baton)
    cache: CacheConfig = field(default_factory=CacheConfig)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    tiers: TierConfig = field(default_factory=TierConfig)  # host / disk KV below the GPU pool (off by default)
    # CUDA graphs replay decode-only steps (triton backend on CUDA only: the torch reference syncs
    # and allocates per step, so it cannot be captured). True runs every step eagerly.
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = CUDA_GRAPH_BATCH_SIZES

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"unknown attention backend {self.attention_backend!r}; valid: {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ConfigError(f"unknown quantization {self.quantization!r}; valid: none, "
                              f"{', '.join(QUANTIZATION_METHODS)}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ConfigError(f"unknown load_format {self.load_format!r}; valid: auto, safetensors, gguf, dummy")
        sizes = self.cuda_graph_batch_sizes
        if any(s <= 0 for s in sizes) or list(sizes) != sorted(set(sizes)):
            raise ConfigError(f"cuda_graph_batch_sizes must be positive, strictly increasing; got {sizes}")
        if self.tiers.enabled and self.parallel.world_size > 1:
            raise ConfigError("KV tiers (--host-kv-gib, --disk-kv-gib) need tensor_parallel_size, "
                              "pipeline_parallel_size and expert_parallel_size 1")
        if self.parallel.world_size > 1 and self.device not in ("cpu", "cuda"):
            raise ConfigError(f"with tensor, pipeline or expert parallelism device must be 'cpu' or 'cuda' "
                              f"(rank r takes cuda:r), got {self.device!r}")

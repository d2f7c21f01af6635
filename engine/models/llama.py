"""The one Llama-family model: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2, and the mixture-of-experts
families Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3.

Every family difference is a `ModelConfig` field (q/k/v bias, q/k norm, tied embeddings, RoPE
scaling, `moe`: which layers' MLPs are a sparse MoE block, engine/layers/moe.py; `mla`: DeepSeek's
latent attention in place of GQA, engine/layers/mla.py), so there is no per-family code here. The
model is a pure function of the step's flat token batch: `forward(input_ids[T], positions[T], kv_cache,
meta)`; it owns no cache and no sequence state, which the model runner holds.

Weights are uninitialised at construction (fast for multi-GB models) and always come from
`load_weights`, which takes Hugging Face parameter names and merges q/k/v and gate/up into single
matmuls on the way in.

Tensor parallelism (`tp`, Megatron-style): each rank holds `num_heads / tp` query heads and their KV
heads (`num_kv_heads / tp`, or one replicated KV head when there are fewer KV heads than ranks),
`intermediate_size / tp` MLP features and `ceil(vocab / tp)` vocabulary rows. Every rank loads the
full HF tensors and keeps its slice, so a checkpoint needs no resharding. Two all-reduces per layer
(after o_proj and down_proj), one for the embedding, one all-gather for the logits.

Pipeline parallelism (`tp.pipeline`, engine/parallel/pipeline.py): a stage builds only its layers
(the others are parameter-free `MissingLayer` placeholders, so parameter names keep their global
layer numbers and checkpoints load unchanged), the embedding on the first stage, the final norm and
the LM head on the last. Its KV cache holds its layers only: layer i is at index `i - first layer`.
`forward_stage` runs one stage on what the previous one sent.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from engine.attention.base import UNSCALED, AttentionBackend, AttentionMetadata, KVScale
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import ColumnParallelLinear, Linear, OutputShard, RowParallelLinear, copy_checked
from engine.layers.mla import MLAAttention
from engine.layers.mlp import SwiGLUMLP
from engine.layers.moe import SparseMoeBlock
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.parallel.group import TensorParallel, check_parallel, kv_head_start, local_kv_heads
from engine.parallel.pipeline import Activations
from engine.quant.config import Fp8Config
from engine.quant.fp8_load import SCALE_KINDS

# HF projection name -> (merged module, shard index) for the projections we fuse.
_MERGED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_MERGED_NAME = re.compile(
    r"^(model\.layers\.\d+)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias|weight_scale"
    r"|weight_scale_inv|input_scale)$"
)
# A decoder-layer part that loads its own checkpoint tensors (named relative to its prefix).
SelfLoadingPart = SparseMoeBlock | MLAAttention
# Checkpoint entries that are derived state, not parameters (old HF Llama exports carry these).
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
# Weights outside the layers that only some pipeline stages hold.
_STAGE_OWNED_PREFIXES = ("model.embed_tokens.", "model.norm.", "lm_head.")
# FP8 KV cache scales as FP8 checkpoints name them (compressed-tensors `kv_cache_scheme`; older exports put
# them on the projections' outputs).
_KV_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.layer = layer - tp.pipeline.layers(config.num_layers).start  # in this stage's KV cache
        self.backend = backend
        self.head_dim = d = config.head_dim
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = local_kv_heads(config.num_kv_heads, tp.size)
        q_shard = OutputShard.even(config.num_heads * d, tp, "num_heads * head_dim")
        kv_start = kv_head_start(config.num_kv_heads, tp) * d
        kv_shard = OutputShard(config.num_kv_heads * d, kv_start, self.num_kv_heads * d)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_shard, kv_shard, kv_shard],
                                             bias=config.attention_bias)
        self.split_sizes = list(self.qkv_proj.output_sizes)
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, config.o_proj_bias, tp)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.scale = d**-0.5
        self.kv_scale: KVScale = UNSCALED  # an FP8 cache's K/V scales (the checkpoint's k_scale/v_scale)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, head_dim/2]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head norm before RoPE
            q, k = self.q_norm.normalize(q), self.k_norm.normalize(k)
        q = self.backend.rotate_and_write_kv(kv_cache, self.layer, q, k, v, rope, meta.slot_mapping, self.kv_scale)
        out = self.backend.attend(q, kv_cache, self.layer, meta, self.scale, self.kv_scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn: LlamaAttention | MLAAttention = (
            MLAAttention(config, layer, backend, tp) if config.mla else LlamaAttention(config, layer, backend, tp)
        )
        self.mlp: SwiGLUMLP | SparseMoeBlock = (
            SparseMoeBlock(config, tp) if config.is_sparse_layer(layer)
            else SwiGLUMLP(config.hidden_size, config.intermediate_size, tp)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(mlp output, residual stream)`; the next layer's norm adds the two."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class MissingLayer(nn.Module):
    """Stands for a layer another pipeline stage holds: no parameters, never called."""


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        stage = tp.pipeline
        self.stage_layers = stage.layers(config.num_layers)
        # The last stage of a tied model needs the embedding matrix as its LM head.
        needs_embedding = stage.is_first or (stage.is_last and config.tie_word_embeddings)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
                             if needs_embedding else None)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, backend, tp) if i in self.stage_layers
                                    else MissingLayer() for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.forward_stage(input_ids, positions, kv_cache, meta, None).hidden

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, incoming: Activations | None) -> Activations:
        """This stage's layers on the embedded tokens (first stage) or on `incoming`; the last stage
        returns the normed output."""
        if incoming is None:
            assert self.embed_tokens is not None, "only the first stage embeds tokens"
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = incoming.hidden, incoming.residual
        rope = self.rotary(positions, x.dtype)  # once per step, shared by every layer
        for i in self.stage_layers:
            x, residual = self.layers[i](x, residual, rope, kv_cache, meta)
        if self.norm is None:
            return Activations(x, residual)
        return Activations(self.norm(x, residual)[0], None)


class LlamaForCausalLM(nn.Module):
    """Build on the target device (e.g. under `with torch.device(...)`), not on "meta": the RoPE tables
    are computed at construction. Cast with `.to(dtype)` before `load_weights` or after; both work.
    `tp` defaults to a group of one: the single-device model."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        check_parallel(config, tp.size, tp.expert.size, tp.pipeline.size)
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, backend, tp)
        # Tied models (SmolLM2, small Qwens) reuse the embedding matrix; no lm_head parameter exists.
        self.lm_head = (
            None if config.tie_word_embeddings or not tp.pipeline.is_last
            else ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, the step's tokens of every sequence, flattened
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        return self.model(input_ids, positions, kv_cache, meta)

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, incoming: Activations | None) -> Activations:
        """One pipeline stage (see LlamaModel.forward_stage); `kv_cache` holds this stage's layers."""
        return self.model.forward_stage(input_ids, positions, kv_cache, meta, incoming)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden] -> [N, vocab]` float32, whole on every rank; the runner passes only sampled rows."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        assert head is not None, "only the last stage computes logits"
        return head.logits(hidden)

    def use_fp8(self, config: Fp8Config) -> None:
        """Hold the projections in FP8: attention (GQA's, or MLA's but for kv_b_proj: engine/layers/mla.py),
        dense MLPs, MoE experts and shared experts (engine/layers/moe.py). Call before `load_weights`,
        after any `.to(dtype)`. The router, norms, embeddings and the LM head keep the activation dtype, and
        so do the GQA and dense-MLP projections `config` ignores (a checkpoint's list of modules it left
        unquantized)."""
        for index, layer in enumerate(self.model.layers):
            if not isinstance(layer, LlamaDecoderLayer):  # another pipeline stage's
                continue
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(attn, MLAAttention):
                attn.use_fp8(config)
            else:
                self._use_fp8_unless_ignored(config, index, layer, (attn.qkv_proj, attn.o_proj))
            if isinstance(mlp, SwiGLUMLP):
                self._use_fp8_unless_ignored(config, index, layer, (mlp.gate_up_proj, mlp.down_proj))
            else:
                mlp.use_fp8(config)

    def _use_fp8_unless_ignored(self, config: Fp8Config, index: int, layer: nn.Module,
                                linears: tuple[Linear, ...]) -> None:
        for linear in linears:
            if not config.ignores_merged(self._hf_projection_names(index, layer, linear)):
                linear.use_fp8(config)

    @staticmethod
    def _hf_projection_names(index: int, layer: nn.Module, linear: nn.Module) -> list[str]:
        """The checkpoint's module names of decoder layer `index`'s (possibly merged) projection `linear`."""
        local = next(name for name, module in layer.named_modules() if module is linear)
        parts = [hf for hf, (merged, _) in _MERGED.items() if merged == local] or [local]
        return [f"model.layers.{index}.{part}" for part in parts]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load from Hugging Face names; every parameter must be covered exactly, or ModelLoadError.
        FP8 scales (`weight_scale`, `weight_scale_inv`, `input_scale`) go to FP8 projections."""
        params = dict(self.named_parameters())
        moe_blocks: dict[str, SelfLoadingPart] = {**self._moe_blocks(), **self._mla_blocks()}
        expected = _expected_hf_names(params, tied=self.lm_head is None, moe_blocks=moe_blocks)
        seen: set[str] = set()
        for name, tensor in weights:
            if _IGNORED.search(name) or (name == "lm_head.weight" and self.lm_head is None):
                continue  # tied checkpoints may still list lm_head: it is the embedding (or another stage's)
            if name not in expected and self._held_by_another_stage(name):
                continue  # its FP8 scales too
            if kv_scale := _KV_SCALE_NAME.match(name):
                self._load_kv_scale(int(kv_scale[1]), kv_scale[2] or kv_scale[3], tensor)
                continue
            is_scale = name.rsplit(".", 1)[-1] in SCALE_KINDS
            if is_scale and not self._dense_projections():
                raise ModelLoadError(f"checkpoint holds FP8 scale {name!r} but the model was built unquantized")
            if name not in expected and not is_scale:
                raise ModelLoadError(f"unexpected weight {name!r} for {self.config.architecture}")
            self._load_one(name, tensor, params, moe_blocks)
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ModelLoadError(f"checkpoint is missing {len(missing)} weights: {shown}")
        for module_name, linear in self._dense_projections().items():
            linear.check_loaded(module_name)
        for prefix, part in moe_blocks.items():
            part.check_loaded(prefix)

    def _load_kv_scale(self, layer: int, which: str, tensor: torch.Tensor) -> None:
        """Keep a checkpoint's per-layer K or V scale (used only when the KV cache is FP8)."""
        if tensor.numel() != 1:
            raise ModelLoadError(f"layer {layer} {which}_scale: only per-tensor KV scales are supported, "
                                 f"got shape {tuple(tensor.shape)}")
        decoder = self.model.layers[layer]
        if not isinstance(decoder, LlamaDecoderLayer):  # another pipeline stage's layer
            return
        attn = decoder.self_attn
        if not isinstance(attn, LlamaAttention):
            raise ModelLoadError(f"layer {layer} {which}_scale: FP8 KV scales are not supported with MLA attention")
        value = float(tensor.reshape(()))
        attn.kv_scale = replace(attn.kv_scale, **{which: value})

    def _decoder_layers(self) -> list[LlamaDecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, LlamaDecoderLayer)]

    def _dense_projections(self) -> dict[str, Linear]:
        """The FP8 projections by module name (empty for an unquantized model)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Linear) and m.fp8 is not None}

    def _held_by_another_stage(self, name: str) -> bool:
        """Whether `name` is a weight of the pipeline stages this one is not: every stage reads the
        whole checkpoint and keeps its own layers."""
        if self.tp.pipeline.size == 1:
            return False
        layer = _LAYER_NAME.match(name)
        if layer is not None:
            return int(layer.group(1)) not in self.model.stage_layers
        return name.startswith(_STAGE_OWNED_PREFIXES)

    def expert_load(self) -> torch.Tensor | None:
        """Token slots routed to each expert since the model was built, `[sparse layers, E]` int64 on the
        host (one copy from the device); None for a dense model."""
        blocks = list(self._moe_blocks().values())
        return torch.stack([b.expert_tokens for b in blocks]).cpu() if blocks else None

    def reset_expert_load(self) -> None:
        """Zero the per-expert counts (after warm-up and graph capture, which route dummy rows)."""
        for block in self._moe_blocks().values():
            block.expert_tokens.zero_()

    def _moe_blocks(self) -> dict[str, SparseMoeBlock]:
        """The sparse layers' MoE blocks by checkpoint name prefix (`model.layers.3.block_sparse_moe.`)."""
        if self.config.moe is None:
            return {}
        block_name = self.config.moe.names.block
        return {f"model.layers.{i}.{block_name}.": mlp for i, layer in enumerate(self.model.layers)
                if isinstance(mlp := getattr(layer, "mlp", None), SparseMoeBlock)}  # MissingLayer: no mlp

    def _mla_blocks(self) -> dict[str, MLAAttention]:
        """MLA attention modules by checkpoint name prefix (`model.layers.3.self_attn.`): they load their
        own tensors, as MoE blocks do."""
        return {f"model.layers.{i}.self_attn.": attn for i, layer in enumerate(self.model.layers)
                if isinstance(attn := getattr(layer, "self_attn", None), MLAAttention)}  # MissingLayer: none

    def _load_one(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                  moe_blocks: dict[str, SelfLoadingPart]) -> None:
        """Route one HF tensor to its layer; sharded layers keep only this rank's slice of it."""
        merged = _MERGED_NAME.match(name)
        moe_prefix = next((prefix for prefix in moe_blocks if name.startswith(prefix)), None)
        try:
            if moe_prefix is not None:
                moe_blocks[moe_prefix].load(name.removeprefix(moe_prefix), tensor)
                return
            if merged is not None:
                prefix, proj, kind = merged.groups()
                module_name, shard = _MERGED[proj]
                module = self.get_submodule(f"{prefix}.{module_name}")
                assert isinstance(module, ColumnParallelLinear)
                module.load_shard(shard, kind, tensor)
                return
            module_name, kind = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if isinstance(module, RowParallelLinear | VocabParallelEmbedding):
                module.load(kind, tensor)
            else:  # replicated: norms
                copy_checked(params[name].data, tensor, name)
        except ModelLoadError as e:
            raise ModelLoadError(e.args[0] if name in e.args[0] else f"{name}: {e}") from e


def _expected_hf_names(params: dict[str, nn.Parameter], tied: bool,
                       moe_blocks: dict[str, SelfLoadingPart]) -> set[str]:
    """Our parameter names translated to the HF names a checkpoint must provide."""
    names = {prefix + name for prefix, block in moe_blocks.items() for name in block.hf_names()}
    # Our modules behind each block (an MoE block is `mlp` whatever the checkpoint calls it).
    owned = tuple(prefix.rsplit(".", 2)[0] + (".self_attn." if prefix.endswith(".self_attn.") else ".mlp.")
                  for prefix in moe_blocks)
    for name in params:
        if name.startswith(owned):
            continue  # the block's parameters: named above, as the checkpoint names them
        for hf_proj, (merged, _) in _MERGED.items():
            if f".{merged}." in name:
                names.add(name.replace(merged, hf_proj))
        if not any(f".{merged}." in name for merged, _ in _MERGED.values()):
            names.add(name)
    assert not tied or "lm_head.weight" not in names
    return names

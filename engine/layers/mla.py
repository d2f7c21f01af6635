"""DeepSeek's multi-head latent attention (MLA) over the latent paged cache.

    q          = q_proj(x)  or  q_b_proj(norm(q_a_proj(x)))                 [T, H, nope + rope]
    c, k_rope  = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)             [T, C], [T, R]
    cache     <- [c | rope(k_rope)]                                          one vector per token
    k_h = [W_UK_h c | k_rope],  v_h = W_UV_h c                              (W_UK, W_UV: kv_b_proj)

Decode uses the absorbed form: `q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c`, so the query is
mapped into latent space once per token and attention runs over the cached latents directly; its
output, a weighted sum of latents, goes through W_UV_h afterwards. Steps with prefill chunks expand
the context instead (engine/attention/mla.py says why). Both give the same result as HF's, which
always expands.

Interleaved-rope checkpoints (DeepSeek's own layout) have their rotary rows permuted at load so the
engine's rotate-half RoPE applies (engine/mla_config.py).

Tensor parallelism shards the heads: each rank holds `num_heads / tp` query heads (`q_proj` or `q_b_proj`
rows), their slice of `kv_b_proj` (W_UK_h, W_UV_h) and of `o_proj`'s input columns, whose partial products
are all-reduced. The latent is shared by every head, so `q_a_proj`, `kv_a_proj_with_mqa` and their norms
are replicated and every rank caches the whole latent (the cache is the same on every rank: TP divides
attention compute and weights, not KV memory). Expert parallelism replicates attention whole.

FP8 (`use_fp8`: DeepSeek-V3's 128 x 128 block-scaled checkpoints, or online quantization): q_proj /
q_a_proj / q_b_proj, kv_a_proj_with_mqa and o_proj are FP8 linears. kv_b_proj stays in the activation
dtype, an FP8 checkpoint's e4m3 values dequantized as they load: decode never multiplies by it as a
linear (its rows are W_UK and W_UV, absorbed into batched matmuls with the query and the latent
output), and the prefill path expands the cached latents with its weight directly; it is ~0.15% of
DeepSeek-V3's weight bytes. The de-interleaving row permutation applies to stored e4m3 rows and their
per-row scales alike; block scales are unaffected as long as each rotary block lies inside one 128-row
scale block (DeepSeek-V3's do), which loading checks.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.mla import expanded_context, latent_decode, write_latent
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.fp8_dequant import Fp8Dequantizer
from engine.layers.linear import ColumnParallelLinear, Linear, OutputShard, RowParallelLinear, copy_checked
from engine.layers.norm import RMSNorm
from engine.layers.rotary import apply_rotary
from engine.mla_config import MlaConfig, mla_hf_shapes
from engine.parallel.group import TensorParallel
from engine.quant.config import BLOCK, Fp8Config
from engine.quant.fp8_load import WEIGHT_SCALE, WEIGHT_SCALE_INV


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        assert config.mla is not None, "MLAAttention built for a model without MLA"
        self.mla: MlaConfig = config.mla
        self.layer = layer - tp.pipeline.layers(config.num_layers).start  # in this stage's KV cache
        self.backend = backend
        self.total_heads = config.num_heads
        self.num_heads = config.num_heads // tp.size  # this rank's
        mla, h = self.mla, config.hidden_size
        self.shapes = mla_hf_shapes(mla, h, self.total_heads)  # the checkpoint's (whole) tensors

        def heads(per_head: int, input_size: int) -> ColumnParallelLinear:  # this rank's heads' rows
            shard = OutputShard.even(self.total_heads * per_head, tp, "num_heads")
            return ColumnParallelLinear(input_size, [shard], bias=False)

        q_lora = mla.q_lora_rank
        self.q_proj = heads(mla.qk_head_dim, h) if q_lora is None else None
        self.q_a_proj = Linear(h, q_lora, bias=False) if q_lora is not None else None
        self.q_a_layernorm = RMSNorm(q_lora, config.rms_norm_eps) if q_lora is not None else None
        self.q_b_proj = heads(mla.qk_head_dim, q_lora) if q_lora is not None else None
        self.kv_a_proj_with_mqa = Linear(h, mla.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = heads(mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        self.o_proj = RowParallelLinear(self.total_heads * mla.v_head_dim, h, False, tp)
        self.kv_b_fp8 = Fp8Dequantizer()  # an FP8 checkpoint's kv_b_proj halves (module docstring)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, R/2]
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 1, block_size, 1, C + R]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        mla, tokens = self.mla, x.shape[0]
        q = self._query(x).view(tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm.normalize(latent)
        q_rope = apply_rotary(q_rope, *rope)
        k_rope = apply_rotary(k_rope.unsqueeze(1), *rope).squeeze(1)
        write_latent(self.backend, kv_cache, self.layer, torch.cat([latent, k_rope], dim=-1), meta.slot_mapping)
        if meta.is_decode_only:
            out = self._absorbed_attention(q_nope, q_rope, kv_cache, meta)
        else:
            out = self._expanded_attention(q_nope, q_rope, kv_cache, meta)
        return self.o_proj(out.reshape(tokens, self.num_heads * mla.v_head_dim))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm.normalize(self.q_a_proj(x)))

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK `[H, nope, C]` and W_UV `[H, v, C]`, views of kv_b_proj's weight."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, :mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim:]

    def _absorbed_attention(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                            meta: AttentionMetadata) -> torch.Tensor:  # [T, H, v]
        w_uk, w_uv = self._kv_b()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, C]
        query = torch.cat([q_latent, q_rope], dim=-1)
        out_latent = latent_decode(self.backend, query, kv_cache, self.layer, meta, self.mla.softmax_scale,
                                   self.mla.kv_lora_rank)  # [T, H, C]
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _expanded_attention(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                            meta: AttentionMetadata) -> torch.Tensor:  # [T, H, v]
        mla = self.mla
        ctx = expanded_context(kv_cache, self.layer, meta, self.kv_b_proj.weight, mla.qk_nope_head_dim,
                               mla.v_head_dim)
        dim = ctx.kv_cache.shape[-1]
        query = torch.cat([q_nope, q_rope], dim=-1)
        if dim > query.shape[-1]:  # zero features add nothing to q.k
            query = torch.nn.functional.pad(query, (0, dim - query.shape[-1]))
        out = self.backend.attend(query.contiguous(), ctx.kv_cache, 0, ctx.meta, mla.softmax_scale)
        return out[..., :mla.v_head_dim]

    def use_fp8(self, config: Fp8Config) -> None:
        """Hold every projection but kv_b_proj in FP8 (module docstring); before loading."""
        for linear in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.o_proj):
            if linear is not None:
                linear.use_fp8(config)

    def hf_names(self) -> set[str]:
        """The checkpoint's names of this layer's attention tensors, relative to `model.layers.{i}.self_attn.`."""
        return set(self.shapes)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor (whole): a weight, or an FP8 weight's scale; head-sharded projections keep
        this rank's heads."""
        base, kind = name.rsplit(".", 1)
        if name not in self.shapes and not (Fp8Dequantizer.wants(kind, tensor) and f"{base}.weight" in self.shapes):
            raise ModelLoadError(f"unexpected MLA attention weight {name!r}")
        if kind == "weight" and tuple(tensor.shape) != self.shapes[name]:
            raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {self.shapes[name]}")
        if base == "kv_b_proj" and Fp8Dequantizer.wants(kind, tensor):
            dequantized = self.kv_b_fp8.take(base, kind, tensor)
            if dequantized is not None:
                self.kv_b_proj.load_shard(0, "weight", dequantized)
            return
        if self.mla.rope_interleaved and base in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa"):
            tensor = self._deinterleave_rope(base, kind, tensor)
        module = self.get_submodule(base)
        if isinstance(module, ColumnParallelLinear):
            module.load_shard(0, kind, tensor)
        elif isinstance(module, RowParallelLinear):
            module.load(kind, tensor)
        elif isinstance(module, Linear):  # replicated: the latent's projection, q_a_proj
            module.load_replicated(kind, tensor)
        else:  # the norms
            copy_checked(self.get_parameter(name).data, tensor, name)

    def check_loaded(self, prefix: str) -> None:
        """Raise if kv_b_proj's FP8 weight came without its scale (the FP8 linears check their own)."""
        self.kv_b_fp8.check_complete(prefix)

    def _deinterleave_rope(self, base: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """Reorder each rotary block's rows `x0 x1 x2 x3 ..` to `x0 x2 .. x1 x3 ..` (module docstring):
        a weight's rows and a per-row scale's alike; a block scale must not see its rows move between
        scale blocks, and then needs no change."""
        spans = self._rope_spans(base)
        if kind == WEIGHT_SCALE_INV:
            for first, count in spans:
                if first // BLOCK != (first + count - 1) // BLOCK:
                    raise ModelLoadError(f"{base}: rotary rows {first}..{first + count - 1} straddle two 128-row "
                                         "FP8 scale blocks; this checkpoint's interleaved rope cannot be reordered")
            return tensor
        if kind not in ("weight", WEIGHT_SCALE) or tensor.numel() == 1:
            return tensor  # input scales; per-tensor scales
        rope = self.mla.qk_rope_head_dim
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        rows = torch.arange(tensor.shape[0])
        for first, _ in spans:
            rows[first:first + rope] = first + order
        return tensor.index_select(0, rows.to(tensor.device))

    def _rope_spans(self, base: str) -> list[tuple[int, int]]:
        """`(first row, count)` of each rotary block of a projection's output rows."""
        mla = self.mla
        rope = mla.qk_rope_head_dim
        if base == "kv_a_proj_with_mqa":
            return [(mla.kv_lora_rank, rope)]
        return [(h * mla.qk_head_dim + mla.qk_nope_head_dim, rope) for h in range(self.total_heads)]

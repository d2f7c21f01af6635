"""FP8 on a CUDA GPU at Llama-3.1-8B shape: the e4m3 GEMMs (the Triton weight-only kernel for decode sizes,
`torch._scaled_mm` row-wise and 1x128 x 128x128 block-scaled past them, after a one-launch activation
quantization that must give torch's bytes exactly) and the FP8 KV cache kernels (KV
store, RoPE + KV store, paged decode and prefill) against the torch reference run on the same GPU.

Tolerances, and why:
- GEMM vs the reference (the same rounded operands multiplied in float32; unrounded activations for the
  weight-only kernel): ||out - ref|| / ||ref|| <= 1e-2
  (bf16 output rounding plus accumulation order); vs the exact bf16 product <= 6e-2 (two e4m3 roundings).
- KV stores: bit-identical e4m3 bytes (the GPU converts float32 -> e4m3 with round-to-nearest-even and
  saturation, as the reference does after its own clamp), except where the RoPE kernel's float32 products
  differ from torch's in a last bf16 bit (<= 1% of the bytes, each at most one e4m3 step).
- Attention over an FP8 cache vs the torch reference over the same cache: ||out - ref|| / ||ref|| <= 2e-2
  (both read the same e4m3 values; bf16 operands and reduction order differ).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.required import require_module

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
require_module("triton")

from engine.attention.base import AttentionMetadata, KVScale  # noqa: E402
from engine.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.kernels.kv_store import store_kv  # noqa: E402
from engine.kernels.rope_kv_store import rope_and_store_kv  # noqa: E402
from engine.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from engine.quant.fp8 import (  # noqa: E402
    WEIGHT_ONLY_MAX_ROWS,
    dequantize_blocks,
    dequantize_rows,
    fp8_linear,
    quantize_blocks,
    quantize_rows,
    reference_linear,
)

HIDDEN, MLP, H_Q, H_KV, HEAD_DIM, BLOCK, LAYERS = 4096, 14336, 32, 8, 128, 16, 2
DEVICE = torch.device("cuda")
SCALE = KVScale(k=0.04, v=0.02)
needs_sm89 = pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU of capability 8.9+ (FP8 GEMMs)")


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@needs_sm89
@pytest.mark.parametrize("tokens", [1, 16, 17, 64, 99, 4096])
@pytest.mark.parametrize("scaling", ["rows", "blocks"])
def test_fp8_gemm_matches_the_reference(tokens: int, scaling: str) -> None:
    """Up to WEIGHT_ONLY_MAX_ROWS tokens the Triton weight-only kernel (activations unrounded), past it
    `_scaled_mm` (activations rounded per token): each against the reference of its own rounding."""
    if scaling == "blocks" and tokens > WEIGHT_ONLY_MAX_ROWS and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a CUDA GPU of capability 9.0+ (block-scaled _scaled_mm)")
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(MLP, HIDDEN, device=DEVICE, generator=gen, dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_rows(w) if scaling == "rows" else quantize_blocks(w)
    out = fp8_linear(x, wq, ws, None)
    dequantized = dequantize_rows(wq, ws) if scaling == "rows" else dequantize_blocks(wq, ws)
    if tokens <= WEIGHT_ONLY_MAX_ROWS:
        reference = x.float() @ dequantized.t()
    else:
        reference = reference_linear(x.float(), dequantized, blocked=scaling == "blocks")  # float32, on the GPU
    assert out.dtype == torch.bfloat16 and rel(out, reference) <= 1e-2
    assert rel(out, x.float() @ w.float().t()) <= 6e-2


@needs_sm89
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (1000, 1000)])
@pytest.mark.parametrize("scaling", ["rows", "blocks"])
def test_weight_only_kernel_matches_the_reference_and_replays_in_a_graph(n: int, k: int, scaling: str) -> None:
    """The kernel at 8B projection shapes and a ragged one: <= 1e-2 relative to x times the dequantized
    weight in float32 (bf16 output rounding, accumulation order), and identical when replayed from a CUDA
    graph, as the decode step runs it."""
    from engine.kernels.fp8_weight_gemm import MAX_ROWS, fp8_weight_gemm

    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    w = torch.randn(n, k, device=DEVICE, generator=gen) * 0.02
    wq, ws = quantize_rows(w) if scaling == "rows" else quantize_blocks(w)
    w_real = dequantize_rows(wq, ws) if scaling == "rows" else dequantize_blocks(wq, ws)
    for m in (1, 3, WEIGHT_ONLY_MAX_ROWS, 29, MAX_ROWS):  # row tiles of 16, 32 and 64
        x = torch.randn(m, k, device=DEVICE, generator=gen, dtype=torch.bfloat16)
        eager = fp8_weight_gemm(x, wq, ws)
        assert rel(eager, x.float() @ w_real.t()) <= 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_weight_gemm(x, wq, ws)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


@needs_sm89
@pytest.mark.parametrize("m", [16, 29, 64])
@pytest.mark.parametrize("scaling", ["rows", "blocks"])
def test_fp8_activation_kernel_matches_the_reference(m: int, scaling: str) -> None:
    """The GEMM kernel with e4m3 activations (both operands on the FP8 tensor cores): <= 1e-2 relative to the
    float32 product of the two dequantized operands, and identical when replayed from a CUDA graph."""
    from engine.kernels.fp8_quant import quantize_activations
    from engine.kernels.fp8_weight_gemm import fp8_weight_gemm
    from engine.quant.fp8 import dequantize_blocks_rows

    gen = torch.Generator(device=DEVICE).manual_seed(m)
    w = torch.randn(HIDDEN, MLP, device=DEVICE, generator=gen) * 0.02  # the down projection's shape
    wq, ws = quantize_rows(w) if scaling == "rows" else quantize_blocks(w)
    w_real = dequantize_rows(wq, ws) if scaling == "rows" else dequantize_blocks(wq, ws)
    x = torch.randn(m, MLP, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    xq, xs = quantize_activations(x, None if scaling == "rows" else 128)
    x_real = dequantize_rows(xq, xs) if scaling == "rows" else dequantize_blocks_rows(xq, xs)
    eager = fp8_weight_gemm(xq, wq, ws, x_scale=xs)
    assert eager.dtype == torch.bfloat16 and rel(eager, x_real @ w_real.t()) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_weight_gemm(xq, wq, ws, x_scale=xs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@needs_sm89
@pytest.mark.parametrize(("rows", "cols"), [(1, 4096), (64, 14336), (17, 1000)])
def test_activation_quantization_kernel_writes_the_reference_bytes(rows: int, cols: int) -> None:
    """One launch per token (and per 128-column group) gives torch's e4m3 bytes and scales exactly."""
    from engine.kernels.fp8_quant import quantize_activations
    from engine.quant.fp8 import quantize_row_groups

    gen = torch.Generator(device=DEVICE).manual_seed(rows + cols)
    x = (torch.randn(rows, cols, device=DEVICE, generator=gen) * 3).to(torch.bfloat16)
    q, scale = quantize_activations(x)
    ref_q, ref_scale = quantize_rows(x)
    assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    q, scale = quantize_activations(x, 128, rows_out=rows + 15, scales_row_major=False)
    ref_q, ref_scale = quantize_row_groups(torch.cat([x, x.new_zeros(15, cols)]))
    assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def _fp8_cache(num_blocks: int) -> torch.Tensor:
    return torch.zeros(num_blocks, LAYERS, 2, BLOCK, H_KV, HEAD_DIM, dtype=torch.float8_e4m3fn, device=DEVICE)


def test_kv_store_writes_the_reference_bytes() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    key, value = (torch.randn(2, 300, H_KV, HEAD_DIM, device=DEVICE, generator=gen) * 4).to(torch.bfloat16)
    key[0, 0, :4] = 1e4  # saturates
    slots = torch.randperm(64 * BLOCK, device=DEVICE, generator=gen)[:300]
    cache, ref = _fp8_cache(64), _fp8_cache(64)
    store_kv(cache, 1, key, value, slots, SCALE.k, SCALE.v)
    TorchAttentionBackend().write_kv(ref, 1, key, value, slots, SCALE)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))


def test_rope_kv_store_lands_within_one_e4m3_step_of_the_float32_rotation() -> None:
    """The kernel rounds each rotate-half product to bf16 (as the torch backend does, which then rounds
    their difference too), so near zero the two can land on neighbouring e4m3 values of opposite sign:
    the bytes are checked against the float32 rotation, within one e4m3 step (2^-3 of the value, 2^-9
    among subnormals) plus the products' bf16 rounding, and few of them unlike the backend's."""
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    q = torch.randn(200, H_Q, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
    k, v = torch.randn(2, 200, H_KV, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
    rope = RotaryEmbedding(HEAD_DIM, max_position=8192, theta=500000.0, scaling=None).to(DEVICE)(
        torch.randint(0, 8192, (200,), device=DEVICE, generator=gen), torch.bfloat16)
    slots = torch.randperm(64 * BLOCK, device=DEVICE, generator=gen)[:200]
    cache, ref = _fp8_cache(64), _fp8_cache(64)
    rope_and_store_kv(cache, 0, q, k, v, *rope, slots, SCALE.k, SCALE.v)
    TorchAttentionBackend().rotate_and_write_kv(ref, 0, q, k, v, rope, slots, SCALE)
    assert (cache.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item() <= 1e-2
    cos, sin = (t.float() for t in rope)
    k1, k2 = k.float().chunk(2, dim=-1)
    products = torch.cat((k1.abs() * cos.abs() + k2.abs() * sin.abs(), k2.abs() * cos.abs() + k1.abs() * sin.abs()),
                         dim=-1)  # what the bf16 rounding of the rotation's two products is relative to
    blocks, offsets = slots // BLOCK, slots % BLOCK
    for kind, exact, rounding, scale in ((0, apply_rotary(k.float(), cos, sin), products * 2.0**-8, SCALE.k),
                                         (1, v.float(), torch.zeros_like(v.float()), SCALE.v)):
        want = (exact / scale).clamp(-448.0, 448.0)
        got = cache[:, 0, kind][blocks, offsets].float()
        step = torch.maximum(want.abs() * 2.0**-3, torch.full_like(want, 2.0**-9))  # normal / subnormal
        assert ((got - want).abs() <= step * 1.001 + rounding / scale).all()


def _meta(seq_lens: list[int], query_lens: list[int], num_blocks: int) -> AttentionMetadata:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, starts, taken = [], [], [0], 0
    for seq_len, q_len in zip(seq_lens, query_lens, strict=True):
        n = -(-seq_len // BLOCK)
        table, taken = ids[taken:taken + n], taken + n
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len - q_len, seq_len)]
        starts.append(starts[-1] + q_len)
    width = max(map(len, tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE), query_start_loc=torch.tensor(starts, device=DEVICE,
                                                                                       dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, device=DEVICE, dtype=torch.int32),
        block_tables=torch.tensor(padded, device=DEVICE, dtype=torch.int32), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens))


@pytest.mark.parametrize("query_lens", [[1] * 8, [1, 700, 1, 300]], ids=["decode", "prefill_mixed"])
def test_attention_over_an_fp8_cache_matches_the_reference(query_lens: list[int]) -> None:
    seq_lens = [1500, 2100, 40, 900, 3000, 17, 600, 1][: len(query_lens)]
    seq_lens = [max(s, q) for s, q in zip(seq_lens, query_lens, strict=True)]
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 8
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    cache = (torch.randn(num_blocks, LAYERS, 2, BLOCK, H_KV, HEAD_DIM, device=DEVICE, generator=gen) * 20)
    cache = cache.clamp(-448, 448).to(torch.float8_e4m3fn)
    meta = _meta(seq_lens, query_lens, num_blocks)
    query = torch.randn(sum(query_lens), H_Q, HEAD_DIM, device=DEVICE, generator=gen).to(torch.bfloat16)
    out = TritonAttentionBackend().attend(query, cache, 1, meta, HEAD_DIM**-0.5, SCALE)
    ref = TorchAttentionBackend().attend(query, cache, 1, meta, HEAD_DIM**-0.5, SCALE)
    assert out.dtype == torch.bfloat16 and rel(out, ref) <= 2e-2

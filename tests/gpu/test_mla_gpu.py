"""DeepSeek's latent attention (MLA) on a CUDA GPU.

- The compiled MLA decode kernel (engine/kernels/mla_decode.py) against the torch reference
  (engine/attention/mla.py) on the same GPU at DeepSeek-V2-Lite's attention shape (16 heads over a
  512 + 64 latent), bf16 within 1e-2 as ||kernel - ref|| / ||ref||, at 1 and several splits, with
  contexts that end mid-block and a padding row of no context.
- The latent store skips negative slots (the CUDA-graph padding rows).

Whole tiny DeepSeek-V2/V3 models with CUDA graphs against transformers, and graph == eager decode on a
bf16 MLA model: tests/gpu/test_moe_gpu.py (parametrized with the other MoE families).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.required import require_module

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
require_module("transformers")
require_module("triton")

from test_engine_gpu import rel_err  # noqa: E402

from engine.attention.mla import latent_decode_reference  # noqa: E402
from engine.kernels.kv_store import is_interpreted  # noqa: E402
from engine.kernels.mla_decode import _mla_decode_split_kernel, mla_decode, store_latent  # noqa: E402
from engine.kv_cache import KVCacheSpec, KVLayout  # noqa: E402

HEADS, LATENT, ROPE, BLOCK = 16, 512, 64, 16  # DeepSeek-V2-Lite's attention
DEVICE = torch.device("cuda")


def test_kernel_is_compiled_not_interpreted() -> None:
    assert not is_interpreted(_mla_decode_split_kernel)


def _latent_cache(num_blocks: int) -> torch.Tensor:
    spec = KVCacheSpec(2, 1, LATENT + ROPE, BLOCK, "bfloat16", KVLayout.LATENT)
    return spec.allocate(num_blocks, DEVICE).normal_(generator=torch.Generator(DEVICE).manual_seed(0))


@pytest.mark.parametrize("num_splits", [1, 8])
def test_bf16_mla_decode_matches_the_reference_at_v2_lite_shape(num_splits: int) -> None:
    seq_lens = [4096, 1, 1000, 0, 2049]
    per_seq = [-(-n // BLOCK) for n in seq_lens]
    cache = _latent_cache(sum(per_seq) + 1)
    ids = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(1)).tolist()
    rows, width = [], max(per_seq)
    for n in per_seq:
        rows.append(ids[:n] + [0] * (width - n))
        ids = ids[n:]
    tables = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(seq_lens), HEADS, LATENT + ROPE, device=DEVICE).bfloat16()
    scale = 0.1
    got = mla_decode(query, cache, 1, tables, lens, scale, LATENT, num_splits)
    live = [i for i, n in enumerate(seq_lens) if n]
    expected = latent_decode_reference(query.float(), cache.float(), 1, tables, lens, max(seq_lens), scale, LATENT)
    assert rel_err(got[live], expected[live]) <= 1e-2
    assert torch.equal(got[3], torch.zeros_like(got[3]))


def test_store_latent_skips_padding_rows() -> None:
    cache = torch.zeros(8, 2, 1, BLOCK, 1, LATENT + ROPE, device=DEVICE, dtype=torch.bfloat16)
    entries = torch.randn(3, LATENT + ROPE, device=DEVICE).bfloat16()
    store_latent(cache, 0, entries, torch.tensor([5 * BLOCK + 2, -1, 17], dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache[5, 0, 0, 2, 0], entries[0]) and torch.equal(cache[1, 0, 0, 1, 0], entries[2])
    assert int((cache != 0).any(dim=-1).sum()) == 2

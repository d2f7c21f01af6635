"""The Triton MLA decode and latent-store kernels (engine/kernels/mla_decode.py) under triton's CPU
interpreter, against the torch reference (engine/attention/mla.py).

Awkward cases: more heads than one head tile (masked tail), a rope width below tl.dot's 16 (padded),
shuffled non-contiguous block tables, contexts that end mid-block, split-KV with splits that get no
tokens, a padded row with no context, and negative slots the store must skip. DeepSeek-V2-Lite's
shape on the compiled kernel: tests/gpu/test_mla_gpu.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.triton_interpret import import_interpreted, interpreted

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

(mla_decode_mod, _) = import_interpreted("engine.kernels.mla_decode", "engine.attention.triton_backend")

from engine.attention.mla import latent_decode_reference  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.kernels.kv_store import is_interpreted  # noqa: E402
from engine.kv_cache import KVCacheSpec, KVLayout  # noqa: E402
from engine.loader.weights import load_model_weights  # noqa: E402
from engine.models.llama import LlamaForCausalLM  # noqa: E402
from tests.support.required import require_module  # noqa: E402
from tests.support.tiny_moe import build_tiny_moe  # noqa: E402
from tests.unit.engine.paged_harness import PagedHarness  # noqa: E402

LATENT, ROPE, LAYERS, BLOCK = 32, 8, 2, 4
NUM_BLOCKS = 40


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    with interpreted():
        yield


def _cache(dtype: torch.dtype, seed: int) -> torch.Tensor:
    spec = KVCacheSpec(LAYERS, 1, LATENT + ROPE, BLOCK, str(dtype).removeprefix("torch."), KVLayout.LATENT)
    cache = spec.allocate(NUM_BLOCKS, "cpu")
    return cache.normal_(generator=torch.Generator().manual_seed(seed))


def _tables(seq_lens: list[int], seed: int) -> torch.Tensor:
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(-(-n // BLOCK) for n in seq_lens) or 1
    rows = []
    for n in seq_lens:
        need = -(-n // BLOCK)
        rows.append(perm[:need] + [0] * (width - need))
        perm = perm[need:]
    return torch.tensor(rows, dtype=torch.int32)


def test_kernels_are_interpreted() -> None:
    assert is_interpreted(mla_decode_mod._mla_decode_split_kernel)


@pytest.mark.parametrize(("num_heads", "num_splits"), [(4, 1), (4, 3), (20, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_the_torch_reference(num_heads: int, num_splits: int, dtype: torch.dtype) -> None:
    seq_lens = [1, 13, 37, 8]
    cache = _cache(dtype, seed=num_heads)
    tables = _tables(seq_lens, seed=num_splits)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(len(seq_lens), num_heads, LATENT + ROPE, generator=torch.Generator().manual_seed(3)).to(dtype)
    scale = (LATENT + ROPE) ** -0.5
    got = mla_decode_mod.mla_decode(query, cache, 1, tables, lens, scale, LATENT, num_splits, block_n=8)
    expected = latent_decode_reference(query.float(), cache.float(), 1, tables, lens, max(seq_lens), scale, LATENT)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.shape == (len(seq_lens), num_heads, LATENT) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


def test_a_row_without_context_gets_zeros() -> None:
    """A CUDA-graph padding row has seq_len 0: no NaN from an empty softmax, whatever the split count."""
    cache = _cache(torch.float32, seed=1)
    tables = _tables([9, 0], seed=2)
    lens = torch.tensor([9, 0], dtype=torch.int32)
    query = torch.randn(2, 4, LATENT + ROPE, generator=torch.Generator().manual_seed(4))
    got = mla_decode_mod.mla_decode(query, cache, 0, tables, lens, 0.2, LATENT, 4, block_n=8)
    assert torch.equal(got[1], torch.zeros(4, LATENT)) and torch.isfinite(got[0]).all()


def test_store_writes_each_row_into_its_slot_and_skips_negative_slots() -> None:
    cache = torch.zeros(NUM_BLOCKS, LAYERS, 1, BLOCK, 1, LATENT + ROPE)
    entries = torch.randn(4, LATENT + ROPE, generator=torch.Generator().manual_seed(5))
    slots = torch.tensor([7 * BLOCK + 1, -1, 3 * BLOCK, 39 * BLOCK + 3], dtype=torch.int64)
    mla_decode_mod.store_latent(cache, 1, entries, slots)
    assert torch.equal(cache[7, 1, 0, 1, 0], entries[0]) and torch.equal(cache[3, 1, 0, 0, 0], entries[2])
    assert torch.equal(cache[39, 1, 0, 3, 0], entries[3])
    assert int((cache != 0).any(dim=-1).sum()) == 3  # the skipped row touched nothing, layer 0 untouched


def test_wrappers_reject_a_key_value_cache_and_a_mis_shaped_query() -> None:
    gqa = KVCacheSpec(LAYERS, 1, LATENT + ROPE, BLOCK, "float32").allocate(4, "cpu")
    lens, tables = torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="latent cache"):
        mla_decode_mod.mla_decode(torch.zeros(1, 4, LATENT + ROPE), gqa, 0, tables, lens, 1.0, LATENT, 1)
    with pytest.raises(ValueError, match="query must be"):
        mla_decode_mod.mla_decode(torch.zeros(1, 4, LATENT), _cache(torch.float32, 0), 0, tables, lens, 1.0,
                                  LATENT, 1)


def test_triton_path_of_a_tiny_deepseek_matches_transformers(tmp_path: Path) -> None:
    """DeepSeek-V2 (the Triton path does not depend on V3's routing or q_lora). Prefill of 20 tokens
    (expanded context, paged prefill kernel), then 4 decode steps (latent store + absorbed MLA decode
    kernel), logits within 1e-3 of the logit scale of HF's full forward."""
    require_module("transformers")
    hf = build_tiny_moe("deepseek-v2", vocab_size=160)
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    ours = LlamaForCausalLM(config, TritonAttentionBackend())
    ours.load_weights(load_model_weights(tmp_path, "safetensors", config, "float32"))
    tokens = torch.randint(0, 160, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    harness = PagedHarness(ours, config, block_size=4)
    got = [harness.step([("a", tokens[:20])])["a"]] + [harness.step([("a", [t])])["a"] for t in tokens[20:]]
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0].float()
    assert (torch.cat(got) - expected).abs().max() <= 1e-3 * expected.abs().max()

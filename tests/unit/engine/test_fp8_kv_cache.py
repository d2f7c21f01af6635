"""The FP8 KV cache on CPU (torch backend): capacity, what attention reads back, scales from the checkpoint,
checksums, copy-on-write and prefix caching over e4m3 blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.base import KVScale
from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.errors import ConfigError
from engine.kv_cache import KVCacheSpec, kv_dtype_name
from engine.kv_integrity import block_checksums
from engine.llm_engine import LLMEngine
from engine.loader.dummy import dummy_weights
from engine.loader.tiny import TINY_MODEL_NAME
from engine.models.llama import LlamaForCausalLM
from engine.sampling_params import SamplingParams
from tests.unit.engine.paged_harness import build_metadata

FP8 = torch.float8_e4m3fn
POOL_BYTES = 4 * 1024**2


def _engine(cache_dir: str, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=TINY_MODEL_NAME, cache_dir=cache_dir, dtype="bfloat16",
                                  cache=CacheConfig(memory_bytes=POOL_BYTES, kv_cache_dtype=kv_cache_dtype)))


def test_an_fp8_cache_holds_twice_the_tokens_of_bf16_in_the_same_pool(default_model_dir: Path) -> None:
    cache_dir = str(default_model_dir.parents[1])
    bf16, fp8 = _engine(cache_dir, "auto"), _engine(cache_dir, "fp8_e4m3")
    assert bf16.runner.kv_cache.dtype == torch.bfloat16 and fp8.runner.kv_cache.dtype == FP8
    assert fp8.runner.kv_spec.bytes_per_block * 2 == bf16.runner.kv_spec.bytes_per_block
    assert fp8.runner.num_blocks == 2 * bf16.runner.num_blocks
    assert fp8.block_manager.num_free_blocks == 2 * bf16.block_manager.num_free_blocks


def test_kv_cache_dtype_names_are_validated() -> None:
    assert kv_dtype_name("bfloat16", "auto") == "bfloat16" and kv_dtype_name("bfloat16", "fp8_e4m3") == "float8_e4m3fn"
    with pytest.raises(ConfigError, match="valid: auto, fp8_e4m3"):
        CacheConfig(kv_cache_dtype="int8")


def test_attention_reads_an_fp8_cache_as_stored_values_times_their_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    heads, dim, block = 2, 32, 4
    meta, _ = build_metadata([[3, 0, 5, 1, 7]], [0], [18], block)
    key, value = torch.randn(2, 18, heads, dim, generator=gen)  # |x| < 4.48: inside both scales
    query = torch.randn(18, 2 * heads, dim, generator=gen)
    scale = KVScale(k=0.02, v=0.01)
    backend = TorchAttentionBackend()
    fp8 = KVCacheSpec(1, heads, dim, block, "float8_e4m3fn").allocate(8, "cpu")
    backend.write_kv(fp8, 0, key, value, meta.slot_mapping, scale)
    stored = torch.zeros(8, 1, 2, block, heads, dim)  # the same values, dequantized into a float32 cache
    stored[:, :, 0], stored[:, :, 1] = fp8[:, :, 0].float() * scale.k, fp8[:, :, 1].float() * scale.v
    exact = torch.zeros_like(stored)
    backend.write_kv(exact, 0, key, value, meta.slot_mapping)
    out = backend.attend(query, fp8, 0, meta, dim**-0.5, scale)
    torch.testing.assert_close(out, backend.attend(query, stored, 0, meta, dim**-0.5), rtol=1e-6, atol=1e-6)
    reference = backend.attend(query, exact, 0, meta, dim**-0.5)
    assert ((out - reference).norm() / reference.norm()).item() < 0.05  # e4m3's rounding, no more


def test_kv_scales_come_from_the_checkpoint_in_either_naming() -> None:
    config = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    weights = [*dummy_weights(config, torch.float32),
               ("model.layers.0.self_attn.k_scale", torch.tensor(0.25)),
               ("model.layers.0.self_attn.v_scale", torch.tensor([0.5])),
               ("model.layers.1.self_attn.k_proj.output_scale", torch.tensor([2.0]))]
    model.load_weights(weights)
    assert model.model.layers[0].self_attn.kv_scale == KVScale(k=0.25, v=0.5)
    assert model.model.layers[1].self_attn.kv_scale == KVScale(k=2.0, v=1.0)


def test_checksums_and_copy_on_write_work_on_fp8_blocks(default_model_dir: Path) -> None:
    engine = _engine(str(default_model_dir.parents[1]), "fp8_e4m3")
    runner = engine.runner
    runner.randomize_kv_cache(seed=1)
    before = block_checksums(runner.kv_cache, [0, 1, 2])
    runner.kv_cache.view(torch.uint8)[1, 0, 0, 0, 0, 0] ^= 1  # one bit of block 1
    after = block_checksums(runner.kv_cache, [0, 1, 2])
    assert before[0] == after[0] and before[1] != after[1] and before[2] == after[2]
    runner._copy_blocks([(0, 2)])
    assert torch.equal(runner.kv_cache[2].view(torch.uint8), runner.kv_cache[0].view(torch.uint8))


def test_prefix_caching_serves_an_fp8_prefix_and_answers_the_same(default_model_dir: Path) -> None:
    engine = _engine(str(default_model_dir.parents[1]), "fp8_e4m3")
    prompt = list(range(100, 164))  # four full blocks
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = engine.generate([prompt], params)
    engine.add_request("again", prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert outputs[0].num_cached_tokens >= 48
    assert [t for o in outputs for t in o.new_token_ids] == first[0]

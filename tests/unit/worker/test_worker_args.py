"""`baton worker` flags reach the engine config: --load-format dummy and --seed (benchmark workers),
--tensor-parallel-size, --speculative-ngram, the KV tier flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from engine.errors import ConfigError
from engine.kv_tiers.types import TierConfig
from engine.loader.loaded_model import load_model
from services.worker.main import add_worker_args, build_engine_config

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    return parser.parse_args(["--role", "both", *argv])


def _config_only_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY))  # no weights, no tokenizer
    return tmp_path


def test_defaults_keep_auto_format_and_seed_zero() -> None:
    config = build_engine_config(_parse())
    assert (config.load_format, config.seed) == ("auto", 0)


def test_unknown_load_format_is_refused() -> None:
    with pytest.raises(SystemExit):
        _parse("--load-format", "pickle")


def test_dummy_workers_with_one_seed_load_identical_weights(tmp_path: Path) -> None:
    model = str(_config_only_dir(tmp_path))
    configs = [build_engine_config(_parse("--model", model, "--load-format", "dummy", "--seed", s))
               for s in ("5", "5", "6")]
    assert [(c.load_format, c.seed) for c in configs] == [("dummy", 5), ("dummy", 5), ("dummy", 6)]
    a, b, c = (dict(load_model(x.model, x.load_format, x.dtype, x.device, seed=x.seed).weights) for x in configs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_tensor_parallel_size_reaches_the_engine_and_the_worker_config() -> None:
    from services.worker.main import build_worker_config

    args = _parse("--tensor-parallel-size", "3")
    assert build_engine_config(args).parallel.tensor_parallel_size == 3
    assert build_worker_config(args).tensor_parallel_size == 3


def test_speculative_ngram_sets_the_engines_default_draft_length() -> None:
    assert build_engine_config(_parse()).speculative.num_draft_tokens == 0
    assert build_engine_config(_parse("--speculative-ngram", "4")).speculative.num_draft_tokens == 4


def test_nixl_progress_thread_follows_the_device_unless_set_and_reaches_the_transfer_config() -> None:
    from services.worker.main import build_worker_config

    assert build_worker_config(_parse()).transfer.progress_thread is None  # on for a GPU KV cache only
    assert build_worker_config(_parse("--nixl-progress-thread")).transfer.progress_thread is True
    assert build_worker_config(_parse("--no-nixl-progress-thread")).transfer.progress_thread is False
    assert build_worker_config(_parse("--nixl-threads", "4")).transfer.nixl_threads == 4


def test_kv_tier_flags_reach_the_engine_config(tmp_path: Path) -> None:
    config = build_engine_config(_parse("--host-kv-gib", "0.5", "--disk-kv-dir", str(tmp_path),
                                        "--disk-kv-gib", "2", "--kv-load-min-speedup", "1.5"))
    assert config.tiers == TierConfig(host_bytes=512 * 1024**2, disk_dir=str(tmp_path), disk_bytes=2 * 1024**3,
                                      min_load_speedup=1.5)
    assert not build_engine_config(_parse()).tiers.enabled  # off by default


def test_a_disk_tier_without_a_directory_is_refused() -> None:
    with pytest.raises(ConfigError, match="--disk-kv-dir"):
        build_engine_config(_parse("--disk-kv-gib", "1"))


def test_pipeline_parallel_size_reaches_the_engine_and_the_worker_config() -> None:
    from services.worker.main import build_worker_config

    args = _parse("--pipeline-parallel-size", "2", "--tensor-parallel-size", "2")
    parallel = build_engine_config(args).parallel
    assert (parallel.pipeline_parallel_size, parallel.world_size) == (2, 4)
    assert build_worker_config(args).pipeline_parallel_size == 2


def test_pipeline_parallel_prefill_and_decode_workers_are_accepted() -> None:
    from services.worker.main import build_worker_config

    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    for role in ("prefill", "decode"):
        args = parser.parse_args(["--role", role, "--pipeline-parallel-size", "2"])
        assert build_worker_config(args).pipeline_parallel_size == 2


def test_fp8_flags_reach_the_engine_config() -> None:
    config = build_engine_config(_parse("--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"))
    assert (config.quantization, config.cache.kv_cache_dtype) == ("fp8", "fp8_e4m3")
    default = build_engine_config(_parse())
    assert (default.quantization, default.cache.kv_cache_dtype) == (None, "auto")
    with pytest.raises(SystemExit):
        _parse("--kv-cache-dtype", "int8")

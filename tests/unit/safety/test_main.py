"""`baton safety` argument parsing: flags override BATON_SAFETY_* settings."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.safety.batcher import BatchConfig, Batching
from services.safety.encoder import EncoderRuntime
from services.safety.main import SafetySettings, config_from, register_safety_command
from services.safety.service import PoolSizes


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baton")
    register_safety_command(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_SAFETY_PORT", "6000")
    monkeypatch.setenv("BATON_SAFETY_POLICY_FILE", "/etc/baton/env-policy.json")
    config = config_from(_parse(["safety", "--port", "7000"]), SafetySettings())
    assert config.port == 7000 and config.policy_path == Path("/etc/baton/env-policy.json")


def test_defaults_without_flags_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PORT", "POLICY_FILE", "METRICS_PORT", "HOST", "GRACE_S"):
        monkeypatch.delenv(f"BATON_SAFETY_{name}", raising=False)
    args = _parse(["safety", "--policy", "p.yaml"])
    config = config_from(args, SafetySettings())
    assert (config.port, config.policy_path, config.metrics_port) == (50071, Path("p.yaml"), None)
    assert args.func.__name__ == "run_safety_command"


def test_encoder_threads_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_SAFETY_ENCODER_THREADS", "4")
    assert config_from(_parse(["safety"]), SafetySettings()).encoder_threads == 4
    monkeypatch.delenv("BATON_SAFETY_ENCODER_THREADS")
    assert config_from(_parse(["safety"]), SafetySettings()).encoder_threads == 2


def test_encoder_runtime_device_pools_and_batching_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"ENCODER_RUNTIME": "torch", "DEVICE": "cuda:1", "INPUT_THREADS": "3", "OUTPUT_THREADS": "5",
                        "LONG_INPUT_THREADS": "1", "BATCH_WAIT_MS": "4", "BATCH_MAX_TEXTS": "64",
                        "BATCH_WORKERS": "3"}.items():
        monkeypatch.setenv(f"BATON_SAFETY_{name}", value)
    config = config_from(_parse(["safety"]), SafetySettings())
    assert (config.encoder_runtime, config.device) == (EncoderRuntime.TORCH, "cuda:1")
    assert config.pools == PoolSizes(input=3, long_input=1, output=5)
    assert config.batch == BatchConfig(max_wait_s=0.004, max_texts=64, workers=3)
    monkeypatch.delenv("BATON_SAFETY_INPUT_THREADS")
    monkeypatch.delenv("BATON_SAFETY_LONG_INPUT_THREADS")
    assert config_from(_parse(["safety"]), SafetySettings()).pools == PoolSizes(input=8, long_input=2, output=5)
    monkeypatch.setenv("BATON_SAFETY_BATCHING", "off")
    assert config_from(_parse(["safety"]), SafetySettings()).batching is Batching.OFF


def test_defaults_are_onnx_with_batching_on_a_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    config = config_from(_parse(["safety"]), SafetySettings())
    assert (config.encoder_runtime, config.batching) == (EncoderRuntime.ONNX, Batching.AUTO)
    assert config.batch == BatchConfig(max_wait_s=0.002, max_texts=None, workers=2) and config.pools is None
    assert [Batching.AUTO.applies(d) for d in ("cpu", "cuda", "cuda:1")] == [False, True, True]
    assert Batching.ON.applies("cpu") and not Batching.OFF.applies("cuda")


@pytest.mark.parametrize(("name", "value"), [("ENCODER_RUNTIME", "tensorrt"), ("DEVICE", "gpu"), ("DEVICE", "cuda:x"),
                                             ("INPUT_THREADS", "0"), ("BATCH_WAIT_MS", "-1"),
                                             ("BATCH_MAX_TEXTS", "0"), ("BATCH_WORKERS", "0"),
                                             ("BATCHING", "yes")])
def test_bad_capacity_settings_are_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"BATON_SAFETY_{name}", value)
    with pytest.raises(ValidationError, match=name.lower()):
        SafetySettings()

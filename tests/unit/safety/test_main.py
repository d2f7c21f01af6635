"""`baton safety` argument parsing: flags override BATON_SAFETY_* settings."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.safety.main import SafetySettings, config_from, register_safety_command


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

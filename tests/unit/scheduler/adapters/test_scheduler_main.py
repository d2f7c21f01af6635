"""`baton scheduler` flags, as registered on a `baton`-style subparsers object."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from scheduler.adapters.main import config_from_args, register_scheduler_command, run_scheduler
from scheduler.types import Tier


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baton")
    register_scheduler_command(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["scheduler", *argv])


def test_the_documented_flags_become_the_service_config() -> None:
    args = _parse("--port", "6001", "--policy", "prefix_aware", "--metrics-port", "6002",
                  "--heartbeat-timeout-s", "5")
    config = config_from_args(args)
    assert (config.port, config.policy, config.metrics_port, config.heartbeat_timeout_s) == (
        6001, "prefix_aware", 6002, 5.0,
    )
    assert args.func is run_scheduler


def test_an_unknown_policy_is_refused_with_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--policy", "fastest")
    assert "goodput" in capsys.readouterr().err


def test_a_heartbeat_timeout_shorter_than_two_intervals_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_scheduler(_parse("--heartbeat-interval-s", "1", "--heartbeat-timeout-s", "1.5")) == 2
    assert "must exceed twice the heartbeat interval" in capsys.readouterr().err


def test_an_unreadable_profile_fails_before_listening(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_scheduler(_parse("--port", "0", "--profile", str(tmp_path / "missing.json"))) == 2
    assert "cannot read profile file" in capsys.readouterr().err


def test_degrading_is_off_unless_a_flag_or_the_environment_turns_it_on() -> None:
    assert config_from_args(_parse(), environ={}).degrade_fraction is None
    flag = config_from_args(_parse("--degrade-fraction", "0.25", "--degrade-tiers", "free,plus"), environ={})
    assert (flag.degrade_fraction, flag.degrade_tiers) == (0.25, frozenset({Tier.FREE, Tier.PLUS}))
    env = config_from_args(_parse(), environ={"BATON_SCHEDULER_DEGRADE_FRACTION": "0.5"})
    assert (env.degrade_fraction, env.degrade_tiers) == (0.5, frozenset({Tier.FREE}))
    both = config_from_args(_parse("--degrade-fraction", "0.3"), environ={"BATON_SCHEDULER_DEGRADE_FRACTION": "0.5"})
    assert both.degrade_fraction == 0.3  # the flag wins


def test_degrade_models_come_from_repeated_flags_or_the_environment() -> None:
    assert config_from_args(_parse(), environ={}).degrade_models == {}
    flags = config_from_args(_parse("--degrade-model", "big=small", "--degrade-model", "b2 = s2"), environ={})
    assert flags.degrade_models == {"big": "small", "b2": "s2"}
    env = config_from_args(_parse(), environ={"BATON_SCHEDULER_DEGRADE_MODELS": "big=small, b2=s2"})
    assert env.degrade_models == {"big": "small", "b2": "s2"}
    wins = config_from_args(_parse("--degrade-model", "x=y"), environ={"BATON_SCHEDULER_DEGRADE_MODELS": "big=small"})
    assert wins.degrade_models == {"x": "y"}  # the flag wins


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--degrade-fraction", "1.5"), "degrade_fraction must be in (0, 1)"),
        (("--degrade-fraction", "0.5", "--degrade-tiers", "gold"), "valid tiers are free, plus, enterprise"),
        (("--degrade-fraction", "0.5", "--policy", "least_loaded"), "needs the goodput policy"),
        (("--degrade-model", "big=small", "--policy", "round_robin"), "needs the goodput policy"),
        (("--degrade-model", "big"), "expected MODEL=FALLBACK"),
        (("--degrade-model", "big=a", "--degrade-model", "big=b"), "expected MODEL=FALLBACK, one per model"),
        (("--degrade-model", "big=big"), "maps a model to a different one"),
    ],
)
def test_a_bad_degrade_setting_is_refused_before_listening(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    assert run_scheduler(_parse("--port", "0", *argv)) == 2
    assert message in capsys.readouterr().err

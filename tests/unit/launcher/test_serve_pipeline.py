"""`baton serve --pipeline-parallel-size N` reaches the workers, co-located or a disaggregated pair (each stage
hands its layers' KV off); `--expert-parallel-size N` reaches the co-located worker and is refused with a
disaggregated pair (handing KV off to every expert rank is not wired into the KV link)."""

from __future__ import annotations

import argparse

import pytest

from services.common.errors import ConfigError
from services.launcher.cluster import parallel_worker_args
from services.launcher.serve import options_from_args, register_serve_command


def _options(*argv: str):  # noqa: ANN202 - ServeOptions
    parser = argparse.ArgumentParser()
    register_serve_command(parser.add_subparsers())
    return options_from_args(parser.parse_args(["serve", *argv]))


def test_the_worker_gets_the_pipeline_size() -> None:
    options = _options("--workers-role", "both", "--pipeline-parallel-size", "2")
    assert parallel_worker_args(options) == ["--pipeline-parallel-size", "2"]


def test_one_stage_adds_no_worker_flag() -> None:
    assert parallel_worker_args(_options()) == []


def test_a_disaggregated_pair_gets_the_pipeline_size_and_zero_stages_are_refused() -> None:
    assert parallel_worker_args(_options("--pipeline-parallel-size", "2")) == ["--pipeline-parallel-size", "2"]
    with pytest.raises(ConfigError, match="--pipeline-parallel-size must be >= 1"):
        _options("--workers-role", "both", "--pipeline-parallel-size", "0")


def test_the_worker_gets_the_expert_parallel_size_and_bad_layouts_are_refused() -> None:
    options = _options("--workers-role", "both", "--expert-parallel-size", "2")
    assert parallel_worker_args(options) == ["--expert-parallel-size", "2"]
    with pytest.raises(ConfigError, match="--expert-parallel-size > 1 needs --workers-role both"):
        _options("--expert-parallel-size", "2")
    with pytest.raises(ConfigError, match="do not combine"):
        _options("--workers-role", "both", "--expert-parallel-size", "2", "--pipeline-parallel-size", "2")

"""`baton serve --host-kv-gib/--disk-kv-dir/--disk-kv-gib` reach every worker, each with its own disk
subdirectory (a worker empties its directory at start-up, so two must never share one)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.launcher.cluster import kv_tier_worker_args
from services.launcher.serve import options_from_args, register_serve_command


def _options(*argv: str):  # noqa: ANN202 - ServeOptions
    parser = argparse.ArgumentParser()
    register_serve_command(parser.add_subparsers())
    return options_from_args(parser.parse_args(["serve", *argv]))


def test_each_worker_gets_the_tier_sizes_and_its_own_disk_directory(tmp_path: Path) -> None:
    options = _options("--host-kv-gib", "8", "--disk-kv-dir", str(tmp_path), "--disk-kv-gib", "64")
    assert kv_tier_worker_args(options, "worker-decode") == [
        "--host-kv-gib", "8.0", "--disk-kv-dir", str(tmp_path / "worker-decode"), "--disk-kv-gib", "64.0"]
    assert kv_tier_worker_args(options, "worker-prefill")[3] == str(tmp_path / "worker-prefill")


def test_no_tier_flags_means_no_worker_flags() -> None:
    assert kv_tier_worker_args(_options(), "worker-both") == []


def test_a_disk_size_without_a_directory_is_refused() -> None:
    with pytest.raises(ConfigError, match="--disk-kv-dir"):
        _options("--disk-kv-gib", "4")

"""`baton serve --quantization fp8 --kv-cache-dtype fp8_e4m3` reaches both workers alike (their KV
dtypes must match for the hand-off) and adds nothing when left at the defaults."""

from __future__ import annotations

import argparse

from services.common.quantization_flags import quantization_worker_args
from services.launcher.serve import options_from_args, register_serve_command


def _options(*argv: str):  # noqa: ANN202 - ServeOptions
    parser = argparse.ArgumentParser()
    register_serve_command(parser.add_subparsers())
    return options_from_args(parser.parse_args(["serve", *argv]))


def test_fp8_flags_are_passed_to_every_worker() -> None:
    options = _options("--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3")
    assert quantization_worker_args(options.quantization, options.kv_cache_dtype) == [
        "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]


def test_defaults_pass_no_flags() -> None:
    options = _options()
    assert quantization_worker_args(options.quantization, options.kv_cache_dtype) == []

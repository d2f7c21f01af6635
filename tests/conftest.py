"""Fixtures shared by every test suite. Keep each one small and named for what it provides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Triton's interpreter must be chosen before triton's first import, whichever test imports it first:
# on CPU-only machines (CI) every Triton kernel runs interpreted against the torch reference.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct HF directory (converted from the PyPI GGUF on first use).

    Cached under `$BATON_CACHE_DIR` when set, else `~/.cache/baton`, so only the first test run of a
    machine pays the ~10 s conversion.
    """
    from engine.loader.prepare import default_model_dir as prepare_default_model

    return prepare_default_model(os.environ.get("BATON_CACHE_DIR") or None)

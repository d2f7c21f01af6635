"""`resolve_model`: a model spec (a built-in name, a path, or none) to a directory or file and its load format.

Beside prepare.py and tiny.py rather than in either: it names both built-ins, and tiny.py builds on prepare.py.
"""

from __future__ import annotations

from pathlib import Path

from engine.loader.prepare import DEFAULT_MODEL_NAME, default_model_dir
from engine.loader.tiny import TINY_MODEL_NAME, tiny_model_dir
from engine.loader.weights import resolve_load_format


def resolve_model(
    spec: str | Path | None, load_format: str = "auto", cache_dir: str | Path | None = None
) -> tuple[Path, str]:
    """`(path, load_format)` for a model spec: `None` or the default's name mean the prepared default,
    `baton-tiny-random` the prepared tiny random-weight model (engine/loader/tiny.py)."""
    if spec is None or str(spec) in ("", DEFAULT_MODEL_NAME):
        path = default_model_dir(cache_dir)
        return path, resolve_load_format(path, load_format)
    if str(spec) == TINY_MODEL_NAME:
        path = tiny_model_dir(cache_dir)
        return path, resolve_load_format(path, "dummy" if load_format == "auto" else load_format)
    path = Path(spec).expanduser()
    return path, resolve_load_format(path, load_format)

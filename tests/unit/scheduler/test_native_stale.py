"""A compiled scheduler module whose source changed is found (scheduler/native.py `stale`): Python would
import the extension module and run the old code. No compile here: a file with an extension module's
name is all `stale` looks at (the compile itself: tests/integration/scheduler/test_native_scheduler.py)."""

from __future__ import annotations

import hashlib
import json
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from scheduler.native import MANIFEST, stale


def _site(tmp_path: Path) -> Path:
    core = tmp_path / "scheduler" / "core"
    core.mkdir(parents=True)
    (core / "cost_model.py").write_text("X = 1\n")
    (core / "placement.py").write_text("Y = 2\n")  # not compiled: never stale
    (core / f"cost_model{EXTENSION_SUFFIXES[0]}").write_bytes(b"\x7fELF")
    return tmp_path


def _record(site: Path, path: str) -> None:
    digest = hashlib.sha256((site / path).read_bytes()).hexdigest()
    (site / MANIFEST).write_text(json.dumps({path: digest}))


def test_a_module_compiled_from_its_current_source_is_fresh(tmp_path: Path) -> None:
    site = _site(tmp_path)
    _record(site, "scheduler/core/cost_model.py")
    assert stale(site) == []


def test_an_edited_source_makes_its_compiled_module_stale(tmp_path: Path) -> None:
    site = _site(tmp_path)
    _record(site, "scheduler/core/cost_model.py")
    (site / "scheduler/core/cost_model.py").write_text("X = 2  # a newer release, installed over it\n")
    assert stale(site) == ["scheduler/core/cost_model.py"]


def test_without_a_manifest_every_compiled_module_is_stale(tmp_path: Path) -> None:
    assert stale(_site(tmp_path)) == ["scheduler/core/cost_model.py"]


def test_a_source_checkout_has_nothing_compiled() -> None:
    assert stale(Path(__file__).resolve().parents[3]) == []

"""Import engine kernel modules under triton's CPU interpreter (TRITON_INTERPRET=1), for CPU-only tests.

TRITON_INTERPRET must be set before triton's first import (its library functions are decorated then)
and while the kernels run: `import_interpreted` sets it around the imports, and the `interpreted`
context keeps it set while a test module's tests run (use it from an autouse module fixture).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import pytest

from tests.support.required import require_module


@contextmanager
def interpreted() -> Iterator[None]:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def import_interpreted(*module_names: str) -> list[ModuleType]:
    """Import the modules with TRITON_INTERPRET=1; fail if triton was already imported compiled."""
    was_imported = "triton" in sys.modules
    with interpreted():
        triton = require_module("triton")
        if was_imported and type(triton.language.max).__name__ != "InterpretedFunction":
            pytest.fail("triton was imported (compiled mode) before TRITON_INTERPRET=1 could be set, so the "
                        "kernels cannot be interpreted; run with TRITON_INTERPRET=1 in the environment",
                        pytrace=False)
        return [importlib.import_module(name) for name in module_names]

"""Packages `make test` installs: a test that needs one imports it with `require_module`, never skips.

`make test` installs the `test`, `triton` and `nixl` extras (Makefile), so a missing package means
the set-up is broken, and a skip would hide that the feature went untested. `require_module` fails
instead, with the install hint: at module level that is a collection ERROR, inside a fixture an
ERROR, inside a test a FAILURE. The only skips the CPU run allows are GPU tests on a machine without
a GPU (tests/support/skip_policy.py checks that).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

# module -> how `make test` installs it
INSTALL_HINTS = {
    "nixl": "pip install nixl==1.5.1 after CPU torch (`make setup` installs the nixl extra)",
    "triton": "pip install triton==3.9.0 (`make setup` installs the triton extra)",
    "transformers": "pip install -e '.[test]' (`make setup` does)",
    "grpc": "pip install -e . (grpcio is a core dependency)",
}


def require_module(name: str) -> ModuleType:
    """Import `name` or fail the test with the install hint of its top-level package.

    OSError counts as missing too: nixl's import loads shared libraries (UCX) that may be absent.
    """
    try:
        return importlib.import_module(name)
    except (ImportError, OSError) as e:
        top = name.split(".")[0]
        hint = INSTALL_HINTS.get(top, f"pip install {top}")
        pytest.fail(f"{name} is not importable ({e}); `make test` needs it: {hint}", pytrace=False)

"""pytest imports test modules by basename (rootdir import mode, no packages): two test files with one
basename anywhere under tests/ stop the whole run at collection. Catch it here with the names."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_unique_basename() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py" and "__pycache__" not in p.parts)
    clashes = {name: sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob(name)) for name, n in names.items() if n > 1}
    assert clashes == {}

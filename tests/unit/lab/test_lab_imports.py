"""Every lab module imports, and every GPU suite parses and names only lab modules that exist.

The benchmarks, experiments and suites run in their smoke modes in tests of their own (test_suites_smoke.py,
test_micro_bench_smoke.py, test_cpu_benches_smoke.py, test_bench_*.py and the experiments'); this is the
cheap first line: an import that broke, a suite that calls a module no longer there.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
LAB_MODULES = sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                     for p in (REPO / "lab").rglob("*.py") if p.name != "__init__.py")
SUITES = sorted((REPO / "lab" / "suites").glob("*.sh"))


_IMPORT_ALL = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=2))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_lab_module_imports() -> None:
    # In a child: importing the lab pulls in triton compiled, which this process's interpreter tests
    # (tests/support/triton_interpret.py) must import first.
    result = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *LAB_MODULES], capture_output=True, text=True,
                            cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


@pytest.mark.parametrize("suite", SUITES, ids=lambda p: p.name)
def test_suite_parses_and_names_existing_modules(suite: Path) -> None:
    assert subprocess.run(["bash", "-n", str(suite)], capture_output=True).returncode == 0
    for module in re.findall(r"-m\s+((?:lab|services|loadtest|scheduler|engine)(?:\.\w+)+)", suite.read_text()):
        assert importlib.util.find_spec(module) is not None, f"{suite.name} runs {module}, which does not exist"

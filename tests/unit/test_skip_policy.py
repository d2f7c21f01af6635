"""The suite's skip rule (tests/support/skip_policy.py, required.py), run on a scratch suite in a pytest
subprocess: only missing hardware may skip; a missing package is an ERROR with its install hint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFTEST = "from tests.support.skip_policy import *  # noqa: F403\n"


def _run_suite(tmp_path: Path, test_source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_scratch.py").write_text(test_source)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)


def test_a_skip_for_a_missing_package_fails_the_run_and_is_listed(tmp_path: Path) -> None:
    run = _run_suite(tmp_path, "import pytest\n\n"
                               "def test_ok():\n    pass\n\n"
                               "def test_needs_nixl():\n    pytest.skip('nixl is not importable')\n")
    assert run.returncode == 1, run.stdout
    assert "skips the suite does not allow" in run.stdout
    assert "test_scratch.py::test_needs_nixl: nixl is not importable" in run.stdout


def test_a_module_level_skip_for_a_missing_package_fails_the_run(tmp_path: Path) -> None:
    run = _run_suite(tmp_path, "import pytest\n\npytest.importorskip('no_such_package_here')\n\n"
                               "def test_never_runs():\n    pass\n")
    assert run.returncode == 1, run.stdout
    assert "no_such_package_here" in run.stdout.split("skips the suite does not allow")[1]


def test_a_gpu_skip_on_a_machine_without_one_passes(tmp_path: Path) -> None:
    run = _run_suite(tmp_path, "import pytest\n\n"
                               "def test_ok():\n    pass\n\n"
                               "@pytest.mark.skipif(True, reason='tensor parallelism needs 2 GPUs')\n"
                               "def test_tp():\n    pass\n\n"
                               "def test_cuda():\n    pytest.skip('needs a CUDA GPU')\n\n"
                               "def test_two():\n    pytest.skip('needs 2 CUDA GPUs')\n")
    assert run.returncode == 0, run.stdout
    assert "1 passed, 3 skipped" in run.stdout


def test_a_skip_that_mentions_a_gpu_but_lacks_a_package_fails_the_run(tmp_path: Path) -> None:
    run = _run_suite(tmp_path, "import pytest\n\n"
                               "def test_kernels():\n    pytest.skip('GPU kernels need triton (pip install triton)')\n")
    assert run.returncode == 1, run.stdout


def test_require_module_errors_with_the_install_hint(tmp_path: Path) -> None:
    run = _run_suite(tmp_path, "from tests.support.required import require_module\n\n"
                               "require_module('nixl.no_such_module')\n\n"
                               "def test_never_runs():\n    pass\n")
    assert run.returncode == 2, run.stdout  # a collection error interrupts the run
    assert "1 error" in run.stdout
    assert "pip install nixl==1.5.1" in run.stdout

"""The compiled decision path (scheduler/native.py) decides exactly as the interpreted one.

A copy of the `scheduler` package is compiled with mypyc (~25 s on 2 cores). The decision benchmark
(64 workers, ~100k indexed blocks, 1,000 requests/s; lab/micro/bench_scheduler_decisions.py) then
runs two simulated seconds per policy under each build, in a process whose `scheduler` is that build;
`decisions_sha256` hashes every answer, the predicted TTFT/TPOT to the last bit. The same process
checks that the load tests' tap, an interpreted subclass of the compiled `Scheduler`, still works.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.core.policies import POLICY_NAMES
from scheduler.native import build, stale

ROOT = Path(__file__).resolve().parents[3]

RUN_POLICIES = """
import json, sys
from lab.experiments.scheduler_tap import TappedScheduler
from lab.micro.bench_scheduler_decisions import BenchConfig, run
from scheduler.core.scheduler import SchedulerConfig
from scheduler.native import compiled

TappedScheduler("goodput", SchedulerConfig())  # an interpreted subclass of the (maybe compiled) core
out = {"compiled": compiled()}
for policy in sys.argv[1:]:
    result = run(BenchConfig(seconds=2.0, policy=policy))
    out[policy] = [result["decisions_sha256"], result["requests"]]
print(json.dumps(out))
"""


def _start_deciding(site: Path, cwd: Path) -> subprocess.Popen[str]:
    """A process that benchmarks each policy with the `scheduler` it imports from `site` first."""
    return subprocess.Popen([sys.executable, "-c", RUN_POLICIES, *POLICY_NAMES], cwd=cwd,
                            env={"PYTHONPATH": f"{site}:{ROOT}"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _decisions(deciding: subprocess.Popen[str]) -> dict[str, object]:
    """Each policy's benchmark digest, once the process from `_start_deciding` is done."""
    try:
        stdout, stderr = deciding.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        deciding.kill()
        raise
    assert deciding.returncode == 0, stderr[-3000:]
    result: dict[str, object] = json.loads(stdout.strip().splitlines()[-1])
    return result


def test_compiled_scheduler_decides_exactly_as_interpreted(tmp_path: Path) -> None:
    interpreted, native = tmp_path / "interpreted", tmp_path / "native"
    for site in (interpreted, native):  # an installed site: the scheduler and the ground floor it imports
        for package in ("scheduler", "tokenization"):
            shutil.copytree(ROOT / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    # The interpreted run needs no compiler: it runs on the second core while the single-threaded C compile
    # (most of this test's time) runs on the first.
    with _start_deciding(interpreted, tmp_path) as deciding_interpreted:  # waited for on the way out
        compiling = subprocess.run([sys.executable, "-m", "scheduler.native", str(native)], cwd=tmp_path,
                                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                                   capture_output=True, text=True, timeout=900, check=False)
        assert compiling.returncode == 0, compiling.stderr[-3000:]
        assert list((native / "scheduler" / "core").glob("scheduler.*.so"))
        assert stale(native) == []
        pure = _decisions(deciding_interpreted)
    with _start_deciding(native, tmp_path) as deciding_native:
        fast = _decisions(deciding_native)

    assert pure.pop("compiled") is False and fast.pop("compiled") is True
    assert set(pure) == set(POLICY_NAMES)
    assert fast == pure

    # An edited source (a newer release installed over the compiled one): the scheduler will not start.
    with (native / "scheduler" / "core" / "placement.py").open("a") as source:
        source.write("# edited\n")
    refused = subprocess.run([sys.executable, "-m", "scheduler.adapters", "--port", "0"], cwd=tmp_path,
                             env={"PYTHONPATH": f"{native}:{ROOT}"}, capture_output=True, text=True, timeout=120,
                             check=False)
    assert refused.returncode == 2
    assert "scheduler/core/placement.py" in refused.stderr and "recompile" in refused.stderr


def test_refuses_to_compile_a_source_checkout() -> None:
    with pytest.raises(ValueError, match="source checkout"):
        build(ROOT)


def test_refuses_a_directory_without_the_package(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no scheduler package"):
        build(tmp_path)

"""Runs lab/suites/*.sh in their SMOKE mode, two at a time, for tests/unit/lab/test_suites_smoke.py.

Why lanes: a suite's smoke run is mostly waiting (processes starting, Poisson arrivals at 1 req/s, a
worker's drain), so two side by side keep both cores of a CI machine busy and cost about half the wall
time of one after the other. Each run gets its own OUT folder; its outcome is kept for every test that
checks it, so one run serves all the assertions on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITES = ROOT / "lab" / "suites"
RUN_LIMIT_S = 400  # a hard limit per suite; each takes ~10-30 s on an idle 2-core machine
OUTPUT_TAIL = 4000  # characters of a run's output kept for an assertion message


@dataclass(frozen=True)
class SuiteCall:
    """One suite's smoke call: lab/suites/<script>, its arguments and the environment it adds."""

    script: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SuiteRun:
    script: str
    out: Path
    returncode: int
    output: str  # stdout and stderr, interleaved

    def tail(self) -> str:
        return self.output[-OUTPUT_TAIL:]


def smoke_env(out: Path, extra: Mapping[str, str]) -> dict[str, str]:
    """SMOKE=1 with this interpreter (the suites default to the GPU box's python3)."""
    return {**os.environ, "SMOKE": "1", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OUT": str(out),
            **extra}


def run_suite(call: SuiteCall, out: Path) -> SuiteRun:
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["bash", str(SUITES / call.script), *call.args], cwd=ROOT, env=smoke_env(out, call.env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=RUN_LIMIT_S,
                          check=False)
    return SuiteRun(call.script, out, done.returncode, done.stdout)


class SuiteLanes:
    """Suite runs started at once, at most `lanes` at a time; `result` waits for one."""

    def __init__(self, lanes: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="suite-lane")
        self._runs: dict[str, Future[SuiteRun]] = {}

    def start(self, call: SuiteCall, out: Path) -> None:
        self._runs[call.script] = self._pool.submit(run_suite, call, out)

    def result(self, script: str) -> SuiteRun:
        return self._runs[script].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

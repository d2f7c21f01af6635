"""Supervision: a dead child comes back (same command line) after a backoff, readiness is matched only in
the current run's output, and killed runs' temp dirs are cleaned at the next start."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from services.launcher.process import SupervisedProcess
from services.launcher.rundir import PID_FILE, RunDir, remove_stale_run_dirs
from services.launcher.supervisor import ChildSpec, RestartPolicy, Supervisor, _next_backoff, log_line

STEADY = "import time; print('READY', flush=True); time.sleep(300)"
FAST = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, stable_after_s=60)


def _poll_until(supervisor: Supervisor, done: object, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        supervisor.poll_restarts()
        time.sleep(0.05)


def test_a_killed_child_is_restarted_and_reported_back(tmp_path: Path) -> None:
    changes: list[dict[str, int]] = []
    with Supervisor(tmp_path / "logs", on_change=lambda s: changes.append(s.pids())) as supervisor:
        first = supervisor.start(ChildSpec("w", [sys.executable, "-c", STEADY], log_line("READY"), restart=FAST)).pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        _poll_until(supervisor, lambda: supervisor.restarts()["w"] == 1 and len(changes) == 2)
        assert supervisor.dead_child() is None  # a restartable child never ends watch()
        assert changes[-1]["w"] not in (None, first)
        assert (tmp_path / "logs" / "w.log").read_text().count("READY") == 2


def test_a_child_that_keeps_dying_backs_off_exponentially() -> None:
    policy = RestartPolicy(initial_backoff_s=1, max_backoff_s=8, stable_after_s=60)
    waits = [0.0]
    for _ in range(5):
        waits.append(_next_backoff(policy, waits[-1], up_for_s=0.5))
    assert waits[1:] == [1, 2, 4, 8, 8]
    assert _next_backoff(policy, 8, up_for_s=61) == 1  # stable for a while: start over


def test_readiness_ignores_an_earlier_runs_marker(tmp_path: Path) -> None:
    log_path = tmp_path / "w.log"
    log_path.write_text("BATON_WORKER_READY port=1 (yesterday)\n")
    process = SupervisedProcess("w", [sys.executable, "-c", "import time; time.sleep(300)"], log_path)
    process.start()
    try:
        assert not log_line("BATON_WORKER_READY")(process)
    finally:
        process.kill()


def test_killed_runs_temp_dirs_are_removed_at_the_next_start(tmp_path: Path) -> None:
    dead, live = tmp_path / "baton-serve-dead", tmp_path / "baton-serve-live"
    dead.mkdir()
    live.mkdir()
    (dead / PID_FILE).write_text("999999999")  # no such process
    (live / PID_FILE).write_text(str(os.getpid()))  # this pytest (a python) still runs
    assert remove_stale_run_dirs(tmp_path) == [dead]
    assert live.exists()


def test_a_temporary_run_dir_is_removed_on_close_and_a_data_dir_is_kept(tmp_path: Path) -> None:
    temporary = RunDir(None)
    temporary.write_run_file({"pids": {}})
    temporary.close()
    assert not temporary.path.exists()
    kept = RunDir(tmp_path / "data")
    kept.write_run_file({"pids": {}})
    kept.close()
    assert (tmp_path / "data").exists() and not kept.run_file.exists()

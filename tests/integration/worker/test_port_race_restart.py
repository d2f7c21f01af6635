"""A test worker that loses the race for its picked port starts again on fresh ports, not a failed test."""

from __future__ import annotations

import socket
import sys
import time

import pytest
import worker_procs
from worker_procs import WorkerExited, WorkerProcess


def test_a_worker_whose_port_was_taken_restarts_on_a_fresh_one(default_model_dir, worker_log_dir, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks = iter([port])  # the first pick is the taken port, as when another socket wins the race
        real = worker_procs.free_port
        monkeypatch.setattr(worker_procs, "free_port", lambda: next(picks, None) or real())
        worker = WorkerProcess("race-1", "both", default_model_dir, worker_log_dir, "--num-blocks", "64").start()
        try:
            assert worker.port == port
            worker.wait_serving()
            assert worker.port != port and worker.address == f"127.0.0.1:{worker.port}"
            assert worker.status().role == "both"
        finally:
            worker.stop()


def test_a_worker_that_fails_for_another_reason_is_not_restarted(default_model_dir, worker_log_dir):
    worker = WorkerProcess("bad-1", "both", default_model_dir, worker_log_dir, "--num-blocks", "-5").start()
    try:
        with pytest.raises(WorkerExited, match="bad-1 exited"):
            worker.wait_serving(timeout_s=60)
    finally:
        worker.stop()


def test_a_worker_that_lost_a_port_race_but_stays_up_is_stopped_not_waited_out(default_model_dir, worker_log_dir):
    # A tensor-parallel worker whose rank 0 lost its metrics port stayed up, its other ranks waiting on it.
    worker = WorkerProcess("stuck-1", "both", default_model_dir, worker_log_dir)
    worker.args = [sys.executable, "-c", "import time; print('OSError: [Errno 98] Address already in use', "
                   "flush=True); time.sleep(120)"]
    worker.start()
    started = time.monotonic()
    with pytest.raises(WorkerExited, match="lost a port race"):
        worker.wait_serving(timeout_s=60, port_attempts=1)
    assert time.monotonic() - started < 30
    assert worker.proc is not None and worker.proc.poll() is not None  # killed, with its process group

"""Several gateway processes on one port (services/gateway/replicas.py): the shared socket, the supervisor's
restarts, give-ups and drain, and /metrics summed over the processes. The supervisor's children here are
small Python programs standing in for replicas (the real gateway in tests/integration/gateway/
test_gateway_processes.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.gateway.replicas import (
    CONFIG_ERROR_EXIT,
    METRICS_DIR_ENV,
    ReplicaSupervisor,
    RestartLimits,
    Spawn,
    reuse_port_socket,
)
from services.launcher.process import free_port

FAST = RestartLimits(backoff_s=0.05, max_backoff_s=0.05, max_deaths=3, window_s=60.0)
# A replica that drains on SIGTERM (exit 0) and otherwise runs until killed.
SERVES = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(60)"


def _spawner(programs: dict[int, list[str]], started: list[int]) -> Spawn:
    """Replica i runs programs[i] in turn, its last program from then on."""

    def spawn(index: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        queue = programs[index]
        code = queue.pop(0) if len(queue) > 1 else queue[0]
        started.append(index)
        assert env[METRICS_DIR_ENV] and env["BATON_GATEWAY_REPLICA"] == str(index)
        return subprocess.Popen([sys.executable, "-c", code], env=env)

    return spawn


def _run_until(supervisor: ReplicaSupervisor, condition: Callable[[], bool], timeout_s: float = 10.0) -> int:
    """Run the supervisor in a thread; stop it once `condition()` holds; its exit code."""
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()))
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.02)
    supervisor.stop()
    thread.join(timeout_s)
    assert not thread.is_alive()
    return result[0]


def test_replicas_share_one_port_and_port_zero_is_refused() -> None:
    port = free_port()
    first, second = reuse_port_socket("127.0.0.1", port), reuse_port_socket("127.0.0.1", port)
    try:
        assert first.getsockname()[1] == second.getsockname()[1] == port
    finally:
        first.close()
        second.close()
    with pytest.raises(ValueError, match="fixed port"):
        reuse_port_socket("127.0.0.1", 0)


def test_a_dead_replica_is_restarted_and_a_stop_drains_the_rest() -> None:
    started: list[int] = []
    crash_once = ["import sys; sys.exit(1)", SERVES]
    supervisor = ReplicaSupervisor(2, _spawner({0: crash_once, 1: [SERVES]}, started), drain_timeout_s=5,
                                   limits=FAST, poll_s=0.01)
    code = _run_until(supervisor, lambda: started.count(0) == 2)
    assert started.count(0) == 2 and started.count(1) == 1
    assert code == 0  # both drained on SIGTERM
    assert not os.path.exists(supervisor.metrics_dir)  # the metrics files go with the gateway
    assert all(r.process.poll() is not None for r in supervisor.replicas)


def test_a_configuration_error_stops_the_whole_gateway() -> None:
    started: list[int] = []
    supervisor = ReplicaSupervisor(2, _spawner({0: [SERVES], 1: [f"import sys; sys.exit({CONFIG_ERROR_EXIT})"]},
                                               started), drain_timeout_s=5, limits=FAST, poll_s=0.01)
    assert supervisor.run() == CONFIG_ERROR_EXIT
    assert started.count(1) == 1  # not restarted: it would fail the same way
    assert all(r.process.poll() is not None for r in supervisor.replicas)  # the healthy one stopped too


def test_a_replica_that_keeps_dying_stops_the_gateway() -> None:
    started: list[int] = []
    supervisor = ReplicaSupervisor(2, _spawner({0: [SERVES], 1: ["import sys; sys.exit(3)"]}, started),
                                   drain_timeout_s=5, limits=FAST, poll_s=0.01)
    assert supervisor.run() == 3
    assert started.count(1) == FAST.max_deaths


def test_a_replica_killed_again_and_again_stops_the_gateway_with_a_plain_failure() -> None:
    suicide = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    supervisor = ReplicaSupervisor(2, _spawner({0: [SERVES], 1: [suicide]}, []), drain_timeout_s=5, limits=FAST,
                                   poll_s=0.01)
    assert supervisor.run() == 1  # not -9, which a shell would read as 247


def test_a_replica_that_does_not_drain_in_time_is_killed(tmp_path: Path) -> None:
    ready = tmp_path / "ignoring-sigterm"
    stubborn = ("import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    supervisor = ReplicaSupervisor(2, _spawner({0: [stubborn], 1: [SERVES]}, []), drain_timeout_s=0.0,
                                   limits=FAST, poll_s=0.01, drain_slack_s=0.5)
    began = time.monotonic()
    assert _run_until(supervisor, ready.exists) == 1
    assert time.monotonic() - began < 5
    assert supervisor.replicas[0].process.returncode == -signal.SIGKILL


def test_metrics_are_the_sum_over_the_processes(tmp_path: Path) -> None:
    """Two processes count into the shared directory; either one's /metrics shows both."""
    count = textwrap.dedent("""
        import sys
        from services.gateway.metrics import GatewayMetrics
        m = GatewayMetrics()
        m.tokens.labels("model", "completion").inc(int(sys.argv[1]))
        m.inflight.inc()
        print(m.render().decode())
    """)
    env = {**os.environ, METRICS_DIR_ENV: str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    subprocess.run([sys.executable, "-c", count, "5"], env=env, check=True, capture_output=True)
    rendered = subprocess.run([sys.executable, "-c", count, "7"], env=env, check=True, capture_output=True,
                              text=True).stdout
    assert 'baton_gateway_tokens_total{kind="completion",model="model"} 12.0' in rendered
    # In-flight generations count the live processes only: the first one has exited (and nothing marked
    # it dead here, as the supervisor would), so it is still summed; the supervisor's mark drops it.
    assert "baton_gateway_inflight_generations 2.0" in rendered
    from prometheus_client import multiprocess

    for name in os.listdir(tmp_path):
        if name.startswith("gauge_livesum_"):
            multiprocess.mark_process_dead(int(name.split("_")[-1].split(".")[0]), str(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("gauge_livesum_")]


def test_a_socket_taken_by_another_program_is_a_clear_error() -> None:
    with socket.socket() as plain:  # no SO_REUSEPORT: nobody may share it
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        with pytest.raises(OSError):
            reuse_port_socket("127.0.0.1", plain.getsockname()[1])

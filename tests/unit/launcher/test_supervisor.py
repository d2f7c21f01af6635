"""The supervisor: readiness gates, reverse-order stop of whole process groups, dead children, set-up steps."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from services.common.errors import InfraStartError
from services.launcher.supervisor import ChildSpec, Supervisor, log_line

# A child that prints READY, forks a grandchild into its own process group, and logs SIGTERM.
CHILD = """
import os, signal, sys, time
name = sys.argv[1]
def bye(*_):
    print(f"{name} got SIGTERM", flush=True)
    with open(sys.argv[2], "a") as f: f.write(name + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stubborn grandchild: only the group kill ends it
    time.sleep(300)
    os._exit(0)
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""


def _spec(name: str, order_file: Path) -> ChildSpec:
    return ChildSpec(name, [sys.executable, "-c", CHILD, name, str(order_file)], log_line("READY"),
                     ready_timeout_s=20, stop_timeout_s=5)



def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def test_children_stop_in_reverse_order_with_their_process_groups(tmp_path: Path) -> None:
    order = tmp_path / "order"
    supervisor = Supervisor(tmp_path / "logs")
    pids = [supervisor.start(_spec(name, order)).pid for name in ("infra", "worker", "gateway")]
    assert all(pid is not None and _group_members(pid) for pid in pids)
    supervisor.stop_all()
    assert order.read_text().split() == ["gateway", "worker", "infra"]
    deadline = time.monotonic() + 5
    while any(_group_members(pid) for pid in pids if pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_group_members(pid) for pid in pids if pid)  # grandchildren included


def test_a_child_that_exits_is_reported(tmp_path: Path) -> None:
    with Supervisor(tmp_path / "logs") as supervisor:
        supervisor.start(_spec("steady", tmp_path / "order"))
        brief = "import time; print('READY', flush=True); time.sleep(0.5)"
        supervisor.start(ChildSpec("brief", [sys.executable, "-c", brief], log_line("READY")))
        assert supervisor.watch(lambda: False, poll_s=0.05) == "brief"


def test_a_child_that_dies_during_start_up_raises_with_its_log(tmp_path: Path) -> None:
    with Supervisor(tmp_path / "logs") as supervisor, pytest.raises(InfraStartError, match="no such thing"):
        supervisor.start(ChildSpec("broken", [sys.executable, "-c", "raise SystemExit('no such thing')"],
                                   log_line("READY")))


def test_a_failing_setup_step_raises_with_its_log(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path / "logs")
    supervisor.run_once("ok", [sys.executable, "-c", "print('fine')"], 20)
    with pytest.raises(InfraStartError, match="exit code 3"):
        supervisor.run_once("bad", [sys.executable, "-c", "import sys; print('oops'); sys.exit(3)"], 20)
    assert supervisor.children == []


# A child whose graceful shutdown takes a while: it logs the signal, works 0.5 s, logs its exit.
SLOW_STOP_CHILD = """
import signal, sys, time
name, record = sys.argv[1], sys.argv[2]
def note(event):
    with open(record, "a") as f: f.write(f"{event}:{name}\\n")
def bye(*_):
    note("signalled"); time.sleep(0.5); note("exited"); sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("READY", flush=True)
while True:
    time.sleep(0.05)
"""


def test_peers_all_get_their_signal_before_any_is_waited_for(tmp_path: Path) -> None:
    record = tmp_path / "record"
    supervisor = Supervisor(tmp_path / "logs")
    for name in ("worker", "gateway-a", "gateway-b"):
        supervisor.start(ChildSpec(name, [sys.executable, "-c", SLOW_STOP_CHILD, name, str(record)],
                                   log_line("READY"), ready_timeout_s=20, stop_timeout_s=5))
    supervisor.stop_peers(["gateway-a", "gateway-b"])
    events = record.read_text().split()
    assert sorted(events[:2]) == ["signalled:gateway-a", "signalled:gateway-b"]  # both shut down at once
    assert sorted(events[2:]) == ["exited:gateway-a", "exited:gateway-b"]
    assert [spec.name for spec, process in supervisor.children if process.alive()] == ["worker"]
    supervisor.stop_all()
    assert record.read_text().split()[4:] == ["signalled:worker", "exited:worker"]


# A child that ignores SIGTERM, as a child still loading (or the gateway before it serves) may.
DEAF_CHILD = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('READY', flush=True); "
              "time.sleep(300)")


def test_an_interrupted_start_up_kills_every_child_within_the_grace(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path / "logs")
    processes = [supervisor.start(ChildSpec(name, [sys.executable, "-c", DEAF_CHILD], log_line("READY"),
                                            ready_timeout_s=20, stop_timeout_s=30))
                 for name in ("scheduler", "worker", "gateway")]
    started = time.monotonic()
    supervisor.stop_all(grace_s=0.5)
    assert time.monotonic() - started < 5  # one grace for all, not 3 x 30 s of stop timeouts
    assert [p.exit_code() for p in processes] == [-9, -9, -9]
    assert supervisor.children == []


def _blocked_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))


def test_a_child_starts_with_its_stop_signals_unblocked(tmp_path: Path) -> None:
    """The launcher holds SIGINT/SIGTERM while it forks a child; the child must not inherit that."""
    with Supervisor(tmp_path / "logs") as supervisor:
        process = supervisor.start(_spec("worker", tmp_path / "order"))
        assert process.pid is not None
        stop_signals = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
        assert _blocked_signals(process.pid) & stop_signals == 0
        assert _blocked_signals(os.getpid()) & stop_signals == 0  # and the launcher holds them no longer
        assert process.stop() == 0  # it got SIGTERM and ran its handler


def test_children_started_together_are_all_ready_and_stop_in_reverse_order(tmp_path: Path) -> None:
    order = tmp_path / "order"
    supervisor = Supervisor(tmp_path / "logs", log_prefix="run1-")
    processes = supervisor.start_together([_spec(name, order) for name in ("prefill", "decode")])
    assert all(p.alive() for p in processes)
    assert (tmp_path / "logs" / "run1-prefill.log").exists()
    supervisor.stop_all()
    assert order.read_text().split() == ["decode", "prefill"]


def test_one_child_of_a_group_failing_to_start_stops_the_others(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path / "logs")
    dies = ChildSpec("dies", [sys.executable, "-c", "import sys; sys.exit(3)"], log_line("READY"), ready_timeout_s=20)
    with pytest.raises(InfraStartError, match="dies exited during start-up"):
        supervisor.start_together([_spec("fine", tmp_path / "order"), dies])
    assert supervisor.children == []
    assert (tmp_path / "order").read_text().split() == ["fine"]  # stopped gracefully

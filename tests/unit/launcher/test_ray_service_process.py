"""The Ray launcher's per-service actor body (`ServiceProcess`), run here without a Ray cluster."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.launcher import process
from services.launcher.ray_cluster import PortTakenError, Readiness, ServiceProcess

# A service stand-in: binds its port on every interface, says it is ready, then waits to be stopped.
CHILD = ("import socket, sys, time; s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); "
         "print('READY', flush=True); time.sleep(60)")
READY = Readiness(log_marker="READY", timeout_s=20.0)


def _ports_from(first: list[int]) -> Callable[[], int]:
    """`first`, then free ports as usual."""
    handed = iter(first)
    real = process.free_port
    return lambda: next(handed, None) or real()


def test_a_child_that_lost_its_port_is_started_again_on_new_ports(monkeypatch, taken_port: int) -> None:
    monkeypatch.setattr(process, "free_port", _ports_from([taken_port]))
    service = ServiceProcess("stand-in")
    try:
        address, _ = service.start(["-c", CHILD, "{port}"], {}, READY)
        assert not address.endswith(f":{taken_port}") and "READY" in service.log_tail()
    finally:
        service.stop(timeout_s=5.0)


def test_it_gives_up_after_three_lost_races(monkeypatch, taken_port: int) -> None:
    monkeypatch.setattr(process, "free_port", lambda: taken_port)
    service = ServiceProcess("stand-in")
    try:
        with pytest.raises(PortTakenError, match="Address already in use"):
            service.start(["-c", CHILD, "{port}"], {}, READY)
    finally:
        service.stop(timeout_s=5.0)


def test_another_early_exit_is_not_retried() -> None:
    service = ServiceProcess("stand-in")
    try:
        with pytest.raises(RuntimeError, match="exited while starting") as failed:
            service.start(["-c", "import sys; sys.exit('bad flag')"], {}, READY)
        assert not isinstance(failed.value, PortTakenError)
    finally:
        service.stop(timeout_s=5.0)


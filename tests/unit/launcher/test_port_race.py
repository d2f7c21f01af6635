"""start_on_free_port: a child that lost its picked port to another socket is started again on a fresh one."""

from __future__ import annotations

import re
import socket
import sys
from pathlib import Path

import pytest

from services.common.errors import InfraStartError
from services.launcher import process
from services.launcher.process import lost_port_race, retry_lost_port_race, start_on_free_port
from services.launcher.supervisor import ChildSpec, Supervisor, log_line


def _listen(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
    except OSError as e:  # the message a server's log shows, as InfraStartError carries it
        s.close()
        raise InfraStartError(f"gateway exited during start-up (code 3); log:\n{e}") from e
    s.listen()
    return s


def test_a_lost_bind_race_is_retried_on_a_fresh_port() -> None:
    tried: list[int] = []
    held: list[socket.socket] = []

    def start(port: int) -> socket.socket:
        tried.append(port)
        if len(tried) == 1:  # someone else binds the picked port before the child does
            held.append(_listen(port))
        return _listen(port)

    server = start_on_free_port(start)
    try:
        assert len(tried) == 2 and tried[0] != tried[1]
        assert server.getsockname()[1] == tried[1]
    finally:
        for s in (server, *held):
            s.close()


@pytest.mark.parametrize("log, calls", [
    ("ImportError: no module named x", 1),  # not a race: raised at once
    ("[Errno 98] error while attempting to bind: address already in use", 2),  # a race every time: the last
])
def test_start_failures_are_raised(log: str, calls: int) -> None:
    ports: list[int] = []

    def start(port: int) -> None:
        ports.append(port)
        raise InfraStartError(f"gateway exited during start-up; log:\n{log}")

    with pytest.raises(InfraStartError, match=re.escape(log)):
        start_on_free_port(start, attempts=2)
    assert len(ports) == calls


@pytest.mark.parametrize("message, raced", [
    ("ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 41563): address already in use", True),
    ("FATAL: could not bind IPv4 address: Address in use", True),
    ("listen tcp 127.0.0.1:9092: bind: EADDRINUSE", True),
    ("ModuleNotFoundError: No module named 'uvicorn'", False),
])
def test_port_race_is_told_from_the_log(message: str, raced: bool) -> None:
    assert lost_port_race(InfraStartError(message)) is raced


# A service stand-in: binds the port it is given (exits with "address already in use" if it is taken).
BINDING_CHILD = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); "
                 "print('READY', flush=True); time.sleep(60)")


def test_a_supervised_child_that_lost_its_port_is_started_again_on_fresh_ports(
        tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """As `baton serve` starts each child (cluster.py): another cluster may take a port between the pick
    and the bind; the failed start leaves nothing supervised, and the next start picks fresh ports."""
    handed = iter([taken_port])
    real_free_port = process.free_port
    monkeypatch.setattr(process, "free_port", lambda: next(handed, None) or real_free_port())
    picked: list[int] = []
    with Supervisor(tmp_path / "logs") as supervisor:
        def start() -> int:
            picked.append(process.free_port())
            supervisor.start(ChildSpec("scheduler", [sys.executable, "-c", BINDING_CHILD, str(picked[-1])],
                                       log_line("READY"), ready_timeout_s=20))
            return picked[-1]

        port = retry_lost_port_race(start)
        assert picked == [taken_port, port] and port != taken_port
        assert [(spec.name, p.listens_on(port)) for spec, p in supervisor.children] == [("scheduler", True)]

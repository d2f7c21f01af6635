"""`baton serve`'s own ports: the gRPC API port follows `--port`, and a taken port fails before anything
starts, naming the flag to change."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.common.settings import BatonSettings
from services.launcher.cluster import ServeOptions
from services.launcher.process import PortInUseError, free_port, port_in_use
from services.launcher.serve import check_gateway_ports, options_from_args, register_serve_command, serve


def _options(*argv: str) -> ServeOptions:
    parser = argparse.ArgumentParser()
    register_serve_command(parser.add_subparsers())
    return options_from_args(parser.parse_args(["serve", *argv]))


def test_the_grpc_port_follows_the_gateway_port() -> None:
    assert (_options().port, _options().grpc_port) == (8000, 8001)
    assert _options("--port", "9100").grpc_port == 9101
    assert _options("--port", "9100", "--grpc-port", "9500").grpc_port == 9500
    assert _options("--port", "9100", "--no-grpc").grpc_port is None


@pytest.mark.parametrize(("argv", "message"), [
    (("--port", "9100", "--grpc-port", "9100"), "--grpc-port 9100 is the gateway's --port"),
    (("--port", "65535",), "--grpc-port 65536: a port is 1..65535"),
    (("--port", "0",), "--port 0: a port is 1..65535"),
])
def test_bad_port_choices_are_refused(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _options(*argv)


def test_a_listening_port_is_in_use_and_a_closed_one_is_not(taken_port: int) -> None:
    assert port_in_use("127.0.0.1", taken_port)
    assert port_in_use("0.0.0.0", taken_port)  # all addresses include the one taken
    assert not port_in_use("127.0.0.1", free_port())


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_taken_port_is_named_by_its_flag(taken_port: int, flag: str) -> None:
    other = free_port()
    argv = ("--port", str(taken_port), "--grpc-port", str(other)) if flag == "--port" else (
        "--port", str(other), "--grpc-port", str(taken_port))
    expected = f"port {taken_port} on 127.0.0.1 \\({flag}\\) is in use.*choose another {flag}"
    with pytest.raises(PortInUseError, match=expected):
        check_gateway_ports(_options(*argv))


def test_serve_on_a_taken_port_exits_2_before_starting_anything(taken_port: int, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a run dir would be made
    started = time.monotonic()
    code = serve(_options("--port", str(free_port()), "--grpc-port", str(taken_port)), BatonSettings(), None)
    assert code == 2
    assert time.monotonic() - started < 5  # nothing was started, nothing waited for
    assert f"port {taken_port} on 127.0.0.1 (--grpc-port) is in use" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no run dir, no infrastructure

"""Ctrl-C during `baton serve`'s start-up stops everything started so far within a couple of seconds and
removes the run dir, at each phase: while the embedded infrastructure starts, while a worker loads its
model, while the gateway starts. (Before, each child got its full graceful stop in turn, and the
gateway ignores SIGTERM until it serves: seconds to tens of seconds.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.launcher.postgres import EmbeddedPostgres
from services.launcher.process import free_port
from services.launcher.redis_server import EmbeddedRedis
from services.launcher.tansu import EmbeddedKafka
from tests.integration.gateway.test_gateway_serve import SERVE, _is_live
from tests.support.gateway_stack import MODEL

STOP_BOUND_S = 10.0  # measured ~1-2 s; generous for a loaded 2-core machine
_EXTERNAL = ("BATON_DATABASE_URL", "BATON_REDIS_URL", "BATON_KAFKA_BOOTSTRAP")


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


@pytest.fixture
def serve_tmp() -> Iterator[Path]:
    """The serve's TMPDIR: one the embedded Postgres's account may traverse (pytest's temp root is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="baton-interrupt-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _log_shows(marker: str) -> Callable[[Path], bool]:
    return lambda tmp: marker in (tmp / "serve.log").read_text(errors="replace")


def _infra_starting(tmp: Path) -> bool:
    return any(tmp.glob("baton-serve-*/infra/pg"))


@pytest.mark.parametrize(("phase", "started", "embedded"), [
    ("infrastructure", _infra_starting, True),
    ("worker loading", _log_shows("scheduler ready in"), False),
    ("gateway starting", _log_shows("billing ready in"), False),
])
def test_ctrl_c_during_start_up_stops_everything_promptly(
        phase: str, started: Callable[[Path], bool], embedded: bool, serve_tmp: Path, postgres: EmbeddedPostgres,
        redis_server: EmbeddedRedis, kafka_broker: EmbeddedKafka, default_model_dir: Path) -> None:
    tmp_path = serve_tmp
    env = {k: v for k, v in os.environ.items() if k not in _EXTERNAL} | {
        "TMPDIR": str(tmp_path), "BATON_SERVED_MODEL_NAME": MODEL, "BATON_USAGE_TOPIC": f"serve.{uuid.uuid4().hex[:8]}"}
    if not embedded:
        env |= {"BATON_DATABASE_URL": postgres.create_database(f"serve_{uuid.uuid4().hex[:8]}"),
                "BATON_REDIS_URL": redis_server.url, "BATON_KAFKA_BOOTSTRAP": kafka_broker.url}
    port = free_port()
    with open(tmp_path / "serve.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--port", str(port), "--grpc-port",
                                 str(free_port()), "--workers-role", "both", "--no-safety", "--model",
                                 str(default_model_dir), "--num-blocks", "64"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        # The phase has begun and a child runs: between two start-up steps (initdb, setting the embedded
        # Postgres's password, starting it) there are moments with none.
        while not (started(tmp_path) and (running := _descendants(proc.pid))):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.05)
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        stopped_s = time.monotonic() - interrupted
        assert stopped_s < STOP_BOUND_S, f"{phase}: stopped in {stopped_s:.1f}s"
        print(f"{phase}: {len(running)} processes stopped in {stopped_s:.2f}s")
        settle = time.monotonic() + 3  # SIGKILLed grandchildren are reaped by init
        while any(_is_live(pid) for pid in running) and time.monotonic() < settle:
            time.sleep(0.05)
        assert not any(_is_live(pid) for pid in running), phase
        assert not list(tmp_path.glob("baton-serve-*"))  # the run dir is gone
        assert not list(tmp_path.glob("baton-runs-*/serve-*.json"))  # and its link for `baton status`
    finally:
        if proc.poll() is None:
            proc.kill()

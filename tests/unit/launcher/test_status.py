"""`baton status` without a cluster: how it finds a run file (the per-port link), and what it says and
exits with when there is none, when its `baton serve` is gone, and when a component is down. (Against a
running `baton serve`: tests/integration/gateway/test_gateway_serve.py.)"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from services.launcher.process import free_port
from services.launcher.rundir import RunDir, indexed_run_file
from services.launcher.status import (
    ClusterStatus,
    ComponentStatus,
    StatusExit,
    kv_tier_line,
    register_status_command,
    render,
)


@pytest.fixture(autouse=True)
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run dirs and the run index go here, not into the machine's temp dir."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _status(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    register_status_command(parser.add_subparsers())
    args = parser.parse_args(["status", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_run_file_is_linked_by_port_until_the_run_dir_closes() -> None:
    run_dir = RunDir(None)
    run_dir.publish(18123)
    run_dir.write_run_file({"state": "starting"})
    link = indexed_run_file(18123)
    assert link.resolve() == run_dir.run_file.resolve()
    assert json.loads(link.read_text())["serve_pid"] == os.getpid()
    assert run_dir.run_file.stat().st_mode & 0o777 == 0o600  # it names the infrastructure's credentials
    later = RunDir(None)  # a later run on the same port (the first one was SIGKILLed, say) takes the link over
    later.publish(18123)
    run_dir.close()
    assert link.resolve() == later.run_file.resolve()  # an earlier run's close leaves the later link alone
    later.close()
    assert not link.is_symlink()


def test_no_cluster_on_the_port_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _status(capsys, "--port", "18124")
    assert code == StatusExit.NOT_RUNNING == 3
    assert "no `baton serve` with --port 18124 is running" in err
    code, out, _ = _status(capsys, "--port", "18124", "--json")
    assert (code, json.loads(out)["running"]) == (3, False)


def test_a_run_file_whose_serve_is_gone_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    data = tmp_path / "data"
    data.mkdir()
    (data / "run.json").write_text(json.dumps({"serve_pid": int(gone.stdout), "state": "ready",
                                               "gateway": "http://127.0.0.1:1", "endpoints": {}}))
    code, _, err = _status(capsys, "--data-dir", str(data))
    assert code == 3
    assert f"(pid {int(gone.stdout)}) is gone" in err


def test_a_component_that_does_not_answer_makes_the_cluster_unhealthy(
        taken_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = RunDir(None)
    run_dir.publish(18125)
    closed = free_port()
    run_dir.write_run_file({"state": "ready", "gateway": "http://127.0.0.1:18125", "grpc": None,
                            "pids": {"redis": os.getpid(), "kafka": os.getpid()},
                            "endpoints": {"redis": {"tcp": taken_port}, "kafka": {"tcp": closed}}})
    try:
        code, out, _ = _status(capsys, "--port", "18125", "--json")
        status = json.loads(out)
        assert (code, status["healthy"]) == (StatusExit.UNHEALTHY, False)
        by_name = {c["name"]: c for c in status["components"]}
        assert by_name["redis"]["healthy"] and by_name["redis"]["probes"][0]["ok"]
        assert not by_name["kafka"]["healthy"] and "refused" in by_name["kafka"]["probes"][0]["detail"]
        code, out, _ = _status(capsys, "--port", "18125")
        assert code == 1
        assert "ready, NOT healthy" in out and f"tcp:{closed}=FAIL" in out
    finally:
        run_dir.close()


def test_a_starting_cluster_is_not_healthy_yet(capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = RunDir(None)
    run_dir.publish(18126)
    run_dir.write_run_file({"state": "starting", "gateway": "http://127.0.0.1:18126", "endpoints": {}})
    try:
        code, out, _ = _status(capsys, "--port", "18126")
        assert code == 1 and "starting, NOT healthy" in out
    finally:
        run_dir.close()


def test_status_and_serve_never_import_torch(tmp_path: Path) -> None:
    """The `baton` CLI imports only the chosen command's module (the worker's pulls in torch: seconds of
    start-up, and of exit after Ctrl-C)."""
    check = ("import sys; from services.cli import main; code = main(sys.argv[1:]); "
             "print(code, 'torch' in sys.modules)")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    for argv, code in ((["status", "--port", "18127"], "3"), (["serve", "--port", "0"], "2")):  # 2: refused
        result = subprocess.run([sys.executable, "-c", check, *argv], capture_output=True, text=True, env=env,
                                timeout=120)
        assert result.stdout.split() == [code, "False"], result.stderr


def test_a_workers_kv_tier_gauges_print_under_it() -> None:
    worker = ComponentStatus("worker-both", 1, 0, {"grpc": 1}, (), "SmolLM2-135M-Instruct",
                             (kv_tier_line("host", 12, 512, 2, 40), kv_tier_line("disk", 0, 4096, 0, 0)))
    text = render(ClusterStatus("run.json", 1, "ready", "http://127.0.0.1:1", None, (worker,), {}))
    assert "kv host: 12/512 blocks, 2 pinned, 40 hits" in text and "kv disk: 0/4096 blocks, 0 pinned, 0 hits" in text

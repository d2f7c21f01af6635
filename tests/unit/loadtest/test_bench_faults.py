"""Fault injection: spec parsing, process controllers on real processes, goodput around the fault."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench_fakes import FakeClient
from bench_sse_server import BenchSSEServer

from loadtest.cli import main
from loadtest.faults import CommandController, FaultError, FaultInjector, FaultSpec, PidFileController, make_controller
from loadtest.records import Session, Turn
from loadtest.runner import BenchRunner, RunConfig


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[subprocess.Popen]:
    """A long-sleeping process with a PID file `victim.pid` in tmp_path."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp_path / "victim.pid").write_text(f"{proc.pid}\n")
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(5)


def test_fault_spec_parses_kill_and_restart() -> None:
    assert FaultSpec.parse("kill:decode-0@30,restart@60") == FaultSpec("decode-0", 30.0, 60.0)
    assert FaultSpec.parse("kill:prefill_1@2.5") == FaultSpec("prefill_1", 2.5, None)


@pytest.mark.parametrize("spec", ["kill:w", "stop:w@1", "kill:w@5,restart@4", "kill:a b@1"])
def test_bad_fault_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        FaultSpec.parse(spec)


def test_pid_file_controller_signals_the_named_process(tmp_path: Path, victim: subprocess.Popen) -> None:
    detail = PidFileController(str(tmp_path)).kill("victim")
    assert victim.wait(5) == -signal.SIGKILL
    assert str(victim.pid) in detail


def test_pid_file_controller_without_pid_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FaultError, match="missing.pid"):
        PidFileController(str(tmp_path)).kill("missing")


def test_command_controller_substitutes_the_name(tmp_path: Path) -> None:
    controller = CommandController(restart_cmd=f"touch {tmp_path}/{{name}}.restarted")
    controller.restart("decode-0")
    assert (tmp_path / "decode-0.restarted").exists()
    with pytest.raises(FaultError, match="exited 1"):
        CommandController(kill_cmd="false").kill("x")


def test_a_controller_needs_a_way_to_reach_the_process() -> None:
    with pytest.raises(ValueError, match="--fault-pid-dir"):
        make_controller(None, None, None)


async def test_injector_acts_on_time_during_a_run(tmp_path: Path, victim: subprocess.Popen) -> None:
    controller = PidFileController(str(tmp_path), restart_cmd=f"touch {tmp_path}/{{name}}.up")
    injector = FaultInjector([FaultSpec("victim", 0.1, 0.25)], controller)
    turn = Turn(({"role": "user", "content": "x"},), 1, 3)
    result = await BenchRunner(FakeClient(delay_s=0.05), RunConfig(20.0, seed=1, progress=False), injector).run(
        [Session(i, (turn,)) for i in range(10)])
    kill, restart = result.faults
    assert (kill["action"], kill["ok"], restart["action"], restart["ok"]) == ("kill", True, "restart", True)
    assert kill["actual_s"] == pytest.approx(0.1, abs=0.05) and restart["actual_s"] == pytest.approx(0.25, abs=0.05)
    assert victim.wait(5) == -signal.SIGKILL and (tmp_path / "victim.up").exists()


async def test_actions_after_the_run_ends_are_reported_as_not_reached(tmp_path: Path) -> None:
    injector = FaultInjector([FaultSpec("victim", 30.0)], PidFileController(str(tmp_path)))
    turn = Turn(({"role": "user", "content": "x"},), 1, 3)
    result = await BenchRunner(FakeClient(), RunConfig(math.inf, progress=False), injector).run([Session(0, (turn,))])
    assert result.faults[0]["actual_s"] is None and result.faults[0]["ok"] is False


def test_cli_reports_goodput_before_during_and_after_the_fault(sse_server: BenchSSEServer, tmp_path: Path,
                                                               victim: subprocess.Popen) -> None:
    out = tmp_path / "fault.json"
    argv = ["--base-url", sse_server.base_url, "--num-prompts", "12", "--random-input-len", "4",
            "--random-output-len", "3", "--request-rate", "20", "--tokenizer", "words", "--no-progress",
            "--slo-ttft-ms", "1000", "--fault", "kill:victim@0.2,restart@0.4", "--fault-pid-dir", str(tmp_path),
            "--fault-restart-cmd", f"touch {tmp_path}/{{name}}.up", "--result-json", str(out)]
    assert main(argv) == 0
    assert victim.wait(5) == -signal.SIGKILL and (tmp_path / "victim.up").exists()
    windows = json.loads(out.read_text())["runs"][0]["summary"]["fault_windows"]["victim@0.2"]
    assert set(windows) == {"before", "during", "after"}
    assert sum(w["requests"] for w in windows.values()) == 12


def test_a_serve_run_file_names_the_pids_that_may_be_killed(tmp_path: Path) -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps({"pids": {"worker-prefill": victim.pid}}))
    controller = make_controller(None, None, None, "SIGKILL", str(run_file))
    assert "worker-prefill pid" in controller.kill("worker-prefill")
    assert victim.wait(10) == -9
    with pytest.raises(FaultError, match="not running under this baton serve"):
        controller.kill("gateway")

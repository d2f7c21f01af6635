"""Fault injection during a run: kill a named worker at second S, optionally restart it at second R.

`--fault kill:NAME@S[,restart@R]` names *what* happens; a `ProcessController` knows *how* to signal
the process called NAME, so the same spec works against a local process tree, `baton serve`'s
supervisor or a cluster, by swapping the controller:
- `PidFileController`: reads `<pid_dir>/<NAME>.pid` and sends a signal (SIGKILL by default); it can
  only kill, so restart goes through a command.
- `ServeRunController`: reads the run file of a `baton serve` (`<run dir>/run.json`, printed at start;
  `--fault-serve-run`) for the pid of child NAME (`worker-prefill`, `worker-decode`, `billing`,
  `safety`, `gateway`, `scheduler`, `postgres`, `redis`, `kafka`) and signals it. `baton serve`
  restarts it by itself, so `restart` only waits until the run file shows a new pid.
- `CommandController`: runs `--fault-kill-cmd` / `--fault-restart-cmd` with `{name}` replaced, e.g.
  `--fault-kill-cmd "kubectl delete pod {name} --grace-period=0"`. Commands run without a shell
  (shlex-split) and must return within `command_timeout` s -- a restart command should start the
  worker in the background (as a supervisor's control command does), not run it in the foreground.

Controllers block (a signal, a short subprocess); the injector calls them in a thread so request
timing on the event loop is not disturbed. Each action's planned and actual time is recorded, and
the report gives goodput before, during and after the fault window (`metrics.fault_windows`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_SPEC = re.compile(r"kill:(?P<name>[A-Za-z0-9_.\-]+)@(?P<at>[0-9.]+)(?:,restart@(?P<restart>[0-9.]+))?")


class FaultError(RuntimeError):
    """A fault action could not be carried out (no PID file, command failed...)."""


@dataclass(frozen=True)
class FaultSpec:
    target: str  # the worker's name, as the controller knows it
    kill_at: float  # seconds after the run starts
    restart_at: float | None = None

    @classmethod
    def parse(cls, spec: str) -> FaultSpec:
        """`kill:NAME@SECONDS[,restart@SECONDS]`, restart strictly after the kill."""
        m = _SPEC.fullmatch(spec.strip())
        if not m:
            raise ValueError(f"bad fault spec {spec!r}; expected kill:NAME@SECONDS[,restart@SECONDS]")
        kill_at = float(m["at"])
        restart_at = float(m["restart"]) if m["restart"] else None
        if restart_at is not None and restart_at <= kill_at:
            raise ValueError(f"restart ({restart_at}s) must come after the kill ({kill_at}s) in {spec!r}")
        return cls(m["name"], kill_at, restart_at)


class ProcessController(ABC):
    """Stops and starts named worker processes. Methods block (briefly) and raise `FaultError`."""

    @abstractmethod
    def kill(self, name: str) -> str:
        """Kill the process `name`; returns a one-line description of what was done."""

    @abstractmethod
    def restart(self, name: str) -> str:
        """Start `name` again; returns once it has been started (not necessarily ready)."""


def _run_command(template: str, name: str, timeout: float) -> str:
    argv = shlex.split(template.replace("{name}", name))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FaultError(f"{argv[0]}: {e}") from e
    if done.returncode != 0:
        raise FaultError(f"{shlex.join(argv)} exited {done.returncode}: {done.stderr.strip()[:200]}")
    return shlex.join(argv)


@dataclass(frozen=True)
class CommandController(ProcessController):
    kill_cmd: str | None = None  # "{name}" is replaced with the target
    restart_cmd: str | None = None
    command_timeout: float = 30.0

    def kill(self, name: str) -> str:
        if not self.kill_cmd:
            raise FaultError("no --fault-kill-cmd given")
        return _run_command(self.kill_cmd, name, self.command_timeout)

    def restart(self, name: str) -> str:
        if not self.restart_cmd:
            raise FaultError("no --fault-restart-cmd given")
        return _run_command(self.restart_cmd, name, self.command_timeout)


@dataclass(frozen=True)
class PidFileController(ProcessController):
    pid_dir: str  # holds NAME.pid files, one PID (decimal) each
    signal_name: str = "SIGKILL"
    restart_cmd: str | None = None
    command_timeout: float = 30.0

    def kill(self, name: str) -> str:
        path = Path(self.pid_dir) / f"{name}.pid"
        try:
            pid = int(path.read_text().strip())
            os.kill(pid, signal.Signals[self.signal_name])
        except (OSError, ValueError, KeyError) as e:
            raise FaultError(f"cannot {self.signal_name} {name} via {path}: {e}") from e
        return f"{self.signal_name} pid {pid} ({path})"

    def restart(self, name: str) -> str:
        if not self.restart_cmd:
            raise FaultError("a PID file can only kill; pass --fault-restart-cmd to restart")
        return _run_command(self.restart_cmd, name, self.command_timeout)


@dataclass(frozen=True)
class ServeRunController(ProcessController):
    run_file: str  # `baton serve`'s run.json: {"pids": {NAME: pid, ...}, ...}
    signal_name: str = "SIGKILL"
    restart_timeout: float = 60.0

    def pids(self) -> dict[str, int]:
        try:
            return {str(k): int(v) for k, v in json.loads(Path(self.run_file).read_text())["pids"].items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FaultError(f"cannot read the pids in {self.run_file}: {e}") from e

    def kill(self, name: str) -> str:
        pid = self.pids().get(name)
        if pid is None:
            raise FaultError(f"{name} is not running under this baton serve; running: {sorted(self.pids())}")
        try:
            os.kill(pid, signal.Signals[self.signal_name])
        except (OSError, KeyError) as e:
            raise FaultError(f"cannot {self.signal_name} {name} (pid {pid}): {e}") from e
        return f"{self.signal_name} {name} pid {pid} ({self.run_file})"

    def restart(self, name: str) -> str:
        """`baton serve` restarts its children itself: wait until `name` runs under a new pid."""
        before = self.pids().get(name)
        deadline = time.monotonic() + self.restart_timeout
        while time.monotonic() < deadline:
            now = self.pids().get(name)
            if now is not None and now != before:
                return f"{name} restarted by baton serve as pid {now}"
            time.sleep(0.2)
        raise FaultError(f"{name} did not come back within {self.restart_timeout:.0f}s")


@dataclass
class FaultEvent:
    action: str  # kill | restart
    target: str
    planned_s: float
    actual_s: float | None = None  # None: the run ended before this time
    ok: bool = False
    detail: str = ""


class FaultInjector:
    """Runs the specs' actions at their times, relative to the run's `t_start` (perf_counter)."""

    def __init__(self, specs: list[FaultSpec], controller: ProcessController) -> None:
        self.specs = specs
        self._controller = controller
        self.events = [FaultEvent("kill", s.target, s.kill_at) for s in specs]
        self.events += [FaultEvent("restart", s.target, s.restart_at) for s in specs if s.restart_at is not None]
        self.events.sort(key=lambda e: e.planned_s)

    async def run(self, t_start: float) -> None:
        """Cancel it when the run ends; actions not reached keep `actual_s = None`."""
        for event in self.events:
            await asyncio.sleep(max(0.0, t_start + event.planned_s - time.perf_counter()))
            event.actual_s = time.perf_counter() - t_start
            action = self._controller.kill if event.action == "kill" else self._controller.restart
            try:
                event.detail = await asyncio.to_thread(action, event.target)
                event.ok = True
            except FaultError as e:
                event.detail = str(e)

    def report(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.events]


def make_controller(pid_dir: str | None, kill_cmd: str | None, restart_cmd: str | None,
                    signal_name: str = "SIGKILL", serve_run: str | None = None) -> ProcessController:
    """A kill command wins over a `baton serve` run file, which wins over a PID directory."""
    if kill_cmd:
        return CommandController(kill_cmd, restart_cmd)
    if serve_run:
        if signal_name not in signal.Signals.__members__:
            raise ValueError(f"unknown signal {signal_name!r}; e.g. SIGKILL, SIGTERM, SIGINT")
        return ServeRunController(serve_run, signal_name)
    if pid_dir:
        if signal_name not in signal.Signals.__members__:
            raise ValueError(f"unknown signal {signal_name!r}; e.g. SIGKILL, SIGTERM, SIGINT")
        return PidFileController(pid_dir, signal_name, restart_cmd)
    raise ValueError("--fault needs --fault-serve-run, --fault-pid-dir or --fault-kill-cmd to know how to reach "
                     "the process")

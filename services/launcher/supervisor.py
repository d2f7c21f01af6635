"""`Supervisor`: start a cluster's processes in order, watch them, stop them in reverse order.

Each child is a `SupervisedProcess` (process.py): its own session and process group (a terminal's
Ctrl-C reaches only the supervisor, which then stops children in order) and the parent-death signal
(SIGKILL when the supervisor dies, even by SIGKILL). A child is started only after the previous one is
ready (`ReadyCheck`: a log line of *this* run, a listening port, an HTTP 200). Stopping sends each child
its graceful signal, waits its `stop_timeout_s`, SIGKILLs it, then SIGKILLs what is left of its process
group (grandchildren a child failed to reap).

Restarts: a child whose spec has a `RestartPolicy` is restarted when it dies, after a backoff that
doubles on each quick death (1 s, 2 s, 4 s ... up to `max_backoff_s`) and resets once the child has
stayed up `stable_after_s`. Restarts never block `watch()`: a restarting child goes through BACKOFF and
STARTING states polled in the same loop, so a second death elsewhere is handled meanwhile and the rest
of the cluster keeps serving. It keeps its command line, so it comes back on the same ports. Embedded
infrastructure (`watch_service`) is restarted the same way, but its start blocks (it takes < 2 s).
A child without a policy that dies ends `watch()` (the caller stops everything).

Synchronous and main-thread only on purpose: the parent-death signal fires when the *thread* that
forked a child exits.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from services.common.errors import InfraStartError
from services.launcher.process import SupervisedProcess

log = logging.getLogger(__name__)
ReadyCheck = Callable[[SupervisedProcess], bool]


def log_line(marker: str) -> ReadyCheck:
    """Ready once this run of the child printed `marker` (e.g. the worker's `BATON_WORKER_READY`)."""
    return lambda process: marker in process.log_of_this_run()


def listening(port: int) -> ReadyCheck:
    """Ready once the child itself listens on `port` (not merely: something answers there)."""
    return lambda process: process.listens_on(port)


def http_ok(url: str) -> ReadyCheck:
    def probe(process: SupervisedProcess) -> bool:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own local URL
            return int(response.status) == 200
    return probe


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # up this long: the next death restarts after initial_backoff_s again


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]
    ready: ReadyCheck
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    ready_timeout_s: float = 120.0
    stop_timeout_s: float = 20.0
    stop_signal: signal.Signals = signal.SIGTERM
    restart: RestartPolicy | None = None  # None: its death ends watch()


class ChildState(enum.Enum):
    RUNNING = "running"
    BACKOFF = "backoff"  # dead; restarted at `next_start_at`
    STARTING = "starting"  # restarted, not ready yet


class RestartableService(Protocol):
    """An embedded Postgres/Redis/broker (launcher/embedded.py): blocking start, same port again."""

    def alive(self) -> bool: ...
    def start(self) -> None: ...
    def log_tail(self, lines: int = 40) -> str: ...


@dataclass
class _Child:
    spec: ChildSpec
    process: SupervisedProcess
    state: ChildState = ChildState.RUNNING
    started_at: float = field(default_factory=time.monotonic)
    next_start_at: float = 0.0
    backoff_s: float = 0.0
    restarts: int = 0


@dataclass
class _Service:
    name: str
    service: RestartableService
    policy: RestartPolicy
    up_since: float = field(default_factory=time.monotonic)
    down_since: float | None = None
    next_start_at: float = 0.0
    backoff_s: float = 0.0
    restarts: int = 0


def _next_backoff(policy: RestartPolicy, previous_s: float, up_for_s: float) -> float:
    if previous_s == 0.0 or up_for_s >= policy.stable_after_s:
        return policy.initial_backoff_s
    return min(policy.max_backoff_s, previous_s * 2)


class Supervisor:
    """Not thread-safe; one owner (the main thread) starts, watches and stops.

    `on_change` is called after every (re)start, e.g. to rewrite a pid file for fault injection."""

    def __init__(self, log_dir: Path, cwd: Path | None = None,
                 on_change: Callable[[Supervisor], None] | None = None, log_prefix: str = "") -> None:
        """`log_prefix`: each child's log is `<log_dir>/<log_prefix><name>.log` (several runs in one folder)."""
        self.log_dir = log_dir
        self.log_prefix = log_prefix
        self.cwd = cwd
        self.on_change = on_change
        self._children: list[_Child] = []
        self._services: list[_Service] = []

    @property
    def children(self) -> list[tuple[ChildSpec, SupervisedProcess]]:
        return [(c.spec, c.process) for c in self._children]

    def process(self, name: str) -> SupervisedProcess:
        """The live child named `name` (the last started of that name); KeyError if none."""
        for c in reversed(self._children):
            if c.spec.name == name:
                return c.process
        raise KeyError(name)

    def pids(self) -> dict[str, int]:
        """Live children (and watched services) by name."""
        found = {c.spec.name: c.process.pid for c in self._children
                 if c.process.pid is not None and c.process.alive()}
        for s in self._services:
            pid = getattr(s.service, "pid", None)
            if pid is not None and s.service.alive():
                found[s.name] = pid
        return found

    def restarts(self) -> dict[str, int]:
        return {**{c.spec.name: c.restarts for c in self._children}, **{s.name: s.restarts for s in self._services}}

    def start(self, spec: ChildSpec) -> SupervisedProcess:
        """Start `spec` and wait until ready; on failure raise InfraStartError with its log tail (the child
        is then stopped and no longer supervised: the caller may start it again, e.g. on other ports)."""
        process = self._process(spec)
        child = _Child(spec, process)
        self._children.append(child)  # recorded first: a stop that interrupts start() finds it
        started = time.monotonic()
        try:
            process.start()
            process.wait_ready(lambda: spec.ready(process), spec.ready_timeout_s)
        except InfraStartError:
            self._children.remove(child)
            self._stop(child)  # with whatever it left in its process group
            raise
        log.info("%s ready in %.1fs (pid %s)", spec.name, time.monotonic() - started, process.pid)
        self._changed()
        return process

    def start_together(self, specs: Sequence[ChildSpec]) -> list[SupervisedProcess]:
        """Start every spec at once, then wait until each is ready, each within its `ready_timeout_s` of the
        start: their start-ups overlap (GPU workers spend minutes loading weights and capturing CUDA graphs).
        On a failure every one of them is stopped and InfraStartError raised with the failed one's log."""
        children = [_Child(spec, self._process(spec)) for spec in specs]
        self._children.extend(children)  # recorded first: a stop that interrupts this finds them
        started = time.monotonic()
        try:
            for c in children:
                c.process.start()
            for c in children:
                left = c.spec.ready_timeout_s - (time.monotonic() - started)
                c.process.wait_ready(functools.partial(c.spec.ready, c.process), max(1.0, left))
        except InfraStartError:
            self._stop_together(children)  # with whatever each left in its process group
            raise
        log.info("%s ready in %.1fs", ", ".join(s.name for s in specs), time.monotonic() - started)
        self._changed()
        return [c.process for c in children]

    def watch_service(self, name: str, service: RestartableService, policy: RestartPolicy | None = None) -> None:
        """Restart `service` (already started) whenever it dies, until stop_all()."""
        self._services.append(_Service(name, service, policy or RestartPolicy()))

    def _process(self, spec: ChildSpec) -> SupervisedProcess:
        return SupervisedProcess(spec.name, spec.argv, self._log_path(spec.name),
                                 env={**os.environ, **spec.env}, cwd=self.cwd,
                                 stop_signal=spec.stop_signal, stop_timeout_s=spec.stop_timeout_s)

    def _log_path(self, name: str) -> Path:
        return self.log_dir / f"{self.log_prefix}{name}.log"

    def run_once(self, name: str, argv: list[str], timeout_s: float) -> None:
        """Run a set-up step to completion (not supervised afterwards); a failure raises with its log."""
        log_path = self.log_dir / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            try:
                code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      cwd=self.cwd, timeout=timeout_s, check=False).returncode
            except subprocess.TimeoutExpired as e:
                raise InfraStartError(f"{name} did not finish within {timeout_s:.0f}s; log {log_path}") from e
        if code != 0:
            raise InfraStartError(f"{name} failed (exit code {code}); log {log_path}:\n{self.log_tail(name)}")

    def dead_child(self) -> str | None:
        """The name of the first child without a restart policy that exited on its own, if any."""
        for c in self._children:
            if c.spec.restart is None and not c.process.alive():
                return c.spec.name
        return None

    def watch(self, should_stop: Callable[[], bool], poll_s: float = 0.5) -> str | None:
        """Block until `should_stop()` or a child without a restart policy dies (returns its name; None:
        asked to stop). Children and services with a policy are restarted meanwhile."""
        while not should_stop():
            dead = self.dead_child()
            if dead is not None:
                return dead
            self.poll_restarts()
            time.sleep(poll_s)
        return None

    def poll_restarts(self) -> None:
        """One round of the restart state machines (watch() calls this every poll)."""
        now = time.monotonic()
        for s in self._services:
            self._poll_service(s, now)
        for c in self._children:
            if c.spec.restart is not None:
                self._poll_child(c, c.spec.restart, now)

    def _poll_child(self, c: _Child, policy: RestartPolicy, now: float) -> None:
        if c.state is ChildState.RUNNING and not c.process.alive():
            self._schedule(c, policy, now, f"exited (code {c.process.exit_code()})")
        elif c.state is ChildState.BACKOFF and now >= c.next_start_at:
            c.process = self._process(c.spec)
            try:
                c.process.start()
            except InfraStartError as e:
                self._schedule(c, policy, now, str(e))
                return
            c.state, c.started_at, c.restarts = ChildState.STARTING, now, c.restarts + 1
        elif c.state is ChildState.STARTING:
            if not c.process.alive():
                self._schedule(c, policy, now, f"died while restarting (code {c.process.exit_code()})")
            elif self._ready(c):
                c.state = ChildState.RUNNING
                log.warning("%s is back after restart %d (pid %s, ready in %.1fs)", c.spec.name, c.restarts,
                            c.process.pid, now - c.started_at)
                self._changed()
            elif now - c.started_at > c.spec.ready_timeout_s:
                c.process.stop()
                self._schedule(c, policy, now, f"not ready after {c.spec.ready_timeout_s:.0f}s")

    @staticmethod
    def _ready(c: _Child) -> bool:
        try:
            return c.spec.ready(c.process)
        except Exception:  # any probe failure just means "not yet"
            return False

    def _schedule(self, c: _Child, policy: RestartPolicy, now: float, why: str) -> None:
        c.backoff_s = _next_backoff(policy, c.backoff_s, now - c.started_at)
        c.state, c.next_start_at = ChildState.BACKOFF, now + c.backoff_s
        log.error("%s %s; restarting in %.1fs. Its log:\n%s", c.spec.name, why, c.backoff_s,
                  c.process.log_tail(15))

    def _poll_service(self, s: _Service, now: float) -> None:
        if s.down_since is None:
            if s.service.alive():
                return
            s.down_since = now
            s.backoff_s = _next_backoff(s.policy, s.backoff_s, now - s.up_since)
            s.next_start_at = now + s.backoff_s
            log.error("%s died; restarting in %.1fs. Its log:\n%s", s.name, s.backoff_s, s.service.log_tail(15))
        if now < s.next_start_at:
            return
        try:
            s.service.start()
        except InfraStartError as e:
            s.backoff_s = min(s.policy.max_backoff_s, s.backoff_s * 2)
            s.next_start_at = time.monotonic() + s.backoff_s
            log.error("%s did not restart (%s); next try in %.1fs", s.name, e, s.backoff_s)
            return
        s.restarts += 1
        s.up_since = time.monotonic()
        log.warning("%s is back after restart %d (down %.1fs)", s.name, s.restarts, s.up_since - s.down_since)
        s.down_since = None
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self)
            except OSError as e:
                log.warning("supervisor on_change failed: %s", e)

    def stop_all(self, grace_s: float | None = None) -> None:
        """Stop every child, the last started first (gateway before workers before infrastructure).
        Watched services are the caller's to stop (after this).

        `grace_s`: instead, every child gets its graceful signal at once and what is left after `grace_s`
        is SIGKILLed -- for an interrupted start-up, where nothing serves yet, so there is nothing to
        drain in order, and a child still loading (or one that ignores its signal until it serves, as
        the gateway does) must not hold Ctrl-C up for its whole `stop_timeout_s`."""
        self._services.clear()
        if grace_s is not None:
            self._stop_together(list(reversed(self._children)), grace_s)
        while self._children:
            self._stop(self._children.pop())

    def stop_peers(self, names: Collection[str]) -> None:
        """Stop these children together: each gets its graceful signal at once, then each is waited for
        (within its own `stop_timeout_s`). Only for peers that no other child needs while it stops (e.g.
        extra gateways in front of one worker): the total is the slowest one's shutdown, not the sum."""
        self._stop_together([c for c in self._children if c.spec.name in names])

    def _stop_together(self, children: list[_Child], grace_s: float | None = None) -> None:
        for c in children:
            self._children.remove(c)
            c.process.request_stop()
        deadline = None if grace_s is None else time.monotonic() + grace_s
        for c in children:
            self._stop(c, None if deadline is None else max(0.0, deadline - time.monotonic()))

    @staticmethod
    def _stop(c: _Child, timeout_s: float | None = None) -> None:
        code = c.process.stop(timeout_s)
        if c.process.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.process.pid, signal.SIGKILL)  # whatever the child left in its group
        log.info("%s stopped (exit code %s)", c.spec.name, code)

    def stop_child(self, name: str) -> None:
        """Stop one child now (gracefully) and stop supervising it (ordered shutdown steps)."""
        for c in list(self._children):
            if c.spec.name == name:
                self._children.remove(c)
                log.info("%s stopped (exit code %s)", name, c.process.stop())

    def log_tail(self, name: str, lines: int = 30) -> str:
        for c in self._children:
            if c.spec.name == name:
                return c.process.log_tail(lines)
        path = self._log_path(name)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

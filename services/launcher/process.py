"""`SupervisedProcess`: one child process that dies with its parent and keeps a log to show on failure.

Dying with the parent: `services.common.lifetime.die_with_parent` (Linux's parent-death signal).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from services.common.errors import ConfigError, InfraStartError
from services.common.lifetime import die_with_parent

_RESERVED_PORTS: set[int] = set()


def reserve_port(port: int) -> None:
    """Never hand `port` out from `free_port()` in this process (e.g. the gateway's requested port,
    which is only bound once the gateway starts, after every other child has picked its ports)."""
    _RESERVED_PORTS.add(port)


class PortInUseError(ConfigError):
    """A port the user chose is taken (found before anything was started)."""


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not bind `host:port` now (something listens there, on that address or on
    all addresses). Binds with SO_REUSEADDR as servers do, so a port left in TIME_WAIT counts as free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and is not reserved (the caller retries on a
    bind race)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _RESERVED_PORTS:
            return port


_T = TypeVar("_T")
_PORT_RACE_MARKERS = ("address already in use", "address in use", "eaddrinuse")


def lost_port_race(error: BaseException | str) -> bool:
    """Whether a child failed to start because its port was taken after `free_port()` picked it, from its
    start-up error or its log."""
    return any(marker in str(error).lower() for marker in _PORT_RACE_MARKERS)


def start_on_free_port(start: Callable[[int], _T], attempts: int = 3) -> _T:
    """`start(port)` on a port `free_port()` picks, again on a fresh one when the child lost a bind race
    (any process's outgoing connection can take the picked port first); other failures raise at once."""
    return retry_lost_port_race(lambda: start(free_port()), attempts)


def retry_lost_port_race(start: Callable[[], _T], attempts: int = 3) -> _T:
    """`start()`, which picks its child's ports itself, again while the child lost one of them to another
    process before binding it (`lost_port_race`); other failures raise at once."""
    for attempt in range(attempts):
        try:
            return start()
        except InfraStartError as e:
            if not lost_port_race(e) or attempt == attempts - 1:
                raise
    raise ValueError(f"attempts must be >= 1, got {attempts}")


class SupervisedProcess:
    """A named child process with its stdout/stderr in `log_path`.

    `stop()` sends `stop_signal` (the program's graceful shutdown), waits `stop_timeout_s`, then
    SIGKILLs; `request_stop()` first lets several children shut down at once. `user` runs the child
    as that account (only meaningful when we are root).
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *, user: str | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None,
                 stop_signal: signal.Signals = signal.SIGTERM, stop_timeout_s: float = 10.0) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.user = user
        self.env = env
        self.cwd = cwd
        self.stop_signal = stop_signal
        self.stop_timeout_s = stop_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop_requested = False  # this run got its graceful signal (a second one may force-quit it)
        self.log_offset = 0  # where this run's output starts in `log_path` (the log is appended across runs)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def popen(self) -> subprocess.Popen[bytes] | None:
        """This run's process (None before `start()`), for callers that signal or wait on it themselves."""
        return self._proc

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        assert self._proc is None or self._proc.poll() is not None, f"{self.name} already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._stop_requested = False
        with open(self.log_path, "ab") as log, _signals_held():
            self.log_offset = log.tell()
            try:
                self._proc = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=self.env, cwd=self.cwd, user=self.user, group=_group_of(self.user),
                    extra_groups=[] if self.user else None,
                    start_new_session=True,  # a terminal's Ctrl-C reaches us, and we stop children in order
                    preexec_fn=_child_setup(os.getpid()))
            except OSError as e:
                raise InfraStartError(f"{self.name}: cannot execute {self.argv[0]}: {e}") from e

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float) -> None:
        """Poll `probe` until it returns True; on exit or timeout stop the child and raise with the log."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                code = self._proc.returncode if self._proc else None
                raise InfraStartError(f"{self.name} exited during start-up (code {code}); "
                                      f"log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(Exception):  # any probe failure just means "not yet"
                if probe():
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise InfraStartError(f"{self.name} not ready after {timeout_s:.0f}s; "
                                      f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Graceful stop, then SIGKILL after `timeout_s` (default: `stop_timeout_s`). Returns the exit code
        (None if never started)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self.request_stop()
            try:
                proc.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def request_stop(self) -> None:
        """Send the graceful signal once, without waiting; `stop()` then waits for the exit."""
        proc = self._proc
        if proc is None or proc.poll() is not None or self._stop_requested:
            return
        self._stop_requested = True
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(self.stop_signal)

    def listens_on(self, port: int) -> bool:
        """True if this child itself holds a listening TCP socket on `port`.

        Readiness probes need this: a probe that merely connects would be answered by any other
        server already on the port, and report a child that is about to die of EADDRINUSE as ready.
        """
        if not self.alive() or self.pid is None:
            return False
        inodes = _listening_inodes(port)
        try:
            fds = os.listdir(f"/proc/{self.pid}/fd")
        except OSError:
            return False
        for fd in fds:
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{self.pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
        return False

    def kill(self) -> None:
        """SIGKILL now, no shutdown (tests of crash recovery)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def log_of_this_run(self) -> str:
        """What this run printed so far: readiness markers are matched here, never in an earlier run's
        lines (a reused `--data-dir`, or the incarnation before a restart)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def exit_code(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT/SIGTERM wait until the child is started and recorded: `baton serve` turns them into an
    exception that unwinds start-up, and one raised inside Popen (after the fork, before `_proc` is set)
    would leave a child nobody stops. Held signals are delivered right after, on this thread."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _child_setup(parent_pid: int) -> Callable[[], None]:
    """The child's `preexec_fn`: it inherits the signal mask, so it unblocks what `_signals_held` blocked
    (or it would never see its stop signal), and dies with its parent."""
    die = die_with_parent(parent_pid)

    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_SIGNALS)
        die()

    return preexec


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes in LISTEN state on `port` (IPv4 and IPv6), from /proc/net."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f)  # header
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.add(inode)
    return found


def _group_of(user: str | None) -> int | None:
    if user is None:
        return None
    import pwd

    try:
        return pwd.getpwnam(user).pw_gid
    except KeyError as e:
        raise InfraStartError(f"system user {user!r} does not exist") from e

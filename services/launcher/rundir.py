"""`RunDir`: where one `baton serve` keeps its logs, embedded data and its run file.

Without `--data-dir` it is a fresh temp dir (`baton-serve-*`), removed on every exit path Python sees:
a normal return, an exception, Ctrl-C and SIGTERM (serve turns both into an unwinding exception).
SIGKILL cannot be caught, so each start also removes the temp dirs of earlier runs whose `serve.pid`
names a process that is gone (the children died with their parent: process.py's parent-death signal).

The run file (`run.json`) says what runs now: the serve pid, its `state` (`RunState`), the gateway URL,
every child's and embedded service's pid, what each serves on which port (`endpoints`: component ->
`Endpoint` -> port), every Prometheus endpoint (`metrics`), rewritten after each (re)start. Fault
injection (loadtest/faults.py) reads its pids; `baton status` (status.py) probes its endpoints.
It holds the cluster token and the infrastructure's passwords, so only its owner may read it (0600).

Finding it: `publish(port)` links it as `serve-<port>.json` in a per-user index dir under the temp dir
(`run_index_dir`), so `baton status --port P` finds the cluster whose gateway is on P without knowing
the run dir; the link goes when the run dir is closed.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)
TEMP_PREFIX = "baton-serve-"
RUN_FILE = "run.json"
PID_FILE = "serve.pid"
_YOUNG_S = 120.0  # a temp dir without a pid file may be a serve that is just starting
INDEX_PREFIX = "baton-runs-"


class RunState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"  # every child started and ready; the gateway URL was printed
    STOPPING = "stopping"


class Endpoint(enum.StrEnum):
    """What a component serves on a port (how `baton status` probes it)."""

    GRPC = "grpc"  # gRPC with the standard health service (grpc.health.v1)
    HTTP = "http"  # the gateway's HTTP API: /healthz, /readyz, /metrics
    METRICS = "metrics"  # Prometheus /metrics
    TCP = "tcp"  # embedded infrastructure (Postgres, Redis, the broker, its store): a listening socket


def run_index_dir(tmp_root: Path | None = None) -> Path:
    """Where running clusters' run files are linked by gateway port: beside the temp run dirs, per user."""
    return (tmp_root or Path(tempfile.gettempdir())) / f"{INDEX_PREFIX}{os.getuid()}"


def indexed_run_file(port: int, tmp_root: Path | None = None) -> Path:
    """The link to the run file of the `baton serve` whose gateway is on `port` (it may be dangling)."""
    return run_index_dir(tmp_root) / f"serve-{port}.json"


class RunDir:
    def __init__(self, data_dir: Path | None) -> None:
        self.temporary = data_dir is None
        if data_dir is None:
            remove_stale_run_dirs()
            self.path = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
            self.path.chmod(0o711)  # the embedded Postgres (user postgres when we are root) must traverse it
        else:
            self.path = data_dir
            self.path.mkdir(parents=True, exist_ok=True)
        (self.path / PID_FILE).write_text(str(os.getpid()))
        self._index_link: Path | None = None

    @property
    def run_file(self) -> Path:
        return self.path / RUN_FILE

    def write_run_file(self, content: dict[str, object]) -> None:
        tmp = self.path / f".{RUN_FILE}.tmp"
        tmp.unlink(missing_ok=True)
        # Owner-only: it holds the infrastructure URLs (with their credentials), and the run dir can be
        # traversed by others (the embedded Postgres's user must).
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(json.dumps({"serve_pid": os.getpid(), **content}, indent=1))
        tmp.replace(self.run_file)  # atomic: a reader never sees half a file

    def publish(self, port: int) -> None:
        """Link the run file as `serve-<port>.json` in the index dir (replacing a stale link)."""
        index = run_index_dir()
        index.mkdir(mode=0o700, exist_ok=True)
        if index.stat().st_uid != os.getuid():  # someone else's dir in a shared /tmp: never follow it
            log.warning("%s is not ours; `baton status --port %d` will not find this run", index, port)
            return
        link, tmp = indexed_run_file(port), index / f".serve-{port}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.run_file)
        tmp.replace(link)  # atomic, like the run file itself
        self._index_link = link

    def _unpublish(self) -> None:
        link = self._index_link
        with contextlib.suppress(OSError):
            if link is not None and os.readlink(link) == str(self.run_file):  # not a later run's link
                link.unlink()

    def close(self) -> None:
        self._unpublish()
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                self.run_file.unlink()
                (self.path / PID_FILE).unlink()


def remove_stale_run_dirs(tmp_root: Path | None = None) -> list[Path]:
    """Remove `baton-serve-*` temp dirs left by runs that were SIGKILLed; returns what was removed."""
    removed = []
    for path in (tmp_root or Path(tempfile.gettempdir())).glob(f"{TEMP_PREFIX}*"):
        if path.is_dir() and _abandoned(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d temp dirs of earlier runs that were killed: %s", len(removed), removed)
    return removed


def _abandoned(path: Path) -> bool:
    try:
        pid = int((path / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        try:
            return time.time() - path.stat().st_mtime > _YOUNG_S
        except OSError:
            return False
    return not _is_serve_process(pid)


def _is_serve_process(pid: int) -> bool:
    """A live process that is a Python (the pid may have been reused by something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"python" in cmdline or b"baton" in cmdline

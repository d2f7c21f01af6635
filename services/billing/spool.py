"""`UsageSpool`: where a finished request's usage goes when Postgres cannot take its outbox row.

One append-only JSON-lines file (`<dir>/usage.jsonl`, one `UsageEvent` per line). `append` writes
the line and fsyncs it before returning, so an event the gateway has spooled survives the gateway's
crash and a power loss. The relay `drain`s the file into the outbox table once Postgres answers
again, then truncates it.

Every access holds an exclusive `flock` on the file, so gateways sharing a directory (replicas on one
host, or a restarted gateway beside a dying one) never interleave a line with a drain. A line torn by
a crash in the middle of `append` was never acknowledged (the response had not ended): it is skipped
with an error log, and the next `append` starts on a line of its own.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from services.billing.events import UsageEvent
from services.common.errors import BillingError

log = logging.getLogger(__name__)
SPOOL_FILE = "usage.jsonl"


class UsageSpool:
    def __init__(self, directory: Path) -> None:
        self.path = directory / SPOOL_FILE

    def append(self, event: UsageEvent) -> None:
        """Durably add `event` (blocking: call it from a thread)."""
        created = not self.path.exists()
        with self._locked(os.O_RDWR | os.O_APPEND | os.O_CREAT) as fd:
            # A line torn by a crashed writer gets its newline first, so it cannot swallow this one.
            prefix = b"" if _ends_with_newline(fd) else b"\n"
            os.write(fd, prefix + event.to_json() + b"\n")
            os.fsync(fd)
        if created:  # the new directory entry must survive a power loss too
            _fsync_dir(self.path.parent)

    def size(self) -> int:
        """Bytes spooled and not yet drained."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def drain(self, store: Callable[[list[UsageEvent]], None]) -> int:
        """Hand every spooled event to `store` (which must make them durable, e.g. commit them to the
        outbox), then empty the file. If `store` raises, the file is kept as it was. Returns the count."""
        if not self.size():
            return 0
        with self._locked(os.O_RDWR) as fd:
            events = list(_parse(_read_all(fd)))
            if events:
                store(events)
            os.ftruncate(fd, 0)
            os.fsync(fd)
        return len(events)

    @contextmanager
    def _locked(self, flags: int) -> Iterator[int]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # releases the lock


def _ends_with_newline(fd: int) -> bool:
    end = os.lseek(fd, 0, os.SEEK_END)
    return end == 0 or os.pread(fd, 1, end - 1) == b"\n"


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(data: bytes) -> Iterator[UsageEvent]:
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield UsageEvent.from_json(line)
        except BillingError as e:
            log.error("usage spool line %d unreadable (torn by a crash?), skipped: %s", number, e)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

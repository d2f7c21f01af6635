"""The notification a sender attaches to its WRITE (DONE) or sends alone when it gives up (ABORTED).

Wire format: the magic `BKV1` followed by compact JSON. NIXL delivers a WRITE's notification only
after the written bytes are visible at the target, so DONE means "every block has landed". ABORTED
is sent only once the sender's NIXL handle has been released, so it means "no more bytes will land".
Either one ends the receiver's danger window for that attempt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from kvtransfer.errors import MalformedNotificationError

MAGIC = b"BKV1"


class NoticeKind(Enum):
    DONE = "done"
    ABORTED = "aborted"


@dataclass(frozen=True)
class TransferNotice:
    kind: NoticeKind
    request_id: str
    attempt: int
    num_blocks: int
    checksums: tuple[int, ...] | None = None  # per destination block, in plan order; None = not computed
    reason: str = ""  # ABORTED only: why the sender gave up

    def encode(self) -> bytes:
        body: dict[str, object] = {
            "k": self.kind.value,
            "r": self.request_id,
            "a": self.attempt,
            "n": self.num_blocks,
        }
        if self.checksums is not None:
            body["c"] = list(self.checksums)
        if self.reason:
            body["why"] = self.reason
        return MAGIC + json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> TransferNotice:
        if not raw.startswith(MAGIC):
            raise MalformedNotificationError(f"not a kvtransfer notice: {raw[:16]!r}")
        try:
            body = json.loads(raw[len(MAGIC) :])
            checksums = body.get("c")
            return cls(
                kind=NoticeKind(body["k"]),
                request_id=str(body["r"]),
                attempt=int(body["a"]),
                num_blocks=int(body["n"]),
                checksums=None if checksums is None else tuple(int(c) for c in checksums),
                reason=str(body.get("why", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise MalformedNotificationError(f"bad kvtransfer notice {raw[:64]!r}: {e}") from e

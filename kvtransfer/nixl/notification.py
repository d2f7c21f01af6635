"""The notification a sender attaches to its WRITE (DONE) or sends alone when it gives up (ABORTED).

Wire format: the magic `BKV2` followed by compact JSON. NIXL delivers a WRITE's notification only
after the written bytes are visible at the target, so DONE means "every block has landed"; it also
carries the hand-off's payload (block checksums, the prefill's first token and its logprobs), so the
decode side commits on the notice alone. ABORTED
is sent only once the sender's NIXL handle has been released, so it means "no more bytes will land".
Either one ends the receiver's danger window for that attempt.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from engine.batch import TokenLogprobs
from kvtransfer.base import HandoffPayload
from kvtransfer.errors import MalformedNotificationError

MAGIC = b"BKV2"


class NoticeKind(Enum):
    DONE = "done"
    ABORTED = "aborted"


@dataclass(frozen=True)
class TransferNotice:
    kind: NoticeKind
    request_id: str
    attempt: int
    num_blocks: int
    payload: HandoffPayload = HandoffPayload()  # DONE only
    reason: str = ""  # ABORTED only: why the sender gave up

    @property
    def checksums(self) -> tuple[int, ...] | None:
        return self.payload.checksums

    def with_follower_checksums(self, follower_sums: Sequence[tuple[int, ...] | None]) -> TransferNotice:
        """This notice with the follower ranks' checksums (rank 1 first) after rank 0's: the rank-major
        checksums of a multi-rank worker's DONE notice. Unchanged when it carries none (checksums off)."""
        if self.payload.checksums is None:
            return self
        sums = self.payload.checksums + tuple(s for rank_sums in follower_sums for s in rank_sums or ())
        return dataclasses.replace(self, payload=dataclasses.replace(self.payload, checksums=sums))

    def encode(self) -> bytes:
        body: dict[str, object] = {
            "k": self.kind.value,
            "r": self.request_id,
            "a": self.attempt,
            "n": self.num_blocks,
        }
        body.update(_encode_payload(self.payload))
        if self.reason:
            body["why"] = self.reason
        return MAGIC + json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> TransferNotice:
        if not raw.startswith(MAGIC):
            raise MalformedNotificationError(f"not a kvtransfer notice: {raw[:16]!r}")
        try:
            body = json.loads(raw[len(MAGIC) :])
            return cls(
                kind=NoticeKind(body["k"]),
                request_id=str(body["r"]),
                attempt=int(body["a"]),
                num_blocks=int(body["n"]),
                payload=_decode_payload(body),
                reason=str(body.get("why", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise MalformedNotificationError(f"bad kvtransfer notice {raw[:64]!r}: {e}") from e


def _encode_payload(payload: HandoffPayload) -> dict[str, object]:
    body: dict[str, object] = {}
    if payload.checksums is not None:
        body["c"] = list(payload.checksums)
    if payload.first_token_id is not None:
        body["t"] = payload.first_token_id
    if payload.prefill_seconds:
        body["ps"] = round(payload.prefill_seconds, 6)
    if payload.first_logprobs is not None:
        body["lp"] = _encode_logprobs(payload.first_logprobs)
    if payload.choice_first:
        body["ch"] = [[t, None if lp is None else _encode_logprobs(lp)] for t, lp in payload.choice_first]
    return body


def _encode_logprobs(lp: TokenLogprobs) -> list[object]:
    return [lp.token_id, lp.logprob, [list(pair) for pair in lp.top]]


def _decode_logprobs(lp: Any) -> TokenLogprobs | None:
    if lp is None:
        return None
    token_id, logprob, top = lp
    return TokenLogprobs(int(token_id), float(logprob), tuple((int(t), float(p)) for t, p in top))


def _decode_payload(body: dict[str, Any]) -> HandoffPayload:
    """Raises ValueError / TypeError / KeyError on a malformed payload (decode() wraps them)."""
    sums, token = body.get("c"), body.get("t")
    return HandoffPayload(
        checksums=None if sums is None else tuple(int(c) for c in sums),
        first_token_id=None if token is None else int(token),
        first_logprobs=_decode_logprobs(body.get("lp")),
        prefill_seconds=float(body.get("ps", 0.0)),
        choice_first=tuple((int(t), _decode_logprobs(lp)) for t, lp in body.get("ch", ())),
    )

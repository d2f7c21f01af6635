"""How a decode engine's commit of remotely prefilled KV ended: a typed outcome, not a message.

The KV link asks the engine to commit the moment a DONE notice lands (AsyncEngine.commit_remote_threadsafe);
the decode flow then drops the blocks and retries, falls back or gives up by what happened, so the
outcome's kind is an enum and its text is only for logs and the fallback's detail.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CommitStatus(enum.Enum):
    COMMITTED = "committed"  # the sequence joined the batch with its first token
    ABORTED = "aborted"  # the request was aborted before its KV was committed: nothing to fall back to
    REJECTED = "rejected"  # verification found a problem (e.g. a landed block's checksum): never use the KV
    FAILED = "failed"  # the verification or the commit raised (a bug, not a mismatch)


@dataclass(frozen=True)
class CommitOutcome:
    status: CommitStatus
    problem: str = ""  # why not committed (REJECTED, FAILED); "" otherwise

    @property
    def committed(self) -> bool:
        return self.status is CommitStatus.COMMITTED


COMMITTED = CommitOutcome(CommitStatus.COMMITTED)
ABORTED_BEFORE_COMMIT = CommitOutcome(CommitStatus.ABORTED, "the request was aborted before its KV was committed")


def commit_failed(error: BaseException) -> CommitOutcome:
    return CommitOutcome(CommitStatus.FAILED, f"commit failed: {error}")

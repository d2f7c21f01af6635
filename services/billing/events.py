"""`UsageEvent`: one finished request's billable usage, as it travels from gateway to billing (JSON).

Billing policy for aborted streams (client disconnect, safety halt, timeout): bill what was
generated. The gateway emits the event with the full prompt (prefill ran) and the completion tokens
actually produced before the abort, and a finish_reason such as "abort" or "content_filter"; a
request that failed before any work (rejected, queued then dropped) emits no event.

Token semantics follow the OpenAI API: `prompt_tokens` includes `cached_tokens` (prompt tokens served
from the prefix cache, billed at the cached-input price).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from services.common.errors import BillingError

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class UsageEvent:
    request_id: str  # unique per request, ever: the idempotency key of billing
    org_id: uuid.UUID
    api_key_id: uuid.UUID | None
    model: str
    prompt_tokens: int  # includes cached_tokens
    cached_tokens: int
    completion_tokens: int  # generated before the finish or the abort
    finish_reason: str  # stop | length | abort | content_filter | error ...
    ttft_ms: float | None  # None when no token was produced
    e2e_ms: float | None
    created_at: datetime  # when the request finished; timezone-aware

    def __post_init__(self) -> None:
        problems = []
        if not self.request_id or len(self.request_id) > 200:
            problems.append("request_id must be 1..200 characters")
        if not self.model:
            problems.append("model is empty")
        if min(self.prompt_tokens, self.cached_tokens, self.completion_tokens) < 0:
            problems.append("token counts must be >= 0")
        if self.cached_tokens > self.prompt_tokens:
            problems.append("cached_tokens exceeds prompt_tokens")
        if self.created_at.tzinfo is None:
            problems.append("created_at must be timezone-aware")
        if problems:
            raise BillingError(f"invalid usage event {self.request_id!r}: {'; '.join(problems)}")

    def to_json(self) -> bytes:
        return json.dumps({
            "v": SCHEMA_VERSION, "request_id": self.request_id, "org_id": str(self.org_id),
            "api_key_id": str(self.api_key_id) if self.api_key_id else None, "model": self.model,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens, "finish_reason": self.finish_reason,
            "ttft_ms": self.ttft_ms, "e2e_ms": self.e2e_ms,
            "created_at": self.created_at.astimezone(UTC).isoformat(),
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> UsageEvent:
        """Parse and validate; anything malformed raises BillingError (the consumer skips it)."""
        try:
            obj: dict[str, Any] = json.loads(data)
            if obj.get("v") != SCHEMA_VERSION:
                raise BillingError(f"unsupported usage event version {obj.get('v')!r}")
            key = obj["api_key_id"]
            return cls(
                request_id=str(obj["request_id"]), org_id=uuid.UUID(obj["org_id"]),
                api_key_id=uuid.UUID(key) if key else None, model=str(obj["model"]),
                prompt_tokens=int(obj["prompt_tokens"]), cached_tokens=int(obj["cached_tokens"]),
                completion_tokens=int(obj["completion_tokens"]), finish_reason=str(obj["finish_reason"]),
                ttft_ms=_opt_float(obj.get("ttft_ms")), e2e_ms=_opt_float(obj.get("e2e_ms")),
                created_at=datetime.fromisoformat(obj["created_at"]))
        except BillingError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BillingError(f"malformed usage event: {e!r}") from e


def _opt_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]

"""What the gateway needs from the safety service (`services.safety.client.SafetyClient`), typed.

`SafetyGate` is the client's shape; `CheckedSafety` wraps it for the gateway's two rules:
- input: a refusal with tier "unavailable" is an outage, not a content decision: a retryable 503
  (`SafetyUnavailableError`), never `content_filter`. The client fails input closed by default.
- any unexpected exception of the client (a bug) is also a 503: an unchecked prompt never reaches a
  worker. Output filtering follows the client's own fail mode (open by default: see its docstring).
"""

from __future__ import annotations

import logging
import uuid
from typing import Protocol

from services.gateway.errors import UpstreamError

log = logging.getLogger(__name__)
UNAVAILABLE_TIER = "unavailable"


class SafetyVerdict(Protocol):
    @property
    def allowed(self) -> bool: ...

    @property
    def category(self) -> str | None: ...

    @property
    def tier(self) -> str: ...


class OutputFilter(Protocol):
    async def feed(self, delta: str, final: bool = False) -> SafetyVerdict: ...

    async def close(self) -> None: ...


class SafetyClientLike(Protocol):
    async def check_input(self, org_id: str, text: str, request_id: str = "") -> SafetyVerdict: ...

    async def open_output_filter(self, org_id: str, request_id: str) -> OutputFilter: ...


class SafetyUnavailableError(UpstreamError):
    http_status = 503
    code = "safety_unavailable"


class SafetyGate:
    def __init__(self, client: SafetyClientLike) -> None:
        self._client = client

    async def check_input(self, org_id: uuid.UUID, text: str, request_id: str) -> SafetyVerdict:
        """The verdict on new user text; raises SafetyUnavailableError when it could not be checked."""
        try:
            verdict = await self._client.check_input(str(org_id), text, request_id)
        except Exception as e:
            raise SafetyUnavailableError(f"the safety check failed: {e}") from e
        if not verdict.allowed and verdict.tier == UNAVAILABLE_TIER:
            raise SafetyUnavailableError("the safety service is unavailable; retry shortly")
        return verdict

    async def open_output_filter(self, org_id: uuid.UUID, request_id: str) -> OutputFilter:
        try:
            return await self._client.open_output_filter(str(org_id), request_id)
        except Exception as e:
            raise SafetyUnavailableError(f"the safety output filter could not open: {e}") from e

    async def close(self) -> None:
        close = getattr(self._client, "close", None)
        if close is not None:
            await close()


class OutputGate:
    """Releases generated text to the client only once the output filter has passed it, whole words only.

    The safety stream filter judges a word only once it is closed (it leaves an open trailing word for
    the next delta), so text must not reach the client before that: the gate holds back everything
    after the last whitespace until the next allowed verdict, and releases the rest with the final
    one. On a halt the held text is dropped. Without a filter, text passes straight through.
    """

    def __init__(self, output_filter: OutputFilter | None) -> None:
        self.output_filter = output_filter
        self._held = ""

    async def admit(self, delta: str, final: bool) -> tuple[str, SafetyVerdict | None]:
        """(text that may be sent now, the halting verdict or None)."""
        if self.output_filter is None:
            return delta, None
        if not delta and not final:
            return "", None
        verdict = await self.output_filter.feed(delta, final=final)
        if not verdict.allowed:
            self._held = ""
            return "", verdict
        text, self._held = self._held + delta, ""
        if final:
            return text, None
        cut = max(text.rfind(" "), text.rfind("\n"), text.rfind("\t")) + 1
        self._held = text[cut:]
        return text[:cut], None

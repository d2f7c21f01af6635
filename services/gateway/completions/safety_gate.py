"""What the gateway needs from the safety service (`services.safety.client.SafetyClient`), typed.

`SafetyGate` wraps the client for the gateway's rules:
- every text the model will read is checked on input, whatever its role: system, developer, user,
  assistant and tool messages, a continued conversation's stored history, a conversation's messages
  when it is created (`check_texts`). Each distinct text is checked once per organisation: verdicts
  are cached by (organisation, SHA-256 of the text) in a bounded LRU (`VerdictCache`), so a long
  history costs one lookup per message per turn, not a classifier pass. Outage verdicts are never
  cached. The new messages are also checked joined together, so a request split over several
  messages is read as the model reads it;
- input: a refusal with tier "unavailable" is an outage, not a content decision: a retryable 503
  with Retry-After (`SafetyUnavailableError`), never `content_filter`. The client fails input closed
  by default. The check completes before placement and before any worker call
  (`CompletionService._serve`), so the 503 is the HTTP answer, never an in-stream error;
- a text longer than `limits.MAX_INPUT_CHARS` is a 400 (`SafetyInputTooLongError`) before any call;
- any unexpected exception of the client (a bug) is also a 503: an unchecked prompt never reaches a
  worker. Output filtering follows the client's own fail mode (open by default: see its docstring).
- `InputDecision.seconds` is the time the request waited for its checks (reported to the client in
  a `Server-Timing: safety;dur=<ms>` header and in `baton_gateway_safety_check_seconds{size}`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.errors import DependencyUnavailableError
from services.common.lru import BoundedLru
from services.gateway.errors import BadRequestError
from services.safety.limits import MAX_INPUT_CHARS, InputTooLongError, check_length

log = logging.getLogger(__name__)
UNAVAILABLE_TIER = "unavailable"


class SafetyVerdict(Protocol):
    @property
    def allowed(self) -> bool: ...

    @property
    def category(self) -> str | None: ...

    @property
    def tier(self) -> str: ...

    @property
    def score(self) -> float: ...

    @property
    def watch(self) -> bool: ...

    @property
    def category_scores(self) -> tuple[tuple[str, float], ...]: ...


class OutputFilter(Protocol):
    async def feed(self, delta: str, final: bool = False) -> SafetyVerdict: ...

    async def close(self) -> None: ...


class SafetyClientLike(Protocol):
    async def check_input(self, org_id: str, text: str, request_id: str = "") -> SafetyVerdict: ...

    async def open_output_filter(self, org_id: str, request_id: str, watch: bool = False) -> OutputFilter: ...


class SafetyUnavailableError(DependencyUnavailableError):
    """The safety service did not answer: 503 with Retry-After (the check is retryable)."""

    code = "safety_unavailable"

    def __init__(self, message: str, retry_after_s: float = 2.0) -> None:
        super().__init__(message, retry_after_s)


class SafetyInputTooLongError(BadRequestError):
    """A text longer than the safety check judges (`limits.MAX_INPUT_CHARS`): 400 before any work."""

    def __init__(self, error: InputTooLongError, param: str) -> None:
        super().__init__(str(error), param, "input_too_long")


@dataclass(frozen=True)
class InputDecision:
    """The input check of one request: `refusal` is the first refusing verdict (None: serve it);
    `watch`: some text scored in the classifier's uncertain band, so the output is checked more often."""

    refusal: SafetyVerdict | None
    watch: bool = False
    seconds: float = 0.0  # how long the request waited for its checks

    def timing_headers(self) -> dict[str, str]:
        """The check's time as a W3C Server-Timing metric (browsers' dev tools and curl -i show it)."""
        return {"server-timing": f"safety;dur={self.seconds * 1000:.1f}"}


def check_length_or_400(text: str, param: str = "messages") -> None:
    """Raise SafetyInputTooLongError when `text` is too long to judge."""
    try:
        check_length(text, MAX_INPUT_CHARS)
    except InputTooLongError as e:
        raise SafetyInputTooLongError(e, param) from e


class VerdictCache:
    """LRU of verdicts by (organisation, SHA-256 of the text); ~200 bytes an entry."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._verdicts: BoundedLru[tuple[str, bytes], SafetyVerdict] = BoundedLru(max_entries)
        self.hits = self.misses = 0

    @staticmethod
    def key(org_id: str, text: str) -> tuple[str, bytes]:
        return org_id, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def get(self, key: tuple[str, bytes]) -> SafetyVerdict | None:
        verdict = self._verdicts.get(key)
        if verdict is None:
            self.misses += 1
        else:
            self.hits += 1
        return verdict

    def put(self, key: tuple[str, bytes], verdict: SafetyVerdict) -> None:
        self._verdicts.put(key, verdict)

    def __len__(self) -> int:
        return len(self._verdicts)


class SafetyGate:
    def __init__(self, client: SafetyClientLike, cache: VerdictCache | None = None) -> None:
        self._client = client
        self.cache = cache or VerdictCache()

    async def check_input(self, org_id: uuid.UUID, text: str, request_id: str, param: str = "messages"
                          ) -> SafetyVerdict:
        """The verdict on one text; raises SafetyUnavailableError when it could not be checked and
        SafetyInputTooLongError (naming `param`) when it is too long to judge."""
        check_length_or_400(text, param)
        key = VerdictCache.key(str(org_id), text)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        try:
            verdict = await self._client.check_input(str(org_id), text, request_id)
        except Exception as e:
            raise SafetyUnavailableError(f"the safety check failed: {e}") from e
        if verdict.tier == UNAVAILABLE_TIER:
            if not verdict.allowed:
                raise SafetyUnavailableError("the safety service is unavailable; retry shortly")
            return verdict  # failed open: served, but never remembered as checked
        self.cache.put(key, verdict)
        return verdict

    async def check_texts(self, org_id: uuid.UUID, history: Sequence[str], new: Sequence[str],
                          request_id: str) -> InputDecision:
        """Check every text the model will read: `history` (stored turns) and `new` (this request's
        messages, any role), each on its own and the new ones joined; cached texts cost nothing."""
        texts = [t for t in (*history, *new) if t.strip()]
        joined = "\n".join(t for t in new if t.strip())
        if len([t for t in new if t.strip()]) > 1:
            texts.append(joined)
        unique = list(dict.fromkeys(texts))
        for text in unique:  # every length first: a 400 never waits on the others' checks
            check_length_or_400(text)
        start = time.perf_counter()
        verdicts = await asyncio.gather(*(self.check_input(org_id, t, request_id) for t in unique))
        refusal = next((v for v in verdicts if not v.allowed), None)
        return InputDecision(refusal, watch=any(v.watch for v in verdicts), seconds=time.perf_counter() - start)

    async def open_output_filter(self, org_id: uuid.UUID, request_id: str, watch: bool = False) -> OutputFilter:
        try:
            return await self._client.open_output_filter(str(org_id), request_id, watch)
        except Exception as e:
            raise SafetyUnavailableError(f"the safety output filter could not open: {e}") from e

    async def close(self) -> None:
        close = getattr(self._client, "close", None)
        if close is not None:
            await close()

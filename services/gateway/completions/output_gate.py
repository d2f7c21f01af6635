"""`OutputGate`: the streaming safety post-filter of one choice, kept off the path of its tokens.

Text goes to the client as soon as the worker sends it; the gate queues a copy for the safety
service, and a task of its own feeds the queue to the filter stream (deltas that piled up while a
verdict was in flight go as one feed) and reads the verdicts. So a first token never waits on the
safety service (TTFT unchanged), and a classifier pass of ~10 ms never stalls the stream.

What bounds the harm that can slip out: at most `max_unchecked_tokens` tokens may be sent past the
last text the filter has answered for. When the filter falls that far behind (a slow classifier
pass, a GPU decoding faster than the checks), `admit` waits for it before releasing more. The
service classifies every ~12 tokens and matches patterns on every delta, so a halt lands within
~12 + `max_unchecked_tokens` (= 16 by default) tokens of the text that caused it; the caller then
aborts the worker stream (its KV blocks are freed) and finishes the choice with `content_filter`.
The final delta is released only after the filter has answered for everything, so a finished
answer has always been checked in full.

Fail mode: the client's (`services.safety.client`, open on output by default): a filter that
fails answers "allowed" with tier "unavailable" and the stream goes on unchecked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.gateway.completions.safety_gate import OutputFilter, SafetyVerdict

log = logging.getLogger(__name__)

MAX_UNCHECKED_TOKENS = 4


class OutputGate:
    """One per choice. `admit` each delta in order, then `close` once (also after errors)."""

    def __init__(self, output_filter: OutputFilter | None, max_unchecked_tokens: int = MAX_UNCHECKED_TOKENS) -> None:
        self.output_filter = output_filter
        self.max_unchecked_tokens = max_unchecked_tokens
        self._pending: list[tuple[str, int, bool]] = []  # (text, tokens, final) not yet sent to the filter
        self._unchecked = 0    # tokens released (or queued) that the filter has not answered for
        self._wake = asyncio.Event()      # the feeder has work
        self._progress = asyncio.Event()  # the filter answered (or halted)
        self._halt: SafetyVerdict | None = None
        self._feeder: asyncio.Task[None] | None = None

    @property
    def halted(self) -> SafetyVerdict | None:
        return self._halt

    async def admit(self, delta: str, tokens: int, final: bool) -> tuple[str, SafetyVerdict | None]:
        """(text that may be sent now, the halting verdict or None). Waits only when the filter is
        more than `max_unchecked_tokens` behind, or on the final delta."""
        if self.output_filter is None:
            return delta, None
        if self._halt is not None:
            return "", self._halt
        if delta or final:
            self._pending.append((delta, tokens, final))
            self._unchecked += tokens
            self._wake.set()
            if self._feeder is None:
                self._feeder = asyncio.get_running_loop().create_task(self._feed_loop())
        while self._halt is None and (final and (self._pending or self._unchecked > 0)
                                      or self._unchecked > self.max_unchecked_tokens):
            if self._feeder.done():  # type: ignore[union-attr]
                break
            self._progress.clear()
            await self._progress.wait()
        if self._halt is not None:
            return "", self._halt
        return delta, None

    async def _feed_loop(self) -> None:
        assert self.output_filter is not None
        try:
            while self._halt is None:
                await self._wake.wait()
                self._wake.clear()
                if not self._pending:
                    continue
                batch, self._pending = self._pending, []
                text, tokens, final = "".join(p[0] for p in batch), sum(p[1] for p in batch), batch[-1][2]
                verdict = await self.output_filter.feed(text, final=final)
                self._unchecked -= tokens
                if not verdict.allowed:
                    self._halt = verdict
                self._progress.set()
                if final:
                    return
        except Exception:  # a bug in the filter client: never block the stream on it
            log.exception("safety output feeder failed; the rest of this stream is unchecked")
        finally:
            self._unchecked = 0
            self._progress.set()

    async def close(self) -> None:
        """Stop feeding and close the filter stream."""
        if self._feeder is not None and not self._feeder.done():
            self._feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._feeder
        if self.output_filter is not None:
            await self.output_filter.close()

"""A fake client for runner tests: fixed delays and answers, no network."""

from __future__ import annotations

import asyncio

from loadtest.records import ErrorKind, Message, RequestRecord, TokenSource


class FakeClient:
    """Answers every request after `delay_s` with `answer` (3 tokens) and records what it was sent and
    how many requests were in flight at once; requests whose index is in `fail` fail with HTTP 503."""

    def __init__(self, delay_s: float = 0.01, fail: set[int] | None = None) -> None:
        self.delay_s = delay_s
        self.fail = fail or set()
        self.sent: list[list[Message]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def send(self, messages: list[Message], record: RequestRecord) -> RequestRecord:
        index = len(self.sent)
        self.sent.append(messages)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        if index in self.fail:
            record.error, record.http_status, record.e2e = ErrorKind.HTTP_503, 503, self.delay_s
            return record
        record.ok, record.ttft, record.e2e = True, self.delay_s / 2, self.delay_s
        record.output_text = f" answer{index} a b"
        record.output_tokens, record.content_chunks, record.token_source = 3, 3, TokenSource.USAGE
        return record

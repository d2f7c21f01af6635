"""`SSEResponse`: server-sent events that follow a stream's log, with ids, keep-alives and disconnects.

Wire format per event: `id: <stream_id>:<seq>` and `data: <json>` (the last one `data: [DONE]`);
`: keep-alive` comment lines when nothing was sent for `keepalive_s`, so proxies and clients don't time
the stream out during a long queue or prefill.

Disconnects: the response listens for `http.disconnect` while it streams, whatever the ASGI server's
spec version (Starlette's StreamingResponse notices a gone client only at its next write, which may
be a whole prefill away). On disconnect it detaches from the log, which (when no one else follows it)
starts the detach grace period of streams.py: the generation runs on for a resume, then is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.gateway.streams.replay_log import StreamEvent, StreamSource

log = logging.getLogger(__name__)
# One comment line, no blank line after it: a blank line ends an event, and several clients (the openai
# SDK among them) dispatch an empty event there once an `id:` was seen, and then fail to parse it.
KEEPALIVE = b": keep-alive\n"


def encode_event(stream_id: str, event: StreamEvent) -> bytes:
    return f"id: {stream_id}:{event.seq}\ndata: {event.data}\n\n".encode()


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, event_log: StreamSource, after_seq: int, keepalive_s: float,
                 headers: Mapping[str, str] | None = None) -> None:
        self.event_log = event_log
        self.after_seq = after_seq
        self.keepalive_s = keepalive_s
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no",
                           "x-baton-stream-id": event_log.stream_id, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Logged with the end below: a stream whose abort never came shows which of the two it reached.
        log.info("stream %s: response starts after event %d", self.event_log.stream_id, self.after_seq)
        self.event_log.attach()
        completed = False  # anything else (disconnect, broken pipe, server cancelling us) counts as gone
        tasks: list[asyncio.Future[None]] = []
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            streaming = asyncio.ensure_future(self._stream(send))
            tasks = [streaming, asyncio.ensure_future(_wait_for_disconnect(receive))]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if streaming in done:
                error = streaming.exception()
                completed = error is None
                if error is not None:  # a broken connection, or a follower too slow for the buffer
                    log.info("stream %s ended early: %r", self.event_log.stream_id, error)
        except OSError:  # the client went away while we wrote the head
            pass
        finally:
            for task in tasks:
                task.cancel()
            log.info("stream %s: response ends (%s)", self.event_log.stream_id,
                     "completed" if completed else "client gone")
            # Detached before the tasks are awaited: the abort of a gone client's generation must not
            # wait on the follower's cancellation (one swallowed by Python 3.11's wait_for held it for
            # the whole generation; streams.py).
            self.event_log.detach(disconnected=not completed)
            await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream(self, send: Send) -> None:
        sid = self.event_log.stream_id
        async for event in self.event_log.follow(self.after_seq, self.keepalive_s):
            chunk = KEEPALIVE if event is None else encode_event(sid, event)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return

"""`BodySizeLimit`: refuse request bodies over a byte cap with 413, before anything parses them.

Pure ASGI (streaming responses untouched): a `Content-Length` over the cap is refused at once without
reading the body; a body without one (chunked) is read up to the cap and refused as soon as it goes
over. The body read here is handed on to the app unchanged. Requests without a body pass through.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client went away: let the app see it
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        pending = iter(messages)

        async def replay() -> Message:
            message = next(pending, None)
            return message if message is not None else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"error": {
            "message": f"the request body is larger than this server's limit of {self.max_bytes} bytes",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None

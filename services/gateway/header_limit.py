"""`header_limited_protocol(max_bytes)`: uvicorn's httptools HTTP/1.1 protocol with a cap on the request
head (request line + headers): a head over the cap is answered 431 and the connection closed.

Why here and not in an ASGI middleware: httptools buffers a header without bound until it is complete
(and by repeated concatenation), so a middleware would see the head only after the server had held all
of it in memory. This protocol counts the bytes it feeds the parser while the head is incomplete and
stops at the cap, whatever the head's shape (one huge header, many small ones, a huge URL); once the
head is complete it checks the exact size too. (uvicorn's other parser, h11, has
`h11_max_incomplete_event_size`, but answers an overflow with a plain 400.)
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEADER_OVERHEAD = 4  # ": " and CRLF around each header


class HeaderLimitedProtocol(HttpToolsProtocol):
    """Set `max_head_bytes` on a subclass (`header_limited_protocol`); uvicorn makes one per connection."""

    max_head_bytes = 32 * 1024
    _head_bytes = 0  # fed while the current request's head is incomplete
    _in_head = True  # a connection starts with a request head
    _began_in_chunk = False  # a request began inside the chunk being fed
    _head_too_large = False

    def data_received(self, data: bytes) -> None:
        was_in_head, self._began_in_chunk = self._in_head, False
        super().data_received(data)
        if self._head_too_large:
            return
        # A head still incomplete after a chunk that began inside it and started no other request: the
        # whole chunk was head. (A head that began inside the chunk is not counted there: at most one
        # chunk under, and its exact size is checked once complete.)
        if self._in_head and was_in_head and not self._began_in_chunk:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._began_in_chunk = True, 0, True

    def on_headers_complete(self) -> None:
        self._in_head = False
        size = len(self.url) + sum(len(n) + len(v) + _HEADER_OVERHEAD for n, v in self.headers)
        if size > self.max_head_bytes:
            self._head_too_large = True
            # Stops the parser; uvicorn answers a parser error with `send_400_response`, which says 431 here.
            raise HeadTooLargeError(size)
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._send_431()
        else:
            super().send_400_response(msg)

    def _refuse(self) -> None:
        self._head_too_large = True
        self._send_431()

    def _send_431(self) -> None:
        if self.transport.is_closing():
            return
        body = json.dumps({"error": {
            "message": f"the request's headers are larger than this server's limit of {self.max_head_bytes} bytes "
                       "(request line and headers together)",
            "type": "invalid_request_error", "param": None, "code": "request_header_fields_too_large"}}).encode()
        head = [b"HTTP/1.1 431 Request Header Fields Too Large\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


class HeadTooLargeError(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(f"request head of {size} bytes")


def header_limited_protocol(max_bytes: int) -> type[HeaderLimitedProtocol]:
    """The protocol class to give `uvicorn.Config(http=...)` for a head cap of `max_bytes`."""
    return type("HeaderLimitedProtocol", (HeaderLimitedProtocol,), {"max_head_bytes": max_bytes})

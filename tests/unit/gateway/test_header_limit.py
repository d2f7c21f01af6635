"""Request heads over the cap get 431 from the gateway's HTTP protocol (a real uvicorn server on a socket):
one huge header, many small ones, and a head that never ends (refused while it streams in, not after)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.gateway.header_limit import header_limited_protocol
from services.launcher.process import free_port

LIMIT = 4096


async def _headers_seen(request: Request) -> JSONResponse:
    return JSONResponse({"headers": len(request.headers)})


@pytest.fixture
async def port() -> AsyncIterator[int]:
    app = Starlette(routes=[Route("/", _headers_seen, methods=["GET", "POST"])])
    chosen = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=chosen, http=header_limited_protocol(LIMIT),
                                           log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    yield chosen
    server.should_exit = True
    await task


async def _exchange(port: int, *chunks: bytes) -> tuple[int, bytes]:
    """Send `chunks` one by one, then read the whole answer: (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.05)  # separate reads on the server's side
        answer = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def _request(*headers: bytes) -> bytes:
    return b"GET / HTTP/1.1\r\nhost: t\r\nconnection: close\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"


async def test_a_head_under_the_cap_is_served(port: int) -> None:
    status, body = await _exchange(port, _request(b"x-big: " + b"a" * (LIMIT - 200)))
    assert status == 200 and json.loads(body)["headers"] == 3


async def test_one_header_over_the_cap_is_431_openai_json(port: int) -> None:
    status, body = await _exchange(port, _request(b"x-big: " + b"a" * LIMIT))
    assert status == 431
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


async def test_many_small_headers_over_the_cap_are_431(port: int) -> None:
    status, _ = await _exchange(port, _request(*(b"x-h%d: %s" % (i, b"v" * 40) for i in range(LIMIT // 40))))
    assert status == 431


async def test_a_head_that_never_ends_is_refused_while_it_streams_in(port: int) -> None:
    start = b"GET / HTTP/1.1\r\nhost: t\r\nx-endless: "
    # The head still unfinished, the last chunk takes it over the cap: the server answers without waiting for
    # its end. (Nothing is sent after that: the server closes, and more bytes would reset the connection.)
    status, body = await _exchange(port, start, *([b"z" * 1000] * 5))
    assert status == 431 and b"request_header_fields_too_large" in body


async def test_pipelined_requests_with_bodies_are_not_counted_as_head(port: int) -> None:
    body = b"b" * (LIMIT * 3)
    post = b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(post + post + _request())
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
    assert answer.count(b"HTTP/1.1 200 OK") == 3

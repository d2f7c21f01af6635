"""A deterministic OpenAI-compatible SSE server for testing the load-test harness itself.

Not a stand-in for Baton: it exists so the harness's measurements can be checked against delays that
are known exactly. Each request is answered with tokens " tok0", " tok1", ... ; the first token leaves
`ttft_s` after the request arrived and token i at `ttft_s + i * itl_s` (an absolute schedule, so the
gaps don't drift). Requests are numbered in arrival order; `reject` maps such numbers to an HTTP status,
`truncate` ends those streams early without [DONE], `hang` never answers them.

The server runs on its own event loop in a thread, so the harness under test (with its own
`asyncio.run`) is a separate client, as it would be against a real server.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Behaviour:
    ttft_s: float = 0.1
    itl_s: float = 0.02
    tokens_per_chunk: int = 1
    send_usage: bool = True  # honour stream_options.include_usage
    cached_fraction: float | None = None  # report usage.prompt_tokens_details.cached_tokens
    reject: dict[int, int] = field(default_factory=dict)  # arrival index -> HTTP status
    truncate: set[int] = field(default_factory=set)  # arrival index -> stream ends after 2 tokens
    hang: set[int] = field(default_factory=set)  # arrival index -> never answers


class BenchSSEServer:
    """`with BenchSSEServer(Behaviour(...)) as server: server.base_url ...`; `server.requests` holds
    every request body (with its Authorization header) in arrival order."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.requests: list[dict[str, Any]] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    def __enter__(self) -> BenchSSEServer:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "bench-test-model", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await request.json()
        index = len(self.requests)
        self.requests.append(body | {"_authorization": request.headers.get("Authorization")})
        b = self.behaviour
        if index in b.reject:
            return web.json_response({"error": {"message": "rejected", "code": b.reject[index]}},
                                     status=b.reject[index])
        if index in b.hang:
            await asyncio.sleep(3600)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            return await self._stream(request, body, chat, arrived, index)
        finally:
            self._in_flight -= 1

    async def _stream(self, request: web.Request, body: dict, chat: bool, arrived: float,
                      index: int) -> web.StreamResponse:
        b = self.behaviour
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:  # the role-only chunk real servers send at once: must not count as the first token
            await _send(resp, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        n = int(body["max_tokens"])
        for start in range(0, n, b.tokens_per_chunk):
            if index in b.truncate and start >= 2:
                return resp  # ends the chunked body cleanly, but without finish_reason or [DONE]
            await asyncio.sleep(max(0.0, arrived + b.ttft_s + start * b.itl_s - time.perf_counter()))
            text = "".join(f" tok{i}" for i in range(start, min(n, start + b.tokens_per_chunk)))
            finish = "length" if start + b.tokens_per_chunk >= n else None
            choice = {"index": 0, "finish_reason": finish}
            choice |= {"delta": {"content": text}} if chat else {"text": text}
            await _send(resp, {"choices": [choice]})
        if b.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            await _send(resp, {"choices": [], "usage": self._usage(body, chat, n)})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def _usage(self, body: dict, chat: bool, n: int) -> dict[str, Any]:
        text = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        prompt = len(text.split())
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        if self.behaviour.cached_fraction is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": int(prompt * self.behaviour.cached_fraction)}
        return usage


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

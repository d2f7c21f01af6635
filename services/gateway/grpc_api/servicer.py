"""`BatonApiServicer`: the `BatonApi` service, a thin edge over the HTTP API's `CompletionService`.

A call authenticates its metadata key with the gateway's authenticator, becomes the HTTP API's
validated request (requests.py) and runs through `CompletionService.chat` / `.text` -- the very
admission, safety, routing and billing of `/v1/chat/completions` and `/v1/completions`. The service
writes the completion into an event log; the call follows it like an SSE response does and sends each
chunk as a message (chunks.py). A caller that cancels detaches from the log, which aborts the
generation (its KV freed, its tokens so far billed), exactly like a closed HTTP connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import NoReturn

import grpc

from rpcgen.baton.v1 import api_pb2 as pb
from rpcgen.baton.v1 import api_pb2_grpc as pb_grpc
from services.gateway.completions.service import ClientGone, Outcome, StreamOutcome
from services.gateway.deps import GatewayDeps
from services.gateway.grpc_api.chunks import chunk_from_body
from services.gateway.grpc_api.requests import chat_body, text_body
from services.gateway.grpc_api.status import RpcFailure, failure_of, stream_failure
from services.gateway.tenancy.auth import Principal, key_from_authorization

Start = Callable[[Principal, ClientGone], Awaitable[Outcome]]
DONE = "[DONE]"


def presented_key(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    """The API key of a call: `x-api-key: <key>` or `authorization: Bearer <key>`; None without either."""
    found = {key.lower(): value for key, value in metadata or () if isinstance(value, str)}
    if found.get("x-api-key", "").strip():
        return found["x-api-key"].strip()
    if "authorization" in found:
        return key_from_authorization(found["authorization"])
    return None


class BatonApiServicer(pb_grpc.BatonApiServicer):
    def __init__(self, deps: GatewayDeps) -> None:
        self._deps = deps

    async def Chat(self, request: pb.ChatRequest,  # noqa: N802 - the RPC's name
                   context: grpc.aio.ServicerContext) -> AsyncGenerator[pb.CompletionChunk, None]:
        async with aclosing(self._serve(context, lambda p, gone: self._deps.completions.chat(
                chat_body(request), p, gone))) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Complete(self, request: pb.CompleteRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncGenerator[pb.CompletionChunk, None]:
        async with aclosing(self._serve(context, lambda p, gone: self._deps.completions.text(
                text_body(request), p, gone))) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _serve(self, context: grpc.aio.ServicerContext,
                     start: Start) -> AsyncGenerator[pb.CompletionChunk, None]:
        try:
            principal = await self._deps.tenancy.authenticator.authenticate_bearer(
                presented_key(context.invocation_metadata()))
            outcome = await start(principal, _hang_up(context))
        except Exception as e:  # typed errors become statuses; anything else is INTERNAL, logged
            await _abort(context, failure_of(e))
        assert isinstance(outcome, StreamOutcome), "gRPC calls always stream"
        await context.send_initial_metadata(tuple(outcome.headers.items()))
        failure: RpcFailure | None = None
        try:
            async with aclosing(_follow(outcome, self._deps.config.stream.keepalive_s)) as lines:
                async for data in lines:
                    body = json.loads(data)
                    if "error" in body:  # a choice failed mid-stream: send the rest (usage), then the status
                        failure = stream_failure(body["error"])
                    else:
                        yield chunk_from_body(body)
        except Exception as e:  # e.g. a caller too slow for the replay buffer (StreamGoneError)
            failure = failure_of(e)
        if failure is not None:
            await _abort(context, failure)


async def _follow(outcome: StreamOutcome, keepalive_s: float) -> AsyncGenerator[str, None]:
    """The log's data lines to its end. Leaving early (the caller cancelled) aborts the generation."""
    event_log = outcome.event_log
    event_log.attach()
    completed = False
    try:
        async for event in event_log.follow(outcome.after_seq, keepalive_s):
            if event is not None and event.data != DONE:  # None: idle (HTTP/2 has its own keep-alives)
                yield event.data
        completed = True
    finally:
        event_log.detach(disconnected=not completed, resumable=False)  # a gRPC call cannot resume


def _hang_up(context: grpc.aio.ServicerContext) -> ClientGone:
    ended = asyncio.Event()
    context.add_done_callback(lambda _: ended.set())

    async def wait() -> None:
        await ended.wait()
    return wait


async def _abort(context: grpc.aio.ServicerContext, failure: RpcFailure) -> NoReturn:
    await context.abort(failure.code, failure.message, failure.metadata)
    raise AssertionError("grpc's abort returned")  # it raises: the call ends there

"""`POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/streams/{stream_id}` (SSE resume) and
`POST /v1/{chat/completions,completions,streams}/{stream_id}/cancel`.

Resuming a stream: every SSE event carries `id: <stream_id>:<n>`. After a broken connection, send
`GET /v1/streams/<stream_id>` with `Last-Event-ID: <stream_id>:<n>` (or re-POST the same request with
that header) within the replay window, to any gateway replica: the events after `n` are replayed, then
the live rest (the generation kept running for the detach grace period). Cancel aborts it at once.
Both answer 404 for a stream another API key started.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from services.gateway.completions.service import ClientGone, Outcome, StreamOutcome
from services.gateway.deps import Completions, CurrentPrincipal, Deps
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.streams.replay_log import parse_last_event_id
from services.gateway.streams.sse import SSEResponse

router = APIRouter(tags=["completions"])
LastEventId = Annotated[str | None, Header(alias="Last-Event-ID", max_length=300)]


def _client_gone(request: Request) -> ClientGone:
    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    return wait


def _render(outcome: Outcome, deps: Deps) -> Response:
    if isinstance(outcome, StreamOutcome):
        return SSEResponse(outcome.event_log, outcome.after_seq, deps.config.stream.keepalive_s, outcome.headers)
    return JSONResponse(outcome.body, headers=outcome.headers)


async def _resume(service: Completions, principal: CurrentPrincipal, last_event_id: str, deps: Deps) -> Response:
    stream_id, seq = parse_last_event_id(last_event_id)
    return _render(await service.resume(stream_id, seq, principal), deps)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, principal: CurrentPrincipal, service: Completions,
                           deps: Deps, request: Request, last_event_id: LastEventId = None) -> Response:
    """OpenAI chat completions; `conversation_id` (extension) continues a stored conversation."""
    if last_event_id and body.stream:
        return await _resume(service, principal, last_event_id, deps)
    return _render(await service.chat(body, principal, _client_gone(request)), deps)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, principal: CurrentPrincipal, service: Completions, deps: Deps,
                      request: Request, last_event_id: LastEventId = None) -> Response:
    """OpenAI (legacy) text completions."""
    if last_event_id and body.stream:
        return await _resume(service, principal, last_event_id, deps)
    return _render(await service.text(body, principal, _client_gone(request)), deps)


@router.get("/v1/streams/{stream_id}")
async def resume_stream(stream_id: str, principal: CurrentPrincipal, service: Completions, deps: Deps,
                        last_event_id: LastEventId = None) -> Response:
    """Replay a stream's events after `Last-Event-ID` (all of them without it), then follow it live."""
    seq = -1 if not last_event_id else parse_last_event_id(last_event_id, stream_id)[1]
    return _render(await service.resume(stream_id, seq, principal), deps)


@router.post("/v1/streams/{stream_id}/cancel")
@router.post("/v1/chat/completions/{stream_id}/cancel")
@router.post("/v1/completions/{stream_id}/cancel")
async def cancel_stream(stream_id: str, principal: CurrentPrincipal, service: Completions) -> JSONResponse:
    """Abort a streaming completion now, from any replica (its followers get `finish_reason: "abort"`);
    `cancelled` is false when it had already finished."""
    cancelled = await service.cancel(stream_id, principal)
    return JSONResponse({"id": stream_id, "object": "stream.cancellation", "cancelled": cancelled})

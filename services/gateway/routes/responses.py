"""`POST /v1/responses` and `POST /v1/responses/{id}/cancel`: OpenAI's Responses API, text and function
tools (see services/gateway/completions/responses.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from services.gateway.deps import CurrentPrincipal, Responses
from services.gateway.routes.completions import _client_gone
from services.gateway.schemas import ResponsesRequest

router = APIRouter(tags=["responses"])


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, principal: CurrentPrincipal, service: Responses,
                          request: Request) -> Response:
    """A model response to `input` (+ `instructions`, + the turns of `previous_response_id`)."""
    result = await service.create(body, principal, _client_gone(request))
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, principal: CurrentPrincipal, service: Responses) -> JSONResponse:
    """Stop a streamed response in progress now; answers it with status `cancelled`."""
    return JSONResponse(await service.cancel(response_id, principal))

"""`GET /v1/models` and `GET /v1/models/{model_id}`: the served models, their context windows and prices.

Every model the gateway is configured for (BATON_MODEL and BATON_EXTRA_MODELS); only those can be
served, since the gateway renders and tokenizes the prompt. A model whose workers are all down is
still listed: its requests get 503 with Retry-After until a worker registers again.
"""

from __future__ import annotations

from fastapi import APIRouter

from services.gateway.config import ServedModel
from services.gateway.deps import CurrentPrincipal, Deps

router = APIRouter(tags=["models"])


def model_object(model: ServedModel) -> dict[str, object]:
    price = model.price
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "baton",
            "context_window": model.context_window, "max_model_len": model.context_window,
            "pricing": {"currency": "USD", "unit": "1K tokens", "input": float(price.input),
                        "cached_input": float(price.cached_input), "output": float(price.output)}}


@router.get("/v1/models")
async def list_models(principal: CurrentPrincipal, deps: Deps) -> dict[str, object]:
    return {"object": "list", "data": [model_object(m.served) for m in deps.models.runtimes()]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, principal: CurrentPrincipal, deps: Deps) -> dict[str, object]:
    return model_object(deps.models.get(model_id).served)

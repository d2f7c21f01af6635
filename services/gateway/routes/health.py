"""`/healthz` (the process is up), `/readyz` (DB, Redis -- when the gateway has them -- and a worker
answer) and Prometheus `/metrics`.

vLLM's probes too, which its clients and benchmark tools (guidellm, vLLM's own `benchmark_serving`)
ask before they start: `/health` and `/ping` (GET or POST, as SageMaker sends it) answer 200 with an
empty body when a decode worker answers (vLLM: when the engine is alive) and 503 when none does or the
gateway drains; `/version` answers `{"version": ...}`. None needs an API key, as in vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from services.gateway.deps import Deps
from services.gateway.routing.router_client import RouterClient

router = APIRouter(tags=["health"])
log = logging.getLogger(__name__)
_PROBE_TIMEOUT_S = 2.0


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def _check(name: str, probe: Awaitable[object]) -> tuple[str, str]:
    try:
        async with asyncio.timeout(_PROBE_TIMEOUT_S):
            await probe
    except Exception as e:
        return name, f"failed: {type(e).__name__}: {e}"[:300]
    return name, "ok"


def _decode_addresses(router_client: RouterClient) -> list[str]:
    return [w.address for w in router_client.view.workers if w.role.can_decode]


async def _any_worker(deps: Deps) -> None:
    if not _decode_addresses(deps.router):
        await deps.router.refresh_view()
    addresses = _decode_addresses(deps.router)
    if not addresses:
        raise LookupError("no decode worker known")
    errors = []
    for address in addresses:
        try:
            await deps.workers.status(address, _PROBE_TIMEOUT_S)
            return
        except Exception as e:
            errors.append(f"{address}: {e}")
    raise ConnectionError("; ".join(errors))


@router.get("/readyz")
async def readyz(deps: Deps) -> JSONResponse:
    if deps.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    probes = [_check(name, probe()) for name, probe in deps.tenancy.readiness.items()]
    checks = dict(await asyncio.gather(*probes, _check("worker", _any_worker(deps))))
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ready" if ready else "not_ready", "checks": checks},
                        status_code=200 if ready else 503)


@router.get("/health")
@router.get("/ping")
@router.post("/ping")
async def health(deps: Deps) -> Response:
    """vLLM's liveness probe: 200 (no body) while a decode worker answers, 503 otherwise."""
    if deps.draining:
        return Response(status_code=503)
    _, worker = await _check("worker", _any_worker(deps))
    if worker != "ok":
        log.info("/health: %s", worker)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/version")
async def version(request: Request) -> dict[str, str]:
    return {"version": request.app.version}


@router.get("/metrics")
async def metrics(deps: Deps) -> Response:
    return Response(deps.metrics.render(), media_type=CONTENT_TYPE_LATEST)

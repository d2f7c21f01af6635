"""`GET /v1/usage?start=YYYY-MM-DD&end=YYYY-MM-DD&group_by=model|day`: the caller's organisation's usage.

501 `feature_disabled` on a gateway without a database (`BATON_AUTH_MODE=none`)."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter

from services.gateway.deps import CurrentPrincipal, Reports

router = APIRouter(tags=["usage"])


@router.get("/v1/usage")
async def usage(principal: CurrentPrincipal, reports: Reports, start: str | None = None, end: str | None = None,
                group_by: str | None = None) -> dict[str, object]:
    """UTC days, `start` inclusive, `end` exclusive (default: tomorrow); `group_by` defaults to day."""
    return await reports.report(principal.org_id, start, end, group_by, datetime.now(UTC).date())

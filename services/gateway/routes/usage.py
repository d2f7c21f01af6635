"""`GET /v1/usage?start=YYYY-MM-DD&end=YYYY-MM-DD&group_by=model|day`: the caller's organisation's usage."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter

from services.billing.usage import UsageQuery, query_usage
from services.gateway.deps import CurrentPrincipal, DbConn

router = APIRouter(tags=["usage"])


@router.get("/v1/usage")
async def usage(principal: CurrentPrincipal, conn: DbConn, start: str | None = None, end: str | None = None,
                group_by: str | None = None) -> dict[str, object]:
    """UTC days, `start` inclusive, `end` exclusive (default: tomorrow); `group_by` defaults to day."""
    query = UsageQuery.parse(principal.org_id, start, end, group_by, datetime.now(UTC).date())
    return (await query_usage(conn, query)).to_dict()

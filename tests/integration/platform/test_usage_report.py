"""The usage ledger (idempotent writes, aggregates) and the `/v1/usage` query over it."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime
from decimal import Decimal

import psycopg
import pytest

from services.billing.events import UsageEvent
from services.billing.ledger import UsageLedger
from services.billing.pricing import ModelPrice, PriceTable
from services.billing.usage import UsageQuery, query_usage
from services.common.errors import BillingError, InvalidRequestError
from services.gateway.db.pool import Database

PRICES = PriceTable({"big": ModelPrice(Decimal("1.0"), Decimal("0.5"), Decimal("2.0"))},
                    fallback=ModelPrice(Decimal("0.1"), Decimal("0.05"), Decimal("0.2")))
ORG = uuid.uuid4()


def _event(rid: str, model: str, day: int, prompt: int, cached: int, completion: int,
           org: uuid.UUID = ORG) -> UsageEvent:
    return UsageEvent(rid, org, None, model, prompt, cached, completion, "stop", 10.0, 100.0,
                      datetime(2026, 5, day, 12, tzinfo=UTC))


EVENTS = [
    _event("a", "big", 1, 1000, 200, 500),    # 0.8*1 + 0.2*0.5 + 0.5*2 = 1.9
    _event("b", "big", 2, 2000, 0, 1000),     # 2 + 2 = 4
    _event("c", "small", 1, 1000, 1000, 0),   # 0.05
    _event("d", "small", 3, 500, 0, 500),     # 0.05 + 0.1 = 0.15
    _event("other-org", "big", 1, 9999, 0, 9999, org=uuid.uuid4()),
]


def _record(url: str, events: list[UsageEvent]) -> tuple[int, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        result = UsageLedger(PRICES).record(conn, events)
    return result.inserted, result.duplicates


def test_replaying_a_batch_changes_nothing(database_url: str) -> None:
    assert _record(database_url, EVENTS + EVENTS[:2]) == (5, 2)  # duplicates inside the batch too
    assert _record(database_url, EVENTS) == (0, 5)
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT sum(requests), sum(cost_usd) FROM usage_daily WHERE org_id = %s",
                           (ORG,)).fetchone()
    assert row == (4, Decimal("6.1"))


async def test_usage_grouped_by_model(database_url: str, db: Database) -> None:
    _record(database_url, EVENTS)
    query = UsageQuery.parse(ORG, "2026-05-01", "2026-06-01", "model", today=date(2026, 5, 20))
    async with db.connection() as conn:
        report = await query_usage(conn, query)
    by_model = {b.key: b for b in report.data}
    assert set(by_model) == {"big", "small"}
    big = by_model["big"]
    assert (big.requests, big.input_tokens, big.input_cached_tokens, big.output_tokens) == (
        2, 3000, 200, 1500)
    assert big.cost_usd == Decimal("5.9")
    assert report.total.cost_usd == Decimal("6.1") and report.total.requests == 4


async def test_usage_grouped_by_day_respects_the_range(database_url: str, db: Database) -> None:
    _record(database_url, EVENTS)
    query = UsageQuery.parse(ORG, "2026-05-01", "2026-05-03", "day", today=date(2026, 5, 20))  # end exclusive
    async with db.connection() as conn:
        body = (await query_usage(conn, query)).to_dict()
    assert [(d["day"], d["requests"], d["output_tokens"]) for d in body["data"]] == [
        ("2026-05-01", 2, 500), ("2026-05-02", 1, 1000)]
    assert body["total"]["cost_usd"] == pytest.approx(5.95)


@pytest.mark.parametrize(("start", "end", "group_by", "message"), [
    (None, None, "day", "start is required"),
    ("2026-05-01", None, "user", "group_by must be one of"),
    ("2026-05-10", "2026-05-01", "day", "must be after start"),
    ("05/01/2026", None, "day", "YYYY-MM-DD"),
    ("2024-01-01", "2026-01-01", "model", "at most 366 days"),
])
def test_bad_usage_queries_are_400s(start: str | None, end: str | None, group_by: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        UsageQuery.parse(ORG, start, end, group_by, today=date(2026, 5, 20))


def test_usage_event_json_round_trip_and_validation() -> None:
    event = EVENTS[0]
    assert UsageEvent.from_json(event.to_json()) == event
    with pytest.raises(BillingError):
        UsageEvent.from_json(b'{"v": 1, "request_id": "x"}')
    with pytest.raises(BillingError):
        _event("bad", "big", 1, 10, 20, 0)  # more cached than prompt tokens

"""Monthly spend budgets, read from the billing aggregates."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import psycopg
import pytest

from services.billing.events import UsageEvent
from services.billing.ledger import UsageLedger
from services.billing.pricing import ModelPrice, PriceTable
from services.common.errors import BudgetExceededError
from services.gateway.db.accounts import AccountStore
from services.gateway.db.pool import Database
from services.gateway.tenancy.budget import BudgetGuard, month_bounds

PRICES = PriceTable({}, fallback=ModelPrice(Decimal("1"), Decimal("1"), Decimal("1")))  # $1 per 1K tokens
NOW = datetime(2026, 7, 15, tzinfo=UTC)


def _spend(url: str, org_id, rid: str, tokens: int, when: datetime) -> None:  # noqa: ANN001
    event = UsageEvent(rid, org_id, None, "m", tokens, 0, 0, "stop", None, None, when)
    with psycopg.connect(url, autocommit=True) as conn:
        UsageLedger(PRICES).record(conn, [event])


async def test_budget_refuses_once_this_months_spend_reaches_it(db: Database, database_url: str) -> None:
    org = await AccountStore(db).create_org("budgeted", "free", Decimal("5"))
    guard = BudgetGuard(db)
    _spend(database_url, org.id, "last-month", 9000, datetime(2026, 6, 30, 23, 59, tzinfo=UTC))  # $9
    _spend(database_url, org.id, "r1", 4000, NOW)  # $4 this month
    assert (await guard.check(org.id, NOW)).spent_usd == Decimal("4")
    _spend(database_url, org.id, "r2", 1000, NOW)  # $5: the budget is used up
    with pytest.raises(BudgetExceededError, match="monthly budget"):
        await guard.check(org.id, NOW)


async def test_org_without_budget_is_never_refused(db: Database, database_url: str) -> None:
    org = await AccountStore(db).create_org("unbounded", "enterprise", None)
    _spend(database_url, org.id, "huge", 10_000_000, NOW)
    spend = await BudgetGuard(db).check(org.id, NOW)
    assert spend.spent_usd == Decimal("10000") and not spend.exhausted


def test_month_bounds_roll_over_the_year() -> None:
    assert month_bounds(datetime(2026, 12, 31, 23, tzinfo=UTC)) == (datetime(2026, 12, 1).date(),
                                                                     datetime(2027, 1, 1).date())

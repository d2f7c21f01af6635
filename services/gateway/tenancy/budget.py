"""`BudgetGuard`: refuse requests once an organisation's spend this month reaches its budget.

Spend is read from the billing aggregates (`usage_daily`, UTC calendar month). It trails real usage
by the billing pipeline's lag (normally well under a second; longer while Kafka or the consumer is
down) and by requests still in flight, so a burst can overshoot a budget by roughly what is spent in
that window: the budget is a soft cap, not a reservation. Organisations without a budget are never
refused.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import TYPE_CHECKING

from services.common.errors import BudgetExceededError, NotFoundError

if TYPE_CHECKING:
    from services.gateway.db.pool import Database

_SPEND_SQL = """
SELECT o.monthly_budget_usd, COALESCE(SUM(d.cost_usd), 0)
FROM organisations o
LEFT JOIN usage_daily d ON d.org_id = o.id AND d.day >= %(start)s AND d.day < %(end)s
WHERE o.id = %(org)s
GROUP BY o.monthly_budget_usd
"""


@dataclass(frozen=True)
class MonthlySpend:
    budget_usd: Decimal | None
    spent_usd: Decimal
    month_start: date

    @property
    def exhausted(self) -> bool:
        return self.budget_usd is not None and self.spent_usd >= self.budget_usd


def month_bounds(now: datetime) -> tuple[date, date]:
    """First day of `now`'s UTC month and of the next one."""
    day = now.astimezone(UTC).date().replace(day=1)
    if day.month == 12:
        return day, day.replace(year=day.year + 1, month=1)
    return day, day.replace(month=day.month + 1)


class BudgetGuard:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def spend(self, org_id: uuid.UUID, now: datetime | None = None) -> MonthlySpend:
        start, end = month_bounds(now or datetime.now(UTC))
        async with self._db.connection() as conn:
            cur = await conn.execute(_SPEND_SQL, {"start": start, "end": end, "org": org_id})
            row = await cur.fetchone()
        if row is None:
            raise NotFoundError(f"organisation {org_id} not found")
        return MonthlySpend(row[0], Decimal(row[1]), start)

    async def check(self, org_id: uuid.UUID, now: datetime | None = None) -> MonthlySpend:
        """Raise BudgetExceededError (429 insufficient_quota) when this month's budget is used up."""
        spend = await self.spend(org_id, now)
        if spend.exhausted:
            raise BudgetExceededError(f"monthly budget of ${spend.budget_usd} reached "
                                      f"(spent ${spend.spent_usd:.4f} since {spend.month_start})")
        return spend

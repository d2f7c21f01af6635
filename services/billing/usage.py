"""The query behind `GET /v1/usage?start=&end=&group_by=model|day`, read from the daily aggregates.

Dates are UTC calendar days; `start` is inclusive and `end` exclusive (default: tomorrow, so today is
included). `input_tokens` includes `input_cached_tokens` (OpenAI's convention). Days or models with no
usage are absent from `data`. The route parses its raw query strings with `UsageQuery.parse` (which
raises InvalidRequestError, a 400, listing the valid choices) and runs `query_usage` on a pooled
connection.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal
from typing import Literal, cast

import psycopg

from services.common.errors import InvalidRequestError

GroupBy = Literal["model", "day"]
GROUP_BY_CHOICES: tuple[GroupBy, ...] = ("model", "day")
MAX_RANGE_DAYS = 366

_SQL = """
SELECT {key}, sum(requests), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), sum(cost_usd)
FROM usage_daily
WHERE org_id = %(org)s AND day >= %(start)s AND day < %(end)s
GROUP BY 1 ORDER BY 1
"""
_KEY_SQL: dict[GroupBy, str] = {"model": "model", "day": "to_char(day, 'YYYY-MM-DD')"}


@dataclass(frozen=True)
class UsageQuery:
    org_id: uuid.UUID
    start: date
    end: date
    group_by: GroupBy

    @classmethod
    def parse(cls, org_id: uuid.UUID, start: str | None, end: str | None, group_by: str | None,
              today: date) -> UsageQuery:
        if not start:
            raise InvalidRequestError("start is required (YYYY-MM-DD, UTC, inclusive)")
        first = _parse_date("start", start)
        last = _parse_date("end", end) if end else today + timedelta(days=1)
        choice = group_by or "day"
        if choice not in GROUP_BY_CHOICES:
            raise InvalidRequestError(f"group_by must be one of {list(GROUP_BY_CHOICES)}, got {choice!r}")
        if last <= first:
            raise InvalidRequestError(f"end ({last}) must be after start ({first}); end is exclusive")
        if (last - first).days > MAX_RANGE_DAYS:
            raise InvalidRequestError(f"the range may span at most {MAX_RANGE_DAYS} days")
        return cls(org_id, first, last, cast(GroupBy, choice))


@dataclass(frozen=True)
class UsageBucket:
    key: str  # the model, or the day as YYYY-MM-DD; "total" for the sum
    requests: int
    input_tokens: int  # includes input_cached_tokens
    input_cached_tokens: int
    output_tokens: int
    cost_usd: Decimal


@dataclass(frozen=True)
class UsageReport:
    query: UsageQuery
    data: list[UsageBucket]
    total: UsageBucket

    def to_dict(self) -> dict[str, object]:
        """The JSON body of `GET /v1/usage`."""
        def bucket(b: UsageBucket, key_name: str) -> dict[str, object]:
            return {key_name: b.key, "requests": b.requests, "input_tokens": b.input_tokens,
                    "input_cached_tokens": b.input_cached_tokens, "output_tokens": b.output_tokens,
                    "cost_usd": float(b.cost_usd)}
        q = self.query
        return {"object": "usage", "start": q.start.isoformat(), "end": q.end.isoformat(),
                "group_by": q.group_by, "data": [bucket(b, q.group_by) for b in self.data],
                "total": bucket(self.total, "key")}


async def query_usage(conn: psycopg.AsyncConnection, query: UsageQuery) -> UsageReport:
    cur = await conn.execute(_SQL.format(key=_KEY_SQL[query.group_by]),
                             {"org": query.org_id, "start": query.start, "end": query.end})
    data = [UsageBucket(str(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]), Decimal(r[5]))
            for r in await cur.fetchall()]
    total = UsageBucket("total", sum(b.requests for b in data), sum(b.input_tokens for b in data),
                        sum(b.input_cached_tokens for b in data), sum(b.output_tokens for b in data),
                        sum((b.cost_usd for b in data), Decimal(0)))
    return UsageReport(query, data, total)


def _parse_date(name: str, value: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError as e:
        raise InvalidRequestError(f"{name} must be a date YYYY-MM-DD, got {value!r}") from e

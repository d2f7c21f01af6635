"""`UsageSpool`: durable lines, drained in order, a torn line skipped, nothing lost when storing fails."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from services.billing.events import UsageEvent
from services.billing.spool import UsageSpool


def _event(i: int) -> UsageEvent:
    return UsageEvent(f"s-{i}", uuid.UUID(int=1), None, "m", 3, 0, 1, "stop", None, None, datetime.now(UTC))


def test_appended_events_drain_in_order_and_the_spool_is_empty_after(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path / "new-dir")
    assert spool.size() == 0 and spool.drain(lambda events: None) == 0
    for i in range(3):
        spool.append(_event(i))
    stored: list[UsageEvent] = []
    assert spool.drain(stored.extend) == 3
    assert [e.request_id for e in stored] == ["s-0", "s-1", "s-2"]
    assert spool.size() == 0


def test_a_line_torn_by_a_crash_is_skipped_and_the_rest_kept(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    spool.append(_event(0))
    with spool.path.open("ab") as f:
        f.write(_event(1).to_json()[:25])  # the process died mid-write: no newline, half a JSON object
    spool.append(_event(2))
    stored: list[UsageEvent] = []
    spool.drain(stored.extend)
    assert [e.request_id for e in stored] == ["s-0", "s-2"]  # the torn s-1 never completed: skipped

    spool.append(_event(3))
    stored.clear()
    spool.drain(stored.extend)
    assert [e.request_id for e in stored] == ["s-3"]


def test_a_failing_store_keeps_every_event(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    spool.append(_event(0))

    def down(events: list[UsageEvent]) -> None:
        raise ConnectionError("postgres down")
    with pytest.raises(ConnectionError):
        spool.drain(down)
    stored: list[UsageEvent] = []
    assert spool.drain(stored.extend) == 1 and stored[0].request_id == "s-0"

"""Purging soft-deleted conversations after the retention period (30 days by default).

`purge_expired_conversations` is the job (tested directly, with the clock passed in);
`run_purge_loop` runs it every `interval_s` inside the gateway. Several gateways may run it at once:
each DELETE is idempotent, so the worst case is wasted work.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.gateway.db.conversations import ConversationStore

log = logging.getLogger(__name__)


async def purge_expired_conversations(store: ConversationStore, retention: timedelta,
                                      now: datetime | None = None) -> int:
    """Hard-delete what was soft-deleted more than `retention` ago; returns how many conversations."""
    cutoff = (now or datetime.now(UTC)) - retention
    purged = await store.purge_deleted(cutoff)
    if purged:
        log.info("purged %d conversations deleted before %s", purged, cutoff.isoformat())
    return purged


async def run_purge_loop(store: ConversationStore, retention: timedelta, interval_s: float) -> None:
    """Forever (until cancelled): purge, then sleep. A failed round is logged and retried next time."""
    while True:
        try:
            await purge_expired_conversations(store, retention)
        except Exception as e:  # the database may be briefly away; never kill the loop
            log.warning("conversation purge failed: %s", e)
        await asyncio.sleep(interval_s)

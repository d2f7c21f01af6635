"""A worker whose engine is stuck in one step longer than the scheduler's liveness tolerance keeps
heartbeating (from its own thread, with its last status) and is not dropped."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from handoff_harness import build_engine, eventually, transfer_config

from scheduler.adapters.server import SchedulerService, SchedulerServiceConfig
from scheduler.adapters.servicer import ServicerConfig
from services.worker.config import WorkerConfig, WorkerRole
from services.worker.server import WorkerServer

TOLERANCE_S = 0.6  # the scheduler's heartbeat timeout in this test
STEP_S = 2.5  # the engine's stuck step: four tolerances


async def test_a_worker_stuck_in_a_long_step_still_heartbeats_and_stays_live(tiny_model_dir: Path) -> None:
    scheduler = SchedulerService(SchedulerServiceConfig(
        host="127.0.0.1", port=0, drain_grace_s=0.0, heartbeat_timeout_s=TOLERANCE_S,
        servicer=ServicerConfig(heartbeat_interval_s=0.1)))
    await scheduler.start()
    config = WorkerConfig(role=WorkerRole.BOTH, model_id="tiny", worker_id="w", transfer=transfer_config(),
                          drain_grace_s=0.0, scheduler_address=f"127.0.0.1:{scheduler.port}",
                          heartbeat_interval_s=0.1)
    worker = WorkerServer(config, build_engine(tiny_model_dir))
    await worker.start()
    try:
        await eventually(lambda: "w" in scheduler.scheduler.live_worker_ids(time.monotonic()))
        heartbeat = worker._heartbeat
        assert heartbeat is not None
        sent_before = heartbeat.heartbeats_sent
        # Occupy the engine thread as one long step would: the status is read between steps.
        step = asyncio.ensure_future(worker._async_engine._call(lambda: time.sleep(STEP_S)))  # type: ignore[union-attr]
        live_during: list[bool] = []
        started = time.monotonic()
        while not step.done():
            await asyncio.sleep(0.1)
            if time.monotonic() - started > TOLERANCE_S:
                live_during.append("w" in scheduler.scheduler.live_worker_ids(time.monotonic()))
        await step
        assert time.monotonic() - started >= STEP_S - 0.1
        assert live_during and all(live_during)  # never dropped while the step ran
        assert heartbeat.heartbeats_sent - sent_before >= STEP_S / 0.1 / 3  # the interval kept, roughly
        assert heartbeat.stale_heartbeats > 0  # sent with the last status while the engine was busy
        assert "w" in scheduler.scheduler.live_worker_ids(time.monotonic())
    finally:
        await worker.drain()
        await scheduler.stop()

"""The `start_cluster` fixture: real scheduler services on free ports, stopped at teardown."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
from scheduler_harness import HEARTBEAT_TIMEOUT_S, Cluster, StartCluster

from scheduler.adapters.clock import ManualClock
from scheduler.adapters.server import SchedulerService, SchedulerServiceConfig
from scheduler.adapters.servicer import ServicerConfig


@pytest.fixture
async def start_cluster() -> AsyncIterator[StartCluster]:
    """`await start_cluster(policy="round_robin", metrics=False, **config_overrides)`; stopped at teardown."""
    started: list[Cluster] = []

    async def start(policy: str = "round_robin", metrics: bool = False, **overrides: Any) -> Cluster:
        clock = ManualClock(start=100.0)
        config = SchedulerServiceConfig(
            host="127.0.0.1",
            port=0,
            policy=policy,
            metrics_port=0 if metrics else None,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            drain_grace_s=0.0,
            servicer=ServicerConfig(tick_interval_s=0.01),
        )
        config = replace(config, **overrides)
        service = SchedulerService(config, clock=clock)
        await service.start()
        cluster = Cluster(service, clock, grpc.aio.insecure_channel(f"127.0.0.1:{service.port}"))
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        await cluster.channel.close()
        await cluster.service.stop(grace_s=0)

"""`WorkerServer`: wires one engine, the KV link and the role's services into a grpc.aio server.

The only place engine + kvtransfer + rpc meet (docs/architecture.md). Also serves the gRPC health service, the
Prometheus endpoint, registration/heartbeats and the SIGTERM drain:

    drain: health NOT_SERVING -> refuse new Generate/Prefill (UNAVAILABLE) -> let in-flight work
    finish for `drain_grace_s` -> abort the rest (every block released on both sides, WRITEs
    cancelled and waited for) -> stop the gRPC server -> close NIXL -> stop the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.async_engine import AsyncEngine
from engine.kv_tiers.tier_stats import TierStatsSnapshot
from engine.llm_engine import LLMEngine
from engine.step_stats import StepStats
from kvtransfer.integrity import LandedVerifier
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.nixl.shards import FollowerShards
from rpcgen.baton.v1 import worker_pb2 as pb
from rpcgen.baton.v1 import worker_pb2_grpc
from services.common.cluster_auth import bind_internal_port, internal_server
from services.worker.config import WorkerConfig, WorkerRole
from services.worker.decode_service import DecodeService
from services.worker.expert_load import ExpertLoadMeter
from services.worker.faults import WorkerFaults
from services.worker.heartbeat import HeartbeatClient, TelemetryBuffer
from services.worker.intake import Intake
from services.worker.kv_link import KVLink
from services.worker.metrics import WorkerMetrics
from services.worker.prefill_peers import PrefillPeers
from services.worker.prefill_service import PrefillService
from services.worker.remote_prefill import RemotePrefill
from services.worker.role_switch import RoleSwitcher
from services.worker.servicer import WorkerServicer
from services.worker.tier_metrics import TierMetrics
from tokenization.kv_blocks import KVTier

log = logging.getLogger(__name__)
SERVICE_NAME = "baton.v1.Worker"
_KV_EVENT_DRAIN_S = 5.0  # without a scheduler, KV events are still drained so they never pile up


class WorkerServer:
    def __init__(self, config: WorkerConfig, engine: LLMEngine) -> None:
        self.config = config
        self.engine = engine
        self.worker_id = config.worker_id or f"{config.role.value}-{uuid.uuid4().hex[:8]}"
        self.metrics = WorkerMetrics(config.role.value)
        self.tier_metrics = TierMetrics(self.metrics.registry)
        self._tier_snapshot: TierStatsSnapshot | None = None  # the KV tiers at the latest KV-event drain
        self._expert_load = (ExpertLoadMeter(engine.view.expert_load, self.metrics.registry)
                             if engine.model_config.moe is not None else None)
        self.faults = WorkerFaults(config.faults)
        self.telemetry = TelemetryBuffer()
        self.intake = Intake()  # requests taken on, across role switches (intake.py)
        self.port = 0
        self._link: KVLink | None = None
        self._verifier: LandedVerifier | None = None
        self._decode: DecodeService | None = None
        self._prefill: PrefillService | None = None
        self._peers: PrefillPeers | None = None
        self._heartbeat: HeartbeatClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._draining = False
        self._stopped = asyncio.Event()
        self._health = health.aio.HealthServicer()
        self._server = internal_server(config.cluster_token, f"worker {self.worker_id}")
        self._async_engine: AsyncEngine | None = None
        self._servicer: WorkerServicer | None = None
        self.role_switcher = RoleSwitcher(self)

    @property
    def advertise_address(self) -> str:
        return self.config.advertise_address or f"{self.config.host}:{self.port}"

    async def start(self) -> int:
        """Build the services, start serving; returns the bound port. Health turns SERVING last."""
        self._async_engine = AsyncEngine(self.engine, on_step=self._on_step)
        self._build_role_services(self._async_engine)
        servicer = self._servicer = WorkerServicer(self.worker_id, self.metrics, self.faults,
                                                   self.config.allow_fault_injection, self.status, self._decode,
                                                   self._prefill)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = bind_internal_port(self._server, f"{self.config.host}:{self.config.port}")
        await self._server.start()
        if self._link is not None:
            self._link.start()
        if self.config.metrics_port is not None:
            self.metrics.serve(self.config.metrics_port, self.config.host)
        self.metrics.total_blocks.set(self.engine.view.kv_pool().total_blocks)
        self._start_telemetry()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("worker %s (%s) serving on %s", self.worker_id, self.config.role.value, self.advertise_address)
        return self.port

    def _build_role_services(self, engine: AsyncEngine) -> None:
        cfg, block_size = self.config, self.engine.view.kv_pool().block_size
        if cfg.uses_nixl and self._link is None:  # kept across role switches
            kv = self.engine.view.kv_export()
            layout = KVLayoutInfo.from_spec(kv.kv_spec, cfg.model_id, tp_size=kv.tp_size, tp_rank=0,
                                            pp_size=kv.pp_size)
            # The followers built their agents at engine start (main passes a ShardAgentFactory).
            shards = FollowerShards(kv.call_followers) if kv.call_followers is not None else None
            self._link = KVLink(f"{self.worker_id}-{uuid.uuid4().hex[:8]}", kv.kv_cache, layout,
                                cfg.transfer, self.faults.kv, self._on_reclaimable, shards)
            self._verifier = LandedVerifier(kv.kv_cache, enabled=cfg.transfer.checksums, faults=self.faults.kv,
                                            shards=shards)
        if cfg.role is WorkerRole.PREFILL:
            assert self._link is not None
            self._prefill = PrefillService(engine, self._link, cfg.transfer, self.faults, self.metrics, block_size,
                                           self.intake)
        elif cfg.role is WorkerRole.DECODE:
            assert self._link is not None
            self._peers = PrefillPeers(cfg.prefill_peers, self._link, self.worker_id, cfg.transfer.peer_down_s,
                                       cfg.cluster_token)
            remote = RemotePrefill(self._link, self._peers, cfg.transfer, block_size)
            self._decode = DecodeService(engine, cfg.policy, self.metrics, remote, self._peers, self._verifier,
                                         self.intake)
        else:
            self._decode = DecodeService(engine, cfg.policy, self.metrics, intake=self.intake)

    def _start_telemetry(self) -> None:
        if self.config.scheduler_address:
            self._heartbeat = HeartbeatClient(self.config.scheduler_address, self.worker_id, self.advertise_address,
                                              self.status, self._collect_kv_events, self.telemetry,
                                              self.config.heartbeat_interval_s, self.role_switcher.apply,
                                              cluster_token=self.config.cluster_token)
            self._tasks.append(asyncio.create_task(self._heartbeat.run(), name="heartbeat"))
        else:
            self._tasks.append(asyncio.create_task(self._drain_kv_events_forever(), name="kv-events"))

    # ---- role switching (services/worker/role_switch.py) ----------------------------------------
    def is_idle(self) -> bool:
        """No Generate flow and no Prefill job here."""
        return ((self._decode is None or self._decode.num_flows == 0)
                and (self._prefill is None or self._prefill.num_jobs == 0))

    async def rebuild_role_services(self, role: WorkerRole, prefill_peers: tuple[str, ...]) -> None:
        """Serve `role` from now on, on the same engine; call only when `is_idle()`."""
        assert self._async_engine is not None and self._servicer is not None and self.is_idle()
        if self._peers is not None:
            await self._peers.close()
        self._decode = self._prefill = self._peers = None
        had_link = self._link is not None
        self.config = replace(self.config, role=role, prefill_peers=prefill_peers)
        self._build_role_services(self._async_engine)
        if self._link is not None and not had_link:
            self._link.start()
        self._servicer.set_role_services(self._decode, self._prefill)

    # ---- status and telemetry -------------------------------------------------------------------
    async def status(self) -> pb.WorkerStatus:
        """A consistent snapshot, taken on the engine thread between steps."""
        assert self._async_engine is not None
        # Read before the engine's snapshot: a job handed over in between then counts twice for one
        # heartbeat rather than not at all (undercounting herds the scheduler's next picks here). The
        # intake first of all: every request it counts is then in the load below (intake.py).
        received = self.intake.count
        unsubmitted = self._prefill.unsubmitted_prefill() if self._prefill is not None else (0, 0)
        s = await self._async_engine.status()
        self.metrics.free_blocks.set(s.free_blocks)
        self.metrics.held_blocks.set(s.held_blocks)
        quarantined = self._decode.num_quarantined if self._decode is not None else 0
        self.metrics.quarantined.set(quarantined)
        # Prefill work queued in this engine, whatever the role (a `both` or decode worker prefills
        # locally too): the tokens still to compute and the prompts they belong to (the scheduler prices
        # a backlog per prompt), plus a prefill worker's jobs not handed to its engine yet.
        backlog = (s.num_pending_prefill_tokens + unsubmitted[0], s.num_pending_prefill_requests + unsubmitted[1])
        return pb.WorkerStatus(
            worker_id=self.worker_id, role=self.config.role.value, model=self.config.model_id,
            queue_depth=s.num_waiting, running_seqs=s.num_running, free_blocks=s.free_blocks,
            total_blocks=s.total_blocks, block_size=s.block_size, max_num_seqs=s.max_num_seqs,
            max_prefill_chunk=s.max_prefill_chunk,
            inflight_prefill_tokens=backlog[0], inflight_prefill_requests=backlog[1],
            running_context_tokens=s.running_context_tokens, running_remaining_tokens=s.running_remaining_tokens,
            held_blocks=s.held_blocks, quarantined_requests=quarantined,
            waiting_for_remote_kv=s.num_waiting_for_remote_kv,
            inflight_transfers=self._link.num_inflight if self._link is not None else 0,
            draining=self._draining, requests_received=received, kv_tiers=self._kv_tier_status())

    def _kv_tier_status(self) -> list[pb.KVTierStatus]:
        snap = self._tier_snapshot
        if snap is None:
            return []
        return [pb.KVTierStatus(tier=tier.value, capacity_blocks=cap, occupied_blocks=snap.occupied_blocks[tier],
                                pinned_blocks=snap.pinned_blocks[tier], hit_blocks=snap.hit_blocks.get(tier, 0),
                                spills_dropped=snap.spills_dropped if tier is KVTier.DISK else 0)
                for tier, cap in snap.capacity_blocks.items() if cap]

    def _on_step(self, stats: StepStats) -> None:
        """Engine thread, after every step that ran something."""
        self.metrics.observe_step(stats)
        self.metrics.free_blocks.set(self.engine.view.kv_pool().free_blocks)
        self.telemetry.add_step(stats)
        if self._expert_load is not None:
            self._expert_load.maybe_observe()

    def _on_reclaimable(self, engine_rid: str) -> None:
        if self._decode is not None:
            self._decode.on_reclaimable(engine_rid)

    async def _collect_kv_events(self) -> None:
        assert self._async_engine is not None
        events = await self._async_engine.drain_kv_events()
        self.telemetry.add_kv_events(events)
        tiers = await self._async_engine.tier_stats()
        if tiers is not None:
            self._tier_snapshot = tiers
            self.tier_metrics.refresh(tiers)

    async def _drain_kv_events_forever(self) -> None:
        while True:
            await asyncio.sleep(_KV_EVENT_DRAIN_S)
            await self._collect_kv_events()
            self.telemetry.take()  # no scheduler to send them to

    # ---- shutdown -------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Graceful stop (SIGTERM); see the module docstring. Idempotent."""
        if self._draining:
            return
        self._draining = True
        log.warning("draining: finishing in-flight work for up to %.1f s", self.config.drain_grace_s)
        await self._health.enter_graceful_shutdown()
        services = [s for s in (self._decode, self._prefill) if s is not None]
        for service in services:
            service.draining = True
        give_up = time.monotonic() + self.config.drain_grace_s
        for service in services:
            await service.wait_idle(max(give_up - time.monotonic(), 0.0))
        for service in services:
            service.abort_all()  # whatever is left: every block released on both sides
        for service in services:
            if not await service.wait_idle(30.0):
                log.error("drain: %s still has work after aborting it", type(service).__name__)
        await self._stop_everything()

    async def _stop_everything(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._heartbeat is not None:
            await self._heartbeat.stop()
        await self._server.stop(grace=1.0)
        if self._peers is not None:
            await self._peers.close()
        if self._link is not None:
            await self._link.aclose()
        if self._async_engine is not None:
            self._async_engine.shutdown()
        self._stopped.set()
        log.warning("worker %s stopped", self.worker_id)

    async def wait_closed(self) -> None:
        await self._stopped.wait()

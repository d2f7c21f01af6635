"""A prefill worker and a decode worker in one process, on a tiny dummy-weights model and the
in-memory KV transport: the real engines, KV links and services, with the gRPC edge replaced by
`InProcessStub` (the generated `WorkerStub`'s async call shape, calling a servicer directly).

`StepGate` holds an engine thread right after a step, before that step's outputs are published, so a
test can land an abort in an exact phase of a request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from engine.async_engine import AsyncEngine, EngineStatus
from engine.config import BatcherConfig, CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.step_stats import StepStats
from kvtransfer.integrity import LandedVerifier
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.memory import FABRIC, MemoryAgent
from kvtransfer.transport import TransportKind
from rpcgen.baton.v1 import worker_pb2 as pb
from services.worker.config import DisaggPolicy, TransferConfig
from services.worker.decode_jobs import GenerateEvent
from services.worker.decode_service import DecodeService
from services.worker.faults import WorkerFaults
from services.worker.intake import Intake
from services.worker.kv_link import KVLink
from services.worker.metrics import WorkerMetrics
from services.worker.prefill_peers import PrefillPeer, PrefillPeers
from services.worker.prefill_service import PrefillService
from services.worker.remote_prefill import RemotePrefill
from services.worker.servicer import WorkerServicer

MODEL_ID = "tiny-dummy"
BLOCK_SIZE = 4
NUM_BLOCKS = 48
PREFILL_ADDRESS = "prefill-1:50051"
TINY_CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=256)
PROMPT = [5, 17, 3, 88, 42, 7, 19, 60, 2, 9, 11, 13, 40, 41, 42, 99, 100, 7, 8, 21]  # 5 blocks
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
POLICY = DisaggPolicy(min_remote_prompt_tokens=8, min_remote_uncached_tokens=4)


def write_tiny_model(path: Path) -> Path:
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return path


def transfer_config(**overrides: Any) -> TransferConfig:
    """Short deadlines so every failure path ends within a fraction of a second."""
    base: dict[str, Any] = dict(transport=TransportKind.MEMORY, prefill_timeout_s=5.0, transfer_timeout_s=0.25,
                                notice_grace_s=0.1, quarantine_s=0.3)
    return TransferConfig(**{**base, **overrides})


def build_engine(model_dir: Path, num_blocks: int = NUM_BLOCKS) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), load_format="dummy", seed=3,
                                  cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
                                  batcher=BatcherConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                        max_prefill_chunk=8)))


class StepGate:
    """`on_step` hook: once armed, the engine thread stops after its next step (before publishing
    that step's outputs) until `release()`; commands queued meanwhile run before the following step."""

    def __init__(self) -> None:
        self._armed = False
        self._paused = threading.Event()
        self._go = threading.Event()

    def arm(self) -> None:
        self._paused.clear()
        self._go.clear()
        self._armed = True

    def __call__(self, stats: StepStats) -> None:
        if self._armed:
            self._armed = False
            self._paused.set()
            self._go.wait(10.0)

    async def paused(self) -> None:
        assert await asyncio.to_thread(self._paused.wait, 10.0), "the engine never stepped"

    def release(self) -> None:
        self._go.set()


async def eventually(predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 5.0) -> None:
    give_up = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return
        assert time.monotonic() < give_up, "condition not reached in time"
        await asyncio.sleep(0.002)


# ---- the gRPC edge, in process --------------------------------------------------------------------
class _Aborted(Exception):
    pass


class FakeContext:
    """The parts of grpc.aio.ServicerContext the worker servicer uses."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._metadata = metadata
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailers: tuple[tuple[str, str], ...] = ()

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.code, self.details, self.trailers = code, details, tuple(trailing_metadata)
        raise _Aborted

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailers = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


class FakeCall:
    """A unary call: awaitable once for the response (AioRpcError on a status), then its trailers."""

    def __init__(self, method: Callable[[Any, FakeContext], Awaitable[Any]], request: Any,
                 timeout: float | None, metadata: Any) -> None:
        self._method, self._request, self._timeout = method, request, timeout
        self._context = FakeContext(tuple(metadata or ()))

    def __await__(self) -> Any:
        return self._run().__await__()

    async def _run(self) -> Any:
        ctx = self._context
        try:
            return await asyncio.wait_for(self._method(self._request, ctx), self._timeout)
        except _Aborted:
            raise grpc.aio.AioRpcError(ctx.code, grpc.aio.Metadata(), grpc.aio.Metadata(*ctx.trailers),
                                       ctx.details) from None
        except TimeoutError:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Deadline Exceeded") from None

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata(*self._context.trailers)


class InProcessStub:
    """`WorkerStub`'s Prefill / Abort / Handshake, calling `servicer` (anything with those coroutine
    methods taking (request, context)) in this process. Counts the calls."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer
        self.calls: list[str] = []

    def _call(self, name: str, request: Any, timeout: float | None, metadata: Any) -> FakeCall:
        self.calls.append(name)
        return FakeCall(getattr(self.servicer, name), request, timeout, metadata)

    def Prefill(self, request: pb.PrefillRequest, timeout: float | None = None,  # noqa: N802
                metadata: Any = None) -> FakeCall:
        return self._call("Prefill", request, timeout, metadata)

    def PrefillDestination(self, request: pb.PrefillDestinationRequest, timeout: float | None = None,  # noqa: N802
                           metadata: Any = None) -> FakeCall:
        return self._call("PrefillDestination", request, timeout, metadata)

    def Abort(self, request: pb.AbortRequest, timeout: float | None = None,  # noqa: N802
              metadata: Any = None) -> FakeCall:
        return self._call("Abort", request, timeout, metadata)

    def Handshake(self, request: pb.HandshakeRequest, timeout: float | None = None,  # noqa: N802
                  metadata: Any = None) -> FakeCall:
        return self._call("Handshake", request, timeout, metadata)


class _FakeChannel:
    async def close(self) -> None:
        return None


class InProcessPeers(PrefillPeers):
    """PrefillPeers whose peers are reached through in-process stubs instead of gRPC channels."""

    def __init__(self, stubs: dict[str, InProcessStub], link: KVLink) -> None:
        self._stubs = stubs
        super().__init__(tuple(stubs), link, "decode-1", peer_down_s=5.0)

    def _add(self, address: str) -> PrefillPeer:
        peer = PrefillPeer(address, _FakeChannel(), self._stubs[address])  # type: ignore[arg-type]
        self._peers[address] = peer
        return peer


# ---- the two workers ------------------------------------------------------------------------------
@dataclass
class Worker:
    llm: LLMEngine
    engine: AsyncEngine
    link: KVLink
    faults: WorkerFaults
    metrics: WorkerMetrics
    gate: StepGate
    reclaimed: list[str] = field(default_factory=list)
    on_reclaimable: Callable[[str], None] | None = None
    intake: Intake = field(default_factory=Intake)  # what its heartbeat would report as requests_received

    @property
    def agent(self) -> MemoryAgent:
        return FABRIC.lookup(self.link.handshake_info.agent_name)

    async def status(self) -> EngineStatus:
        return await self.engine.status()

    async def all_blocks_free(self) -> bool:
        s = await self.engine.status()
        return s.free_blocks == s.total_blocks and s.held_blocks == 0

    def note_reclaimable(self, rid: str) -> None:
        self.reclaimed.append(rid)
        if self.on_reclaimable is not None:
            self.on_reclaimable(rid)

    async def close(self) -> None:
        await self.link.aclose(timeout_s=2.0)
        self.gate.release()
        self.engine.shutdown()


async def open_worker(model_dir: Path, role: str, config: TransferConfig, num_blocks: int = NUM_BLOCKS) -> Worker:
    llm = build_engine(model_dir, num_blocks)
    gate = StepGate()
    engine = AsyncEngine(llm, on_step=gate)
    faults, metrics = WorkerFaults(), WorkerMetrics(role)
    layout = KVLayoutInfo.from_spec(llm.runner.kv_spec, MODEL_ID)
    worker: Worker
    link = KVLink(f"{role}-{uuid.uuid4().hex[:8]}", llm.runner.kv_cache, layout, config, faults.kv,
                  lambda rid: worker.note_reclaimable(rid))
    worker = Worker(llm, engine, link, faults, metrics, gate)
    link.start()
    return worker


async def no_status() -> pb.WorkerStatus:
    return pb.WorkerStatus()


def prefill_servicer(worker: Worker, service: PrefillService) -> WorkerServicer:
    return WorkerServicer("prefill-1", worker.metrics, worker.faults, True, no_status, prefill=service)


async def drain_events(stream: AsyncIterator[GenerateEvent]) -> list[GenerateEvent]:
    return [event async for event in stream]


def tokens_of(events: list[GenerateEvent]) -> list[int]:
    return [t for e in events for t in e.output.new_token_ids]


def prefill_service(worker: Worker, config: TransferConfig) -> PrefillService:
    return PrefillService(worker.engine, worker.link, config, worker.faults, worker.metrics, BLOCK_SIZE,
                          worker.intake)


def decode_service(worker: Worker, config: TransferConfig, stubs: dict[str, InProcessStub],
                   ) -> tuple[DecodeService, RemotePrefill, InProcessPeers]:
    peers = InProcessPeers(stubs, worker.link)
    remote = RemotePrefill(worker.link, peers, config, BLOCK_SIZE)
    verifier = LandedVerifier(worker.llm.runner.kv_cache, enabled=config.checksums, faults=worker.faults.kv)
    service = DecodeService(worker.engine, POLICY, worker.metrics, remote, peers, verifier, worker.intake)
    worker.on_reclaimable = service.on_reclaimable
    return service, remote, peers

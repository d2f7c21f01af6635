"""The real serving stack for gateway tests: a `both` worker, the billing consumer and the gateway, as
subprocesses (started by the launcher's `Supervisor`), on the session's Postgres, Redis and broker.

Tenants are real organisations and keys in the gateway's database, created per test with unique
names, so tests never share rate-limit buckets, conversations or usage rows.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import grpc
import httpx
from openai import OpenAI

from rpcgen.baton.v1 import worker_pb2 as wpb
from rpcgen.baton.v1 import worker_pb2_grpc as wpb_grpc
from services.common.settings import Tier
from services.gateway.admin import create_key, create_org
from services.gateway.db.pool import Database, DatabaseConfig
from services.launcher.process import SupervisedProcess, free_port
from services.launcher.supervisor import ChildSpec, Supervisor, http_ok, listening, log_line

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
        return {**self.infra_env, "BATON_WORKER_ADDRESSES": json.dumps([self.worker_address]),
                "BATON_SSE_KEEPALIVE_S": "0.1", "BATON_STREAM_REPLAY_WINDOW_S": "60",
                "BATON_STREAM_DETACH_GRACE_S": "0",  # a disconnect aborts at once; the detach tests start their own
                "BATON_DRAIN_TIMEOUT_S": "20", "PYTHONUNBUFFERED": "1", **extra}

    def start_gateway(self, name: str, **extra_env: str) -> tuple[SupervisedProcess, str]:
        """Another gateway on this stack (e.g. with safety, or to be drained); stopped with the stack."""
        self._extra_gateways.append(name)
        return start_gateway(self.supervisor, name, self.gateway_env(**extra_env))

    def start_pattern_safety(self, policy_dir: Path) -> str:
        """A safety service whose thresholds are 1.0, so only the deterministic pattern tier fires (the
        classifier's scores never reach 1.0); stopped with the stack. Its address."""
        return self.start_safety(policy_dir, {"default": {"categories": {
            c: {"threshold": 1.0, "input": c != "pii"} for c in SAFETY_CATEGORIES}}})

    def start_safety(self, policy_dir: Path, policy: dict[str, object] | None = None) -> str:
        """A safety service with `policy` (None: the built-in default policy); stopped with the stack."""
        argv = [sys.executable, "-m", "services.safety", "--host", "127.0.0.1"]
        if policy is not None:
            (policy_dir / "policy.json").write_text(json.dumps(policy))
            argv += ["--policy", str(policy_dir / "policy.json")]
        port = free_port()
        self.supervisor.start(ChildSpec(f"safety-{port}", [*argv, "--port", str(port)], listening(port),
                                        ready_timeout_s=60))
        return f"127.0.0.1:{port}"

    def log_tail(self, name: str = "gateway", lines: int = 40) -> str:
        return self.supervisor.log_tail(name, lines)

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
    port = free_port()
    process = supervisor.start(ChildSpec(name, [sys.executable, "-m", "services.gateway", "--port", str(port)],
                                         http_ok(f"http://127.0.0.1:{port}/readyz"), env=env, ready_timeout_s=60,
                                         stop_timeout_s=30))
    return process, f"http://127.0.0.1:{port}"


def open_gateway_env(worker: str, model_dir: Path, **extra: str) -> dict[str, str]:
    """A gateway in open mode (no Postgres, Redis or Kafka) in front of one `both` worker."""
    return {"BATON_AUTH_MODE": "none", "BATON_WORKER_ADDRESSES": json.dumps([worker]),
            "BATON_MODEL": str(model_dir), "BATON_SERVED_MODEL_NAME": MODEL, "BATON_MAX_MODEL_LEN": str(CONTEXT_WINDOW),
            "BATON_DRAIN_TIMEOUT_S": "5", "PYTHONUNBUFFERED": "1", **extra}


def start_worker(supervisor: Supervisor, name: str, role: str, model_dir: Path, *extra: str) -> str:
    port = free_port()
    argv = [sys.executable, "-m", "services.worker", "--role", role, "--model", str(model_dir), "--model-id", MODEL,
            "--port", str(port), "--worker-id", name, "--torch-threads", "1", "--num-blocks", str(WORKER_BLOCKS),
            "--max-model-len", str(CONTEXT_WINDOW), *extra]
    supervisor.start(ChildSpec(name, argv, log_line("BATON_WORKER_READY"), env={"OMP_NUM_THREADS": "1"},
                               ready_timeout_s=180))
    return f"127.0.0.1:{port}"


def start_stack(log_dir: Path, model_dir: Path, database_url: str, redis_url: str, kafka: str) -> GatewayStack:
    supervisor = Supervisor(log_dir, cwd=ROOT)
    topic = f"baton.usage.{uuid.uuid4().hex[:8]}"
    infra_env = {"BATON_DATABASE_URL": database_url, "BATON_REDIS_URL": redis_url, "BATON_KAFKA_BOOTSTRAP": kafka,
                 "BATON_USAGE_TOPIC": topic, "BATON_MODEL": str(model_dir), "BATON_SERVED_MODEL_NAME": MODEL,
                 "BATON_MAX_MODEL_LEN": str(CONTEXT_WINDOW),
                 "BATON_BILLING_GROUP_ID": f"billing-{topic}", "BATON_BILLING_BATCH_SIZE": "20",
                 "BATON_KAFKA_CONSUMER_CONFIG": json.dumps(KAFKA_TEST_CONSUMER_CONFIG),
                 "BATON_USAGE_SPOOL_DIR": str(log_dir / "usage-spool")}
    try:
        metrics_port = free_port()
        worker = start_worker(supervisor, "worker-both", "both", model_dir, "--metrics-port", str(metrics_port))
        supervisor.start(ChildSpec("billing", [sys.executable, "-m", "services.billing"],
                                   log_line("billing consumer:"), env=infra_env))
        stack = GatewayStack("", database_url, worker, infra_env, supervisor, model_dir,
                             f"http://127.0.0.1:{metrics_port}/metrics")
        _, stack.url = start_gateway(supervisor, "gateway", stack.gateway_env())
    except BaseException:
        supervisor.stop_all()
        raise
    return stack

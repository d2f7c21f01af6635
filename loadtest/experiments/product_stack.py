"""`ProductStack`: what a user's deployment runs around the engine, for experiments that compare it with
the bare path (`BATON_AUTH_MODE=none`, no safety).

Entered, it has started the embedded Postgres, Redis and Kafka-protocol broker (`baton serve`'s own
`EmbeddedInfra`), migrated the schema, registered an enterprise API key, and started the safety service
and the billing consumer. `gateway_env` is what turns a gateway into the full product: API keys checked
in Postgres, RPM + TPM limits in Redis, the safety pre-check and streaming output filter, usage events
to Kafka and into the ledger. The experiment's bench sends `api_key`. The safety service's encoder runs
on the GPU when there is one (`SAFETY_ENCODER_RUNTIME`; its log names the runtime it chose).

Why not `baton serve` itself: its workers take no GPU engine flags (device, CUDA graphs, KV pool), and
the experiment needs the same workers, scheduler and gateway flags in both modes so that only the
product's services differ.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
from pathlib import Path
from types import TracebackType

from loadtest.experiments.distserve_cluster import stop_in_reverse
from services.launcher.cluster import BILLING_READY, FAST_GROUP_RECOVERY
from services.launcher.infra import EmbeddedInfra, InfraConfig
from services.launcher.process import SupervisedProcess, free_port
from services.launcher.serve import ensure_api_key, migrate_database

ROOT = Path(__file__).resolve().parents[2]
# torch on the GPU where torch sees one (the GPU box), else ONNX on the CPU (services/safety/encoder.py).
SAFETY_ENCODER_RUNTIME = "auto"


class ProductStack:
    """A context manager; `gateway_env` and `api_key` are set once entered."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, ready_timeout_s: float = 120.0) -> None:
        self.log_dir = log_dir
        self.env = env or {}  # for every process started here (e.g. the cluster's token)
        self.ready_timeout_s = ready_timeout_s
        self.infra = EmbeddedInfra(InfraConfig())  # temp dirs: Postgres runs as its own account when root
        self.processes: list[SupervisedProcess] = []
        self.api_key = "bt-" + secrets.token_urlsafe(32)
        self.gateway_env: dict[str, str] = {}
        self.safety_metrics_url: str | None = None

    def __enter__(self) -> ProductStack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _start(self) -> None:
        endpoints = self.infra.start()
        migrate_database(endpoints.database_url)
        asyncio.run(ensure_api_key(endpoints.database_url, self.api_key, "enterprise"))
        infra_env = endpoints.env()
        safety = self._start_safety()
        self._start_billing(infra_env)
        self.gateway_env = {**self.env, **infra_env, "BATON_SAFETY_ADDRESS": safety}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> SupervisedProcess:
        process = SupervisedProcess(name, argv, self.log_dir / f"product-{name}.log",
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **env}, cwd=ROOT,
                                    stop_timeout_s=15)
        process.start()
        self.processes.append(process)
        return process

    def _start_safety(self) -> str:
        port = free_port()
        # The encoder on the GPU when there is one (a 5,000-word prompt is ~170 GFLOP: the CPU cores that
        # feed the workers cannot judge 10 a second); BATON_SAFETY_ENCODER_RUNTIME set by the caller wins.
        runtime = {} if "BATON_SAFETY_ENCODER_RUNTIME" in {**os.environ, **self.env} else {
            "BATON_SAFETY_ENCODER_RUNTIME": SAFETY_ENCODER_RUNTIME}
        process = self._spawn("safety", [sys.executable, "-m", "services.safety", "--host", "127.0.0.1",
                                         "--port", str(port)], runtime)
        process.wait_ready(lambda: process.listens_on(port), self.ready_timeout_s)
        return f"127.0.0.1:{port}"

    def _start_billing(self, infra_env: dict[str, str]) -> None:
        env = {**infra_env, "BATON_BILLING_METRICS_PORT": str(free_port()),
               "BATON_KAFKA_CONSUMER_CONFIG": json.dumps(FAST_GROUP_RECOVERY)}
        process = self._spawn("billing", [sys.executable, "-m", "services.billing"], env)
        process.wait_ready(lambda: BILLING_READY in process.log_of_this_run(), self.ready_timeout_s)

    def stop(self) -> None:
        """Billing and safety, then the infrastructure: the reverse of the start order."""
        stop_in_reverse(self.processes)
        self.infra.stop()


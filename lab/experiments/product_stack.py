"""`ProductStack`: what a user's deployment runs around the engine, for experiments that compare it with
the bare path (`BATON_AUTH_MODE=none`, no safety).

Entered, it has started the embedded Postgres, Redis and Kafka-protocol broker (`baton serve`'s own
`EmbeddedInfra`), migrated the schema, registered an enterprise API key, and started the safety service
and the billing consumer (the cluster builder, services/launcher/builder.py; logs as
`product-<name>.log`). `gateway_env` is what turns a gateway into the full product: API keys checked
in Postgres, RPM + TPM limits in Redis, the safety pre-check and streaming output filter, usage events
to Kafka and into the ledger. The experiment's bench sends `api_key`. The safety service's encoder runs
on the GPU when there is one (`SAFETY_ENCODER_RUNTIME`; its log names the runtime it chose).

Why not `baton serve` itself: its workers take no GPU engine flags (device, CUDA graphs, KV pool), and
the experiment needs the same workers, scheduler and gateway flags in both modes so that only the
product's services differ.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from types import TracebackType

from scheduler.types import Tier
from services.launcher.builder import BillingSpec, ClusterBuilder, ClusterSpec, SafetySpec
from services.launcher.infra import EmbeddedInfra, InfraConfig
from services.launcher.serve import ensure_api_key, migrate_database
from services.launcher.supervisor import Supervisor

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
        self.supervisor = Supervisor(log_dir, cwd=ROOT, log_prefix="product-")
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
        asyncio.run(ensure_api_key(endpoints.database_url, self.api_key, Tier.ENTERPRISE))
        # The encoder on the GPU when there is one (a 5,000-word prompt is ~170 GFLOP: the CPU cores that
        # feed the workers cannot judge 10 a second); BATON_SAFETY_ENCODER_RUNTIME set by the caller wins.
        runtime = {} if "BATON_SAFETY_ENCODER_RUNTIME" in {**os.environ, **self.env} else {
            "BATON_SAFETY_ENCODER_RUNTIME": SAFETY_ENCODER_RUNTIME}
        t = self.ready_timeout_s
        spec = ClusterSpec(infra=endpoints, scheduler=None, safety=SafetySpec(env=runtime, ready_timeout_s=t,
                                                                               stop_timeout_s=15),
                           billing=BillingSpec(ready_timeout_s=t, stop_timeout_s=15),
                           env={"PYTHONUNBUFFERED": "1", **self.env})
        builder = ClusterBuilder(spec, self.supervisor)
        safety = builder.start().safety
        assert safety is not None
        self.safety_metrics_url = builder.metrics_url("safety")
        self.gateway_env = {**self.env, **endpoints.env(), "BATON_SAFETY_ADDRESS": safety}

    def stop(self) -> None:
        """Billing and safety, then the infrastructure: the reverse of the start order."""
        self.supervisor.stop_all()
        self.infra.stop()

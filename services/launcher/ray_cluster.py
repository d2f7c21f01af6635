"""`baton ray up`: Baton across the nodes of an existing Ray cluster, without Kubernetes.

Ray places, Baton serves: each service is a Ray actor (`ServiceProcess`) that owns one child process
running the same entry point as in Kubernetes or `baton serve` (`python -m services.worker ...`), so
the gRPC services, the scheduler and the KV hand-off are exactly the ones tested elsewhere. Ray
chooses the node and reserves the resources: a worker actor asks for one GPU per process of its group,
`tensor_parallel_size x expert_parallel_size` (`device="cuda"`), and Ray's CUDA_VISIBLE_DEVICES for the
actor is inherited by its child. An expert-parallel worker runs role `both` (every expert rank holds a
whole KV cache; the hand-off to each is not built), so EP needs `prefill_workers=0`. The child
binds a free port on its node and is addressed by the node's IP, which it advertises to the scheduler.

Start order: scheduler, prefill workers, decode workers, optionally safety, then the gateway (static
decode addresses as its fallback). Every node needs Baton installed in the same environment (the
worker image, or the same venv path). Billing and the tenant stores (Postgres, Redis, Kafka) are
external here: pass `BATON_DATABASE_URL`... to the gateway's environment, or `BATON_AUTH_MODE=none`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.cluster_auth import ROTATING_ENV, TOKEN_ENV, ClusterToken
from services.launcher.builder import WORKER_READY

log = logging.getLogger(__name__)
_POLL_S = 0.2
# A port found free can be taken by another process before the child binds it; the child then exits at once
# with this error, and is started again on new ports.
_PORT_TAKEN = "Address already in use"
_START_ATTEMPTS = 3


class PortTakenError(RuntimeError):
    """The child exited while starting because a port it was given was taken meanwhile."""


@dataclass(frozen=True)
class Readiness:
    """When a child is ready: a line in its output, or an HTTP 200 on a path of its port."""

    log_marker: str = ""
    http_path: str = ""
    timeout_s: float = 300.0


class ServiceProcess:
    """A Ray actor owning one Baton process on the actor's node. `{host}`, `{port}` and
    `{metrics_port}` in argv and env values become the node's IP and free ports there; `start`
    returns ("ip:port", "ip:metrics_port")."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.log_path = Path(tempfile.mkdtemp(prefix=f"baton-ray-{name}-")) / "service.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, argv: list[str], env: dict[str, str], ready: Readiness) -> tuple[str, str]:
        attempt = 1
        while True:
            try:
                return self._start_once(argv, env, ready)
            except PortTakenError:
                if attempt == _START_ATTEMPTS:
                    raise
                attempt += 1
                log.warning("%s: a port it was given was taken before it bound it; starting again", self.name)

    def _start_once(self, argv: list[str], env: dict[str, str], ready: Readiness) -> tuple[str, str]:
        import ray

        from services.launcher.process import free_port

        host, port, metrics_port = ray.util.get_node_ip_address(), free_port(), free_port()

        def fill(text: str) -> str:
            return text.replace("{host}", host).replace("{port}", str(port)).replace("{metrics_port}",
                                                                                     str(metrics_port))

        with open(self.log_path, "wb") as out:
            self._proc = subprocess.Popen(
                [sys.executable, *(fill(a) for a in argv)], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **{k: fill(v) for k, v in env.items()}}, start_new_session=True)
        self._wait_ready(ready, f"http://{host}:{port}{ready.http_path}")
        return f"{host}:{port}", f"{host}:{metrics_port}"

    def _wait_ready(self, ready: Readiness, url: str) -> None:
        deadline = time.monotonic() + ready.timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                tail = self.log_tail()
                error = PortTakenError if _PORT_TAKEN in tail else RuntimeError
                raise error(f"{self.name} exited while starting:\n{tail}")
            if ready.log_marker and ready.log_marker in self.log_path.read_text(errors="replace"):
                return
            if ready.http_path and _http_ok(url):
                return
            time.sleep(_POLL_S)
        raise TimeoutError(f"{self.name} not ready after {ready.timeout_s:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (each service drains on it), then SIGKILL after `timeout_s`; the exit code. The log's
        temp dir goes with a clean exit and stays (named in a warning) after a failed one, to be read."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        code = None if self._proc is None else self._proc.returncode
        if code in (None, 0, -signal.SIGTERM):
            shutil.rmtree(self.log_path.parent, ignore_errors=True)
        else:
            log.warning("%s exited with %s; its log stays at %s", self.name, code, self.log_path)
        return code


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@dataclass(frozen=True)
class RayClusterConfig:
    address: str  # the Ray cluster: "auto", "host:6379" or "ray://host:10001"
    prefill_workers: int = 1
    decode_workers: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1  # MoE: expert ranks per worker (`baton worker --expert-parallel-size`)
    device: str = "cpu"  # "cuda": each worker actor reserves `gpus_per_worker` GPUs
    model: str | None = None  # None: the default model (prepared on each node on first use)
    worker_args: tuple[str, ...] = ()  # more `baton worker` flags, for both roles
    scheduler_args: tuple[str, ...] = ()  # more `baton scheduler` flags, e.g. ("--policy", "round_robin")
    worker_cpus: float = 1.0
    service_cpus: float = 0.5
    safety: bool = False
    gateway: bool = True
    gateway_env: dict[str, str] = field(default_factory=dict)  # BATON_* for the gateway (read in main)
    namespace: str = "baton"
    # Every service gets it (BATON_CLUSTER_TOKEN): the internal gRPC ports ask for it.
    cluster_token: ClusterToken = field(default_factory=ClusterToken.generate)

    def __post_init__(self) -> None:
        if self.decode_workers < 1 or self.prefill_workers < 0 or self.tensor_parallel_size < 1:
            raise ValueError("needs >= 1 decode worker, >= 0 prefill workers and a tensor parallel size >= 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size must be >= 1, got {self.expert_parallel_size}")
        if self.expert_parallel_size > 1 and self.prefill_workers:
            raise ValueError("expert_parallel_size > 1 needs prefill_workers 0: an expert-parallel worker serves "
                             "role both (every expert rank holds a whole KV cache)")

    @property
    def gpus_per_worker(self) -> int:
        """GPUs a worker actor reserves: one per process of its group (0 on CPU)."""
        return self.tensor_parallel_size * self.expert_parallel_size if self.device == "cuda" else 0

    def worker_role(self, role: str) -> str:
        """The `--role` a worker started as `role` runs with: `both` under expert parallelism."""
        return "both" if self.expert_parallel_size > 1 else role


@dataclass
class RayEndpoints:
    scheduler: str = ""
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    safety: str = ""
    gateway: str = ""
    metrics: dict[str, str] = field(default_factory=dict)  # service name -> host:port of its /metrics


def worker_argv(c: RayClusterConfig, name: str, role: str, endpoints: RayEndpoints) -> list[str]:
    """The `python -m services.worker` arguments of worker `name` (ports filled in by its actor)."""
    argv = ["-m", "services.worker", "--role", c.worker_role(role), "--host", "0.0.0.0", "--port", "{port}",
            "--advertise-address", "{host}:{port}", "--metrics-port", "{metrics_port}", "--worker-id", name,
            "--scheduler", endpoints.scheduler, "--device", c.device,
            "--tensor-parallel-size", str(c.tensor_parallel_size),
            "--expert-parallel-size", str(c.expert_parallel_size), *c.worker_args]
    if c.model:
        argv += ["--model", c.model]
    if role == "decode" and endpoints.prefill:
        argv += ["--prefill-peers", ",".join(endpoints.prefill)]
    return argv


class RayCluster:
    """Places and starts Baton on a Ray cluster; `down()` stops everything it started."""

    def __init__(self, config: RayClusterConfig) -> None:
        self.config = config
        self.endpoints = RayEndpoints()
        self._actors: list[tuple[str, Any]] = []
        self._run = uuid.uuid4().hex[:6]  # actor names are unique per cluster: `ray list actors` shows them

    def up(self) -> RayEndpoints:
        import ray

        if not ray.is_initialized():
            ray.init(address=self.config.address, namespace=self.config.namespace, log_to_driver=False)
        e, c = self.endpoints, self.config
        e.scheduler = self._start("scheduler", ["-m", "scheduler.adapters", "--host", "0.0.0.0", "--port", "{port}",
                                                "--metrics-port", "{metrics_port}", *c.scheduler_args],
                                  Readiness(log_marker="listening on", timeout_s=60))
        e.prefill = [self._worker(f"prefill-{i}", "prefill") for i in range(c.prefill_workers)]
        e.decode = [self._worker(f"decode-{i}", "decode") for i in range(c.decode_workers)]
        if c.safety:
            e.safety = self._start("safety", ["-m", "services.safety", "--host", "0.0.0.0", "--port", "{port}",
                                              "--metrics-port", "{metrics_port}"],
                                   Readiness(log_marker="safety service on", timeout_s=120))
        if c.gateway:
            e.gateway = self._start("gateway", ["-m", "services.gateway", "--host", "0.0.0.0", "--port", "{port}"],
                                    Readiness(http_path="/readyz", timeout_s=120), env=self._gateway_env())
        return e

    def _worker(self, name: str, role: str) -> str:
        c = self.config
        argv = worker_argv(c, name, role, self.endpoints)
        return self._start(name, argv, Readiness(log_marker=WORKER_READY, timeout_s=900),
                           num_cpus=c.worker_cpus, num_gpus=c.gpus_per_worker)

    def _gateway_env(self) -> dict[str, str]:
        env = {**self.config.gateway_env, "BATON_SCHEDULER_ADDRESS": self.endpoints.scheduler,
               "BATON_WORKER_ADDRESSES": json.dumps(self.endpoints.decode)}
        if self.endpoints.safety:
            env["BATON_SAFETY_ADDRESS"] = self.endpoints.safety
        if self.config.model:
            env["BATON_MODEL"] = self.config.model
        return env

    def _start(self, name: str, argv: list[str], ready: Readiness, env: dict[str, str] | None = None,
               num_cpus: float | None = None, num_gpus: float = 0) -> str:
        import ray

        actor_class: Any = ray.remote(ServiceProcess)  # Ray's typing does not follow the actor's methods
        cpus = self.config.service_cpus if num_cpus is None else num_cpus
        actor = actor_class.options(name=f"baton-{self._run}-{name}", num_cpus=cpus, num_gpus=num_gpus).remote(name)
        self._actors.append((name, actor))
        token = self.config.cluster_token
        env = {TOKEN_ENV: token.value, **({ROTATING_ENV: token.rotating} if token.rotating else {}), **(env or {})}
        address, metrics = ray.get(actor.start.remote(argv, env, ready))
        self.endpoints.metrics[name] = f"{address}/metrics" if ready.http_path else metrics
        log.info("%s on %s (metrics %s)", name, address, self.endpoints.metrics[name])
        return str(address)

    def dead(self) -> list[str]:
        """Names of the services whose process has exited."""
        import ray

        alive = ray.get([actor.alive.remote() for _, actor in self._actors])
        return [name for (name, _), ok in zip(self._actors, alive, strict=True) if not ok]

    def log_tail(self, name: str, lines: int = 40) -> str:
        import ray

        return str(ray.get(dict(self._actors)[name].log_tail.remote(lines)))

    def down(self) -> None:
        """Stop in reverse start order (the gateway drains first), then release the actors."""
        import ray

        for _name, actor in reversed(self._actors):
            try:
                ray.get(actor.stop.remote())
            finally:
                ray.kill(actor)
        self._actors.clear()

    def watch(self, stopping: Callable[[], bool], interval_s: float = 2.0) -> str | None:
        """Block until `stopping()` or a service dies; returns the dead service's name."""
        while not stopping():
            dead = self.dead()
            if dead:
                return dead[0]
            time.sleep(interval_s)
        return None

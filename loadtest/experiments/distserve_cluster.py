"""One DistServe configuration's processes: scheduler, workers, gateway (`BATON_AUTH_MODE=none`).

Every worker runs `--tensor-parallel-size tp` on `tp` consecutive GPUs, as its layout places it
(loadtest/experiments/layouts.py: `1p3d`, `c4`, ...; `disagg` = `1p1d`, `colocated` = `c2`). Each decode
worker names every prefill worker in `--prefill-peers` (KV moves rank by rank). Each worker sees only its own
GPUs (CUDA_VISIBLE_DEVICES=<its GPUs>; rank r takes cuda:r of them), dummy weights from one
config.json and one `--seed` (identical weights everywhere). The scheduler (`python -m scheduler.adapters`)
routes with the given policy; the gateway is the real one, without Postgres/Redis/Kafka.

Workers start at the same time (loading and CUDA-graph capture overlap); every wait has a timeout,
and `stop()` (also on any failure while starting) stops the gateway first and the scheduler last,
SIGKILLing whatever ignores SIGTERM. Children die with this process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from loadtest.experiments.handoff_phases import scrape
from loadtest.experiments.layouts import parse_layout
from services.common.cluster_auth import TOKEN_ENV, ClusterToken
from services.launcher.process import SupervisedProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER_READY = "BATON_WORKER_READY"
# What shows where prompts were prefilled and how the KV moved (scraped after each configuration).
METRIC_PREFIXES = ("baton_pd_prefill_path", "baton_pd_fallback", "baton_worker_requests", "baton_kv_transfer_seconds",
                   "baton_pd_handoff_seconds", "baton_pd_handoff_phase_seconds")


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: Path
    model_name: str
    engine_args: tuple[str, ...]  # device, dtype, backend, load format, cache and batch sizes
    slo_ttft_ms: float
    slo_tpot_ms: float
    policy: str = "least_loaded"
    scheduler_profile: Path | None = None  # a `baton profile` JSON: the scheduler's cost-model seed
    gateway_processes: int = 1  # gateway processes on its port (services/gateway/replicas.py)
    tp: int = 1  # ranks (and GPUs) per worker
    cpu: bool = False  # no CUDA_VISIBLE_DEVICES
    worker_ready_timeout_s: float = 240.0
    service_ready_timeout_s: float = 60.0
    env: dict[str, str] = field(default_factory=dict)
    # Run the scheduler as `loadtest.experiments.scheduler_tap` (the same service, plus a record of every
    # decision and step sample, written to the log folder at exit) for `tpot_forecast` afterwards.
    tap_scheduler: bool = False


class Cluster:
    """A context manager: entered = every process ready; `url` is the gateway's root."""

    def __init__(self, config: str, spec: ClusterSpec, log_dir: Path, layout: str | None = None,
                 product_env: dict[str, str] | None = None, cluster_token: ClusterToken | None = None) -> None:
        """`config` names the run (its logs, the summary); `layout` the workers (default: `config`).
        `product_env`: the gateway runs as the full product with it (loadtest/experiments/product_stack.py);
        None: the bare path (`BATON_AUTH_MODE=none`, no safety, no billing). `cluster_token`: the one the
        product's services already run with (default: a new one)."""
        self.config = config
        self.spec = spec
        self.product_env = product_env
        self.log_dir = log_dir
        self.processes: list[SupervisedProcess] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_s: float | None = None
        self.metrics_urls: dict[str, str] = {}  # worker name -> its Prometheus /metrics
        self.service_metrics_urls: dict[str, str] = {}  # "scheduler" / "gateway" -> its /metrics
        self.plans = parse_layout(layout or config).worker_plans(spec.tp)
        self.cluster_token = cluster_token or ClusterToken.generate()  # every process gets it
        self.tap_path = log_dir / f"{config}-scheduler_tap.json"  # written when the scheduler stops, if tapped

    def __enter__(self) -> Cluster:
        started = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> SupervisedProcess:
        import os

        process = SupervisedProcess(name, argv, self.log_dir / f"{self.config}-{name}.log",
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: self.cluster_token.value,
                                         **self.spec.env, **env}, cwd=ROOT,
                                    stop_timeout_s=15)
        process.start()
        self.processes.append(process)
        return process

    def _start(self) -> None:
        s = self.spec
        scheduler_port, scheduler_metrics_port = free_port(), free_port()
        self.service_metrics_urls["scheduler"] = f"http://127.0.0.1:{scheduler_metrics_port}/metrics"
        scheduler = self._spawn("scheduler", self.scheduler_argv(scheduler_port, scheduler_metrics_port), {})
        scheduler.wait_ready(lambda: scheduler.listens_on(scheduler_port), s.service_ready_timeout_s)
        address = f"127.0.0.1:{scheduler_port}"
        plans = self.plans
        workers: dict[str, tuple[SupervisedProcess, str]] = {}
        prefill_addresses: list[str] = []
        for plan in plans:  # prefill workers first: each decode worker names them all as its peers
            port, metrics_port = free_port(), free_port()
            self.metrics_urls[plan.name] = f"http://127.0.0.1:{metrics_port}/metrics"
            argv = [sys.executable, "-m", "services.worker", "--role", plan.role, "--host", "127.0.0.1",
                    "--port", str(port), "--worker-id", plan.name, "--model", str(s.model_dir),
                    "--model-id", s.model_name, "--scheduler", address, "--heartbeat-interval-s", "0.2",
                    "--drain-grace-s", "1", "--metrics-port", str(metrics_port),
                    "--tensor-parallel-size", str(s.tp), *s.engine_args]
            if plan.role == "decode":
                argv += ["--prefill-peers", ",".join(prefill_addresses)]
            env = {} if s.cpu else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, plan.gpus))}
            workers[plan.name] = (self._spawn(plan.name, argv, env), f"127.0.0.1:{port}")
            if plan.role == "prefill":
                prefill_addresses.append(f"127.0.0.1:{port}")
        give_up = time.monotonic() + s.worker_ready_timeout_s
        for _name, (process, _) in workers.items():
            process.wait_ready(_log_has(process, WORKER_READY), max(1.0, give_up - time.monotonic()))
        decode_capable = [a for plan in plans if plan.role != "prefill" for a in [workers[plan.name][1]]]
        slos = {tier: {"ttft_ms": s.slo_ttft_ms, "tpot_ms": s.slo_tpot_ms} for tier in ("free", "plus", "enterprise")}
        tenants = self.product_env if self.product_env is not None else {
            "BATON_AUTH_MODE": "none", "BATON_ANONYMOUS_TIER": "enterprise"}
        gateway = self._spawn("gateway", [sys.executable, "-m", "services.gateway", "--host", "127.0.0.1",
                                          "--port", str(self.port)], {
            **tenants, "BATON_SCHEDULER_ADDRESS": address,
            "BATON_WORKER_ADDRESSES": json.dumps(decode_capable), "BATON_MODEL": str(s.model_dir),
            "BATON_SERVED_MODEL_NAME": s.model_name, "BATON_MAX_MODEL_LEN": _arg(s.engine_args, "--max-model-len"),
            "BATON_SLOS": json.dumps(slos), "BATON_DRAIN_TIMEOUT_S": "2", "BATON_LOG_LEVEL": "WARNING",
            "BATON_GATEWAY_PROCESSES": str(s.gateway_processes)})
        gateway.wait_ready(_http_ok(f"{self.url}/readyz"), s.service_ready_timeout_s)
        self.service_metrics_urls["gateway"] = f"{self.url}/metrics"

    def scheduler_argv(self, port: int, metrics_port: int) -> list[str]:
        s = self.spec
        module = ("loadtest.experiments.scheduler_tap", "--tap-out", str(self.tap_path)) if s.tap_scheduler \
            else ("scheduler.adapters",)
        return [sys.executable, "-m", *module, "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", str(metrics_port),
                "--policy", s.policy, "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "10",
                "--drain-grace-s", "1", "--log-level", "WARNING",
                *(["--profile", str(s.scheduler_profile)] if s.scheduler_profile else [])]

    def stop(self) -> None:
        """Gateway, workers, scheduler: the reverse of the start order."""
        stop_in_reverse(self.processes)

    def worker_counters(self, prefixes: tuple[str, ...] = METRIC_PREFIXES,
                        buckets: bool = False) -> dict[str, dict[str, float]]:
        """Each worker's samples whose name starts with one of `prefixes` (diagnostics; {} if unreachable);
        histogram buckets too with `buckets` (for per-run quantiles: loadtest/experiments/handoff_phases.py)."""
        return _scrape(self.metrics_urls, prefixes, buckets)

    def service_counters(self, prefixes: tuple[str, ...]) -> dict[str, dict[str, float]]:
        """The scheduler's and the gateway's samples (buckets included) whose name starts with one of
        `prefixes` (per-run deltas: loadtest/experiments/run_metrics.py)."""
        return _scrape(self.service_metrics_urls, prefixes, buckets=True)

    def log_tails(self, lines: int = 15) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(lines)}" for p in self.processes)


def stop_in_reverse(processes: list[SupervisedProcess]) -> None:
    """Stop (and forget) the processes, the last started first; one that will not stop is killed."""
    while processes:
        process = processes.pop()
        try:
            process.stop()
        except Exception:  # noqa: BLE001 - keep stopping the others
            process.kill()


def _scrape(urls: dict[str, str], prefixes: tuple[str, ...], buckets: bool) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, url in urls.items():
        try:
            out[name] = scrape(url, prefixes, buckets)
        except OSError as e:
            out[name] = {"unreachable": 1.0, "error": str(e)}  # type: ignore[dict-item]
    return out


def _arg(args: tuple[str, ...], flag: str) -> str:
    return args[args.index(flag) + 1]


def _log_has(process: SupervisedProcess, marker: str):  # noqa: ANN202 - a probe
    def probe() -> bool:
        try:
            return marker in process.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return False
    return probe


def _http_ok(url: str):  # noqa: ANN202 - a probe
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False
    return probe

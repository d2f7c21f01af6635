"""One DistServe configuration's processes: scheduler, workers, gateway (`BATON_AUTH_MODE=none`).

Every worker runs `--tensor-parallel-size tp` on `tp` consecutive GPUs, as its layout places it
(lab/experiments/layouts.py: `1p3d`, `c4`, ...; `disagg` = `1p1d`, `colocated` = `c2`). Each decode
worker names every prefill worker in `--prefill-peers` (KV moves rank by rank). Each worker sees only its own
GPUs (CUDA_VISIBLE_DEVICES=<its GPUs>; rank r takes cuda:r of them), dummy weights from one
config.json and one `--seed` (identical weights everywhere). The scheduler (`python -m scheduler.adapters`)
routes with the given policy; the gateway is the real one, without Postgres/Redis/Kafka.

The processes are started by the cluster builder (services/launcher/builder.py) under one
`Supervisor`, logs as `<config>-<name>.log`. Workers start at the same time (loading and CUDA-graph
capture overlap); every wait has a timeout, and `stop()` (also on any failure while starting) stops the
gateway first and the scheduler last, SIGKILLing whatever ignores SIGTERM. Children die with this
process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from lab.experiments.handoff_phases import scrape
from lab.experiments.layouts import parse_layout
from services.common.cluster_auth import ClusterToken
from services.launcher.builder import ClusterBuilder, ClusterSpec, GatewaySpec, SchedulerSpec
from services.launcher.fleet import RoleArgs
from services.launcher.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
# What shows where prompts were prefilled and how the KV moved (scraped after each configuration).
METRIC_PREFIXES = ("baton_pd_prefill_path", "baton_pd_fallback", "baton_worker_requests", "baton_kv_transfer_seconds",
                   "baton_pd_handoff_seconds", "baton_pd_handoff_phase_seconds")


@dataclass(frozen=True)
class DistServeSpec:
    """One DistServe run's model, engine flags, SLOs and how its processes are started."""

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
    # Run the scheduler as `lab.experiments.scheduler_tap` (the same service, plus a record of every
    # decision and step sample, written to the log folder at exit) for `tpot_forecast` afterwards.
    tap_scheduler: bool = False


class Cluster:
    """A context manager: entered = every process ready; `url` is the gateway's root."""

    def __init__(self, config: str, spec: DistServeSpec, log_dir: Path, layout: str | None = None,
                 product_env: dict[str, str] | None = None, cluster_token: ClusterToken | None = None) -> None:
        """`config` names the run (its logs, the summary); `layout` the workers (default: `config`).
        `product_env`: the gateway runs as the full product with it (lab/experiments/product_stack.py);
        None: the bare path (`BATON_AUTH_MODE=none`, no safety, no billing). `cluster_token`: the one the
        product's services already run with (default: a new one)."""
        self.config = config
        self.spec = spec
        self.product_env = product_env
        self.log_dir = log_dir
        self.url = ""  # the gateway's, once entered
        self.startup_s: float | None = None
        self.metrics_urls: dict[str, str] = {}  # worker name -> its Prometheus /metrics
        self.service_metrics_urls: dict[str, str] = {}  # "scheduler" / "gateway" -> its /metrics
        self.fleet = parse_layout(layout or config).worker_fleet(spec.tp, self._worker_args(), pin_gpus=not spec.cpu)
        self.plans = self.fleet.plans()
        self.cluster_token = cluster_token or ClusterToken.generate()  # every process gets it
        self.tap_path = log_dir / f"{config}-scheduler_tap.json"  # written when the scheduler stops, if tapped
        self.supervisor = Supervisor(log_dir, cwd=ROOT, log_prefix=f"{config}-")

    def __enter__(self) -> Cluster:
        started = time.monotonic()
        try:
            endpoints = ClusterBuilder(self.cluster_spec(), self.supervisor, self.cluster_token).start()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        assert endpoints.gateway_url is not None and endpoints.scheduler_metrics_url is not None
        self.url = endpoints.gateway_url
        self.metrics_urls = {w.name: w.metrics_url for w in endpoints.workers}
        self.service_metrics_urls = {"scheduler": endpoints.scheduler_metrics_url, "gateway": f"{self.url}/metrics"}
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _worker_args(self) -> RoleArgs:
        s = self.spec
        return RoleArgs(common=("--model", str(s.model_dir), "--model-id", s.model_name,
                                "--heartbeat-interval-s", "0.2", "--drain-grace-s", "1",
                                "--tensor-parallel-size", str(s.tp), *s.engine_args))

    def cluster_spec(self) -> ClusterSpec:
        s = self.spec
        slos = {tier: {"ttft_ms": s.slo_ttft_ms, "tpot_ms": s.slo_tpot_ms} for tier in ("free", "plus", "enterprise")}
        tenants = self.product_env if self.product_env is not None else {
            "BATON_AUTH_MODE": "none", "BATON_ANONYMOUS_TIER": "enterprise"}
        gateway_env = {**tenants, "BATON_MODEL": str(s.model_dir), "BATON_SERVED_MODEL_NAME": s.model_name,
                       "BATON_MAX_MODEL_LEN": _arg(s.engine_args, "--max-model-len"), "BATON_SLOS": json.dumps(slos),
                       "BATON_DRAIN_TIMEOUT_S": "2", "BATON_LOG_LEVEL": "WARNING"}
        gateway = GatewaySpec(processes=s.gateway_processes, env=gateway_env,
                              ready_timeout_s=s.service_ready_timeout_s, stop_timeout_s=15)
        return ClusterSpec(self.plans, scheduler=self.scheduler_spec(), gateway=gateway,
                           env={"PYTHONUNBUFFERED": "1", **s.env}, worker_ready_timeout_s=s.worker_ready_timeout_s,
                           worker_stop_timeout_s=15, start_workers_together=True)

    def scheduler_spec(self) -> SchedulerSpec:
        s = self.spec
        module, tap = ("lab.experiments.scheduler_tap", ("--tap-out", str(self.tap_path))) if s.tap_scheduler \
            else ("scheduler.adapters", ())
        return SchedulerSpec(module=module, args=(*tap, "--policy", s.policy, "--heartbeat-interval-s", "0.2",
                                      "--heartbeat-timeout-s", "10", "--drain-grace-s", "1", "--log-level", "WARNING",
                                      *(["--profile", str(s.scheduler_profile)] if s.scheduler_profile else [])),
                             ready_timeout_s=s.service_ready_timeout_s, stop_timeout_s=15)

    def stop(self) -> None:
        """Gateway, workers, scheduler: the reverse of the start order."""
        self.supervisor.stop_all()

    def worker_counters(self, prefixes: tuple[str, ...] = METRIC_PREFIXES,
                        buckets: bool = False) -> dict[str, dict[str, float]]:
        """Each worker's samples whose name starts with one of `prefixes` (diagnostics; {} if unreachable);
        histogram buckets too with `buckets` (for per-run quantiles: lab/experiments/handoff_phases.py)."""
        return _scrape(self.metrics_urls, prefixes, buckets)

    def service_counters(self, prefixes: tuple[str, ...]) -> dict[str, dict[str, float]]:
        """The scheduler's and the gateway's samples (buckets included) whose name starts with one of
        `prefixes` (per-run deltas: lab/experiments/run_metrics.py)."""
        return _scrape(self.service_metrics_urls, prefixes, buckets=True)

    def log_tails(self, lines: int = 15) -> str:
        return "\n".join(f"--- {spec.name}\n{p.log_tail(lines)}" for spec, p in self.supervisor.children)


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

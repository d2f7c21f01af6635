"""Worker processes for the 2-GPU disaggregation benchmark and GPU test: `DisaggWorkers` starts their
`WorkerPlan`s together through the cluster builder (services/launcher/builder.py; one log file each),
and each started `Worker` has a gRPC channel for one greedy Generate; GPU placement helpers."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import grpc

from rpcgen.baton.v1 import worker_pb2 as pb
from rpcgen.baton.v1 import worker_pb2_grpc
from services.common.cluster_auth import ClusterToken, sync_internal_channel
from services.launcher.builder import ClusterSpec, WorkerEndpoint, start_cluster
from services.launcher.fleet import WorkerPlan
from services.launcher.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("baton_kv_transfer_seconds_sum", "baton_kv_transfer_seconds_count", "baton_kv_transfer_bytes_total",
           "baton_pd_handoff_seconds_sum", "baton_pd_handoff_seconds_count")
# One per run, shared by every worker started here (a decode worker calls its prefill peer with it).
CLUSTER_TOKEN = ClusterToken.generate()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Worker:
    """One started worker: where it serves, and a channel that carries the cluster token."""

    endpoint: WorkerEndpoint
    log_path: Path
    channel: grpc.Channel

    @property
    def name(self) -> str:
        return self.endpoint.name

    @property
    def address(self) -> str:
        return self.endpoint.address

    @property
    def metrics_url(self) -> str:
        return self.endpoint.metrics_url

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channel)

    def metrics(self) -> dict[str, float]:
        """The samples of METRICS, summed over labels; {} if the scrape fails (diagnostics only)."""
        try:
            import urllib.request

            from prometheus_client.parser import text_string_to_metric_families

            with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
                text = r.read().decode()
            out: dict[str, float] = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in METRICS:
                        out[sample.name] = out.get(sample.name, 0.0) + sample.value
            return out
        except Exception as e:  # noqa: BLE001
            log(f"metrics of {self.name} unavailable: {e}")
            return {}


class DisaggWorkers:
    """A context manager: entered = every worker ready (each within `ready_timeout_s`), by name; exited =
    every worker stopped, the last planned first (plan decode workers after their prefill peers)."""

    def __init__(self, plans: Sequence[WorkerPlan], log_dir: Path, ready_timeout_s: float) -> None:
        self.plans = tuple(plans)
        self.supervisor = Supervisor(log_dir, cwd=ROOT)
        self.spec = ClusterSpec(self.plans, scheduler=None, worker_ready_timeout_s=ready_timeout_s,
                                worker_stop_timeout_s=15, start_workers_together=True)
        self.workers: dict[str, Worker] = {}

    def __enter__(self) -> dict[str, Worker]:
        for plan in self.plans:
            visible = plan.env.get("CUDA_VISIBLE_DEVICES")
            log(f"start {plan.name} ({plan.role}): {' '.join(plan.args)}"
                + (f"  (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""))
        endpoints = start_cluster(self.spec, self.supervisor, CLUSTER_TOKEN)
        self.workers = {w.name: Worker(w, self.supervisor.process(w.name).log_path,
                                       sync_internal_channel(w.address, CLUSTER_TOKEN)) for w in endpoints.workers}
        return self.workers

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for w in self.workers.values():
            w.channel.close()
        self.supervisor.stop_all()

    def log_tails(self, lines: int = 25) -> str:
        """Every planned worker's last lines (also after a failed start, from its log file)."""
        return "\n".join(f"--- {p.name} log tail\n{self.supervisor.log_tail(p.name, lines)}" for p in self.plans)


def generate(worker: Worker, prompt: list[int], max_tokens: int, timeout_s: float) -> dict:
    """One greedy Generate; returns tokens, path, TTFT (s, first response with tokens) and total (s)."""
    req = pb.GenerateRequest(request_id=f"bench-{uuid.uuid4().hex[:12]}", prompt_token_ids=prompt,
                             sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out = {"tokens": [], "path": pb.PREFILL_PATH_UNSPECIFIED, "fallback_reason": "", "ttft_s": None,
           "total_s": None, "error": "", "finish_reason": 0}
    t0 = time.perf_counter()
    try:
        for msg in worker.stub.Generate(req, timeout=timeout_s):
            if msg.token_ids and out["ttft_s"] is None:
                out["ttft_s"] = time.perf_counter() - t0
            if msg.prefill_path:
                out["path"], out["fallback_reason"] = msg.prefill_path, msg.fallback_reason
            out["tokens"].extend(msg.token_ids)
            if msg.finish_reason:
                out["finish_reason"] = msg.finish_reason
                if msg.error:
                    out["error"] = msg.error
    except grpc.RpcError as e:
        out["error"] = f"{e.code()}: {e.details()}"  # type: ignore[attr-defined]
    out["total_s"] = time.perf_counter() - t0
    if not out["error"] and len(out["tokens"]) != max_tokens:
        out["error"] = f"{len(out['tokens'])} tokens, {max_tokens} asked"
    return out


def physical_gpu(index: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        return ids[index] if index < len(ids) else str(index)
    return str(index)


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0

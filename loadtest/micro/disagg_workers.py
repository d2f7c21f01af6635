"""Worker processes for the 2-GPU disaggregation benchmark and GPU test: one `python -m services.worker`
subprocess each (its log in a file), health polling, one greedy Generate, GPU placement helpers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpcgen.baton.v1 import worker_pb2 as pb
from rpcgen.baton.v1 import worker_pb2_grpc
from services.common.cluster_auth import TOKEN_ENV, ClusterToken, sync_internal_channel

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("baton_kv_transfer_seconds_sum", "baton_kv_transfer_seconds_count", "baton_kv_transfer_bytes_total",
           "baton_pd_handoff_seconds_sum", "baton_pd_handoff_seconds_count")
# One per run, shared by every worker started here (a decode worker calls its prefill peer with it).
CLUSTER_TOKEN = ClusterToken.generate()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Worker:
    """One `python -m services.worker` subprocess; stdout/stderr into `log_path`."""

    def __init__(self, name: str, role: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name, self.role = name, role
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.argv = [sys.executable, "-m", "services.worker", "--role", role, "--port", str(self.port),
                     "--metrics-port", str(self.metrics_port), "--worker-id", name, *args]
        self.env = {**env, TOKEN_ENV: CLUSTER_TOKEN.value}
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None

    def start(self) -> Worker:
        log(f"start {self.name}: {' '.join(self.argv[1:])}"
            + (f"  (CUDA_VISIBLE_DEVICES={self.env['CUDA_VISIBLE_DEVICES']})"
               if "CUDA_VISIBLE_DEVICES" in self.env else ""))
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env)
        self.channel = sync_internal_channel(self.address, CLUSTER_TOKEN)
        return self

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        assert self.channel is not None
        return worker_pb2_grpc.WorkerStub(self.channel)

    def check_serving(self) -> bool:
        assert self.proc is not None and self.channel is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service="baton.v1.Worker"), timeout=1.0)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def metrics(self) -> dict[str, float]:
        """The samples of METRICS, summed over labels; {} if the scrape fails (diagnostics only)."""
        try:
            import urllib.request

            from prometheus_client.parser import text_string_to_metric_families

            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
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

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log(f"{self.name} ignored SIGTERM for {timeout_s} s: SIGKILL")
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                log(f"{self.name} (pid {self.proc.pid}) did not die")


def wait_all_serving(workers: list[Worker], timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    pending = list(workers)
    while pending:
        pending = [w for w in pending if not w.check_serving()]
        if not pending:
            return
        if time.monotonic() > give_up:
            tails = "\n".join(f"--- {w.name}\n{w.log_tail()}" for w in pending)
            raise TimeoutError(f"not SERVING after {timeout_s} s: {[w.name for w in pending]}\n{tails}")
        time.sleep(0.5)


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

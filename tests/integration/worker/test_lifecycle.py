"""A `both` worker's service plumbing: registration and heartbeats to a scheduler that comes up late,
/metrics, role errors, and the SIGTERM drain (in-flight work finishes, new work is refused)."""

from __future__ import annotations

import re
import signal
import threading
import time
from concurrent import futures

import grpc
import pytest
from worker_client import collect, generate, request, wait_for
from worker_procs import WorkerProcess, free_port

from rpcgen.baton.v1 import scheduler_pb2 as spb
from rpcgen.baton.v1 import scheduler_pb2_grpc
from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Records what workers send."""

    def __init__(self) -> None:
        self.registrations: list[spb.RegisterRequest] = []
        self.heartbeats: list[spb.HeartbeatRequest] = []
        self.lock = threading.Lock()

    def Register(self, request, context):  # noqa: N802
        with self.lock:
            self.registrations.append(request)
        return spb.RegisterResponse(heartbeat_interval_s=0.2)

    def Heartbeat(self, request, context):  # noqa: N802
        with self.lock:
            self.heartbeats.append(request)
        return spb.HeartbeatResponse(known=True)


@pytest.fixture(scope="module")
def scheduler_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(default_model_dir, worker_log_dir, scheduler_port):
    w = WorkerProcess("both-2", "both", default_model_dir, worker_log_dir, "--num-blocks", "64",
                      "--scheduler", f"127.0.0.1:{scheduler_port}", "--heartbeat-interval-s", "0.2",
                      "--drain-grace-s", "30").start()
    try:
        yield w.wait_serving()
    finally:
        w.stop()


@pytest.fixture(scope="module")
def prompt(default_model_dir) -> list[int]:
    tok = Tokenizer.from_dir(default_model_dir)
    return tok.encode_chat([{"role": "user", "content": "Tell me about the moon and its phases."}])


def test_serves_while_the_scheduler_is_down_then_registers_and_heartbeats(worker, scheduler_port, prompt):
    assert generate(worker, request(prompt, 4)).token_ids  # no scheduler yet: serving anyway
    fake = FakeScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    server.add_insecure_port(f"127.0.0.1:{scheduler_port}")
    server.start()
    try:
        wait_for(lambda: fake.registrations, 30, "a registration")
        generate(worker, request(prompt + [42], 4))
        wait_for(lambda: any(h.kv_events for h in fake.heartbeats) and any(h.samples for h in fake.heartbeats),
                 15, "heartbeats with samples and KV events")
    finally:
        server.stop(0)
    reg = fake.registrations[0]
    assert (reg.worker_id, reg.address, reg.status.role) == ("both-2", worker.address, "both")
    assert reg.status.total_blocks == 64 and reg.status.block_size == 16
    kinds = {s.kind for h in fake.heartbeats for s in h.samples}
    assert kinds == {spb.StepSample.KIND_PREFILL, spb.StepSample.KIND_DECODE}
    assert any(e.kind == spb.KVEvent.KIND_STORED for h in fake.heartbeats for e in h.kv_events)


def test_metrics_endpoint_exposes_baton_series(worker):
    text = worker.metrics_text()
    for name in ("baton_engine_step_seconds_bucket", "baton_kv_free_blocks", "baton_worker_tokens_total",
                 "baton_pd_prefill_path_total"):
        assert re.search(rf"^{name}", text, re.M), name


def test_a_both_worker_refuses_prefill_and_handshake(worker):
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.Prefill(pb.PrefillRequest(request_id="x", prompt_token_ids=[1]), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ("baton-kv-idle", "1") in tuple(info.value.trailing_metadata())
    with pytest.raises(grpc.RpcError) as info:
        worker.stub.Handshake(pb.HandshakeRequest(worker_id="x"), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not a prefill worker" in info.value.details()


def test_bad_input_is_invalid_argument_and_changes_nothing(worker, prompt):
    unknown_tier = request(prompt, 4)
    unknown_tier.tier = "gold"
    for bad in (request([10**7], 4), unknown_tier):
        with pytest.raises(grpc.RpcError) as info:
            list(worker.stub.Generate(bad, timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tier must be one of" in info.value.details()
    assert worker.status().free_blocks == 64


def test_sigterm_drains_in_flight_requests_then_exits(worker, prompt):
    call = worker.stub.Generate(request(prompt, 40), timeout=120)
    stream = iter(call)
    got = list(next(stream).token_ids)
    worker.signal(signal.SIGTERM)
    time.sleep(0.3)
    late = collect(worker.stub.Generate(request(prompt, 4), timeout=10))
    rest = collect(stream)
    assert late.code == grpc.StatusCode.UNAVAILABLE
    assert rest.code is None and len(got) + len(rest.token_ids) == 40
    assert worker.proc is not None and worker.proc.wait(30) == 0

"""An abort at every phase releases every block on both workers (read back through GetStatus).

Phases: queued in the decode engine, waiting for the prefill worker (delay_prefill), mid-transfer
(stall_transfer: the WRITE never completes), decoding; by the Abort RPC and by client cancellation.
The baseline is checked sooner than the decode worker's quarantine (6 s) would free anything, so a
pass proves the definite-end path (Abort RPC + the Prefill RPC's idle trailer), not the backstop.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest
from worker_client import Result, collect, generated_tokens, request, wait_baseline, wait_for

from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer

QUICK_S = 4.0  # shorter than the decode worker's 6 s quarantine
LONG_OUTPUT = 1000  # tokens: far more than a request decodes before its abort lands


@pytest.fixture(scope="module")
def prompt(default_model_dir) -> list[int]:
    tok = Tokenizer.from_dir(default_model_dir)
    return tok.encode_chat([{"role": "user", "content": "Describe a walk through a forest in autumn."}])


@pytest.fixture
def pool():
    with ThreadPoolExecutor(16) as executor:
        yield executor


@pytest.fixture(autouse=True)
def settled_cluster(cluster):
    wait_baseline([cluster.decode, cluster.prefill])
    yield
    wait_baseline([cluster.decode, cluster.prefill], timeout_s=QUICK_S)


def _start(pool, worker, req: pb.GenerateRequest) -> tuple[object, Future[Result]]:
    call = worker.stub.Generate(req, timeout=120)
    return call, pool.submit(collect, call)


def _abort(worker, rid: str) -> bool:
    return worker.stub.Abort(pb.AbortRequest(request_id=rid), timeout=10).existed


def test_abort_while_queued_in_the_decode_engine(cluster, pool, prompt):
    fillers = [request(prompt[:6], 200, mode=pb.PREFILL_MODE_LOCAL) for _ in range(8)]  # max_num_seqs is 8
    running = [_start(pool, cluster.decode, r) for r in fillers]
    wait_for(lambda: cluster.decode.status().running_seqs == 8, 60, "8 running sequences")
    # The scheduler prices the decode batch by its summed context: 8 six-token prompts plus their outputs.
    assert 8 * 6 <= cluster.decode.status().running_context_tokens <= 8 * (6 + 200)
    # ...and by when their slots free: each may still generate up to its 200 tokens.
    assert 0 < cluster.decode.status().running_remaining_tokens <= 8 * 200
    queued = request(prompt[:7], 4, mode=pb.PREFILL_MODE_LOCAL)
    _, result = _start(pool, cluster.decode, queued)
    wait_for(lambda: cluster.decode.status().queue_depth == 1, 10, "the request to queue")
    assert _abort(cluster.decode, queued.request_id)
    assert result.result(10).finish_reason == pb.FINISH_REASON_ABORT
    for call, _ in running:
        call.cancel()


def test_abort_while_waiting_for_the_prefill_worker(cluster, pool, prompt):
    cluster.prefill.stub.InjectFault(pb.InjectFaultRequest(fault="delay_prefill", delay_s=30.0))
    req = request(prompt, 8)
    _, result = _start(pool, cluster.decode, req)
    wait_for(lambda: cluster.decode.status().waiting_for_remote_kv == 1, 10, "a reservation")
    wait_for(lambda: cluster.prefill.status().inflight_prefill_tokens > 0, 10, "the prefill job")
    status = cluster.prefill.status()  # the scheduler prices a backlog per prompt: the count comes with the tokens
    assert (status.inflight_prefill_tokens, status.inflight_prefill_requests) == (len(prompt), 1)
    assert _abort(cluster.decode, req.request_id)
    assert result.result(QUICK_S).finish_reason == pb.FINISH_REASON_ABORT


def test_client_cancel_while_waiting_for_the_prefill_worker(cluster, pool, prompt):
    cluster.prefill.stub.InjectFault(pb.InjectFaultRequest(fault="delay_prefill", delay_s=30.0))
    call, result = _start(pool, cluster.decode, request(prompt, 8))
    wait_for(lambda: cluster.prefill.status().inflight_prefill_tokens > 0, 10, "the prefill job")
    call.cancel()
    assert result.result(QUICK_S).code == grpc.StatusCode.CANCELLED


def test_abort_mid_transfer_waits_for_the_write_then_frees_both_sides(cluster, pool, prompt):
    cluster.prefill.stub.InjectFault(pb.InjectFaultRequest(fault="stall_transfer"))
    req = request(prompt, 8)
    _, result = _start(pool, cluster.decode, req)
    wait_for(lambda: cluster.prefill.status().inflight_transfers == 1, 20, "a WRITE in flight")
    assert cluster.prefill.status().held_blocks > 0  # the WRITE's source stays allocated meanwhile
    assert _abort(cluster.decode, req.request_id)
    assert result.result(QUICK_S).finish_reason == pb.FINISH_REASON_ABORT


def test_abort_while_decoding(cluster, pool, prompt):
    req = request(prompt, 200)
    call = cluster.decode.stub.Generate(req, timeout=120)
    got: list[int] = []
    for msg in call:
        got.extend(msg.token_ids)
        if len(got) >= 3:
            assert _abort(cluster.decode, req.request_id)
            break
    rest = collect(call)
    assert rest.finish_reason == pb.FINISH_REASON_ABORT and len(got) + len(rest.token_ids) < 200


def test_client_cancel_while_decoding(cluster, prompt):
    """The client hangs up after 3 tokens of 1000: the decode worker aborts the sequence (its engine stops
    generating long before max_tokens) and every block on both workers is back, sooner than quarantine."""
    before = generated_tokens(cluster.decode)
    call = cluster.decode.stub.Generate(request(prompt, LONG_OUTPUT), timeout=120)
    received: list[int] = []
    for msg in call:
        assert not msg.finish_reason
        received.extend(msg.token_ids)
        if len(received) >= 3:
            call.cancel()
            break
    assert collect(call).code == grpc.StatusCode.CANCELLED
    wait_baseline([cluster.decode, cluster.prefill], timeout_s=QUICK_S)  # nothing running, every block free
    generated = generated_tokens(cluster.decode) - before
    assert len(received) <= generated < LONG_OUTPUT // 2, generated


def test_abort_of_unknown_request_is_harmless(cluster):
    assert not _abort(cluster.decode, "nope-" + uuid.uuid4().hex)
    assert not _abort(cluster.prefill, "nope-" + uuid.uuid4().hex)
    threading.Event().wait(0.1)

"""Worker death and slowness: a slow prefill worker (deadline) and a SIGKILLed one are routed around
(another prefill worker or local recompute, counted in /metrics); a dead decode worker ends its
streams with UNAVAILABLE."""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from worker_client import QUESTIONS, collect, generate, generate_many, request, wait_baseline, wait_for
from worker_procs import WorkerProcess, stop_workers

from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def pair(cluster, default_model_dir, worker_log_dir):
    """A second prefill worker (to kill) and a decode worker using it first, then the shared one."""
    prefill = WorkerProcess("prefill-2", "prefill", default_model_dir, worker_log_dir, "--num-blocks", "128",
                            "--transfer-timeout-s", "2", "--allow-fault-injection").start()
    decode = WorkerProcess("decode-2", "decode", default_model_dir, worker_log_dir, "--num-blocks", "256",
                           "--prefill-peers", f"{prefill.address},{cluster.prefill.address}",
                           "--min-remote-prompt-tokens", "8", "--prefill-timeout-s", "6", "--transfer-timeout-s", "2",
                           "--kv-quarantine-s", "4", "--peer-down-s", "1").start()
    try:
        prefill.wait_serving()
        decode.wait_serving()
        yield prefill, decode
    finally:
        stop_workers([decode, prefill])


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    tok = Tokenizer.from_dir(default_model_dir)
    return [tok.encode_chat([{"role": "user", "content": f"{q} Answer at length."}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def references(cluster, prompts) -> list[list[int]]:
    return [r.token_ids for r in generate_many(cluster.both, [request(p, 16) for p in prompts])]


def _fallbacks(worker: WorkerProcess, reason: str) -> float:
    match = re.search(rf'^baton_pd_fallback_total{{reason="{reason}"}} (\S+)$', worker.metrics_text(), re.M)
    return float(match.group(1)) if match else 0.0


def _busy(status: pb.WorkerStatus) -> bool:
    """Jobs in flight: prompt tokens still to compute (a short prompt's are gone within one engine step),
    or blocks held for a WRITE of the KV."""
    return status.inflight_prefill_tokens > 0 or status.held_blocks > 0


def test_slow_prefill_worker_hits_the_deadline_and_another_one_serves(pair, prompts, references):
    prefill, decode = pair
    prefill.stub.InjectFault(pb.InjectFaultRequest(fault="delay_prefill", delay_s=15.0))
    result = generate(decode, request(prompts[0], 16, prefill_worker=prefill.address))
    assert result.token_ids == references[0]
    assert result.prefill_path == pb.PREFILL_PATH_REMOTE  # the second prefill worker did it
    assert _fallbacks(decode, "prefill_deadline") == 1
    wait_baseline([decode, prefill], timeout_s=10.0)


def test_killed_prefill_worker_in_flight_and_later_requests_complete(pair, prompts, references):
    prefill, decode = pair
    time.sleep(1.2)  # the slow-prefill test marked it down for 1 s
    reqs = [request(prompts[i % len(prompts)], 16, prefill_worker=prefill.address) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        running = pool.map(lambda r: generate(decode, r), reqs)
        wait_for(lambda: _busy(prefill.status()), 30, "prefills on the doomed worker")
        prefill.signal(signal.SIGKILL)
        results = list(running)
    later = generate_many(decode, [request(p, 16) for p in prompts[:4]])
    assert [r.token_ids for r in results] == [references[i % len(prompts)] for i in range(12)]
    assert [r.token_ids for r in later] == references[:4]
    assert _fallbacks(decode, "prefill_unavailable") >= 1
    wait_baseline([decode], timeout_s=15.0)


def test_killed_decode_worker_ends_the_stream_with_unavailable(pair, prompts):
    _, decode = pair
    call = decode.stub.Generate(request(prompts[1], 300), timeout=60)
    first = next(iter(call))
    assert first.token_ids
    decode.signal(signal.SIGKILL)
    rest = collect(call)
    assert rest.code == grpc.StatusCode.UNAVAILABLE

"""Soak: 250 requests, ~20% cancelled at random moments; every block comes back on both workers and
every request that was not cancelled streams exactly the reference tokens."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from worker_client import QUESTIONS, Result, collect, generate_many, request, wait_baseline

from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer

NUM_REQUESTS = 250
CANCEL_RATE = 0.2
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    tok = Tokenizer.from_dir(default_model_dir)
    plain = [tok.encode(f"Question: {q} Answer:") for q in QUESTIONS]  # 8+ tokens: remote
    return plain + [tok.encode(q)[:6] for q in QUESTIONS[:4]]  # short ones prefill locally


@pytest.fixture(scope="module")
def references(cluster, prompts) -> list[list[int]]:
    return [r.token_ids for r in generate_many(cluster.both, [request(p, MAX_TOKENS) for p in prompts])]


def _one(decode, prompt: list[int], max_tokens: int, mode: int, cancel_after: int | None) -> Result | None:
    """Run one request; cancel it after `cancel_after` messages (0: at once). None when cancelled."""
    call = decode.stub.Generate(request(prompt, max_tokens, mode=mode), timeout=300)
    if cancel_after is None:
        return collect(call)
    if cancel_after == 0:
        call.cancel()
        return None
    try:
        for n, _ in enumerate(call, 1):
            if n >= cancel_after:
                break
    except grpc.RpcError:
        pass
    call.cancel()
    return None


def test_soak_with_random_cancellations_returns_every_block(cluster, prompts, references):
    rng = random.Random(1234)
    jobs = []
    for _ in range(NUM_REQUESTS):
        i = rng.randrange(len(prompts))
        mode = pb.PREFILL_MODE_REMOTE if rng.random() < 0.6 else pb.PREFILL_MODE_AUTO
        cancel = rng.choice([0, 1, 2, 3]) if rng.random() < CANCEL_RATE else None
        jobs.append((i, rng.randint(1, MAX_TOKENS), mode, cancel))
    start = time.monotonic()
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(lambda j: _one(cluster.decode, prompts[j[0]], j[1], j[2], j[3]), jobs))
    elapsed = time.monotonic() - start
    finished = [(j, r) for j, r in zip(jobs, results, strict=True) if r is not None]
    assert len(finished) >= NUM_REQUESTS * 0.7
    wrong = [(j, r.token_ids, r.code) for j, r in finished if r.token_ids != references[j[0]][:j[1]]]
    assert not wrong, f"{len(wrong)} requests streamed wrong tokens, e.g. {wrong[:3]}"
    wait_baseline([cluster.decode, cluster.prefill], timeout_s=20.0)
    print(f"soak: {NUM_REQUESTS} requests in {elapsed:.1f} s")

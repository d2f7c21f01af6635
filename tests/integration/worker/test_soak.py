"""Soak: 125 requests, ~20% cancelled at random moments; every block comes back on both workers and
every request that was not cancelled streams exactly the reference tokens.

With KV tiers: 125 requests, ~20% cancelled, against a `both` worker whose pool is far smaller than
the conversations it serves, so histories are demoted to host memory and disk and loaded back while
requests are cancelled around (and during) those loads; afterwards every GPU block is free, no tier
entry is pinned, and every finished request streamed the tokens of a worker without tiers."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from worker_client import QUESTIONS, Result, collect, generate_many, request, wait_baseline, wait_for
from worker_procs import WorkerProcess, stop_workers

from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer

# ~25 cancellations at every moment a request can be cancelled (before, during and after the remote prefill,
# between tokens) and 24 requests in flight at once; 250 doubled the soak's time for no path not taken here.
NUM_REQUESTS = 125
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


CANCEL_POINTS = (0, 1, 2, 3)  # messages received before the cancel (0: at once)


def test_soak_with_random_cancellations_returns_every_block(cluster, prompts, references):
    rng = random.Random(1239)  # a seed whose 125 requests cancel at every point in both prefill modes
    jobs = []
    for _ in range(NUM_REQUESTS):
        i = rng.randrange(len(prompts))
        mode = pb.PREFILL_MODE_REMOTE if rng.random() < 0.6 else pb.PREFILL_MODE_AUTO
        cancel = rng.choice(CANCEL_POINTS) if rng.random() < CANCEL_RATE else None
        jobs.append((i, rng.randint(1, MAX_TOKENS), mode, cancel))
    cancelled_where = {(mode, cancel) for _, _, mode, cancel in jobs if cancel is not None}
    assert cancelled_where == {(m, c) for m in (pb.PREFILL_MODE_REMOTE, pb.PREFILL_MODE_AUTO) for c in CANCEL_POINTS}
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


# As many as the plain soak: 36 histories through a 16-block pool demote and load on nearly every request, so
# ~25 cancellations land around loads; 250 and 500 doubled and quadrupled the soak's time for no new path.
TIERED_REQUESTS = 125
_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # the default model's float32 16-token block


@pytest.fixture(scope="module")
def tiered(default_model_dir, worker_log_dir, tmp_path_factory) -> WorkerProcess:
    disk = tmp_path_factory.mktemp("soak-kv-disk")
    worker = WorkerProcess("both-tiered", "both", default_model_dir, worker_log_dir, "--num-blocks", "16",
                           "--host-kv-gib", str(6 * _BLOCK_BYTES / 1024**3), "--disk-kv-dir", str(disk),
                           "--disk-kv-gib", str(512 * _BLOCK_BYTES / 1024**3), "--kv-load-min-speedup", "0").start()
    try:
        worker.wait_serving()
        yield worker
    finally:
        stop_workers([worker])


@pytest.fixture(scope="module")
def histories() -> list[list[int]]:
    """Twelve conversations' turns: turn k of a conversation extends turn k-1 by 8 tokens."""
    rng = random.Random(99)
    out = []
    for _ in range(12):
        turn = [rng.randrange(200, 40_000) for _ in range(34)]
        for _ in range(3):
            out.append(list(turn))
            turn = turn + [rng.randrange(200, 40_000) for _ in range(8)]
    return out


def test_tiered_soak_with_random_cancellations_returns_every_block_and_pin(cluster, tiered, histories):
    references = [r.token_ids for r in generate_many(cluster.both, [request(p, MAX_TOKENS) for p in histories])]
    rng = random.Random(4321)
    jobs = [(rng.randrange(len(histories)), rng.randint(1, MAX_TOKENS),
             rng.choice(CANCEL_POINTS) if rng.random() < CANCEL_RATE else None) for _ in range(TIERED_REQUESTS)]
    assert {cancel for _, _, cancel in jobs} == {None, *CANCEL_POINTS}
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: _one(tiered, histories[j[0]], j[1], pb.PREFILL_MODE_AUTO, j[2]), jobs))
    finished = [(j, r) for j, r in zip(jobs, results, strict=True) if r is not None]
    assert len(finished) >= TIERED_REQUESTS * 0.7
    wrong = [(j, r.token_ids, r.code) for j, r in finished if r.token_ids != references[j[0]][:j[1]]]
    assert not wrong, f"{len(wrong)} requests streamed wrong tokens, e.g. {wrong[:3]}"
    wait_baseline([tiered], timeout_s=20.0)

    def tiers_idle() -> bool:  # the tier gauges come with the KV-event drain, about a second behind
        tiers = {t.tier: t for t in tiered.status().kv_tiers}
        return set(tiers) == {"host", "disk"} and all(t.pinned_blocks == 0 for t in tiers.values())

    wait_for(tiers_idle, 20.0, "every tier entry unpinned")
    tiers = {t.tier: t for t in tiered.status().kv_tiers}
    assert tiers["host"].hit_blocks + tiers["disk"].hit_blocks > 0  # histories really came back from the tiers
    assert tiers["disk"].occupied_blocks <= tiers["disk"].capacity_blocks

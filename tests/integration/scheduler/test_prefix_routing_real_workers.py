"""Prefix-aware routing from real workers' KV events: a real scheduler (`prefix_aware`) and two real
`both` workers on the default model, which register and heartbeat their stored/evicted block hashes.

Each worker is seeded with a long prefix of its own (a request sent to it directly), so a constant
or load-only choice cannot pass: a later prompt on prefix A must go to the worker holding A, one on
prefix B to the worker holding B, and that worker must then reuse the prefix (`num_cached_tokens`).
A scheduler restarted after the seeding must relearn what the workers already hold.
"""

from __future__ import annotations

import random
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "worker"))
from worker_client import Result, generate, request  # noqa: E402
from worker_procs import WorkerProcess  # noqa: E402

from rpcgen.baton.v1 import scheduler_pb2 as spb  # noqa: E402
from rpcgen.baton.v1 import worker_pb2 as pb  # noqa: E402
from scheduler.types import SLO, Reason, RequestSummary, Tier  # noqa: E402
from tests.support.scheduler_process import SchedulerProcess  # noqa: E402
from tokenization.block_hashes import block_hashes  # noqa: E402

PREFIX_TOKENS = 160  # 10 blocks of 16
LEARN_S = 10.0  # a heartbeat is 0.2 s; generous for a loaded machine


@dataclass
class PrefixCluster:
    scheduler: SchedulerProcess
    workers: list[WorkerProcess]
    prefixes: list[list[int]]  # prefixes[i] was first computed on workers[i]
    block_size: int


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[PrefixCluster]:
    logs = tmp_path_factory.mktemp("prefix-routing")
    scheduler = SchedulerProcess(logs / "scheduler.log", "prefix_aware", "--heartbeat-timeout-s", "10").start()
    workers = [WorkerProcess(f"cache-{name}", "both", default_model_dir, logs, "--num-blocks", "128",
                             "--scheduler", scheduler.address).start() for name in ("a", "b")]
    try:
        for worker in workers:
            worker.wait_serving()
        scheduler.wait_workers({w.name for w in workers})
        rng = random.Random(18)
        prefixes = [_tokens(rng, PREFIX_TOKENS) for _ in workers]
        for worker, prefix in zip(workers, prefixes, strict=True):
            seeded = generate(worker, request(prefix + _tokens(rng, 5), 1, mode=pb.PREFILL_MODE_LOCAL))
            assert seeded.num_cached_tokens == 0 and len(seeded.token_ids) == 1, seeded
        yield PrefixCluster(scheduler, workers, prefixes, workers[0].status().block_size)
    finally:
        scheduler.kill()
        for worker in workers:
            worker.stop()


def _route_to_holder(cluster: PrefixCluster, prompt: list[int]) -> str:
    """The worker id the scheduler routes `prompt` to, once it routes for prefix affinity (the index lags
    a worker by a heartbeat); fails if it never does."""
    hashes = tuple(block_hashes(prompt, cluster.block_size))
    give_up = time.monotonic() + LEARN_S
    while True:
        summary = RequestSummary(uuid.uuid4().hex, len(prompt), hashes, Tier.FREE, SLO(60_000, 5_000), 1)
        decision = cluster.scheduler.route(summary)
        assert decision.kind == spb.RouteResponse.KIND_ROUTE, decision
        if decision.reason == Reason.PREFIX_AFFINITY.value:
            return decision.decode_worker_id
        assert time.monotonic() < give_up, f"never routed for prefix affinity: {decision}"
        time.sleep(0.1)


def _follow_up(cluster: PrefixCluster, prefix: list[int]) -> tuple[WorkerProcess, Result]:
    """Route a new prompt on `prefix` and run it on the chosen worker."""
    prompt = prefix + _tokens(random.Random(), 7)
    chosen = _route_to_holder(cluster, prompt)
    worker = next(w for w in cluster.workers if w.name == chosen)
    return worker, generate(worker, request(prompt, 1))


def test_a_repeated_long_prefix_lands_on_the_worker_that_holds_it(cluster: PrefixCluster) -> None:
    for holder, prefix in zip(cluster.workers, cluster.prefixes, strict=True):
        worker, result = _follow_up(cluster, prefix)
        assert worker is holder
        assert result.num_cached_tokens == PREFIX_TOKENS  # every prefix block reused, none recomputed


def test_a_restarted_scheduler_relearns_the_caches_the_workers_hold(cluster: PrefixCluster) -> None:
    cluster.scheduler.kill()  # everything it learnt from KV events is gone
    cluster.scheduler.start()
    cluster.scheduler.wait_workers({w.name for w in cluster.workers})  # they register again
    for holder, prefix in zip(cluster.workers, cluster.prefixes, strict=True):
        worker, result = _follow_up(cluster, prefix)
        assert worker is holder
        assert result.num_cached_tokens == PREFIX_TOKENS

"""Scheduler decision latency: the real core (goodput policy, cost-based prefill siting) at cluster scale.

64 workers (16 prefill + 48 decode by default), ~100k block hashes in the prefix index, 1,000
requests/s of simulated time. Every worker heartbeats every 0.2 s with load that follows what was
routed to it, each request finishes after ~2 s, the admission tick runs every 50 ms. Only CPU time
spent inside the core is measured: wall time (perf_counter) and the thread's CPU time (thread_time,
which leaves out time the OS ran other processes: on a shared machine the two differ), around each
call. The gRPC hop is not included.

The cluster can serve the offered load: every heartbeat carries a step sample of the worker's kind,
as real workers' do, matching `CLUSTER_PROFILE` (a small model on a fast card: a 1.5k-token prompt
prefills in ~10 ms, so the 16 prefill workers run at about half load), which also seeds the cost
models. An earlier version reported decode steps only: the prefill workers' cost stayed the default
profile's (~0.2 s for a 1.5k-token prompt with 512 tokens cached), over ten times what the offered
load allows, and the goodput policy queued ~60% of the requests behind the few it could not place
with room left for a heavier tier. A queued-behind decision is a deque append, so the figures timed
the admission queue more than routing. `queued_fraction` in the output says how many decisions only queued.

    .venv/bin/python -m lab.micro.bench_scheduler_decisions [--seconds 10] [--json out.json]

The compiled decision path (scheduler/native.py): compile a copy of the package and put it first,

    mkdir -p /tmp/native && cp -r scheduler /tmp/native/ && .venv/bin/python -m scheduler.native /tmp/native
    PYTHONPATH=/tmp/native .venv/bin/python -m lab.micro.bench_scheduler_decisions

(`compiled` in the output says which ran). `decisions_sha256` hashes every answer: the same seed and
code decide alike compiled or not (tests/integration/scheduler/test_native_scheduler.py).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from scheduler.adapters.loop_watch import quiet_gc
from scheduler.core.cost_model import WorkerProfile
from scheduler.core.policies import make_policy
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.native import compiled
from scheduler.sim.trace import extend_chain
from scheduler.types import (
    SLO,
    DecisionKind,
    DecodeSample,
    KVEvent,
    KVEventKind,
    PrefillSample,
    RequestSummary,
    RouteDecision,
    StepSample,
    Tier,
    WorkerRole,
    WorkerSnapshot,
)

BLOCK = 16
CLUSTER_PROFILE = WorkerProfile(prefill_fixed_s=0.004, prefill_per_token_s=4e-6, prefill_per_token_sq_s=1e-10)
# What each worker's heartbeat reports, as real ones do: a step of its kind.
STEP_SAMPLE: dict[WorkerRole, StepSample] = {
    WorkerRole.PREFILL: PrefillSample(1024, CLUSTER_PROFILE.prefill_s(1024)),
    WorkerRole.DECODE: DecodeSample(8, 12_000, 0.02),
}


@dataclass(frozen=True)
class BenchConfig:
    prefill_workers: int = 16
    decode_workers: int = 48
    indexed_blocks: int = 100_000
    rate: float = 1000.0  # requests per simulated second
    seconds: float = 10.0
    heartbeat_s: float = 0.2
    tick_s: float = 0.05
    lifetime_s: float = 2.0
    system_prompts: int = 200  # shared prefixes of 32 blocks each
    seed: int = 0
    policy: str = "goodput"


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def run(config: BenchConfig) -> dict[str, float]:
    previous = quiet_gc()  # the garbage-collector setting `baton scheduler` runs with (adapters/loop_watch.py)
    try:
        return _measure(config)
    finally:
        gc.set_threshold(*previous)


def _measure(config: BenchConfig) -> dict[str, float]:
    rng = random.Random(config.seed)
    core = Scheduler(
        make_policy(config.policy), SchedulerConfig(heartbeat_timeout_s=10.0, default_profile=CLUSTER_PROFILE)
    )
    workers = [(f"p{i}", WorkerRole.PREFILL) for i in range(config.prefill_workers)]
    workers += [(f"d{i}", WorkerRole.DECODE) for i in range(config.decode_workers)]
    running: dict[str, int] = {w: 0 for w, _ in workers}
    roles = dict(workers)

    def snapshot(worker_id: str, now: float) -> WorkerSnapshot:
        seqs = running[worker_id]
        decoding = roles[worker_id] is WorkerRole.DECODE
        return WorkerSnapshot(
            worker_id, roles[worker_id], "m", f"{worker_id}:1", queue_depth=0,
            running_seqs=seqs if decoding else 0, free_blocks=max(40_000 - seqs * 100, 0), total_blocks=40_000,
            block_size=BLOCK, inflight_prefill_tokens=0 if decoding else seqs * 50, heartbeat_at=now,
            running_context_tokens=seqs * 1500 if decoding else 0, max_num_seqs=256,
        )

    prompts = [extend_chain((), 32, label) for label in range(config.system_prompts)]
    per_worker = config.indexed_blocks // len(workers)
    for worker_id, _ in workers:
        core.register(snapshot(worker_id, 0.0), 0.0)
        held: list[int] = []
        for prefix in rng.sample(prompts, k=min(len(prompts), per_worker // 32)):
            held.extend(prefix)
        label = hash(worker_id) & 0xFFFF_FFFF
        held.extend(extend_chain((), max(per_worker - len(held), 0), label))
        core.on_heartbeat(snapshot(worker_id, 0.0), [], [KVEvent(KVEventKind.STORED, h) for h in held], 0.0)
    indexed = sum(core._prefix.num_blocks(w) for w, _ in workers)  # noqa: SLF001 - a benchmark's peek

    route_s: list[float] = []
    route_cpu_s: list[float] = []  # thread CPU time: the same call minus time descheduled (shared machine)
    heartbeat_s: list[float] = []
    tick_s: list[float] = []
    kinds: Counter[DecisionKind] = Counter()
    digest = hashlib.sha256()  # every decision's answer: two builds that decide alike hash alike
    finishing: deque[tuple[float, str, str]] = deque()
    next_beat = {w: config.heartbeat_s * i / len(workers) for i, (w, _) in enumerate(workers)}
    now, next_tick, n = 0.0, 0.0, 0
    slo = SLO(ttft_ms=2000, tpot_ms=100)
    wall = time.perf_counter()
    while now < config.seconds:
        now += rng.expovariate(config.rate)
        while finishing and finishing[0][0] <= now:
            _, rid, decode_id = finishing.popleft()
            core.on_finished(rid, now)
            running[decode_id] = max(running[decode_id] - 1, 0)
        for worker_id, due in next_beat.items():
            if due <= now:
                started = time.perf_counter()
                core.on_heartbeat(snapshot(worker_id, now), [STEP_SAMPLE[roles[worker_id]]], [], now)
                heartbeat_s.append(time.perf_counter() - started)
                next_beat[worker_id] = due + config.heartbeat_s
        if next_tick <= now:
            started = time.perf_counter()
            core.tick(now)
            tick_s.append(time.perf_counter() - started)
            next_tick += config.tick_s
        system = rng.choice(prompts)
        tail = rng.randint(4, 120)
        request = RequestSummary(
            f"r{n}", (32 + tail) * BLOCK, extend_chain(system, tail, n + 1_000_000), rng.choice(list(Tier)), slo,
            max_tokens=rng.randint(32, 256),
        )
        n += 1
        started, started_cpu = time.perf_counter(), time.thread_time()
        decision = core.route(request, now)
        route_s.append(time.perf_counter() - started)
        route_cpu_s.append(time.thread_time() - started_cpu)
        kinds[decision.kind] += 1
        digest.update(_decision_key(decision))
        if decision.is_placed and decision.decode_worker_id is not None:
            running[decision.decode_worker_id] += 1
            finishing.append((now + config.lifetime_s, request.request_id, decision.decode_worker_id))
    elapsed = time.perf_counter() - wall
    return {
        "compiled": compiled(),
        "workers": len(workers),
        "indexed_blocks": indexed,
        "requests": len(route_s),
        "rate": config.rate,
        "queued_fraction": kinds[DecisionKind.QUEUE] / len(route_s),
        "placed_fraction": (kinds[DecisionKind.ROUTE] + kinds[DecisionKind.DEGRADE]) / len(route_s),
        "route_p50_ms": _percentile(route_s, 0.5) * 1e3,
        "route_p99_ms": _percentile(route_s, 0.99) * 1e3,
        "route_mean_ms": statistics.fmean(route_s) * 1e3,
        "route_max_ms": max(route_s) * 1e3,
        "route_cpu_p50_ms": _percentile(route_cpu_s, 0.5) * 1e3,
        "route_cpu_p99_ms": _percentile(route_cpu_s, 0.99) * 1e3,
        "route_p999_ms": _percentile(route_s, 0.999) * 1e3,
        "heartbeat_p50_ms": _percentile(heartbeat_s, 0.5) * 1e3,
        "heartbeat_p99_ms": _percentile(heartbeat_s, 0.99) * 1e3,
        "tick_p99_ms": _percentile(tick_s, 0.99) * 1e3,
        # Core CPU seconds per simulated second: below 1.0, one core keeps up with the rate.
        "core_busy_fraction": elapsed / config.seconds,
        "decisions_sha256": digest.hexdigest(),
    }


def _decision_key(d: RouteDecision) -> bytes:
    """What a decision answered, to the last bit of its predictions (`repr` of a float round-trips)."""
    return repr((d.kind.value, d.decode_worker_id, d.prefill_worker_id, d.predicted_ttft_ms, d.predicted_tpot_ms,
                 d.predicted_stretch_ms, _text(d.reason), _text(d.prefill_reason), d.max_tokens)).encode()


def _text(reason: StrEnum | None) -> str:
    """A reason as the digest has always hashed it: its value, or empty."""
    return reason.value if reason is not None else ""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=BenchConfig.seconds, help="simulated seconds")
    parser.add_argument("--rate", type=float, default=BenchConfig.rate)
    parser.add_argument("--policy", default=BenchConfig.policy)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    result = run(BenchConfig(seconds=args.seconds, rate=args.rate, policy=args.policy))
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()

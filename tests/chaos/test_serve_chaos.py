"""Chaos: `baton serve` (real Postgres, Redis and broker, embedded) keeps serving while its children are
SIGKILLed one after another under a steady load of streaming chats.

Killed in turn: the prefill worker (decode prefills locally meanwhile), the decode worker (its
in-flight stream is lost: it has no other decode worker to migrate to), the billing consumer, the
Kafka-protocol broker (it restarts with every message it acknowledged: its data is in its on-disk
store), the broker's store (the broker's writes wait for it), Redis (rate limits fail open), Postgres
(usage goes to the local spool meanwhile), the scheduler (the gateway routes statically meanwhile) and
the gateway. (Safety is off to keep the test short on two cores; it is restarted like any other gRPC
child.) Asserted: no request hangs; after each kill a request started after it completes within
RECOVERY_S; every completed request is billed exactly once (one `usage_events` row per request id) —
among them those published while billing was down and the broker was killed right after, and those
that finished just before the gateway's SIGKILL (their usage was in the Postgres outbox before the
client saw `[DONE]`; the restarted gateway's relay publishes it); after the load, every worker's KV pool
is back to its free count before the load; `baton serve` still exits 0 on SIGTERM.
The kills go through loadtest's `ServeRunController`, i.e. the run file `baton serve` writes.
Figures (requests lost per kill, recovery time) are printed; docs/benchmarks.md records them.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psycopg

from loadtest.faults import ServeRunController
from tests.chaos.serve_load import Outcome, ServeProcess, SteadyLoad
from tests.support.gateway_stack import MODEL

VICTIMS = ("worker-prefill", "worker-decode", "billing", "kafka", "kafka-store", "redis", "postgres", "scheduler",
           "gateway")
WORKERS = ("worker-prefill", "worker-decode")
RECOVERY_S = 30.0  # a kill must be followed by a completed request within this long
BILLING_S = 30.0  # every completed request is billed within this long after the load stops
KV_SETTLE_S = 15.0  # after the load, every worker's KV pool is back to its pre-load free count within this long


def _recover(load: SteadyLoad, killed_at: float) -> float:
    deadline = killed_at + RECOVERY_S
    while load.completed_since(killed_at) == 0:
        assert time.monotonic() < deadline, f"nothing completed within {RECOVERY_S}s of the kill"
        time.sleep(0.1)
    return time.monotonic() - killed_at


def _free_kv_blocks(run: dict) -> dict[str, float]:
    """`baton_kv_free_blocks` of each worker, from its /metrics (ports in baton serve's run file)."""
    free = {}
    for worker in WORKERS:
        text = httpx.get(f"http://127.0.0.1:{run['ports'][worker + '-metrics']}/metrics", timeout=5).text
        free[worker] = next(float(line.split()[-1]) for line in text.splitlines()
                            if line.startswith("baton_kv_free_blocks"))
    return free


def _kv_settled(run: dict, baseline: dict[str, float]) -> dict[str, float]:
    deadline = time.monotonic() + KV_SETTLE_S
    while (free := _free_kv_blocks(run)) != baseline and time.monotonic() < deadline:
        time.sleep(0.5)
    return free


def _billed(database_url: str, ids: set[str]) -> dict[str, int]:
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT request_id, count(*) FROM usage_events WHERE request_id = ANY(%s) "
                            "GROUP BY 1", (list(ids),)).fetchall()
    return {r[0]: r[1] for r in rows}


def _diagnose(database_url: str, unbilled: list[Outcome], killed: dict[str, float]) -> str:
    """What the outbox and the consumers' progress say about unbilled requests (for a failure message)."""
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT request_id, recorded_at, sent_at, republished FROM usage_outbox "
                            "WHERE request_id = ANY(%s)", ([o.request_id for o in unbilled],)).fetchall()
        progress = conn.execute("SELECT member, caught_up_at, seen_at, now() FROM billing_consumer_progress").fetchall()
    first_kill = killed["worker-prefill"]
    ended = [(o.request_id, round(o.ended - first_kill, 1)) for o in unbilled[:10]]
    kills = {name: round(at - first_kill, 1) for name, at in killed.items()}
    return f"ended (s after the first kill) {ended}; kills {kills}; outbox rows {rows[:10]}; consumers {progress}"


def test_children_killed_in_turn_lose_no_billing_and_the_cluster_recovers(tmp_path: Path,
                                                                          default_model_dir: Path) -> None:
    serve = ServeProcess(default_model_dir, tmp_path / "serve.log")
    try:
        started = time.monotonic()
        serve.wait_ready(240)
        ready_s = time.monotonic() - started
        run = serve.run()
        kv_baseline = _free_kv_blocks(run)
        controller = ServeRunController(str(serve.run_file))
        load = SteadyLoad(serve.url, serve.key, MODEL)
        load.start()
        _recover(load, time.monotonic())  # warm: the first request completes
        figures = []
        killed: dict[str, float] = {}
        for victim in VICTIMS:
            before = len(load.outcomes)
            killed_at = killed[victim] = time.monotonic()
            controller.kill(victim)
            controller.restart(victim)  # waits until baton serve runs it under a new pid
            recovery = _recover(load, killed_at)
            in_flight = [o for o in load.outcomes[before:] if o.started < killed_at]
            lost = [o.detail for o in in_flight if o.result != "completed"]
            figures.append((victim, recovery, lost,
                            sum(o.result != "completed" and o.started >= killed_at for o in load.outcomes[before:])))
        load.stop()
        stopped = time.monotonic()
        hung = [o for o in load.outcomes if o.result == "hung"]
        assert not hung, f"{len(hung)} requests hung"
        completed = {o.request_id for o in load.outcomes if o.result == "completed"}
        deadline = time.monotonic() + BILLING_S
        while (billed := _billed(run["database_url"], completed)).keys() != completed and time.monotonic() < deadline:
            time.sleep(0.5)
        billing_s = time.monotonic() - stopped
        unbilled = [o for o in load.outcomes if o.result == "completed" and o.request_id not in billed]
        just_before_kill = [o for o in load.outcomes if o.result == "completed"
                            and killed["gateway"] - 2.0 <= o.ended <= killed["gateway"]]
        # Usage published while the billing consumer was down is still in the broker killed right after
        # (its storage is on disk): with the broker in memory, 6-19 such requests went unbilled in about
        # half the runs.
        in_gap = [o for o in load.outcomes if o.result == "completed"
                  and killed["billing"] <= o.ended <= killed["kafka"] + 1.0]
        assert not unbilled, (f"{len(unbilled)} completed requests unbilled: "
                              f"{_diagnose(run['database_url'], unbilled, killed)}")
        assert set(billed.values()) == {1}  # never twice
        assert (kv := _kv_settled(run, kv_baseline)) == kv_baseline, f"KV pools not back: {kv} vs {kv_baseline}"
        print(f"\nchaos: {len(load.outcomes)} requests, {len(completed)} completed, {len(billed)} billed once, "
              f"{len(in_gap)} finished between the billing and broker kills and "
              f"{len(just_before_kill)} < 2 s before the gateway's SIGKILL, all billed)")
        print(f"  cluster ready after {ready_s:.1f}s; everything billed {billing_s:.1f}s after the load stopped")
        for victim, recovery, lost, refused in figures:
            print(f"  kill -9 {victim:15s} serving again after {recovery:5.1f}s; in-flight requests lost: "
                  f"{len(lost)} {lost}; requests refused meanwhile: {refused}")
    finally:
        code = serve.stop()
    assert code == 0, serve.log_path.read_text()[-3000:]

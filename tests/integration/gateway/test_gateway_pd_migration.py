"""Migration on a prefill/decode cluster (CPU): a scheduler, one prefill worker, two decode workers that
hand prompts over from it, and a gateway routing through the scheduler. The decode worker serving a
streamed greedy request is killed (SIGKILL) after a few tokens: the stream goes on on the other decode
worker (prompt + tokens so far re-prefilled) with the text of an uninterrupted run, one response id and
one usage row; and the gateway's failure report makes the scheduler unlist the dead worker at once,
long before its heartbeat deadline (10 s).
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import pytest

from rpcgen.baton.v1 import scheduler_pb2 as pb
from rpcgen.baton.v1 import scheduler_pb2_grpc as pb_grpc
from rpcgen.baton.v1 import worker_pb2 as wpb
from rpcgen.baton.v1 import worker_pb2_grpc as wpb_grpc
from tests.integration.gateway.migration_checks import billed, content, migrations
from tests.integration.gateway.sse_events import Event, events
from tests.support.gateway_stack import MODEL, GatewayStack, Tenant
from tests.support.required import require_module

require_module("nixl._api")  # the prefill -> decode hand-off: a missing nixl is an ERROR, never a skip

# Over the scheduler's remote-prefill threshold (256 tokens): the prompt is prefilled on the prefill worker.
PROMPT = ("Background notes: " + "the sea is calm and blue today. " * 45
          + "Now write a detailed essay about the history of the Roman Empire.")
MAX_TOKENS = 48
DECODERS = ("worker-pd-d1", "worker-pd-d2")


@dataclass(frozen=True)
class PDCluster:
    stack: GatewayStack
    url: str
    scheduler: str
    scheduler_metrics: str
    decoders: dict[str, str]  # supervisor name -> address

    def listed(self) -> set[str]:
        with grpc.insecure_channel(self.scheduler) as channel:
            reply = pb_grpc.SchedulerStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5)
        return {w.status.worker_id for w in reply.workers}

    def busy_decoder(self) -> str:
        for name, address in self.decoders.items():
            with grpc.insecure_channel(address) as channel:
                if wpb_grpc.WorkerStub(channel).GetStatus(wpb.StatusRequest(), timeout=2).running_seqs:
                    return name
        raise AssertionError("no decode worker is running the request")

    def kill(self, name: str) -> None:
        os.kill(self.stack.supervisor.pids()[name], signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(gateway_stack: GatewayStack) -> Iterator[PDCluster]:
    supervisor = gateway_stack.supervisor
    started = gateway_stack.start_disaggregated("scheduler-pd", "worker-pd-p", DECODERS, "gateway-pd-m")
    assert started.gateway_url is not None and started.scheduler is not None
    assert started.scheduler_metrics_url is not None
    decoders = {name: started.worker(name).address for name in DECODERS}
    pd = PDCluster(gateway_stack, started.gateway_url, started.scheduler, started.scheduler_metrics_url, decoders)
    give_up = time.monotonic() + 20  # registrations may still be on their way
    while pd.listed() != {"worker-pd-p", *DECODERS}:
        assert time.monotonic() < give_up, f"workers never all registered: {pd.listed()}"
        time.sleep(0.2)
    yield pd
    for name in ["gateway-pd-m", *DECODERS, "worker-pd-p", "scheduler-pd"]:
        supervisor.stop_child(name)


def _body(stream: bool) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


def _http(url: str, tenant: Tenant) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60)


def _failure_reports(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r'^baton_scheduler_worker_failure_reports_total\{outcome="marked",[^}]*\} (\S+)$', text, re.M))


def _seconds_until_unlisted(cluster: PDCluster, worker: str, since: float, give_up_s: float = 20.0) -> float:
    """How long after `since` the scheduler stopped listing `worker` (polled every 0.1 s)."""
    while worker in cluster.listed() and time.monotonic() - since < give_up_s:
        time.sleep(0.1)
    return time.monotonic() - since


def test_a_decode_worker_killed_mid_stream_hands_the_stream_to_the_other_decode_worker(
        cluster: PDCluster, tenant: Tenant) -> None:
    with _http(cluster.url, tenant) as http:
        reference = http.post("/v1/chat/completions", json=_body(False)).json()
    assert reference["usage"]["completion_tokens"] == MAX_TOKENS, "the reference must outlast the kill"
    killed: list[tuple[str, Future[float]]] = []
    got: list[Event] = []
    with ThreadPoolExecutor(max_workers=1) as watcher, _http(cluster.url, tenant) as http, \
            http.stream("POST", "/v1/chat/completions", json=_body(True)) as r:
        assert r.status_code == 200
        for event in events(r.iter_lines()):
            got.append(event)
            if len(got) == 6:
                victim = cluster.busy_decoder()
                cluster.kill(victim)
                killed.append((victim, watcher.submit(_seconds_until_unlisted, cluster, victim, time.monotonic())))
    assert killed, "the stream ended before the kill"
    victim, dropped_after = killed[0]
    # The gateway reported the death: the scheduler dropped the worker from its list before the heartbeat
    # deadline could have (well inside its 10 s, or it would prove nothing). Timed when the worker left the
    # list, not when the migrated stream ended: on a slow host the rest of the answer alone took 10 s.
    assert dropped_after.result() < 8.0
    assert cluster.listed() == {"worker-pd-p", *DECODERS} - {victim}
    assert _failure_reports(cluster.scheduler_metrics) == 1.0
    assert content(got) == reference["choices"][0]["message"]["content"]
    assert got[-1].data == "[DONE]" and not any("error" in e.json for e in got[:-1])
    chunks = [e.json for e in got[:-1]]
    assert len({c["id"] for c in chunks}) == 1  # one response id across the seam
    usage = reference["usage"]
    # The reference warmed the prefill worker's prefix cache: only the cached count may differ.
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [chunks[-1]["usage"][k] for k in counts] == [usage[k] for k in counts]
    assert billed(cluster.stack, chunks[0]["id"]) == [(usage["prompt_tokens"], usage["completion_tokens"])]
    assert migrations(cluster.url) == {"migrated": 1.0}

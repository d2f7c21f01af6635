"""A request's full path (docs/architecture.md): gateway -> scheduler Route -> decode worker -> remote
prefill over NIXL.

A scheduler, a prefill and a decode worker (registered with the scheduler) and a gateway that routes
through the scheduler, on the session's stack. The decode worker's metrics say where the prompt was
prefilled.
"""

from __future__ import annotations

import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from openai import OpenAI

from services.launcher.process import free_port
from services.launcher.supervisor import ChildSpec, listening
from tests.support.gateway_stack import MODEL, GatewayStack, Tenant, start_worker
from tests.support.required import require_module

require_module("nixl._api")  # the prefill -> decode hand-off: a missing nixl is an ERROR, never a skip


@dataclass(frozen=True)
class Disaggregated:
    url: str
    decode_metrics_port: int


@pytest.fixture(scope="module")
def disaggregated(gateway_stack: GatewayStack) -> Iterator[Disaggregated]:
    supervisor = gateway_stack.supervisor
    port = free_port()
    # least_loaded keeps the fixed remote-prefill threshold: this test is about the path, and the goodput
    # policy prices an idle CPU decode worker's own prefill cheaper than a hand-off (tested on its own in
    # tests/integration/scheduler/test_prefill_siting_process.py).
    supervisor.start(ChildSpec("scheduler", [sys.executable, "-m", "scheduler.adapters", "--host", "127.0.0.1",
                                             "--port", str(port), "--heartbeat-interval-s", "0.5",
                                             "--policy", "least_loaded"],
                               listening(port), ready_timeout_s=60))
    scheduler = f"127.0.0.1:{port}"
    prefill = start_worker(supervisor, "worker-prefill", "prefill", gateway_stack.model_dir, "--scheduler", scheduler)
    metrics_port = free_port()
    start_worker(supervisor, "worker-decode", "decode", gateway_stack.model_dir, "--scheduler", scheduler,
                 "--prefill-peers", prefill, "--metrics-port", str(metrics_port))
    _, url = gateway_stack.start_gateway("gateway-pd", BATON_SCHEDULER_ADDRESS=scheduler,
                                         BATON_WORKER_ADDRESSES="[]")
    yield Disaggregated(url, metrics_port)


def _remote_prefills(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r'baton_pd_prefill_path_total\{[^}]*path="remote"[^}]*\} (\S+)',
                                                       text))


def test_a_long_prompt_is_prefilled_remotely_and_streamed(disaggregated: Disaggregated, tenant: Tenant) -> None:
    client = OpenAI(base_url=f"{disaggregated.url}/v1", api_key=tenant.key, max_retries=0, timeout=60)
    before = _remote_prefills(disaggregated.decode_metrics_port)
    # Above the scheduler's remote-prefill threshold (256 uncached tokens).
    prompt = "Summarise this in one word: " + "the sea is calm and blue today. " * 45
    deadline = time.monotonic() + 20  # the workers' first heartbeats may still be on their way
    while True:
        try:
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=5, temperature=0,
                stream=True, stream_options={"include_usage": True}))
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _remote_prefills(disaggregated.decode_metrics_port) == before + 1


def test_n_choices_share_one_remote_prefill_with_the_co_located_logprobs(
        disaggregated: Disaggregated, gateway_stack: GatewayStack, tenant: Tenant) -> None:
    """n=3 through P/D: one remote prefill (the decode worker's metric), three choices, and each choice's
    tokens and logprobs equal the co-located (`both` worker) gateway's for the same seed."""
    prompt = "List three colours, then explain: " + "the sky over the quiet harbour is grey. " * 40
    ask = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, n=3, seed=77,
               temperature=1.0, logprobs=True, top_logprobs=2)
    pd = OpenAI(base_url=f"{disaggregated.url}/v1", api_key=tenant.key, max_retries=0, timeout=60)
    before = _remote_prefills(disaggregated.decode_metrics_port)
    reply = pd.chat.completions.create(**ask)  # type: ignore[call-overload]
    assert _remote_prefills(disaggregated.decode_metrics_port) == before + 1  # one prefill for all three
    with gateway_stack.openai(tenant.key) as co_located:
        reference = co_located.chat.completions.create(**ask)  # type: ignore[call-overload]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for got, want in zip(reply.choices, reference.choices, strict=True):
        lps, want_lps = got.logprobs.content, want.logprobs.content  # type: ignore[union-attr]
        assert [lp.token for lp in lps] == [lp.token for lp in want_lps] and len(lps) == 6
        for a, b in zip(lps, want_lps, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=2e-3) and len(a.top_logprobs) == 2
            assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
    # That seeded choices differ is checked where the prompt leaves the model room to (tests/unit/engine).

"""A request's full path (docs/architecture.md): gateway -> scheduler Route -> decode worker -> remote
prefill over NIXL.

A scheduler, a prefill and a decode worker (registered with the scheduler) and a gateway that routes
through the scheduler, on the session's stack. The decode worker's metrics say where the prompt was
prefilled.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from openai import OpenAI

from tests.support.gateway_stack import MODEL, GatewayStack, Tenant
from tests.support.required import require_module

require_module("nixl._api")  # the prefill -> decode hand-off: a missing nixl is an ERROR, never a skip


@dataclass(frozen=True)
class Disaggregated:
    url: str
    decode_metrics_url: str


@pytest.fixture(scope="module")
def disaggregated(gateway_stack: GatewayStack) -> Iterator[Disaggregated]:
    cluster = gateway_stack.start_disaggregated("scheduler", "worker-prefill", ["worker-decode"], "gateway-pd")
    assert cluster.gateway_url is not None
    yield Disaggregated(cluster.gateway_url, cluster.worker("worker-decode").metrics_url)


def _remote_prefills(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r'baton_pd_prefill_path_total\{[^}]*path="remote"[^}]*\} (\S+)',
                                                       text))


def test_a_long_prompt_is_prefilled_remotely_and_streamed(disaggregated: Disaggregated, tenant: Tenant) -> None:
    client = OpenAI(base_url=f"{disaggregated.url}/v1", api_key=tenant.key, max_retries=0, timeout=60)
    before = _remote_prefills(disaggregated.decode_metrics_url)
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
    assert _remote_prefills(disaggregated.decode_metrics_url) == before + 1


def test_n_choices_share_one_remote_prefill_with_the_co_located_logprobs(
        disaggregated: Disaggregated, gateway_stack: GatewayStack, tenant: Tenant) -> None:
    """n=3 through P/D: one remote prefill (the decode worker's metric), three choices, and each choice's
    tokens and logprobs equal the co-located (`both` worker) gateway's for the same seed."""
    prompt = "List three colours, then explain: " + "the sky over the quiet harbour is grey. " * 40
    ask = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, n=3, seed=77,
               temperature=1.0, logprobs=True, top_logprobs=2)
    pd = OpenAI(base_url=f"{disaggregated.url}/v1", api_key=tenant.key, max_retries=0, timeout=60)
    before = _remote_prefills(disaggregated.decode_metrics_url)
    reply = pd.chat.completions.create(**ask)  # type: ignore[call-overload]
    assert _remote_prefills(disaggregated.decode_metrics_url) == before + 1  # one prefill for all three
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

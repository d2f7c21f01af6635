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

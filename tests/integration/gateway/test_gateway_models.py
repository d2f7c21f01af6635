"""Two models behind one gateway, as real processes: a scheduler, a `both` worker of the default model
(SmolLM2-135M-Instruct) and one of `baton-tiny-random` served as "tiny", and two open-mode gateways
(enterprise and free) that serve both models.

Routing by model is checked on the workers themselves (their generated-token counters), not only in
the response's `model`. Degraded mode: the scheduler maps the default model to "tiny"
(`--degrade-model`) and is seeded with per-model profiles that say what this machine shows (the
135M model prefills in ~0.1 s + 3 ms a token on this CPU, the tiny one in a few ms); a free request
whose TTFT target (600 ms, for a ~1000-token prompt) only the tiny model meets is answered by it, the
response saying so.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from services.launcher.process import free_port
from services.launcher.supervisor import Supervisor
from tests.support.gateway_stack import CONTEXT_WINDOW, MODEL, start_gateway, start_worker
from tests.support.scheduler_process import SchedulerProcess

ROOT = Path(__file__).resolve().parents[3]
TINY = "tiny"
# ~1000-token prompts: ~2 s of prefill for the 135M model on this CPU, milliseconds of compute for the tiny
# one (its steps are Python overhead, ~0.1-0.2 s when the machine is loaded). The free target sits between.
# Two texts: the measured request must not hit the big worker's prefix cache (cached, it prefills fast).
FREE_TTFT_MS = 600
# Distinct warm-ups: a repeated one is a prefix-cache hit, a step that says nothing about long prompts.
WARMUP_PROMPTS = [f"Count to {n}, slowly. " * 150 for n in ("ten", "twelve", "twenty")]
LONG_PROMPT = "List the colours of the rainbow, one per line. " * 100
PROFILES = {
    MODEL: {"prefill_fixed_s": 0.09, "prefill_per_token_s": 3e-3, "decode_fixed_s": 0.06, "decode_per_seq_s": 5e-3},
    TINY: {"prefill_fixed_s": 0.002, "prefill_per_token_s": 2e-5, "decode_fixed_s": 0.002, "decode_per_seq_s": 1e-4},
}


@dataclass(frozen=True)
class TwoModels:
    enterprise_url: str
    free_url: str
    metrics: dict[str, str]  # model -> its worker's /metrics URL
    scheduler_metrics: str
    free_gateway_log: Path

    def generated(self) -> dict[str, int]:
        """Tokens each model's worker has generated since it started."""
        counts = {}
        for model, url in self.metrics.items():
            found = re.search(r'^baton_worker_tokens_total\{kind="generated"\} (\S+)$', _read(url), re.M)
            counts[model] = int(float(found.group(1))) if found else 0
        return counts

    def decisions(self) -> dict[str, int]:
        """The scheduler's decisions so far, by kind and reason, e.g. {'degrade/degraded_model': 1}."""
        found = re.findall(r'^baton_scheduler_decisions_total\{kind="(\w+)",reason="(\w+)"\} (\S+)$',
                           _read(self.scheduler_metrics), re.M)
        return {f"{kind}/{reason}": int(float(count)) for kind, reason, count in found}


def _read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[TwoModels]:
    from engine.loader.tiny import tiny_model_dir

    tiny_model_dir(default_model_dir.parents[1])  # prepared before the worker and the gateways read it
    logs = tmp_path_factory.mktemp("two-models")
    (logs / "profiles.json").write_text(json.dumps(PROFILES))
    scheduler = SchedulerProcess(logs / "scheduler.log", "goodput", "--profile", str(logs / "profiles.json"),
                                 "--degrade-model", f"{MODEL}={TINY}").start()
    supervisor = Supervisor(logs, cwd=ROOT)
    try:
        metrics = {MODEL: free_port(), TINY: free_port()}
        start_worker(supervisor, "worker-big", "both", default_model_dir, "--scheduler", scheduler.address,
                     "--metrics-port", str(metrics[MODEL]))
        start_worker(supervisor, "worker-tiny", "both", Path("baton-tiny-random"), "--model-id", TINY,
                     "--scheduler", scheduler.address, "--metrics-port", str(metrics[TINY]))
        scheduler.wait_workers({"worker-big", "worker-tiny"})
        env = {"BATON_AUTH_MODE": "none", "BATON_SCHEDULER_ADDRESS": scheduler.address,
               "BATON_MODEL": str(default_model_dir), "BATON_SERVED_MODEL_NAME": MODEL,
               "BATON_EXTRA_MODELS": json.dumps({TINY: "baton-tiny-random"}),
               "BATON_CACHE_DIR": str(default_model_dir.parents[1]),
               "BATON_MAX_MODEL_LEN": str(CONTEXT_WINDOW), "PYTHONUNBUFFERED": "1"}
        _, enterprise = start_gateway(supervisor, "gateway-enterprise", env)
        _, free = start_gateway(supervisor, "gateway-free", {
            **env, "BATON_ANONYMOUS_TIER": "free",
            "BATON_SLOS": json.dumps({"free": {"ttft_ms": FREE_TTFT_MS, "tpot_ms": 1000}})})
        yield TwoModels(enterprise, free, {m: f"http://127.0.0.1:{p}/metrics" for m, p in metrics.items()},
                        f"http://127.0.0.1:{scheduler.metrics_port}/metrics", logs / "gateway-free.log")
    finally:
        supervisor.stop_all()
        scheduler.kill()


def _chat(url: str, model: str, max_tokens: int = 4, prompt: str = "Count to ten.") -> tuple[str, int]:
    with OpenAI(base_url=f"{url}/v1", api_key="open", max_retries=0, timeout=120) as client:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage is not None
    return reply.model, reply.usage.completion_tokens


def test_models_lists_both_models(two_models: TwoModels) -> None:
    listed = httpx.get(f"{two_models.enterprise_url}/v1/models", timeout=10).json()
    assert [(m["id"], m["context_window"]) for m in listed["data"]] == [(MODEL, CONTEXT_WINDOW), (TINY, 2048)]
    assert httpx.get(f"{two_models.enterprise_url}/v1/models/{TINY}", timeout=10).json()["id"] == TINY


def test_each_request_runs_only_on_its_own_models_worker(two_models: TwoModels) -> None:
    for model in (TINY, MODEL):
        before = two_models.generated()
        answered_by, tokens = _chat(two_models.enterprise_url, model)
        after = two_models.generated()
        assert (answered_by, tokens) == (model, 4)
        assert {m: after[m] - before[m] for m in after} == {m: 4 if m == model else 0 for m in after}


def test_an_unknown_model_is_a_404_model_not_found(two_models: TwoModels) -> None:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    reply = httpx.post(f"{two_models.enterprise_url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert MODEL in error["message"] and TINY in error["message"]


def test_a_free_request_the_big_model_cannot_serve_in_time_is_answered_by_the_tiny_one(two_models: TwoModels) -> None:
    # The scheduler refits each worker's cost model from its real steps: both first prefill a long prompt
    # (enterprise requests, never degraded), so neither is judged from short prompts alone. Before this,
    # a short cached prompt and a 150 ms target made the outcome depend on the machine's load: the big
    # model was predicted in time, or the tiny one (slowed by a busy CPU) was not (~1 run in 8). The
    # tiny one gets two distinct long prompts, so one slow step (a busy CPU) is not its whole fit.
    for model, prompt in ((MODEL, WARMUP_PROMPTS[0]), (TINY, WARMUP_PROMPTS[1]), (TINY, WARMUP_PROMPTS[2])):
        assert _chat(two_models.enterprise_url, model, max_tokens=2, prompt=prompt)[0] == model
    before, decided = two_models.generated(), two_models.decisions()
    answered_by, tokens = _chat(two_models.free_url, MODEL, max_tokens=6, prompt=LONG_PROMPT)
    after = two_models.generated()
    # What to look at if it fails: the scheduler's decision, and whether the gateway reached it at all.
    why = {k: n - decided.get(k, 0) for k, n in two_models.decisions().items() if n != decided.get(k, 0)}
    outage = [line for line in two_models.free_gateway_log.read_text().splitlines() if "scheduler" in line]
    assert (answered_by, tokens) == (TINY, 6), f"the scheduler decided {why}; free gateway: {outage}"
    assert (after[TINY] - before[TINY], after[MODEL] - before[MODEL]) == (6, 0)

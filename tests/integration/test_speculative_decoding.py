"""Speculative decoding on the default model (SmolLM2-135M-Instruct): the output does not change.

Greedy decoding with n-gram drafts must give exactly the tokens of greedy decoding without them, in a
continuous batch that mixes requests with and without speculation; a seeded sampled request draws
the same tokens either way (each verified row uses the noise of its output position); a stop token
inside an accepted draft ends the request there. Copy-heavy prompts must actually accept drafts.
"""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams

PASSAGE = ("Baton is a disaggregated prefill and decode serving cluster written in Python. A prompt is "
           "prefilled on a compute-bound prefill worker, its KV cache is handed over to a bandwidth-bound "
           "decode worker, and tokens stream back through an OpenAI-compatible gateway.")
TASKS = [
    f"Repeat the following text exactly:\n\n{PASSAGE}",
    f"Fix the grammar of this text and return it in full:\n\n{PASSAGE.replace('is a', 'are a')}",
    "Write a haiku about the sea.",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(default_model_dir), cache=CacheConfig(num_blocks=256)))


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    assert engine.tokenizer is not None
    return [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TASKS]


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def greedy(k: int, max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_draft_tokens=k)


@pytest.fixture(scope="module")
def baseline(engine, prompts) -> list[list[int]]:
    return run(engine, prompts, [greedy(0)] * len(prompts))


def test_greedy_with_speculation_equals_greedy_without(engine, prompts, baseline) -> None:
    before = engine.spec_stats.accepted_tokens
    assert run(engine, prompts, [greedy(4), greedy(0), greedy(6)]) == baseline
    assert engine.spec_stats.accepted_tokens - before >= NEW_TOKENS // 2  # the copy task copies


def test_each_steps_stats_carry_its_drafts_and_count_verify_chunks_as_decodes(engine, prompts) -> None:
    """What the worker's `baton_spec_*` counters and the scheduler's step samples are fed from."""
    totals = (engine.spec_stats.verify_chunks, engine.spec_stats.draft_tokens, engine.spec_stats.accepted_tokens)
    engine.add_request("stats", prompts[0], greedy(4))
    steps = []
    while engine.has_unfinished():
        engine.step()
        steps.append(engine.last_step)
    per_step = [s.speculation for s in steps if s is not None]
    summed = tuple(sum(getattr(x, f) for x in per_step) for f in ("verify_chunks", "draft_tokens", "accepted_tokens"))
    after = (engine.spec_stats.verify_chunks, engine.spec_stats.draft_tokens, engine.spec_stats.accepted_tokens)
    assert summed == tuple(a - b for a, b in zip(after, totals, strict=True))
    assert summed[0] > 0 and summed[2] > 0
    verify_steps = [s for s in steps if s is not None and s.speculation.verify_chunks]
    assert all(s.prefill_tokens == 0 and s.decode_seqs == 1 for s in verify_steps)  # not mistaken for prefill


def test_worker_metrics_export_the_speculation_counters() -> None:
    from prometheus_client import generate_latest

    from engine.step_stats import SpeculationStats, StepStats
    from services.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics("decode")
    metrics.observe_step(StepStats(0, 0, 2, 300, 0.01, SpeculationStats(verify_chunks=2, draft_tokens=8,
                                                                        accepted_tokens=5)))
    metrics.observe_step(StepStats(0, 0, 2, 302, 0.01))  # no drafts this step
    text = generate_latest(metrics.registry).decode()
    for line in ("baton_spec_verify_chunks_total 2.0", "baton_spec_draft_tokens_total 8.0",
                 "baton_spec_accepted_tokens_total 5.0"):
        assert line in text


def test_server_default_applies_to_requests_that_do_not_choose(default_model_dir, prompts, baseline) -> None:
    config = EngineConfig(model=str(default_model_dir), cache=CacheConfig(num_blocks=256),
                          speculative=SpeculativeConfig(num_draft_tokens=4))
    spec_engine = LLMEngine(config)
    unset = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert run(spec_engine, prompts[:1], [unset]) == baseline[:1]
    assert spec_engine.spec_stats.verify_chunks > 0


def test_seeded_sampling_draws_the_same_tokens_with_speculation(engine, prompts) -> None:
    def seeded(k: int) -> SamplingParams:
        return SamplingParams(max_tokens=32, temperature=0.7, seed=11, ignore_eos=True, num_draft_tokens=k)

    assert run(engine, prompts[:1], [seeded(4)]) == run(engine, prompts[:1], [seeded(0)])


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there(engine, prompts, baseline) -> None:
    copy = baseline[0]
    stop_at = next(i for i in range(8, len(copy)) if copy[i] not in copy[:i])  # first occurrence only
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, num_draft_tokens=8,
                            stop_token_ids=(copy[stop_at],))
    engine.add_request("stop", prompts[0], params)
    tokens, reasons = [], []
    while engine.has_unfinished():
        for o in engine.step():
            tokens.extend(o.new_token_ids)
            reasons.append(o.finish_reason)
    assert tokens == copy[:stop_at + 1]
    assert reasons[-1] is FinishReason.STOP


def test_max_tokens_is_exact_with_drafts(engine, prompts, baseline) -> None:
    assert run(engine, prompts[:1], [greedy(8, max_tokens=13)]) == [baseline[0][:13]]

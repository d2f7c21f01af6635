"""n > 1 under disaggregation on one engine (CPU, default model): a held prefill samples every choice's
first token, the decode side commits the landed KV once and forks the choices, which share the prompt
blocks by reference and copy the partly filled last one on write. The hand-off is a manual block copy
(as tests/unit/worker/test_engine_hold.py); the real KV link is tested in tests/integration."""

from __future__ import annotations

import dataclasses

import pytest

from engine.batch import SampledToken
from engine.choices import ChoiceFork
from engine.config import CacheConfig, EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

N = 3
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, logprobs=2)


def _choice(i: int, base: SamplingParams = SAMPLED) -> SamplingParams:
    return dataclasses.replace(base, seed=None if base.seed is None else base.seed + i)


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(default_model_dir), cache=CacheConfig(num_blocks=64)))


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    tokens = engine.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers in Europe, please."}])
    if len(tokens) % engine.block_manager.block_size == 0:  # the last prompt block must be partly filled
        tokens = tokens + engine.tokenizer.encode(" Thanks")
    return tokens


def _drain(engine: LLMEngine) -> list[RequestOutput]:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def _handoff(engine: LLMEngine, prompt: list[int], params: list[SamplingParams], rid: str = "c") -> list[RequestOutput]:
    """Prefill held (choice 0's request with the siblings' samplings), copy the KV into a reservation,
    commit with the siblings forked. Returns the commit's outputs (one per choice)."""
    engine.add_request(f"{rid}-pre", prompt, params[0], hold_for_s=30.0, choice_samplings=tuple(params[1:]))
    [held_out] = _drain(engine)
    assert held_out.held is not None and len(held_out.choice_first) == len(params) - 1
    block_ids, cached = engine.reserve_remote(f"{rid}0", prompt, params[0])
    bs, kv = engine.block_manager.block_size, engine.runner.kv_cache
    todo = range(cached // bs, -(-len(prompt) // bs))
    kv[[block_ids[i] for i in todo]] = kv[[held_out.held.block_ids[i] for i in todo]]
    engine.release_held(f"{rid}-pre")
    forks = tuple(ChoiceFork(f"{rid}{i}", p, first) for i, (p, first) in
                  enumerate(zip(params[1:], held_out.choice_first, strict=True), start=1))
    first_lp = held_out.logprobs[0] if held_out.logprobs else None
    return engine.commit_remote(f"{rid}0", held_out.new_token_ids[0], first_lp, forks)


def _by_request(outs: list[RequestOutput]) -> dict[str, list[RequestOutput]]:
    grouped: dict[str, list[RequestOutput]] = {}
    for o in outs:
        grouped.setdefault(o.request_id, []).append(o)
    return grouped


def _alone(engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str) -> list[RequestOutput]:
    engine.add_request(rid, prompt, params)
    return [o for o in _drain(engine) if o.request_id == rid]


def test_forked_choices_share_the_prompt_blocks_and_copy_the_last_on_write(engine, prompt):
    bm = engine.block_manager
    baseline = bm.num_free_blocks
    params = [_choice(i, dataclasses.replace(SAMPLED, seed=7)) for i in range(N)]
    _handoff(engine, prompt, params)
    tables = [engine.batcher.get(f"c{i}").block_ids for i in range(N)]
    prompt_blocks = bm.blocks_for(len(prompt))
    assert all(t[:prompt_blocks] == tables[0][:prompt_blocks] for t in tables)
    assert all(bm.ref_count(b) == N for b in tables[0][:prompt_blocks])
    # Only the reservation's blocks are used (prompt + the one extra slot): no copy of the prompt per choice.
    assert baseline - bm.num_free_blocks == bm.blocks_for(len(prompt) + 1)
    last = tables[0][prompt_blocks - 1]
    plan = engine.batcher.schedule()
    assert len(plan.block_copies) == N - 1 and all(src == last for src, _ in plan.block_copies)
    result = engine.runner.execute(plan)
    engine.batcher.postprocess(plan, result)
    for i in range(N):  # every choice now writes into a block of its own
        assert bm.ref_count(engine.batcher.get(f"c{i}").block_ids[prompt_blocks - 1]) == 1
    assert baseline - bm.num_free_blocks == (prompt_blocks - 1) + N  # shared full blocks + one tail each
    for i in range(N):
        engine.abort(f"c{i}")
    assert bm.num_free_blocks == baseline


def test_each_choice_equals_that_choice_run_alone(engine, prompt):
    params = [_choice(i, dataclasses.replace(SAMPLED, seed=1234)) for i in range(N)]
    outs = _by_request(_handoff(engine, prompt, params, "s") + _drain(engine))
    texts = []
    for i, p in enumerate(params):
        alone = _alone(engine, prompt, p, f"alone{i}")
        got = outs[f"s{i}"]
        assert [t for o in got for t in o.new_token_ids] == [t for o in alone for t in o.new_token_ids]
        lps, alone_lps = [lp for o in got for lp in o.logprobs], [lp for o in alone for lp in o.logprobs]
        assert len(lps) == len(alone_lps) == SAMPLED.max_tokens
        for a, b in zip(lps, alone_lps, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        texts.append("".join(o.new_text for o in got))
    assert len(set(texts)) > 1  # derived seeds: the choices differ


def test_greedy_choices_are_identical(engine, prompt):
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = _by_request(_handoff(engine, prompt, [greedy] * N, "g") + _drain(engine))
    tokens = [[t for o in outs[f"g{i}"] for t in o.new_token_ids] for i in range(N)]
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 5


@pytest.mark.parametrize("aborted", [(1,), (0,), (0, 1, 2)])
def test_aborting_choices_returns_the_pool_to_baseline(engine, prompt, aborted):
    bm = engine.block_manager
    baseline = bm.num_free_blocks
    params = [_choice(i, dataclasses.replace(SAMPLED, seed=99, max_tokens=12)) for i in range(N)]
    _handoff(engine, prompt, params, "a")
    engine.step()
    for i in aborted:
        assert engine.abort(f"a{i}")
    outs = _by_request(_drain(engine))
    for i in set(range(N)) - set(aborted):  # the others still run to their end
        assert sum(len(o.new_token_ids) for o in outs[f"a{i}"]) == 12 - 2  # first + one step before the abort
    assert bm.num_free_blocks == baseline and engine.batcher.num_unfinished == 0


def test_a_bad_fork_commits_nothing(engine, prompt):
    bm = engine.block_manager
    baseline = bm.num_free_blocks
    engine.reserve_remote("b0", prompt, SAMPLED)
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.commit_remote("b0", 1, None, (ChoiceFork("b0", SAMPLED, SampledToken(2)),))
    assert engine.batcher.get("b0") is not None and engine.batcher.get("b0").num_output_tokens == 0
    engine.abort("b0")
    assert bm.num_free_blocks == baseline

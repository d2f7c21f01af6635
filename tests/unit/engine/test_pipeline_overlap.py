"""Pipeline parallelism across steps on CPU (2 stages over gloo): the engine keeps two batches of
disjoint sequences in flight, and its greedy tokens are PP=1's.

Both models (a tiny random one, the default model) run the same scenario: requests of different
prompt lengths and max_tokens (so batches interleave and finish at different steps), one stopped by a
stop token, two more added while the first ones run, and (PP=2 only) one aborted while its batch is in
flight. The tight pool also preempts sequences while other batches are in flight.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_pipeline_parallel import CONFIG
from test_tensor_parallel import write_dummy_model

from engine.config import CacheConfig, EngineConfig, ParallelConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PP2 = ParallelConfig(pipeline_parallel_size=2, timeout_s=120)
PP2_NO_OVERLAP = dataclasses.replace(PP2, pipeline_overlap=False)


@dataclass(frozen=True)
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    stop: tuple[int, ...] = ()
    drafts: int = 0  # n-gram speculation: a decode may carry a draft to verify

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, stop_token_ids=list(self.stop),
                              ignore_eos=True, num_draft_tokens=self.drafts)


@dataclass
class Run:
    """What `drive` saw: every request's tokens; after each step, the requests it gave outputs for and
    the plans still in flight."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    outputs: list[set[str]] = field(default_factory=list)
    in_flight: list[list[tuple[str, ...]]] = field(default_factory=list)
    aborted_in_flight: bool = False
    preemptions: int = 0
    draft_tokens: int = 0


def drive(engine: LLMEngine, first: list[Req], later: list[Req], abort: str | None = None) -> Run:
    """`first` at once, `later` after two steps; `abort` once it has two tokens and its batch is in flight."""
    run = Run()
    for r in first:
        engine.add_request(r.rid, r.prompt, r.params())
        run.tokens[r.rid] = []
    steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        for out in outputs:
            run.tokens[out.request_id].extend(out.new_token_ids)
        steps += 1
        run.outputs.append({out.request_id for out in outputs})
        run.in_flight.append(engine.batcher.in_flight_request_ids())
        if steps == 2:
            for r in later:
                engine.add_request(r.rid, r.prompt, r.params())
                run.tokens[r.rid] = []
        flying = {rid for plan in run.in_flight[-1] for rid in plan}
        if abort is not None and abort in flying and len(run.tokens[abort]) >= 2 and not run.aborted_in_flight:
            run.aborted_in_flight = engine.abort(abort)
    run.preemptions = engine.batcher.num_preemptions
    run.draft_tokens = engine.spec_stats.draft_tokens
    return run


def until_stop(tokens: list[int], stop: tuple[int, ...]) -> list[int]:
    """PP=1's tokens of a request run without its stop token, cut after the stop token's first occurrence."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1]
    return tokens


def check_scenario(config: EngineConfig, first: list[Req], later: list[Req], parallel: ParallelConfig = PP2) -> Run:
    """PP=1 (no stop token, no abort) then `parallel` with overlap; returns that run after checking its tokens."""
    engine = LLMEngine(config)
    try:
        reference = drive(engine, first, later)
    finally:
        engine.shutdown()
    assert not any(plans for plans in reference.in_flight)  # PP=1: one step at a time, nothing left in flight
    stop_req = first[1]
    stop = (reference.tokens[stop_req.rid][2],)  # a token it samples mid-way
    first = [dataclasses.replace(stop_req, stop=stop) if r is stop_req else r for r in first]
    aborted = later[0].rid
    engine = LLMEngine(dataclasses.replace(config, parallel=parallel))
    try:
        got = drive(engine, first, later, abort=aborted)
        assert engine.batcher.num_in_flight == 0 and engine.block_manager.num_free_blocks == engine.runner.num_blocks
    finally:
        engine.shutdown()
    assert got.aborted_in_flight
    assert got.tokens[aborted] == reference.tokens[aborted][:len(got.tokens[aborted])]
    for r in first + later[1:]:
        expected = until_stop(reference.tokens[r.rid], r.stop)
        assert got.tokens[r.rid] == expected, r.rid
    assert len(got.tokens[stop_req.rid]) < stop_req.max_tokens  # the stop token ended it early
    return got


def tiny_requests() -> tuple[list[Req], list[Req]]:
    prompt = [(7 * i + 3) % CONFIG.vocab_size for i in range(40)]
    first = [Req("a", prompt[:3], 9), Req("b", prompt[5:17], 12), Req("c", prompt[2:9], 5),
             Req("d", prompt[20:25], 14, drafts=3)]
    later = [Req("e", prompt[10:30], 10), Req("f", prompt[30:34], 7)]
    return first, later


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_blocks", [64, 9], ids=["roomy-pool", "tight-pool-preempts"])
def test_pp2_overlap_gives_pp1_tokens_on_a_tiny_model_with_two_batches_in_flight(tmp_path: Path,
                                                                               num_blocks: int) -> None:
    config = EngineConfig(model=str(write_dummy_model(tmp_path, CONFIG)), load_format="dummy", seed=3,
                          dtype="float32", cache=CacheConfig(block_size=4, num_blocks=num_blocks))
    got = check_scenario(config, *tiny_requests())
    assert (got.preemptions > 0) == (num_blocks == 9)
    assert got.draft_tokens > 0  # "d" verified drafts in batches in flight
    # The overlap itself: a step returns the outputs of one batch while a batch of other sequences,
    # submitted in that same step, is still in flight: two batches were in flight at once.
    overlapped = [(done, plans[0]) for done, plans in zip(got.outputs, got.in_flight, strict=True) if done and plans]
    assert len(overlapped) > len(got.outputs) // 3
    assert all(len(plans) <= 1 for plans in got.in_flight)  # P - 1 after each step: the depth is P
    assert all(not done & set(flying) for done, flying in overlapped)


@pytest.mark.timeout(300)
def test_tp2_by_pp2_overlap_gives_pp1_tokens_on_a_tiny_model(tmp_path: Path) -> None:
    """4 ranks: each stage's 2 tensor ranks run the same plan of the window; the last stage's tensor
    rank 0 sends the logits."""
    config = EngineConfig(model=str(write_dummy_model(tmp_path, CONFIG)), load_format="dummy", seed=3,
                          dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64))
    got = check_scenario(config, *tiny_requests(), parallel=dataclasses.replace(PP2, tensor_parallel_size=2))
    assert any(done and plans for done, plans in zip(got.outputs, got.in_flight, strict=True))


@pytest.mark.timeout(240)
def test_pp2_without_overlap_runs_one_step_at_a_time(tmp_path: Path) -> None:
    """The fallback (`pipeline_overlap=False`): each step goes through both stages before the next."""
    config = EngineConfig(model=str(write_dummy_model(tmp_path, CONFIG)), load_format="dummy", seed=3,
                          dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64), parallel=PP2_NO_OVERLAP)
    engine = LLMEngine(config)
    try:
        assert engine.runner.pipeline_depth == 1
        first, later = tiny_requests()
        got = drive(engine, first, later)
    finally:
        engine.shutdown()
    assert not any(plans for plans in got.in_flight)
    assert all(len(got.tokens[r.rid]) == r.max_tokens for r in first + later)


@pytest.mark.timeout(600)
def test_pp2_overlap_gives_pp1_tokens_on_the_default_model(default_model_dir: Path) -> None:
    from tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    questions = ["What is the capital of France?", "Name three colours of the rainbow and say why the sky is blue.",
                 "Hi!", "Write one sentence about the sea.", "Count from one to five.", "What is 2 + 2?"]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    first = [Req(f"q{i}", p, n) for i, (p, n) in enumerate(zip(prompts[:4], (6, 10, 4, 8), strict=True))]
    later = [Req("q4", prompts[4], 9), Req("q5", prompts[5], 5)]
    config = EngineConfig(model=str(default_model_dir), cache=CacheConfig(num_blocks=64))
    check_scenario(config, first, later)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parallel", [None, PP2], ids=["pp1", "pp2-overlap"])
def test_a_failed_step_drops_its_batches_and_the_other_requests_go_on(tmp_path: Path,
                                                                      parallel: ParallelConfig | None) -> None:
    """A grammar-constrained request fails its step: the sampler raises when its batch is sampled (the
    model has no tokenizer). At PP=2 that is when the batch leaves the pipeline, while the batch
    submitted in the same round is still in it. The engine drops every batch in flight (the one still
    in the pipeline leaves it a round later and records nothing); once the bad request is aborted, the
    others get exactly the tokens of a run that never had it."""
    from engine.structured.constraint import GrammarKind, GuidedDecoding

    config = EngineConfig(model=str(write_dummy_model(tmp_path, CONFIG)), load_format="dummy", seed=3,
                          dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64))
    first, later = tiny_requests()
    clean = LLMEngine(config)
    try:
        expected = drive(clean, first, later).tokens
    finally:
        clean.shutdown()
    engine = LLMEngine(config if parallel is None else dataclasses.replace(config, parallel=parallel))
    try:
        for r in first + later:
            engine.add_request(r.rid, r.prompt, r.params())
        engine.add_request("bad", first[0].prompt, SamplingParams(guided=GuidedDecoding(GrammarKind.JSON_OBJECT)))
        got: dict[str, list[int]] = {r.rid: [] for r in first + later}
        with pytest.raises(ValueError, match="needs the model's tokenizer"):
            while True:
                for out in engine.step():
                    got[out.request_id].extend(out.new_token_ids)
        assert engine.batcher.num_in_flight == 0
        assert engine.abort("bad")
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
        assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    finally:
        engine.shutdown()
    assert got == expected

"""Datasets: exact prompt lengths, multi-turn prefix sharing, ShareGPT streaming and sampling."""

from __future__ import annotations

import io
import json
import math

import pytest
from bench_fakes import FakeClient

from loadtest.datasets import DatasetConfig, LengthDistribution, build_sessions
from loadtest.runner import BenchRunner, RunConfig
from loadtest.sharegpt import iter_records
from loadtest.tokens import PromptTokenizer, WordTokenizer


@pytest.mark.parametrize("spec", ["1", "37", "700"])
def test_random_prompts_have_exactly_the_asked_token_count(engine_tokenizer: PromptTokenizer, spec: str) -> None:
    config = DatasetConfig("random", num_prompts=5, input_len=LengthDistribution.parse(spec))
    for s in build_sessions(config, engine_tokenizer):
        (turn,) = s.turns
        assert turn.prompt_len == int(spec)
        assert engine_tokenizer.count(turn.messages[0]["content"]) == int(spec)


def test_distributed_lengths_are_exact_per_prompt_and_seeded(engine_tokenizer: PromptTokenizer) -> None:
    config = DatasetConfig("random", num_prompts=20, seed=5, input_len=LengthDistribution.parse("uniform:10:90"),
                           output_len=LengthDistribution.parse("lognormal:64:0.5"))
    first = build_sessions(config, engine_tokenizer)
    lengths = [s.turns[0].prompt_len for s in first]
    assert len(set(lengths)) > 5 and all(10 <= n <= 90 for n in lengths)
    assert all(engine_tokenizer.count(s.turns[0].messages[0]["content"]) == s.turns[0].prompt_len for s in first)
    assert build_sessions(config, engine_tokenizer) == first


@pytest.mark.parametrize(("spec", "lo", "hi", "mean"), [
    ("uniform:100:200", 100, 200, 150), ("normal:500:50", 300, 700, 500), ("lognormal:100:0.3", 30, 400, 104.6)])
def test_length_distributions(spec: str, lo: int, hi: int, mean: float) -> None:
    import random

    dist, rng = LengthDistribution.parse(spec), random.Random(0)
    values = [dist.sample(rng) for _ in range(4000)]
    assert lo <= min(values) and max(values) <= hi
    assert sum(values) / len(values) == pytest.approx(mean, rel=0.03)


@pytest.mark.parametrize("spec", ["", "0", "gauss:1:2", "uniform:9:3", "normal:1"])
def test_bad_length_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        LengthDistribution.parse(spec)


def test_word_tokenizer_is_an_approximation_that_says_so() -> None:
    config = DatasetConfig("random", num_prompts=2, input_len=LengthDistribution.parse("12"))
    tok = WordTokenizer()
    (s, _) = build_sessions(config, tok)
    assert tok.kind == "words" and len(s.turns[0].messages[0]["content"].split()) == 12


def multiturn(tokenizer: PromptTokenizer, **kw) -> list:  # noqa: ANN003
    config = DatasetConfig("multiturn", num_prompts=6, num_turns=3, system_prompt_len=40, num_system_prompts=2,
                           input_len=LengthDistribution.parse("8"), output_len=LengthDistribution.parse("5"), **kw)
    return build_sessions(config, tokenizer)


def test_multiturn_conversations_share_system_prompts(engine_tokenizer: PromptTokenizer) -> None:
    sessions = multiturn(engine_tokenizer)
    assert [len(s.turns) for s in sessions] == [3] * 6
    assert len({s.system_prompt for s in sessions}) == 2
    assert sessions[0].system_prompt == sessions[2].system_prompt == sessions[4].system_prompt
    assert all(engine_tokenizer.count(s.system_prompt) == 40 == s.system_prompt_len for s in sessions)


async def test_multiturn_turns_extend_the_previous_prompt_and_answer(engine_tokenizer: PromptTokenizer) -> None:
    client = FakeClient()
    result = await BenchRunner(client, RunConfig(math.inf, progress=False)).run(multiturn(engine_tokenizer))
    by_conv: dict[str, list] = {}
    for messages in client.sent:
        by_conv.setdefault(messages[0]["content"] + messages[1]["content"], []).append(messages)
    assert len(by_conv) == 6
    for turns in by_conv.values():
        assert [len(m) for m in turns] == [2, 4, 6]  # system + user, then + answer + user per turn
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt[: len(prev)] == prev
            assert nxt[len(prev)]["role"] == "assistant" and nxt[len(prev)]["content"].startswith(" answer")
    third = next(r for r in result.records if r.turn == 2)
    assert third.prompt_len == 40 + 3 * 8 + 2 * 3  # system + three user turns + two 3-token answers


async def test_a_failed_turn_skips_the_rest_of_its_conversation_as_misses(engine_tokenizer) -> None:  # noqa: ANN001
    client = FakeClient(fail={0})
    result = await BenchRunner(client, RunConfig(math.inf, max_concurrency=1, progress=False)).run(
        multiturn(engine_tokenizer))
    assert len(result.records) == 18 and len(client.sent) == 16
    assert sorted(str(r.error) for r in result.records if not r.ok) == ["http_503", "skipped", "skipped"]


def test_sharegpt_loads_n_filtered_records(engine_tokenizer: PromptTokenizer) -> None:
    config = DatasetConfig("sharegpt", num_prompts=25, seed=1)
    sessions = build_sessions(config, engine_tokenizer)
    assert len(sessions) == 25
    prompts = {s.turns[0].messages[0]["content"] for s in sessions}
    assert len(prompts) == 25  # enough records pass the filters: no repeats
    for s in sessions:
        t = s.turns[0]
        assert 4 <= t.prompt_len <= 1024 and t.output_len >= 4 and t.prompt_len + t.output_len <= 2048
        assert engine_tokenizer.count(t.messages[0]["content"]) == t.prompt_len
    assert build_sessions(config, engine_tokenizer) == sessions


def test_sharegpt_output_len_override(engine_tokenizer: PromptTokenizer) -> None:
    sessions = build_sessions(DatasetConfig("sharegpt", num_prompts=3, sharegpt_output_len=64), engine_tokenizer)
    assert [s.turns[0].output_len for s in sessions] == [64, 64, 64]


def test_record_reader_streams_across_blocks_and_stops_at_a_truncated_tail(monkeypatch) -> None:  # noqa: ANN001
    import loadtest.sharegpt as sharegpt

    monkeypatch.setattr(sharegpt, "READ_BLOCK", 7)  # force records and UTF-8 characters across reads
    records = [{"id": str(i), "conversations": [{"from": "human", "value": "héllo ✓ " * i}]} for i in range(5)]
    data = json.dumps(records, ensure_ascii=False).encode()
    assert list(iter_records(io.BytesIO(data))) == records
    assert list(iter_records(io.BytesIO(data[:-20]))) == records[:4]
    assert list(iter_records(io.BytesIO(data), max_records=2)) == records[:2]

"""Migration seams (services/gateway/completions/migration.py) on the default model's real tokenizer: the text a
migrated choice shows is exactly what one uninterrupted worker would have produced, and which worker
failures are taken over at all."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from scheduler.types import SLO, RequestSummary, Tier, WorkerRole
from services.gateway.completions.generation import FailureKind, GenerationDelta, SamplingSpec
from services.gateway.completions.migration import Continuation, first_attempt, next_attempt
from services.gateway.routing.last_view import KnownWorker, LastView
from tokenization.detokenizer import IncrementalDetokenizer
from tokenization.tokenizer import Tokenizer

TEXT = "Hello there! The café costs 5€ 🙂 — END of story; stop here. 日本語のテキスト END"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def one_worker(tokenizer: Tokenizer, prompt: list[int], output: list[int], stop: tuple[str, ...]) -> tuple[str, int]:
    """(text, tokens consumed) as a single worker's detokenizer streams them, flushed at the end."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    text, used = "", 0
    for token in output:
        text += detok.add(token)
        used += 1
        if detok.stopped:
            return text, used
    return text + detok.flush(), used


def migrated(tokenizer: Tokenizer, prompt: list[int], output: list[int], stop: tuple[str, ...],
             seam: int) -> tuple[str, int]:
    """The same, when the first worker died after `seam` tokens and the rest came from another one
    (its deltas one token at a time, the last one finishing)."""
    old = IncrementalDetokenizer(tokenizer, prompt, stop)
    text = ""
    for used, token in enumerate(output[:seam], 1):
        text += old.add(token)
        if old.stopped:  # finished before the seam: nothing to migrate
            return text, used
    continuation = Continuation(tokenizer, prompt, stop, output[:seam])
    used = seam
    for i, token in enumerate(output[seam:]):
        last = seam + i == len(output) - 1
        delta = continuation.translate(GenerationDelta((token,), "ignored", finish_reason="length" if last else None))
        text += delta.text
        used += len(delta.token_ids)
        if delta.finish_reason is not None:
            break
    return text, used


@pytest.mark.parametrize("stop", [(), ("END",), (" stop here",), ("🙂",)])
def test_the_text_across_any_seam_is_the_uninterrupted_text(tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
    prompt = tokenizer.encode("Say something.", add_special_tokens=False)
    output = tokenizer.encode(TEXT, add_special_tokens=False)
    expected = one_worker(tokenizer, prompt, output, stop)
    for seam in range(1, len(output)):
        assert migrated(tokenizer, prompt, output, stop, seam) == expected, f"seam after {seam} tokens"


def test_a_retry_keeps_the_request_and_a_migration_continues_it(tokenizer: Tokenizer) -> None:
    sampling = SamplingSpec(max_tokens=20, temperature=0.7, seed=42, stop=("x",))
    first = first_attempt("chatcmpl-1", [1, 2, 3], sampling)
    retry = next_attempt(first, "chatcmpl-1", [1, 2, 3], sampling, [], tokenizer)
    assert (retry.prompt_token_ids, retry.sampling, retry.migrated) == ([1, 2, 3], sampling, False)
    moved = next_attempt(retry, "chatcmpl-1", [1, 2, 3], sampling, [7, 8, 9, 10], tokenizer)
    assert moved.prompt_token_ids == [1, 2, 3, 7, 8, 9, 10] and moved.migrated
    assert (moved.sampling.max_tokens, moved.sampling.prior_output_tokens) == (16, 4)
    assert (moved.sampling.seed, moved.sampling.stop, moved.sampling.temperature) == (42, ("x",), 0.7)
    assert len({first.request_id, retry.request_id, moved.request_id}) == 3  # each attempt its own id


@pytest.mark.parametrize(("code", "kind"), [
    (grpc.StatusCode.UNAVAILABLE, FailureKind.WORKER_LOST),
    (grpc.StatusCode.INVALID_ARGUMENT, FailureKind.BAD_REQUEST),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, FailureKind.OVERLOADED),
    (grpc.StatusCode.INTERNAL, FailureKind.WORKER_FAILED),
])
def test_only_a_lost_worker_is_taken_over(code: grpc.StatusCode, kind: FailureKind) -> None:
    assert FailureKind.of(code) is kind


def test_the_last_view_routes_around_avoided_workers() -> None:
    view = LastView([KnownWorker("a:1", WorkerRole.DECODE), KnownWorker("b:1", WorkerRole.DECODE)])
    summary = RequestSummary("r", 10, (), Tier.FREE, SLO(1000, 100), 8)
    assert {view.pick(summary, 256, frozenset({"a:1"})) for _ in range(4)} == {("b:1", None)}
    assert view.pick(summary, 256, frozenset({"a:1", "b:1"})) is None

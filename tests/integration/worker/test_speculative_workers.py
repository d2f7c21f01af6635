"""Speculative decoding through the workers: a request's SamplingParams.num_draft_tokens crosses gRPC,
and on a `both` worker and through disaggregation (first token from the prefill worker, drafts on the
decode side) greedy output equals the output without speculation; every block comes back."""

from __future__ import annotations

import pytest
from worker_client import generate_many, request, wait_baseline

from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer

PASSAGE = ("The committee met on Tuesday to review the budget. The members agreed to increase funding for "
           "the public library by ten percent and to delay the road repairs until the spring.")
TASKS = [f"Repeat the following text exactly:\n\n{PASSAGE}",
         f"Rewrite the following text in the past tense, keeping everything else the same:\n\n{PASSAGE}"]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    tok = Tokenizer.from_dir(default_model_dir)
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in TASKS]


def spec_request(prompt: list[int], k: int) -> pb.GenerateRequest:
    req = request(prompt, NEW_TOKENS)
    req.sampling.num_draft_tokens = k
    return req


def test_speculative_greedy_equals_plain_greedy_on_both_and_disaggregated(cluster, prompts) -> None:
    plain = generate_many(cluster.both, [request(p, NEW_TOKENS) for p in prompts])
    both = generate_many(cluster.both, [spec_request(p, 4) for p in prompts])
    disagg = generate_many(cluster.decode, [spec_request(p, 4) for p in prompts])
    assert [r.code for r in plain + both + disagg] == [None] * 6
    assert [r.token_ids for r in both] == [r.token_ids for r in plain]
    assert [r.token_ids for r in disagg] == [r.token_ids for r in plain]
    assert [r.text for r in disagg] == [r.text for r in plain]
    assert [r.prefill_path for r in disagg] == [pb.PREFILL_PATH_REMOTE] * 2
    wait_baseline([cluster.decode, cluster.prefill, cluster.both])

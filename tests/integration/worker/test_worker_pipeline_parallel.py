"""Pipeline-parallel workers on CPU (2 stages over gloo, one process each, NIXL over DRAM): a `both`
worker, and a prefill worker of 2 stages handing each stage's layers' KV from that stage to a decode
worker of 2 stages (rank to rank) and to one of 1 stage (each stage's layers into their place in the
decode blocks), all give a single-process worker's greedy tokens; a stage's failed WRITE or an abort
mid-transfer frees every block on both sides."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from worker_client import (
    QUESTIONS,
    collect,
    fallbacks,
    generate,
    generate_many,
    metric,
    request,
    wait_baseline,
    wait_for,
)
from worker_procs import WorkerProcess, stop_workers, wait_all_serving

from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer

MAX_TOKENS = 8
NUM_BLOCKS = "128"
GROUP_START_S = 480.0  # 7 processes of the default model load at once; the test timeout (600 s) includes this
PP_ARGS = ("--pipeline-parallel-size", "2")
QUICK_S = 4.0  # shorter than the decode workers' 6 s quarantine: freed by the definite-end path
# Prompts above 64 tokens stream: a 64-token chunk's full blocks go as a part while the rest computes (the
# long prompts are over 96 tokens: more than a chunk after the template blocks the prefix caches hold).
# The other tests' prompts (< 64 tokens) are one chunk, prefilled and written at once as before.
STREAM_ARGS = ("--max-prefill-chunk", "64", "--kv-stream-min-prompt-tokens", "65")
STREAM_PARTS = "baton_kv_stream_parts_total"
LONG_QUESTIONS = tuple(q + " Please answer in plain words, with short sentences, and give one everyday example for "
                       "each point so that a reader who has never thought about it before can follow along easily "
                       "and explain it to a friend afterwards." for q in (
    "Describe, in a short paragraph for a curious ten year old, how a bicycle stays upright while it is moving, "
    "why it falls over when it stops, and what the rider does with the handlebars to keep balance on a windy day.",
    "Plan a relaxed three day walking trip through the old town of a European city you like: say where to sleep, "
    "which museums and markets to visit each morning, where to eat lunch and what to do in the evenings.",
    "Explain to a new gardener when and how deep to plant tulip bulbs, how much sun and water they need, what to "
    "do with the leaves after the flowers fade, and how to keep squirrels from digging the bulbs up in winter.",
))


def decode_args(prefill_address: str) -> list[str]:
    """As the session cluster's decode worker: prompts >= 8 tokens prefill remotely, short deadlines."""
    return ["--num-blocks", NUM_BLOCKS, "--prefill-peers", prefill_address, "--max-num-seqs", "8",
            "--min-remote-prompt-tokens", "8", "--min-remote-uncached-tokens", "4",
            "--transfer-timeout-s", "3", "--kv-quarantine-s", "6", "--prefill-timeout-s", "20",
            "--allow-fault-injection"]


class PPCluster:
    """The PP workers of this module, and the session's single-process `both` worker as their reference."""

    def __init__(self, model_dir, log_dir, reference: WorkerProcess) -> None:  # noqa: ANN001
        self.reference = reference
        self.both = WorkerProcess("both-pp2", "both", model_dir, log_dir, "--num-blocks", NUM_BLOCKS, *PP_ARGS).start()
        self.prefill = WorkerProcess("prefill-pp2", "prefill", model_dir, log_dir, "--num-blocks", NUM_BLOCKS,
                                     "--transfer-timeout-s", "3", "--allow-fault-injection", *STREAM_ARGS,
                                     *PP_ARGS).start()
        self.decode = WorkerProcess("decode-pp2", "decode", model_dir, log_dir, *decode_args(self.prefill.address),
                                    *PP_ARGS).start()
        self.merged = WorkerProcess("decode-pp1", "decode", model_dir, log_dir,
                                    *decode_args(self.prefill.address)).start()

    @property
    def own(self) -> list[WorkerProcess]:
        return [self.both, self.prefill, self.decode, self.merged]

    @property
    def workers(self) -> list[WorkerProcess]:
        return [*self.own, self.reference]


@pytest.fixture(scope="module")
def cluster(default_model_dir, worker_log_dir, both_worker) -> Iterator[PPCluster]:
    cluster = PPCluster(default_model_dir, worker_log_dir, both_worker)
    try:
        wait_all_serving(cluster.workers, GROUP_START_S)
        yield cluster
    finally:
        stop_workers(cluster.own)


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    tok = Tokenizer.from_dir(default_model_dir)
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:3] + QUESTIONS[4:5]]


@pytest.fixture(scope="module")
def reference(cluster, prompts) -> list[list[int]]:
    results = generate_many(cluster.reference, [request(p, MAX_TOKENS) for p in prompts])
    assert [r.code for r in results] == [None] * len(prompts)
    return [r.token_ids for r in results]


def test_both_worker_with_two_stages_gives_the_single_process_tokens(cluster, prompts, reference) -> None:
    got = generate_many(cluster.both, [request(p, MAX_TOKENS) for p in prompts])
    assert [r.code for r in got] == [None] * len(prompts)
    assert [r.token_ids for r in got] == reference
    assert all(len(t) == MAX_TOKENS for t in reference)


@pytest.mark.parametrize("decode_name", ["decode", "merged"], ids=["to-pp2", "to-pp1"])
def test_each_prefill_stage_hands_its_layers_to_the_decode_worker(cluster, prompts, reference, decode_name) -> None:
    decode = getattr(cluster, decode_name)
    results = generate_many(decode, [request(p, MAX_TOKENS) for p in prompts])
    assert [(r.prefill_path, r.fallback_reason) for r in results] == [(pb.PREFILL_PATH_REMOTE, "")] * len(prompts)
    assert [r.token_ids for r in results] == reference
    wait_baseline([decode, cluster.prefill])


@pytest.mark.parametrize("decode_name", ["decode", "merged"], ids=["to-pp2", "to-pp1"])
def test_a_failed_stage_write_recomputes_locally_and_frees_every_block(cluster, default_model_dir,
                                                                      decode_name) -> None:
    decode = getattr(cluster, decode_name)
    tok = Tokenizer.from_dir(default_model_dir)
    fresh = tok.encode_chat([{"role": "user", "content": QUESTIONS[5]}])  # not in the decode prefix cache
    expected = generate(cluster.reference, request(fresh, MAX_TOKENS)).token_ids
    cluster.prefill.stub.InjectFault(pb.InjectFaultRequest(fault="fail_shard_transfer"))
    result = generate(decode, request(fresh, MAX_TOKENS))
    assert (result.prefill_path, result.fallback_reason) == (pb.PREFILL_PATH_LOCAL_FALLBACK, "transfer_failed")
    assert result.token_ids == expected
    assert "rank 1 failed: injected fault: fail_transfer" in decode.log_path.read_text()
    wait_baseline([decode, cluster.prefill], timeout_s=QUICK_S)


@pytest.mark.parametrize(("decode_name", "fault", "question"), [
    ("decode", "corrupt_destination", "Name a famous painting."),  # stage 0's blocks, decode rank 0
    ("decode", "corrupt_shard_destination", "Name a river in Africa."),  # stage 1's blocks, decode rank 1
    ("merged", "corrupt_destination", "Name a famous painting."),  # stage 1's layers inside decode rank 0's blocks
], ids=["to-pp2-stage0", "to-pp2-stage1", "to-pp1-stage1-layers"])
def test_a_corrupted_block_is_caught_recomputed_and_counted(cluster, default_model_dir, decode_name, fault,
                                                           question) -> None:
    decode = getattr(cluster, decode_name)
    prompt = Tokenizer.from_dir(default_model_dir).encode_chat([{"role": "user", "content": question}])
    expected = generate(cluster.reference, request(prompt, MAX_TOKENS)).token_ids
    before = fallbacks(decode, "checksum_mismatch")
    decode.stub.InjectFault(pb.InjectFaultRequest(fault=fault))
    result = generate(decode, request(prompt, MAX_TOKENS))
    assert (result.prefill_path, result.fallback_reason) == (pb.PREFILL_PATH_LOCAL_FALLBACK, "checksum_mismatch")
    assert result.token_ids == expected
    assert fallbacks(decode, "checksum_mismatch") == before + 1
    wait_baseline([decode, cluster.prefill], timeout_s=QUICK_S)


def _long_prompt(model_dir, index: int) -> list[int]:  # noqa: ANN001
    prompt = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": LONG_QUESTIONS[index]}])
    assert len(prompt) > 96, len(prompt)  # past the template block(s) the prefix caches hold, over one chunk
    return prompt


@pytest.mark.parametrize(("decode_name", "index"), [("decode", 0), ("merged", 1)], ids=["to-pp2", "to-pp1"])
def test_a_long_prompt_streams_stage_0s_first_chunk_and_gives_the_same_tokens(cluster, default_model_dir,
                                                                            decode_name, index) -> None:
    decode, prompt = getattr(cluster, decode_name), _long_prompt(default_model_dir, index)
    expected = generate(cluster.reference, request(prompt, MAX_TOKENS)).token_ids
    before = metric(cluster.prefill, STREAM_PARTS)
    result = generate(decode, request(prompt, MAX_TOKENS))
    assert (result.prefill_path, result.fallback_reason) == (pb.PREFILL_PATH_REMOTE, "")
    assert result.token_ids == expected
    wait_baseline([decode, cluster.prefill])
    # a chunk's blocks went before the first token (counted once the prefill's hand-off ended)
    wait_for(lambda: metric(cluster.prefill, STREAM_PARTS) > before, what="a streamed part")


def test_a_stage_failing_at_the_end_of_a_stream_recomputes_and_frees_every_block(cluster, default_model_dir) -> None:
    prompt = _long_prompt(default_model_dir, 2)
    expected = generate(cluster.reference, request(prompt, MAX_TOKENS)).token_ids
    before = metric(cluster.prefill, STREAM_PARTS)
    cluster.prefill.stub.InjectFault(pb.InjectFaultRequest(fault="fail_shard_transfer"))
    result = generate(cluster.decode, request(prompt, MAX_TOKENS))
    assert (result.prefill_path, result.fallback_reason) == (pb.PREFILL_PATH_LOCAL_FALLBACK, "transfer_failed")
    assert result.token_ids == expected
    wait_baseline([cluster.decode, cluster.prefill], timeout_s=QUICK_S)
    wait_for(lambda: metric(cluster.prefill, STREAM_PARTS) > before, what="a streamed part")


def test_an_abort_mid_transfer_frees_every_block_on_both_sides(cluster, default_model_dir) -> None:
    tok = Tokenizer.from_dir(default_model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": QUESTIONS[6]}])
    cluster.prefill.stub.InjectFault(pb.InjectFaultRequest(fault="stall_transfer"))
    req = request(prompt, MAX_TOKENS)
    call = cluster.decode.stub.Generate(req, timeout=120)
    wait_for(lambda: cluster.prefill.status().inflight_transfers == 1, 30, "a WRITE in flight")
    assert cluster.prefill.status().held_blocks > 0  # the WRITE's source stays allocated meanwhile
    assert cluster.decode.stub.Abort(pb.AbortRequest(request_id=req.request_id), timeout=10).existed
    assert collect(call).finish_reason == pb.FINISH_REASON_ABORT
    wait_baseline([cluster.decode, cluster.prefill], timeout_s=QUICK_S)

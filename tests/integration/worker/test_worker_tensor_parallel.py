"""Tensor-parallel workers on CPU (gloo, NIXL over DRAM): a `both` worker and a prefill -> decode pair,
each rank handing its own KV shard to the peer's same rank, give a TP=1 worker's greedy tokens.

SmolLM2-135M has 9 query heads and 3 KV heads, so 3 is its smallest tensor-parallel size above 1:
every TP worker here runs 3 ranks (3 processes).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from worker_client import QUESTIONS, fallbacks, generate, generate_many, request, wait_baseline
from worker_procs import WorkerProcess, stop_workers, wait_all_serving

from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer

TP = "3"
TP_ARGS = ("--tensor-parallel-size", TP)
NUM_BLOCKS = "128"
GROUP_START_S = 480.0  # 9 processes of the default model load at once; the test timeout (600 s) includes this
TRANSFER_TIMEOUT_S = "3"
MAX_TOKENS = 8


def decode_args(prefill_address: str) -> list[str]:
    """As the session cluster's decode worker: prompts >= 8 tokens prefill remotely, short deadlines."""
    return ["--num-blocks", NUM_BLOCKS, "--prefill-peers", prefill_address, "--max-num-seqs", "8",
            "--min-remote-prompt-tokens", "8", "--min-remote-uncached-tokens", "4",
            "--transfer-timeout-s", TRANSFER_TIMEOUT_S, "--kv-quarantine-s", "6", "--prefill-timeout-s", "20",
            "--allow-fault-injection"]


class TPCluster:
    """The TP workers of this module, and the session's single-process `both` worker as their reference."""

    def __init__(self, model_dir, log_dir, reference: WorkerProcess) -> None:  # noqa: ANN001
        self.reference = reference
        self.prefill = WorkerProcess("prefill-tp3", "prefill", model_dir, log_dir, "--num-blocks", NUM_BLOCKS,
                                     "--transfer-timeout-s", TRANSFER_TIMEOUT_S, "--allow-fault-injection",
                                     *TP_ARGS).start()
        self.decode = WorkerProcess("decode-tp3", "decode", model_dir, log_dir, *decode_args(self.prefill.address),
                                    *TP_ARGS).start()
        self.both = WorkerProcess("both-tp3", "both", model_dir, log_dir, "--num-blocks", NUM_BLOCKS, *TP_ARGS).start()

    @property
    def own(self) -> list[WorkerProcess]:
        return [self.prefill, self.decode, self.both]

    @property
    def workers(self) -> list[WorkerProcess]:
        return [*self.own, self.reference]


@pytest.fixture(scope="module")
def tp_cluster(default_model_dir, worker_log_dir, both_worker) -> Iterator[TPCluster]:
    cluster = TPCluster(default_model_dir, worker_log_dir, both_worker)
    try:
        wait_all_serving(cluster.workers, GROUP_START_S)
        yield cluster
    finally:
        stop_workers(cluster.own)


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    """Four chat prompts of 30-60 tokens: all take the remote path (>= 8 tokens)."""
    tok = Tokenizer.from_dir(default_model_dir)
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:3] + QUESTIONS[4:5]]


@pytest.fixture(scope="module")
def reference(tp_cluster, prompts) -> list[list[int]]:
    results = generate_many(tp_cluster.reference, [request(p, MAX_TOKENS) for p in prompts])
    assert [r.code for r in results] == [None] * len(prompts)
    return [r.token_ids for r in results]



def test_both_worker_with_three_ranks_gives_the_single_rank_tokens(tp_cluster, prompts, reference):
    results = generate_many(tp_cluster.both, [request(p, MAX_TOKENS) for p in prompts])
    assert [r.token_ids for r in results] == reference


def test_prefill_ranks_hand_their_kv_shards_to_the_decode_ranks(tp_cluster, prompts, reference):
    results = generate_many(tp_cluster.decode, [request(p, MAX_TOKENS) for p in prompts])
    assert [(r.prefill_path, r.fallback_reason) for r in results] == [(pb.PREFILL_PATH_REMOTE, "")] * len(prompts)
    assert [r.token_ids for r in results] == reference
    wait_baseline([tp_cluster.decode, tp_cluster.prefill])


def test_a_failed_follower_write_recomputes_locally_with_the_reference_tokens(tp_cluster, default_model_dir):
    tok = Tokenizer.from_dir(default_model_dir)
    fresh = tok.encode_chat([{"role": "user", "content": QUESTIONS[5]}])  # not in the decode prefix cache
    expected = generate(tp_cluster.reference, request(fresh, MAX_TOKENS)).token_ids
    before = fallbacks(tp_cluster.decode, "transfer_failed")
    tp_cluster.prefill.stub.InjectFault(pb.InjectFaultRequest(fault="fail_shard_transfer"))
    result = generate(tp_cluster.decode, request(fresh, MAX_TOKENS))
    assert (result.prefill_path, result.fallback_reason) == (pb.PREFILL_PATH_LOCAL_FALLBACK, "transfer_failed")
    assert result.token_ids == expected
    assert fallbacks(tp_cluster.decode, "transfer_failed") == before + 1
    assert "rank 2 failed: injected fault: fail_transfer" in tp_cluster.decode.log_path.read_text()
    wait_baseline([tp_cluster.decode, tp_cluster.prefill], timeout_s=4.0)


@pytest.mark.parametrize(("fault", "question"), [
    ("corrupt_destination", "Name a famous painting."),  # rank 0's shard
    ("corrupt_shard_destination", "Name a river in Africa."),  # the last rank's shard
], ids=["rank0", "rank2"])
def test_a_corrupted_shard_is_caught_recomputed_and_counted(tp_cluster, default_model_dir, fault, question):
    prompt = Tokenizer.from_dir(default_model_dir).encode_chat([{"role": "user", "content": question}])
    expected = generate(tp_cluster.reference, request(prompt, MAX_TOKENS)).token_ids
    before = fallbacks(tp_cluster.decode, "checksum_mismatch")
    tp_cluster.decode.stub.InjectFault(pb.InjectFaultRequest(fault=fault))
    result = generate(tp_cluster.decode, request(prompt, MAX_TOKENS))
    assert (result.prefill_path, result.fallback_reason) == (pb.PREFILL_PATH_LOCAL_FALLBACK, "checksum_mismatch")
    assert result.token_ids == expected
    assert fallbacks(tp_cluster.decode, "checksum_mismatch") == before + 1
    wait_baseline([tp_cluster.decode, tp_cluster.prefill], timeout_s=4.0)


def test_a_handshake_with_another_tp_size_is_refused_naming_tp_size(tp_cluster):
    status = tp_cluster.prefill.status()
    layout = pb.KVLayout(protocol_version=1, model_id=status.model, dtype="float32", layout="block_major_v1",
                         block_size=16, num_layers=30, num_kv_heads=3, head_dim=64, tp_size=1, tp_rank=0)
    info = pb.KVHandshake(layout=layout, agent_name="single-rank", agent_metadata=b"x", base_address=4096,
                          num_blocks=8, bytes_per_block=30 * 2 * 16 * 3 * 64 * 4, device_kind="cpu")
    with pytest.raises(grpc.RpcError) as refused:
        tp_cluster.prefill.stub.Handshake(pb.HandshakeRequest(decode=info, worker_id="single-rank"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tp_size: local=3 peer=1" in refused.value.details()


@pytest.fixture(scope="module")
def single_rank_decode(tp_cluster, default_model_dir, worker_log_dir) -> Iterator[WorkerProcess]:
    """A TP=1 decode worker pointed at the TP=3 prefill worker."""
    worker = WorkerProcess("decode-tp1", "decode", default_model_dir, worker_log_dir,
                           *decode_args(tp_cluster.prefill.address)).start()
    try:
        yield worker.wait_serving()
    finally:
        worker.stop()


def test_a_decode_worker_with_another_tp_size_prefills_locally(single_rank_decode, prompts, reference):
    result = generate(single_rank_decode, request(prompts[1], MAX_TOKENS, mode=pb.PREFILL_MODE_REMOTE))
    assert (result.prefill_path, result.fallback_reason) == (pb.PREFILL_PATH_LOCAL_FALLBACK, "handshake_refused")
    assert result.token_ids == reference[1]
    assert "tp_size: local=3 peer=1" in single_rank_decode.log_path.read_text()  # the prefill worker's words

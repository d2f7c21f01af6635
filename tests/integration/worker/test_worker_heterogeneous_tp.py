"""Heterogeneous TP on CPU (gloo, NIXL over DRAM): the tiny Qwen3-MoE cluster's single-rank prefill worker
feeds a two-rank decode worker, writing each decode rank its half of the KV heads of every block
(kvtransfer/nixl/sliced.py). Its greedy tokens are the co-located worker's; a head slice corrupted on
the second decode rank is caught by that rank's checksums and recomputed locally; a decode layout
holding other KV heads in all is refused at the handshake, stating both layouts.

The tiny Qwen3-MoE has 2 KV heads (the default model's 3 admit no TP size 2), and `moe_cluster` is a
session fixture the parity tests start anyway: this module adds only the two-rank decode worker.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from worker_client import QUESTIONS, fallbacks, generate, generate_many, request, wait_baseline
from worker_procs import WorkerProcess

from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tp2_decode(moe_cluster, moe_model_dir, worker_log_dir) -> Iterator[WorkerProcess]:
    """A TP=2 decode worker pointed at the TP=1 prefill worker; prompts >= 8 tokens prefill remotely."""
    worker = WorkerProcess("decode-tp2", "decode", moe_model_dir, worker_log_dir / "moe", "--num-blocks", "128",
                           "--prefill-peers", moe_cluster.prefill.address, "--min-remote-prompt-tokens", "8",
                           "--min-remote-uncached-tokens", "4", "--transfer-timeout-s", "3",
                           "--prefill-timeout-s", "20", "--tensor-parallel-size", "2",
                           "--allow-fault-injection").start()
    try:
        yield worker.wait_serving(180.0)
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def prompts(moe_model_dir) -> list[list[int]]:
    tok = Tokenizer.from_dir(moe_model_dir)
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:3]]


def test_a_single_rank_prefill_feeds_two_decode_ranks_with_the_co_located_tokens(moe_cluster, tp2_decode, prompts):
    reference = generate_many(moe_cluster.both, [request(p, MAX_TOKENS) for p in prompts])
    results = generate_many(tp2_decode, [request(p, MAX_TOKENS, mode=pb.PREFILL_MODE_REMOTE) for p in prompts])
    assert [(r.prefill_path, r.fallback_reason) for r in results] == [(pb.PREFILL_PATH_REMOTE, "")] * len(prompts)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    wait_baseline([tp2_decode, moe_cluster.prefill])


def test_a_corrupted_head_slice_on_the_second_decode_rank_is_caught_and_counted(moe_cluster, tp2_decode,
                                                                                moe_model_dir):
    prompt = Tokenizer.from_dir(moe_model_dir).encode_chat([{"role": "user", "content": "Name a famous painting."}])
    expected = generate(moe_cluster.both, request(prompt, MAX_TOKENS)).token_ids
    before = fallbacks(tp2_decode, "checksum_mismatch")
    tp2_decode.stub.InjectFault(pb.InjectFaultRequest(fault="corrupt_shard_destination"))
    result = generate(tp2_decode, request(prompt, MAX_TOKENS, mode=pb.PREFILL_MODE_REMOTE))
    assert (result.prefill_path, result.fallback_reason) == (pb.PREFILL_PATH_LOCAL_FALLBACK, "checksum_mismatch")
    assert result.token_ids == expected
    assert fallbacks(tp2_decode, "checksum_mismatch") == before + 1
    wait_baseline([tp2_decode, moe_cluster.prefill])


def test_a_decode_layout_with_other_total_kv_heads_is_refused_stating_both(moe_cluster):
    status = moe_cluster.prefill.status()
    layout = pb.KVLayout(protocol_version=2, model_id=status.model, dtype="float32", layout="block_major_v1",
                         block_size=16, num_layers=2, num_kv_heads=2, head_dim=32, tp_size=2, tp_rank=0)
    info = pb.KVHandshake(layout=layout, agent_name="tp2-4-heads", agent_metadata=b"x", base_address=4096,
                          num_blocks=8, bytes_per_block=2 * 2 * 16 * 2 * 32 * 4, device_kind="cpu")
    with pytest.raises(grpc.RpcError) as refused:
        moe_cluster.prefill.stub.Handshake(pb.HandshakeRequest(decode=info, worker_id="tp2-4-heads"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ("tp_size: local=1 peer=2; kv_heads: local='TP1 x 2 KV heads per rank (2 in all)' "
            "peer='TP2 x 2 KV heads per rank (4 in all)'") in refused.value.details()

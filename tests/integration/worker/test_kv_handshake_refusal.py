"""The KV handshake refuses incompatible peers with a message naming the mismatching field."""

from __future__ import annotations

import grpc
import pytest
from worker_client import generate, request
from worker_procs import WorkerProcess

from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def mismatched_decode(cluster, default_model_dir, worker_log_dir):
    """A decode worker with block_size 32 pointed at the session's prefill worker (block_size 16)."""
    worker = WorkerProcess("decode-bs32", "decode", default_model_dir, worker_log_dir, "--num-blocks", "64",
                           "--block-size", "32", "--prefill-peers", cluster.prefill.address).start()
    try:
        yield worker.wait_serving()
    finally:
        worker.stop()


def test_direct_handshake_with_another_block_size_is_refused_naming_it(cluster):
    status = cluster.prefill.status()
    layout = pb.KVLayout(protocol_version=1, model_id=status.model, dtype="float32", layout="block_major_v1",
                         block_size=32, num_layers=30, num_kv_heads=3, head_dim=64, tp_size=1, tp_rank=0)
    bytes_per_block = 30 * 2 * 32 * 3 * 64 * 4
    info = pb.KVHandshake(layout=layout, agent_name="imposter", agent_metadata=b"x", base_address=4096,
                          num_blocks=8, bytes_per_block=bytes_per_block, device_kind="cpu")
    with pytest.raises(grpc.RpcError) as refused:
        cluster.prefill.stub.Handshake(pb.HandshakeRequest(decode=info, worker_id="imposter"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size: local=16 peer=32" in refused.value.details()


def test_decode_worker_with_another_block_size_is_refused_and_prefills_locally(mismatched_decode, cluster,
                                                                                 default_model_dir):
    tok = Tokenizer.from_dir(default_model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": "Why do cats purr?"}])
    result = generate(mismatched_decode, request(prompt, 6, mode=pb.PREFILL_MODE_REMOTE))
    reference = generate(cluster.both, request(prompt, 6))
    assert (result.prefill_path, result.fallback_reason) == (pb.PREFILL_PATH_LOCAL_FALLBACK, "handshake_refused")
    assert result.token_ids == reference.token_ids
    assert "block_size: local=16 peer=32" in mismatched_decode.log_path.read_text()

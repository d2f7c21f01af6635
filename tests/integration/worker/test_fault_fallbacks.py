"""Injected KV hand-off failures recompute locally: the tokens always equal the reference, and each
fallback is counted by reason in the decode worker's /metrics."""

from __future__ import annotations

import grpc
import pytest
from worker_client import fallbacks, generate, request, wait_baseline

from rpcgen.baton.v1 import worker_pb2 as pb
from tokenization.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def prompt(default_model_dir) -> list[int]:
    tok = Tokenizer.from_dir(default_model_dir)
    return tok.encode_chat([{"role": "user", "content": "List five prime numbers and explain what a prime is."}])


@pytest.fixture(scope="module")
def reference(cluster, prompt) -> list[int]:
    return generate(cluster.both, request(prompt, 12)).token_ids



@pytest.mark.parametrize(("fault", "side", "reason"), [
    ("fail_transfer", "prefill", "transfer_failed"),
    ("corrupt_destination", "decode", "checksum_mismatch"),
    ("stall_transfer", "prefill", "transfer_timeout"),  # the WRITE's 3 s deadline passes
    ("drop_notification", "decode", "transfer_timeout"),  # DONE response, but no NIXL notice
])
def test_injected_fault_recomputes_locally_with_the_right_tokens(cluster, prompt, reference, fault, side, reason):
    before = fallbacks(cluster.decode, reason)
    getattr(cluster, side).stub.InjectFault(pb.InjectFaultRequest(fault=fault))
    result = generate(cluster.decode, request(prompt, 12))
    assert (result.prefill_path, result.fallback_reason) == (pb.PREFILL_PATH_LOCAL_FALLBACK, reason)
    assert result.token_ids == reference
    assert fallbacks(cluster.decode, reason) == before + 1
    wait_baseline([cluster.decode, cluster.prefill], timeout_s=4.0)


def test_fault_injection_names_the_valid_faults(cluster):
    with pytest.raises(grpc.RpcError) as info:
        cluster.prefill.stub.InjectFault(pb.InjectFaultRequest(fault="meteor_strike"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stall_transfer" in info.value.details()


def test_fault_injection_is_refused_unless_enabled(cluster):
    with pytest.raises(grpc.RpcError) as info:
        cluster.both.stub.InjectFault(pb.InjectFaultRequest(fault="fail_transfer"))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

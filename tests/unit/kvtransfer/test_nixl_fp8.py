"""An FP8 KV cache over NIXL on CPU (UCX over DRAM): the same pool holds twice the tokens of bf16, a hand-off
of the same tokens moves half the bytes and lands them bit-exact, and a bf16 peer is refused by name."""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.support.required import require_module

require_module("nixl._api")  # the KV hand-off: a missing nixl is an ERROR, never a skip

from nixl_pair_helpers import ManualClock, drive  # noqa: E402

from engine.kv_cache import KVCacheSpec  # noqa: E402
from kvtransfer.base import TransferPlan, TransferState  # noqa: E402
from kvtransfer.errors import IncompatiblePeerError  # noqa: E402
from kvtransfer.layout import KVLayoutInfo  # noqa: E402
from kvtransfer.nixl import NixlAgent, NixlAgentConfig, NixlKVReceiver, NixlKVSender  # noqa: E402

POOL_BYTES = 2 * 1024**2
TOKENS = 96  # six blocks of 16


def _spec(dtype: str) -> KVCacheSpec:
    return KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)


def _agent(role: str, spec: KVCacheSpec, fill_seed: int | None) -> NixlAgent:
    kv = spec.allocate(spec.num_blocks_for(POOL_BYTES), "cpu")
    if fill_seed is not None:
        values = torch.randn(kv.shape, generator=torch.Generator().manual_seed(fill_seed))
        kv.copy_(values.clamp(-448, 448).to(kv.dtype))
    return NixlAgent(NixlAgentConfig(name=f"{role}-{uuid.uuid4().hex[:8]}"), kv,
                     KVLayoutInfo.from_spec(spec, model_id="test-model"))


def _hand_off(dtype: str) -> tuple[int, int]:
    """Move TOKENS tokens' blocks prefill -> decode; (blocks in the pool, bytes the transfer moved)."""
    spec, clock = _spec(dtype), ManualClock()
    prefill, decode = _agent("prefill", spec, fill_seed=3), _agent("decode", spec, fill_seed=None)
    sender, receiver = NixlKVSender(prefill, clock=clock), NixlKVReceiver(decode, clock=clock)
    try:
        num_blocks = prefill.kv_cache.shape[0]
        n = TOKENS // spec.block_size
        local, remote = list(range(1, 1 + n)), list(range(num_blocks - n, num_blocks))
        plan = TransferPlan.create("req", local, remote, now=clock(), timeout_s=5.0)
        receiver.expect("req", remote, deadline=clock() + 10.0)
        transfer = sender.start(sender.add_peer(receiver.handshake_info), plan)
        drive(sender, receiver, [transfer])
        assert transfer.state is TransferState.DONE
        landed, sent = decode.kv_cache[remote], prefill.kv_cache[local]
        assert landed.dtype == spec.torch_dtype and torch.equal(landed.view(torch.uint8), sent.view(torch.uint8))
        return num_blocks, transfer.num_bytes
    finally:
        sender.close()
        receiver.close()
        prefill.close()
        decode.close()


def test_fp8_holds_twice_the_tokens_and_a_hand_off_moves_half_the_bytes() -> None:
    bf16_blocks, bf16_bytes = _hand_off("bfloat16")
    fp8_blocks, fp8_bytes = _hand_off("float8_e4m3fn")
    assert fp8_blocks == 2 * bf16_blocks
    assert fp8_bytes * 2 == bf16_bytes == TOKENS * 2 * 2 * 2 * 64 * 2  # tokens x layers x K/V x heads x dim x 2 B


def test_a_bf16_peer_of_an_fp8_worker_is_refused_naming_the_dtype() -> None:
    clock = ManualClock()
    prefill, decode = _agent("prefill", _spec("float8_e4m3fn"), 1), _agent("decode", _spec("bfloat16"), None)
    sender, receiver = NixlKVSender(prefill, clock=clock), NixlKVReceiver(decode, clock=clock)
    try:
        with pytest.raises(IncompatiblePeerError, match="dtype: local='float8_e4m3fn' peer='bfloat16'"):
            sender.add_peer(receiver.handshake_info)
    finally:
        sender.close()
        receiver.close()
        prefill.close()
        decode.close()

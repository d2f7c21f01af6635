"""The KV hand-off of a pipeline-parallel prefill worker, in one process, over NIXL-DRAM and the memory
transport: rank 0's sender (stage 0, layers 0-1) and a real `ShardAgent` of stage 1 (layer 2) write
into a decode worker of two stages (the same split: whole blocks, rank to rank) or of one stage
(each stage's layers into their place in the decode blocks). `FollowerShards` reaches the followers
by a direct call instead of the control group, as in test_nixl_shards.py.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.support.required import require_module

require_module("nixl._api")  # the KV hand-off: a missing nixl is an ERROR, never a skip

sys.path.insert(0, str(Path(__file__).parent))
from nixl_pair_helpers import drive, random_plan  # noqa: E402

from engine.kv_cache import KVCacheSpec  # noqa: E402
from kvtransfer.base import HandshakeInfo, TransferPlan, TransferState  # noqa: E402
from kvtransfer.errors import IncompatiblePeerError  # noqa: E402
from kvtransfer.faults import Fault, FaultInjector, corrupt_block_byte  # noqa: E402
from kvtransfer.integrity import LandedVerifier  # noqa: E402
from kvtransfer.layout import KVLayoutInfo  # noqa: E402
from kvtransfer.memory import FABRIC, MemoryAgent  # noqa: E402
from kvtransfer.nixl import NixlAgent, NixlAgentConfig, NixlKVReceiver, NixlKVSender, ReceiverConfig  # noqa: E402
from kvtransfer.nixl.shards import FollowerShards, ShardAgent  # noqa: E402

NUM_BLOCKS = 16
LAYERS = 3
STAGE_LAYERS = ((0, 2), (2, 1))  # (first layer, layers) of stage 0 and stage 1
AgentFactory = Callable[[NixlAgentConfig, torch.Tensor, KVLayoutInfo], NixlAgent]
TRANSPORTS: dict[str, AgentFactory] = {
    "nixl": NixlAgent,
    "memory": lambda config, kv, layout: MemoryAgent(config, kv, layout, FABRIC),
}


def _spec(layers: int) -> KVCacheSpec:
    return KVCacheSpec(num_layers=layers, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")


def _stage(pp_size: int, stage: int) -> tuple[KVCacheSpec, KVLayoutInfo]:
    first, layers = STAGE_LAYERS[stage] if pp_size == 2 else (0, LAYERS)
    spec = _spec(layers)
    return spec, KVLayoutInfo.from_spec(spec, "test-model", pp_size=pp_size, pp_rank=stage, first_layer=first)


def _kv(spec: KVCacheSpec, seed: int | None) -> torch.Tensor:
    kv = spec.allocate(NUM_BLOCKS, "cpu")
    if seed is not None:
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def _direct(agent: ShardAgent):  # noqa: ANN202
    return lambda request: [agent.handle(request)]


class Stages:
    """A prefill worker of 2 stages feeding a decode worker of `decode_pp` stages (1 or 2)."""

    def __init__(self, decode_pp: int, make_agent: AgentFactory, faults: FaultInjector) -> None:
        tag = uuid.uuid4().hex[:6]
        (spec0, layout0), (spec1, layout1) = _stage(2, 0), _stage(2, 1)
        self.prefill_kv = (_kv(spec0, 1), _kv(spec1, 2))
        self.prefill0 = make_agent(NixlAgentConfig(name=f"prefill-{tag}"), self.prefill_kv[0], layout0)
        self.prefill1 = ShardAgent(f"prefill-{tag}-r1", self.prefill_kv[1], layout1, 1e-3, 5e-5,
                                   agent_factory=make_agent)
        decode = [_stage(decode_pp, s) for s in range(decode_pp)]
        self.decode_kv = tuple(_kv(spec, None) for spec, _ in decode)
        self.decode0 = make_agent(NixlAgentConfig(name=f"decode-{tag}"), self.decode_kv[0], decode[0][1])
        self.decode1 = (ShardAgent(f"decode-{tag}-r1", self.decode_kv[1], decode[1][1], 1e-3, 5e-5,
                                   agent_factory=make_agent) if decode_pp == 2 else None)
        self.decode_shards = FollowerShards(_direct(self.decode1)) if self.decode1 is not None else None
        self.sender = NixlKVSender(self.prefill0, faults=faults, shards=FollowerShards(_direct(self.prefill1)))
        self.receiver = NixlKVReceiver(self.decode0, ReceiverConfig(quarantine_s=60.0), faults,
                                       shards=self.decode_shards)
        self.receiver.accept_peer(self.sender.handshake_info)
        self.peer = self.sender.add_peer(self.receiver.handshake_info)

    def decode_layers(self, block_ids: list[int]) -> torch.Tensor:
        """The decode worker's blocks with every layer, stage after stage: [blocks, layers, ...]."""
        return torch.cat([kv[block_ids] for kv in self.decode_kv], dim=1)

    def sent_layers(self, block_ids: list[int]) -> torch.Tensor:
        return torch.cat([kv[block_ids] for kv in self.prefill_kv], dim=1)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        for agent in (self.prefill1, self.decode1, self.prefill0, self.decode0):
            if agent is not None:
                agent.close()


@pytest.fixture
def faults() -> FaultInjector:
    return FaultInjector()


@pytest.fixture(params=[(2, "nixl"), (1, "nixl"), (2, "memory"), (1, "memory")],
                ids=["pp2-to-pp2-nixl", "pp2-to-pp1-nixl", "pp2-to-pp2-memory", "pp2-to-pp1-memory"])
def stages(request, faults):  # noqa: ANN001, ANN201
    decode_pp, transport = request.param
    pair = Stages(decode_pp, TRANSPORTS[transport], faults)
    yield pair
    pair.close()


def _plan(request_id: str, checksums_of: torch.Tensor | None = None) -> TransferPlan:
    return random_plan(request_id, NUM_BLOCKS, checksums_of)


def _start(stages: Stages, plan: TransferPlan):  # noqa: ANN202
    stages.receiver.expect(plan.request_id, plan.remote_block_ids, deadline=time.monotonic() + 10.0)
    transfer = stages.sender.start(stages.peer, plan)
    return transfer, *drive(stages.sender, stages.receiver, [transfer])


def test_the_handshake_states_each_ranks_stage_and_layers(stages) -> None:
    info = stages.sender.handshake_info
    assert [(r.layout.pp_rank, r.layout.first_layer, r.layout.num_layers) for r in info.all_ranks] == [(0, 0, 2),
                                                                                                       (1, 2, 1)]


def test_every_stage_lands_its_layers_before_the_one_notice(stages) -> None:
    plan = _plan("req-pp")
    transfer, arrived, failures = _start(stages, plan)
    assert transfer.state is TransferState.DONE and set(arrived) == {"req-pp"} and not failures
    sent = stages.sent_layers(list(plan.local_block_ids))
    assert torch.equal(stages.decode_layers(list(plan.remote_block_ids)), sent)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(plan.remote_block_ids))
    assert not stages.decode_layers(untouched).any()


def test_a_failed_stage_write_fails_the_transfer_on_both_sides(stages, faults) -> None:
    faults.arm(Fault.FAIL_SHARD_TRANSFER)
    transfer, arrived, failures = _start(stages, _plan("req-fail"))
    assert transfer.state is TransferState.FAILED and not arrived
    assert transfer.reason == "rank 1 failed: injected fault: fail_transfer"
    assert "aborted: rank 1 failed" in failures["req-fail"].reason
    assert stages.receiver.release("req-fail") is True  # the ABORTED notice ended the write: reusable now


def _landed_with_checksums(stages: Stages, request_id: str):  # noqa: ANN202
    plan = _plan(request_id, stages.prefill_kv[0])
    transfer, arrived, _ = _start(stages, plan)
    assert transfer.state is TransferState.DONE
    return plan, arrived[request_id]


def test_every_stages_checksums_are_checked_where_its_layers_landed(stages) -> None:
    _, landed = _landed_with_checksums(stages, "req-sums")
    assert len(landed.payload.checksums) == 2 * 5  # each prefill stage checksummed its own blocks
    assert LandedVerifier(stages.decode_kv[0], shards=stages.decode_shards).problem(landed) == ""


@pytest.mark.parametrize("stage", [0, 1])
def test_a_byte_corrupted_in_either_stages_layers_is_caught(stages, stage) -> None:
    plan, landed = _landed_with_checksums(stages, f"req-bad{stage}")
    bad = plan.remote_block_ids[3]
    first, _ = STAGE_LAYERS[stage]
    merged = len(stages.decode_kv) == 1  # both stages' layers in the decode rank 0's blocks
    kv = stages.decode_kv[0 if merged else stage]
    layer = first if merged else 0
    corrupt_block_byte(kv, bad, kv[bad, layer].numel() * kv.element_size() * layer + 7)
    problem = LandedVerifier(stages.decode_kv[0], shards=stages.decode_shards).problem(landed)
    where = f"rank 0 layers {first}+{STAGE_LAYERS[stage][1]}" if merged else f"rank {stage}"
    assert problem == f"checksum mismatch in 1 block(s): [{where} block {bad}]"


def test_an_injected_corruption_on_the_decode_stage_follower_is_caught(faults) -> None:
    pair = Stages(2, TRANSPORTS["memory"], faults)
    try:
        plan, landed = _landed_with_checksums(pair, "req-shard")
        faults.arm(Fault.CORRUPT_SHARD_DESTINATION)
        problem = LandedVerifier(pair.decode_kv[0], faults=faults, shards=pair.decode_shards).problem(landed)
        assert problem == f"checksum mismatch in 1 block(s): [rank 1 block {plan.remote_block_ids[0]}]"
        assert faults.injected(Fault.CORRUPT_SHARD_DESTINATION) == 1
    finally:
        pair.close()


def test_a_decode_worker_of_more_stages_is_refused_naming_the_layer_ranges() -> None:
    spec, single = _stage(1, 0)
    kv = _kv(spec, 0)
    prefill = MemoryAgent(NixlAgentConfig(name=f"prefill-{uuid.uuid4().hex[:6]}"), kv, single, FABRIC)
    decode = Stages(2, TRANSPORTS["memory"], FaultInjector())
    try:
        sender = NixlKVSender(prefill)
        layers = r"layer ranges: local='PP1: layers 0-2' peer='PP2: layers 0-1 \| 2-2'"
        route = r"route: local=\"stage 0's layers 0-2 lie in no one stage of the other side"
        with pytest.raises(IncompatiblePeerError, match=rf"pp_size: local=1 peer=2; {layers}; {route}"):
            sender.add_peer(decode.receiver.handshake_info)
    finally:
        decode.close()
        prefill.close()


def _info(layout: KVLayoutInfo, name: str, ranks: tuple[HandshakeInfo, ...] = ()) -> HandshakeInfo:
    return HandshakeInfo(layout, name, b"x", 4096, NUM_BLOCKS, layout.bytes_per_block, "cpu", ranks=ranks)


def test_another_stage_split_with_another_tp_size_is_refused() -> None:
    (_, stage0), (_, stage1) = _stage(2, 0), _stage(2, 1)
    prefill = _info(stage0, "prefill", (_info(stage1, "prefill-r1"),))
    _, whole = _stage(1, 0)
    tp = [replace(whole, num_kv_heads=1, tp_size=2, tp_rank=r) for r in range(2)]
    decode = _info(tp[0], "decode", (_info(tp[1], "decode-r1"),))
    with pytest.raises(IncompatiblePeerError, match="pp_size: local=2 peer=1.*tp_size: local=1 peer=2"):
        prefill.check_group_compatible(decode)
    with pytest.raises(IncompatiblePeerError, match="pp_size: local=1 peer=2.*tp_size: local=2 peer=1"):
        decode.check_group_compatible(prefill, sending=False)


# ------------------------------------------------------------------------- streaming per chunk (staged_stream.py)


def _open_stream(stages: Stages, plan: TransferPlan):  # noqa: ANN202
    stages.receiver.expect(plan.request_id, plan.remote_block_ids, deadline=time.monotonic() + 10.0)
    stream = stages.sender.open_stream(stages.peer, plan.request_id, plan.attempt, plan.deadline)
    assert stream.write(plan.local_block_ids[:2], plan.remote_block_ids[:2])  # the first chunk's blocks
    give_up = time.monotonic() + 10.0
    while time.monotonic() < give_up and not stages.decode_kv[0][list(plan.remote_block_ids[:2])].any():
        stages.sender.poll()
        stages.receiver.poll_arrivals()
    return stream


def test_stage_0_streams_per_chunk_and_every_stage_lands_before_the_one_notice(stages) -> None:
    plan = _plan("req-stream", stages.prefill_kv[0])
    stream = _open_stream(stages, plan)
    first = list(plan.remote_block_ids[:2])
    assert stages.decode_layers(first)[:, :2].any() and not stages.decode_layers(first)[:, 2:].any()  # stage 0 only
    assert stages.receiver.poll_arrivals() == []  # no notice for a part
    stream.finish(plan)
    arrived, failures = drive(stages.sender, stages.receiver, [stream])
    assert stream.state is TransferState.DONE and set(arrived) == {"req-stream"} and not failures
    sent = stages.sent_layers(list(plan.local_block_ids))
    assert torch.equal(stages.decode_layers(list(plan.remote_block_ids)), sent)
    assert LandedVerifier(stages.decode_kv[0], shards=stages.decode_shards).problem(arrived["req-stream"]) == ""
    assert stages.sender.num_inflight == 0 and stages.receiver.release("req-stream") is True


def test_a_failed_stage_write_at_finish_fails_the_stream_on_both_sides(stages, faults) -> None:
    plan = _plan("req-stream-fail", stages.prefill_kv[0])
    stream = _open_stream(stages, plan)
    faults.arm(Fault.FAIL_SHARD_TRANSFER)
    stream.finish(plan)
    arrived, failures = drive(stages.sender, stages.receiver, [stream])
    assert stream.state is TransferState.FAILED and not arrived
    assert stream.reason == "rank 1 failed: injected fault: fail_transfer"
    assert "aborted: rank 1 failed" in failures["req-stream-fail"].reason
    assert stages.sender.num_inflight == 0 and stages.receiver.release("req-stream-fail") is True


def test_a_stream_cancelled_mid_prefill_orders_no_stage_and_frees_both_sides(stages) -> None:
    plan = _plan("req-stream-cancel", stages.prefill_kv[0])
    stream = _open_stream(stages, plan)
    stream.cancel()
    assert not stream.write(plan.local_block_ids[2:], plan.remote_block_ids[2:])  # a stopping stream posts nothing
    arrived, failures = drive(stages.sender, stages.receiver, [stream])
    assert stream.state is TransferState.CANCELLED and not arrived
    assert "aborted: cancelled by its owner" in failures["req-stream-cancel"].reason
    assert not stages.decode_layers(list(plan.remote_block_ids))[:, 2:].any()  # stage 1 was never ordered
    assert stages.sender.num_inflight == 0 and stages.receiver.release("req-stream-cancel") is True


def test_a_failed_stage_0_part_fails_the_stream_before_any_other_stage_is_ordered(stages, faults) -> None:
    plan = _plan("req-stream-part", stages.prefill_kv[0])
    stages.receiver.expect(plan.request_id, plan.remote_block_ids, deadline=time.monotonic() + 10.0)
    stream = stages.sender.open_stream(stages.peer, plan.request_id, plan.attempt, plan.deadline)
    faults.arm(Fault.FAIL_TRANSFER)
    stream.write(plan.local_block_ids[:2], plan.remote_block_ids[:2])
    arrived, failures = drive(stages.sender, stages.receiver, [stream])
    assert stream.state is TransferState.FAILED and "part failed" in stream.reason and not arrived
    assert "aborted: a part failed" in failures["req-stream-part"].reason
    assert not stream.write(plan.local_block_ids[2:], plan.remote_block_ids[2:])
    assert not stages.decode_layers(list(plan.remote_block_ids)).any()  # nothing landed on any rank
    assert stages.sender.num_inflight == 0 and stages.receiver.release("req-stream-part") is True

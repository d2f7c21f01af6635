"""NIXL KV hand-off on CPU: UCX over DRAM, two agents in one process and in two processes."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.support.required import require_module

require_module("nixl._api")  # the KV hand-off: a missing nixl is an ERROR, never a skip

from nixl_pair_helpers import LAYOUT, SPEC, ManualClock, drive, make_agent, receiver_process  # noqa: E402

from kvtransfer.base import HandoffPayload, HandshakeInfo, TransferPlan, TransferState  # noqa: E402
from kvtransfer.errors import (  # noqa: E402
    IncompatiblePeerError,
    InvalidTransferPlanError,
    PeerBusyError,
    UnknownPeerError,
)
from kvtransfer.faults import Fault, FaultInjector  # noqa: E402
from kvtransfer.integrity import LandedVerifier, block_checksums  # noqa: E402
from kvtransfer.nixl import NixlKVReceiver, NixlKVSender, ReceiverConfig  # noqa: E402

NUM_BLOCKS = 48
TIMEOUT_S = 5.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def faults() -> FaultInjector:
    return FaultInjector()


@pytest.fixture
def pair(clock, faults):
    """(sender, receiver, peer name) on two agents in this process; checksums on both sides."""
    prefill = make_agent("prefill", NUM_BLOCKS, random_fill=True)
    decode = make_agent("decode", NUM_BLOCKS, random_fill=False)
    sender = NixlKVSender(prefill, faults=faults, clock=clock)
    receiver = NixlKVReceiver(decode, ReceiverConfig(quarantine_s=60.0), faults, clock)
    peer = sender.add_peer(receiver.handshake_info)
    yield sender, receiver, peer
    sender.close()
    _settle(sender, receiver)  # let abort notices from close() reach the receiver before teardown
    receiver.close()
    prefill.close()
    decode.close()


def _settle(sender: NixlKVSender, receiver: NixlKVReceiver, seconds: float = 0.1) -> None:
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        sender.poll()
        receiver.poll_failures()


def _plan(clock: ManualClock, request_id: str, n: int = 6, seed: int = 1) -> TransferPlan:
    rng = random.Random(seed)
    local, remote = rng.sample(range(NUM_BLOCKS), n), rng.sample(range(NUM_BLOCKS), n)
    return TransferPlan.create(request_id, local, remote, now=clock(), timeout_s=TIMEOUT_S)


def _expect(receiver: NixlKVReceiver, clock: ManualClock, plan: TransferPlan) -> None:
    receiver.expect(plan.request_id, plan.remote_block_ids, deadline=clock() + 2 * TIMEOUT_S)


def _kv(side) -> torch.Tensor:
    return side._agent.kv_cache


def test_write_lands_at_random_noncontiguous_block_ids(pair, clock) -> None:
    sender, receiver, peer = pair
    plan = _plan(clock, "req-1", n=12)
    _expect(receiver, clock, plan)
    transfer = sender.start(peer, plan)
    drive(sender, receiver, [transfer])
    assert transfer.state is TransferState.DONE
    assert torch.equal(_kv(receiver)[list(plan.remote_block_ids)], _kv(sender)[list(plan.local_block_ids)])
    untouched = sorted(set(range(NUM_BLOCKS)) - set(plan.remote_block_ids))
    assert not _kv(receiver)[untouched].any()


def test_notification_reports_exactly_the_arrived_requests(pair, clock) -> None:
    sender, receiver, peer = pair
    plans = [
        TransferPlan.create("req-a", [5, 9, 1], [40, 2, 17], now=clock(), timeout_s=TIMEOUT_S),
        TransferPlan.create("req-b", [30, 31, 32], [3, 4, 5], now=clock(), timeout_s=TIMEOUT_S),
    ]
    _expect(receiver, clock, plans[0])
    _expect(receiver, clock, plans[1])
    arrived, failures = drive(sender, receiver, [sender.start(peer, p) for p in plans])
    assert (set(arrived), failures) == ({"req-a", "req-b"}, {})
    assert receiver.state("req-a") is TransferState.DONE


def test_second_request_reuses_prepared_descriptor_lists(pair, clock) -> None:
    sender, receiver, peer = pair
    for i in range(2):
        plan = _plan(clock, f"req-{i}", seed=10 + i)
        _expect(receiver, clock, plan)
        drive(sender, receiver, [sender.start(peer, plan)])
        receiver.release(plan.request_id)
    assert sender._agent.dlist_preparations == 2  # one local + one for the peer, none per transfer


@pytest.mark.parametrize(("field", "value"), [("block_size", 32), ("dtype", "bfloat16"), ("num_kv_heads", 4)])
def test_incompatible_peer_is_refused_naming_the_field(pair, field, value) -> None:
    sender, receiver, _ = pair
    mine = receiver.handshake_info
    layout = replace(mine.layout, **{field: value})
    theirs = replace(mine, agent_name="decode-other", layout=layout, bytes_per_block=layout.bytes_per_block)
    with pytest.raises(IncompatiblePeerError, match=f"{field}: local=.* peer={value!r}"):
        sender.add_peer(theirs)
    assert "decode-other" not in sender._agent.peer_names()


def test_injected_failure_fails_the_transfer_and_the_receiver(pair, clock, faults) -> None:
    sender, receiver, peer = pair
    plan = _plan(clock, "req-fail")
    _expect(receiver, clock, plan)
    faults.arm(Fault.FAIL_TRANSFER)
    transfer = sender.start(peer, plan)
    _, failures = drive(sender, receiver, [transfer])
    assert (transfer.state, transfer.reason) == (TransferState.FAILED, "injected fault: fail_transfer")
    assert failures["req-fail"].state is TransferState.FAILED
    assert "aborted" in failures["req-fail"].reason
    assert receiver.release("req-fail") is True  # the abort notice closed the danger window


def test_transfer_failed_inside_start_is_still_reported_by_poll(pair, clock, faults) -> None:
    sender, _, peer = pair
    faults.arm(Fault.FAIL_TRANSFER)
    transfer = sender.start(peer, _plan(clock, "req-early"))
    assert sender.poll() == [transfer] and sender.poll() == []


def test_quarantined_blocks_are_freed_at_once_when_the_sender_reports_idle(pair, clock) -> None:
    _, receiver, _ = pair
    receiver.expect("req-q", [1, 2], deadline=clock() + 1.0)
    assert receiver.release("req-q") is False
    assert receiver.release("req-q") is False  # still guarded: a second release cannot free it early
    assert receiver.release("req-q", sender_idle=True) is True
    clock.advance(120.0)
    assert receiver.poll_reclaimable() == set()  # never reported twice


def test_deadline_turns_a_stalled_transfer_timed_out(pair, clock, faults) -> None:
    sender, receiver, peer = pair
    plan = _plan(clock, "req-slow")
    _expect(receiver, clock, plan)
    faults.arm(Fault.STALL_TRANSFER)
    transfer = sender.start(peer, plan)
    assert transfer.poll() is TransferState.TRANSFERRING
    clock.advance(TIMEOUT_S)
    assert transfer.poll() is TransferState.TIMED_OUT
    assert sender.poll() == [transfer] and sender.num_inflight == 0


def test_cancel_releases_the_handle_and_reports_cancelled(pair, clock, faults) -> None:
    sender, receiver, peer = pair
    faults.arm(Fault.STALL_TRANSFER)
    transfer = sender.start(peer, _plan(clock, "req-cancel"))
    assert transfer.cancel() is TransferState.CANCELLED
    assert sender._agent.live_xfer_handles == 0


def test_receiver_times_out_and_quarantines_blocks_without_a_notice(pair, clock) -> None:
    _, receiver, _ = pair
    receiver.expect("req-lost", [1, 2], deadline=clock() + 1.0)
    clock.advance(1.0)
    assert receiver.poll_failures()["req-lost"].state is TransferState.TIMED_OUT
    assert receiver.release("req-lost") is False
    clock.advance(60.0)
    assert receiver.poll_reclaimable() == {"req-lost"}


def test_blocks_released_mid_write_become_reusable_when_the_write_lands(pair, clock) -> None:
    sender, receiver, peer = pair
    plan = _plan(clock, "req-aborted")
    _expect(receiver, clock, plan)
    transfer = sender.start(peer, plan)
    assert receiver.release("req-aborted") is False  # the request was aborted while its WRITE is in flight
    reclaimed: set[str] = set()
    for _ in range(100_000):
        sender.poll()
        reclaimed |= receiver.poll_reclaimable()
        if reclaimed and transfer.state.is_terminal:
            break
    assert reclaimed == {"req-aborted"} and receiver.stale_notices == 0


def _with_checksums(sender: NixlKVSender, plan: TransferPlan) -> TransferPlan:
    """The plan as the prefill engine hands it over: its source blocks' checksums and first token."""
    sums = tuple(block_checksums(_kv(sender), plan.local_block_ids))
    return replace(plan, payload=HandoffPayload(sums, first_token_id=7))


def test_landed_payload_carries_the_checksums_and_first_token(pair, clock) -> None:
    sender, receiver, peer = pair
    plan = _with_checksums(sender, _plan(clock, "req-payload"))
    _expect(receiver, clock, plan)
    arrived, _ = drive(sender, receiver, [sender.start(peer, plan)])
    landed = arrived["req-payload"]
    assert (landed.block_ids, landed.payload) == (plan.remote_block_ids, plan.payload)
    assert LandedVerifier(_kv(receiver)).problem(landed) == ""


def test_checksum_detects_a_corrupted_destination_byte(pair, clock, faults) -> None:
    sender, receiver, peer = pair
    plan = _with_checksums(sender, _plan(clock, "req-corrupt"))
    _expect(receiver, clock, plan)
    faults.arm(Fault.CORRUPT_DESTINATION)
    transfer = sender.start(peer, plan)
    arrived, failures = drive(sender, receiver, [transfer])
    assert transfer.state is TransferState.DONE and not failures
    problem = LandedVerifier(_kv(receiver), faults=faults).problem(arrived["req-corrupt"])
    assert problem == f"checksum mismatch in 1 block(s): [{plan.remote_block_ids[0]}]"


def test_unknown_peer_and_out_of_range_blocks_are_refused_before_posting(pair, clock) -> None:
    sender, _, peer = pair
    with pytest.raises(UnknownPeerError):
        sender.start("nobody", _plan(clock, "r"))
    with pytest.raises(InvalidTransferPlanError, match="remote block id 48"):
        sender.start(peer, TransferPlan("r", (0,), (NUM_BLOCKS,), deadline=clock() + 1))
    assert sender._agent.live_xfer_handles == 0


def test_peer_with_transfers_in_flight_cannot_be_removed(pair, clock, faults) -> None:
    sender, _, peer = pair
    faults.arm(Fault.STALL_TRANSFER)
    sender.start(peer, _plan(clock, "req-busy"))
    with pytest.raises(PeerBusyError):
        sender.remove_peer(peer)


def test_no_handle_leaks_after_200_transfers(pair, clock) -> None:
    sender, receiver, peer = pair
    for i in range(200):
        plan = TransferPlan.create(
            f"r{i}", [i % NUM_BLOCKS], [(i * 7) % NUM_BLOCKS], now=clock(), timeout_s=5
        )
        _expect(receiver, clock, plan)
        arrived, _ = drive(sender, receiver, [sender.start(peer, plan)])
        assert set(arrived) == {plan.request_id}
        receiver.release(plan.request_id)
    agent = sender._agent
    assert (agent.live_xfer_handles, agent.raw._leaked_xfer_handles, sender.num_inflight) == (0, [], 0)


def test_two_processes_write_and_notify(clock) -> None:
    num_blocks = 64
    requests = [("req-x", [60, 3, 17, 42, 5]), ("req-y", [11, 12, 13, 40])]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_process, args=(child, num_blocks, requests))
    proc.start()
    prefill = make_agent("prefill", num_blocks, random_fill=True, seed=5)
    try:
        assert parent.poll(30), "receiver process did not send its handshake"
        info: HandshakeInfo = parent.recv()
        sender = NixlKVSender(prefill)
        peer = sender.add_peer(info)
        sources = {"req-x": [1, 2, 30, 31, 7], "req-y": [50, 51, 52, 53]}
        states = []
        for request_id, dst in requests:
            transfer = sender.start(
                peer, TransferPlan.create(request_id, sources[request_id], dst, now=0, timeout_s=1e9)
            )
            while not transfer.poll().is_terminal:
                pass
            states.append(transfer.state)
        assert parent.poll(30), "receiver process did not report arrivals"
        arrived, failures, landed = parent.recv()
        parent.send("stop")
        proc.join(15)
        assert states == [TransferState.DONE, TransferState.DONE]
        assert (arrived, failures) == ({"req-x", "req-y"}, {})
        for request_id, src in sources.items():
            np.testing.assert_array_equal(landed[request_id], prefill.kv_cache[src].numpy())
        assert prefill.dlist_preparations == 2 and proc.exitcode == 0
        sender.close()
    finally:
        if proc.is_alive():
            proc.kill()
        prefill.close()


def test_layout_of_a_live_agent_matches_the_engine_spec(pair) -> None:
    _, receiver, _ = pair
    info = receiver.handshake_info
    assert (info.layout, info.bytes_per_block, info.num_blocks, info.device_kind) == (
        LAYOUT,
        SPEC.bytes_per_block,
        NUM_BLOCKS,
        "cpu",
    )


def test_write_lands_with_nixl_progress_threads(clock, faults) -> None:
    """`--nixl-progress-thread`: the same WRITE + notice with NIXL progressing on its own threads."""
    prefill = make_agent("prefill", NUM_BLOCKS, random_fill=True, progress_thread=True)
    decode = make_agent("decode", NUM_BLOCKS, random_fill=False, progress_thread=True)
    sender = NixlKVSender(prefill, faults=faults, clock=clock)
    receiver = NixlKVReceiver(decode, ReceiverConfig(quarantine_s=60.0), faults, clock)
    try:
        peer = sender.add_peer(receiver.handshake_info)
        plan = _plan(clock, "req-pt", n=8)
        _expect(receiver, clock, plan)
        transfer = sender.start(peer, plan)
        arrived, _ = drive(sender, receiver, [transfer])
        assert transfer.state is TransferState.DONE and set(arrived) == {"req-pt"}
        assert torch.equal(_kv(receiver)[list(plan.remote_block_ids)], _kv(sender)[list(plan.local_block_ids)])
    finally:
        sender.close()
        _settle(sender, receiver)
        receiver.close()
        prefill.close()
        decode.close()

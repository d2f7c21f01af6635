"""The KV transport contract (kvtransfer/base.py), run against every kind `open_transport` opens:
`nixl` (UCX over DRAM, two agents in this process) and the in-process `memory` fake the worker unit
tests use. A scenario passing on both is what lets those tests stand in for NIXL."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch
from nixl_pair_helpers import LAYOUT, SPEC, ManualClock

from engine.batch import TokenLogprobs
from kvtransfer.base import HandoffPayload, LandedKV, TransferFailure, TransferPlan, TransferState
from kvtransfer.errors import IncompatiblePeerError, InvalidTransferPlanError, PeerBusyError, UnknownPeerError
from kvtransfer.faults import Fault, FaultInjector
from kvtransfer.integrity import LandedVerifier, block_checksums
from kvtransfer.roles import KVTransfer
from kvtransfer.transport import Transport, TransportKind, open_transport
from tests.support.required import require_module

NUM_BLOCKS = 48
TIMEOUT_S = 5.0
QUARANTINE_S = 60.0


@dataclass
class Pair:
    prefill: Transport
    decode: Transport
    peer: str  # the decode side's agent name, as the prefill sender knows it
    src: torch.Tensor  # the prefill side's KV pool (random)
    dst: torch.Tensor  # the decode side's KV pool (zeros)
    clock: ManualClock
    faults: FaultInjector

    def plan(self, request_id: str, n: int = 6, seed: int = 1, **kw: object) -> TransferPlan:
        rng = random.Random(seed)
        local, remote = rng.sample(range(NUM_BLOCKS), n), rng.sample(range(NUM_BLOCKS), n)
        return TransferPlan.create(request_id, local, remote, now=self.clock(), timeout_s=TIMEOUT_S, **kw)  # type: ignore[arg-type]

    def expect(self, plan: TransferPlan) -> None:
        self.decode.receiver.expect(plan.request_id, plan.remote_block_ids, self.clock() + 2 * TIMEOUT_S,
                                    plan.attempt)

    def start_stalled(self, request_id: str) -> KVTransfer:
        """An expected WRITE that is never posted (STALL_TRANSFER): in flight until cancel or deadline."""
        plan = self.plan(request_id)
        self.expect(plan)
        self.faults.arm(Fault.STALL_TRANSFER)
        return self.prefill.sender.start(self.peer, plan)

    def drive(self, transfers: list[KVTransfer], timeout_s: float = 10.0,
              ) -> tuple[dict[str, LandedKV], dict[str, TransferFailure]]:
        """Poll both sides until every transfer is terminal and each request has an outcome."""
        wanted = {t.plan.request_id for t in transfers}
        arrived: dict[str, LandedKV] = {}
        failures: dict[str, TransferFailure] = {}
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            self.prefill.sender.poll()
            arrived.update((a.request_id, a) for a in self.decode.receiver.poll_arrivals())
            failures.update(self.decode.receiver.poll_failures())
            if all(t.state.is_terminal for t in transfers) and wanted <= arrived.keys() | failures.keys():
                break
        return arrived, failures

    def settle(self, seconds: float = 0.05) -> None:
        give_up = time.monotonic() + seconds
        while time.monotonic() < give_up:
            self.prefill.sender.poll()
            self.decode.receiver.poll_failures()


def _pool(random_fill: bool) -> torch.Tensor:
    kv = SPEC.allocate(NUM_BLOCKS, "cpu")
    if random_fill:
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)))
    return kv


@pytest.fixture(params=[TransportKind.NIXL, TransportKind.MEMORY])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    kind = request.param
    if kind is TransportKind.NIXL:
        require_module("nixl._api")
    clock, faults = ManualClock(), FaultInjector()
    src, dst = _pool(True), _pool(False)
    tag = uuid.uuid4().hex[:8]
    prefill = open_transport(kind, f"prefill-{tag}", src, LAYOUT, faults=faults, clock=clock,
                             quarantine_s=QUARANTINE_S)
    decode = open_transport(kind, f"decode-{tag}", dst, LAYOUT, faults=faults, clock=clock,
                            quarantine_s=QUARANTINE_S)
    peer = prefill.sender.add_peer(decode.handshake_info)
    pair = Pair(prefill, decode, peer, src, dst, clock, faults)
    yield pair
    prefill.sender.close()
    pair.settle()  # abort notices from close() reach the receiver before it closes
    prefill.close()
    decode.close()


def test_write_lands_at_random_noncontiguous_block_ids(pair: Pair) -> None:
    plan = pair.plan("req-1", n=12)
    pair.expect(plan)
    transfer = pair.prefill.sender.start(pair.peer, plan)
    pair.drive([transfer])
    assert transfer.state is TransferState.DONE
    assert torch.equal(pair.dst[list(plan.remote_block_ids)], pair.src[list(plan.local_block_ids)])
    untouched = sorted(set(range(NUM_BLOCKS)) - set(plan.remote_block_ids))
    assert not pair.dst[untouched].any()


def test_notices_report_exactly_the_arrived_requests(pair: Pair) -> None:
    plans = [pair.plan("req-a", n=3, seed=2), pair.plan("req-b", n=3, seed=3)]
    for plan in plans:
        pair.expect(plan)
    arrived, failures = pair.drive([pair.prefill.sender.start(pair.peer, p) for p in plans])
    assert (set(arrived), failures) == ({"req-a", "req-b"}, {})
    assert pair.decode.receiver.state("req-a") is TransferState.DONE


def test_landed_payload_carries_checksums_first_token_and_logprobs(pair: Pair) -> None:
    plan = pair.plan("req-payload")
    sums = tuple(block_checksums(pair.src, plan.local_block_ids))
    logprobs = TokenLogprobs(7, -0.25, ((7, -0.25), (3, -1.5)))
    choices = ((3, TokenLogprobs(3, -1.5, ((7, -0.25),))), (9, None))  # n > 1: the other choices' first tokens
    plan = replace(plan, payload=HandoffPayload(sums, first_token_id=7, first_logprobs=logprobs,
                                                choice_first=choices))
    pair.expect(plan)
    arrived, _ = pair.drive([pair.prefill.sender.start(pair.peer, plan)])
    landed = arrived["req-payload"]
    assert (landed.block_ids, landed.payload) == (plan.remote_block_ids, plan.payload)
    assert LandedVerifier(pair.dst).problem(landed) == ""


def test_corrupted_destination_is_caught_by_the_verifier(pair: Pair) -> None:
    plan = pair.plan("req-corrupt")
    plan = replace(plan, payload=HandoffPayload(tuple(block_checksums(pair.src, plan.local_block_ids))))
    pair.expect(plan)
    pair.faults.arm(Fault.CORRUPT_DESTINATION)
    arrived, failures = pair.drive([pair.prefill.sender.start(pair.peer, plan)])
    problem = LandedVerifier(pair.dst, faults=pair.faults).problem(arrived["req-corrupt"])
    assert not failures and problem == f"checksum mismatch in 1 block(s): [{plan.remote_block_ids[0]}]"


@pytest.mark.parametrize(("field", "value"), [("block_size", 32), ("dtype", "bfloat16"), ("num_kv_heads", 4)])
def test_incompatible_peer_is_refused_naming_the_field(pair: Pair, field: str, value: object) -> None:
    mine = pair.decode.handshake_info
    layout = replace(mine.layout, **{field: value})
    theirs = replace(mine, agent_name="decode-other", layout=layout, bytes_per_block=layout.bytes_per_block)
    with pytest.raises(IncompatiblePeerError, match=f"{field}: local=.* peer={value!r}"):
        pair.prefill.sender.add_peer(theirs)


def test_injected_write_failure_aborts_the_receiver_and_frees_its_blocks(pair: Pair) -> None:
    plan = pair.plan("req-fail")
    pair.expect(plan)
    pair.faults.arm(Fault.FAIL_TRANSFER)
    transfer = pair.prefill.sender.start(pair.peer, plan)
    _, failures = pair.drive([transfer])
    assert (transfer.state, transfer.reason) == (TransferState.FAILED, "injected fault: fail_transfer")
    assert failures["req-fail"].state is TransferState.FAILED and "aborted" in failures["req-fail"].reason
    assert pair.decode.receiver.release("req-fail") is True  # the ABORTED notice closed the danger window


def test_a_transfer_terminal_inside_start_is_reported_by_poll_once(pair: Pair) -> None:
    pair.faults.arm(Fault.FAIL_TRANSFER)
    transfer = pair.prefill.sender.start(pair.peer, pair.plan("req-early"))
    assert pair.prefill.sender.poll() == [transfer] and pair.prefill.sender.poll() == []


def test_stalled_write_times_out_at_its_deadline(pair: Pair) -> None:
    transfer = pair.start_stalled("req-slow")
    assert transfer.poll() is TransferState.TRANSFERRING
    pair.clock.advance(TIMEOUT_S)
    assert transfer.poll() is TransferState.TIMED_OUT
    assert pair.prefill.sender.poll() == [transfer]
    assert not pair.dst.any()  # a WRITE that never ran wrote nothing


def test_cancel_of_a_stalled_write_ends_cancelled_and_notifies_the_receiver(pair: Pair) -> None:
    transfer = pair.start_stalled("req-cancel")
    assert transfer.cancel() is TransferState.CANCELLED
    _, failures = pair.drive([transfer])
    assert failures["req-cancel"].state is TransferState.FAILED
    assert pair.decode.receiver.release("req-cancel") is True


def test_dropped_done_notice_times_out_and_quarantines_until_expiry(pair: Pair) -> None:
    plan = pair.plan("req-drop")
    pair.expect(plan)
    pair.faults.arm(Fault.DROP_NOTIFICATION)
    transfer = pair.prefill.sender.start(pair.peer, plan)
    arrived, _ = pair.drive([transfer], timeout_s=0.5)
    assert transfer.state is TransferState.DONE and arrived == {}
    pair.clock.advance(2 * TIMEOUT_S)
    assert pair.decode.receiver.poll_failures()["req-drop"].state is TransferState.TIMED_OUT
    assert pair.decode.receiver.release("req-drop") is False
    assert pair.decode.receiver.poll_reclaimable() == set()
    pair.clock.advance(QUARANTINE_S)
    assert pair.decode.receiver.poll_reclaimable() == {"req-drop"}


def test_quarantined_blocks_are_freed_at_once_when_the_sender_reports_idle(pair: Pair) -> None:
    receiver = pair.decode.receiver
    receiver.expect("req-q", [1, 2], deadline=pair.clock() + 1.0)
    assert receiver.release("req-q") is False
    assert receiver.release("req-q") is False  # a second release cannot free it early
    assert receiver.release("req-q", sender_idle=True) is True
    pair.clock.advance(2 * QUARANTINE_S)
    assert receiver.poll_reclaimable() == set()  # never reported twice


def test_blocks_released_mid_write_are_reclaimable_once_it_lands(pair: Pair) -> None:
    plan = pair.plan("req-aborted")
    pair.expect(plan)
    transfer = pair.prefill.sender.start(pair.peer, plan)
    assert pair.decode.receiver.release("req-aborted") is False  # aborted while its WRITE may land
    reclaimed: set[str] = set()
    give_up = time.monotonic() + 10
    while not (reclaimed and transfer.state.is_terminal) and time.monotonic() < give_up:
        pair.prefill.sender.poll()
        reclaimed |= pair.decode.receiver.poll_reclaimable()
    assert reclaimed == {"req-aborted"}


def test_a_notice_of_another_attempt_is_stale_and_ignored(pair: Pair) -> None:
    old = pair.plan("req-retry", attempt=0)
    pair.decode.receiver.expect("req-retry", old.remote_block_ids, pair.clock() + 2 * TIMEOUT_S, attempt=1)
    transfer = pair.prefill.sender.start(pair.peer, old)
    arrived, _ = pair.drive([transfer], timeout_s=0.5)
    assert transfer.state is TransferState.DONE and arrived == {}
    assert pair.decode.receiver.state("req-retry") is TransferState.PENDING


def test_unknown_peer_and_out_of_range_blocks_are_refused_before_posting(pair: Pair) -> None:
    with pytest.raises(UnknownPeerError):
        pair.prefill.sender.start("nobody", pair.plan("r"))
    with pytest.raises(InvalidTransferPlanError, match="remote block id 48"):
        pair.prefill.sender.start(pair.peer, TransferPlan("r", (0,), (NUM_BLOCKS,), deadline=pair.clock() + 1))
    assert pair.prefill.sender.poll() == []


def test_peer_with_transfers_in_flight_cannot_be_removed(pair: Pair) -> None:
    pair.start_stalled("req-busy")
    with pytest.raises(PeerBusyError):
        pair.prefill.sender.remove_peer(pair.peer)


def test_unknown_transport_kind_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'; valid: nixl, memory"):
        open_transport("rdma", "x", _pool(False), LAYOUT)

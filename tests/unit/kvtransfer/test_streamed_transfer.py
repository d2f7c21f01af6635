"""KV streamed per prefill chunk (kvtransfer/nixl/streamed.py) on the in-memory transport: parts land
without a notice, the one DONE notice follows the last part, and every failure path (abort mid-stream,
dead peer, corrupted chunk, timeout on either side) ends with every block free on both sides: the
sender's WRITE handles all released and the receiver's blocks reusable (at once, or after quarantine)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch
from nixl_pair_helpers import LAYOUT, SPEC, ManualClock

from kvtransfer.base import HandoffPayload, TransferPlan, TransferState
from kvtransfer.errors import InvalidTransferPlanError
from kvtransfer.integrity import LandedVerifier, block_checksums
from kvtransfer.memory import FABRIC, MemoryAgent
from kvtransfer.roles import KVStream
from kvtransfer.transport import Transport, TransportKind, open_transport

NUM_BLOCKS = 16
LOCAL = (1, 2, 3, 4, 5)
REMOTE = (9, 8, 12, 13, 14)
DEADLINE_S = 5.0
QUARANTINE_S = 30.0


class Pair:
    def __init__(self) -> None:
        self.clock = ManualClock()
        self.prefill = self._open("prefill", torch.randn)
        self.decode = self._open("decode", torch.zeros)
        self.peer = self.prefill.sender.add_peer(self.decode.handshake_info)

    def _open(self, role: str, fill) -> Transport:  # type: ignore[no-untyped-def]
        kv = SPEC.allocate(NUM_BLOCKS, "cpu")
        kv.copy_(fill(kv.shape, generator=torch.Generator().manual_seed(1)) if fill is torch.randn else fill(kv.shape))
        return open_transport(TransportKind.MEMORY, f"{role}-{uuid.uuid4().hex[:8]}", kv, LAYOUT,
                              quarantine_s=QUARANTINE_S, clock=self.clock)

    def agent(self, transport: Transport) -> MemoryAgent:
        return FABRIC.lookup(transport.handshake_info.agent_name)

    def kv(self, transport: Transport) -> torch.Tensor:
        return self.agent(transport).kv_cache

    def open_stream(self, rid: str = "r") -> KVStream:
        self.decode.receiver.expect(rid, REMOTE, self.clock() + DEADLINE_S + 1.0)
        return self.prefill.sender.open_stream(self.peer, rid, 0, self.clock() + DEADLINE_S)

    def plan(self, rid: str = "r", checksums: bool = False) -> TransferPlan:
        sums = tuple(block_checksums(self.kv(self.prefill), LOCAL)) if checksums else None
        return TransferPlan(rid, LOCAL, REMOTE, self.clock() + DEADLINE_S, 0, HandoffPayload(sums, first_token_id=7))

    def sender_idle(self) -> bool:
        return self.agent(self.prefill).live_xfer_handles == 0 and self.prefill.sender.num_inflight == 0  # type: ignore[attr-defined]


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.prefill.close()
    p.decode.close()


def test_parts_land_without_a_notice_and_the_done_notice_follows_the_last(pair: Pair) -> None:
    stream = pair.open_stream()
    assert stream.write(LOCAL[:2], REMOTE[:2])
    assert pair.prefill.sender.poll() == []  # the part landed; the stream is not done
    assert bool((pair.kv(pair.decode)[list(REMOTE[:2])] == pair.kv(pair.prefill)[list(LOCAL[:2])]).all())
    assert pair.decode.receiver.poll_arrivals() == []  # no notice for a part
    assert stream.write(LOCAL[2:4], REMOTE[2:4])
    stream.finish(pair.plan())
    assert pair.prefill.sender.poll() == [stream] and stream.state is TransferState.DONE
    landed = pair.decode.receiver.poll_arrivals()
    assert [(a.request_id, a.block_ids, a.payload.first_token_id) for a in landed] == [("r", REMOTE, 7)]
    assert torch.equal(pair.kv(pair.decode)[list(REMOTE)], pair.kv(pair.prefill)[list(LOCAL)])
    assert pair.sender_idle() and pair.decode.receiver.release("r")


def test_the_notice_waits_for_an_earlier_part_still_in_flight(pair: Pair) -> None:
    stream = pair.open_stream()
    agent = pair.agent(pair.prefill)
    agent.hold_writes(True)
    stream.write(LOCAL[:3], REMOTE[:3])
    stream.finish(pair.plan())  # the first part had not landed: the notice may not ride on the last
    assert pair.prefill.sender.poll() == [] and pair.decode.receiver.poll_arrivals() == []
    agent.hold_writes(False)
    assert pair.prefill.sender.poll() == [stream] and stream.state is TransferState.DONE
    assert [a.request_id for a in pair.decode.receiver.poll_arrivals()] == ["r"]
    assert pair.sender_idle()


def test_a_stream_is_moving_only_while_a_part_or_its_notice_is_on_its_way(pair: Pair) -> None:
    """The KV link polls a stream at a WRITE's rate only while it is moving; between parts it sleeps."""
    stream = pair.open_stream()
    agent = pair.agent(pair.prefill)
    assert not stream.moving  # open, nothing posted
    agent.hold_writes(True)
    stream.write(LOCAL[:2], REMOTE[:2])
    pair.prefill.sender.poll()
    assert stream.moving  # a part in flight
    agent.hold_writes(False)
    pair.prefill.sender.poll()
    assert not stream.moving  # the part landed; the next chunk computes
    agent.hold_writes(True)
    stream.finish(pair.plan())
    assert stream.moving  # the rest and the notice
    agent.hold_writes(False)
    assert pair.prefill.sender.poll() == [stream] and stream.state is TransferState.DONE and not stream.moving


def test_a_stream_finished_with_nothing_left_sends_the_notice_alone(pair: Pair) -> None:
    stream = pair.open_stream()
    stream.write(LOCAL, REMOTE)
    pair.prefill.sender.poll()
    stream.finish(pair.plan())
    assert stream.state is TransferState.DONE
    assert [a.block_ids for a in pair.decode.receiver.poll_arrivals()] == [REMOTE]


def test_an_abort_mid_stream_waits_for_nixl_then_frees_both_sides(pair: Pair) -> None:
    stream = pair.open_stream()
    agent = pair.agent(pair.prefill)
    stream.write(LOCAL[:2], REMOTE[:2])
    agent.hold_writes(True)  # the part stays in flight through the abort
    assert stream.cancel() is TransferState.TRANSFERRING and agent.live_xfer_handles == 1
    assert not stream.write(LOCAL[2:], REMOTE[2:])  # a stopping stream posts nothing more
    agent.hold_writes(False)
    assert pair.prefill.sender.poll() == [stream] and stream.state is TransferState.CANCELLED
    failures = pair.decode.receiver.poll_failures()
    assert failures["r"].state is TransferState.FAILED and "aborted" in failures["r"].reason
    assert pair.sender_idle() and pair.decode.receiver.release("r")  # ABORTED notice: reusable at once


def test_a_dead_peer_fails_the_stream_and_releases_every_handle(pair: Pair) -> None:
    stream = pair.open_stream()
    stream.write(LOCAL[:2], REMOTE[:2])
    pair.prefill.sender.poll()
    pair.decode.close()  # the decode worker died
    stream.write(LOCAL[2:], REMOTE[2:])
    assert pair.prefill.sender.poll() == [stream] and stream.state is TransferState.FAILED
    assert "part failed" in stream.reason and pair.sender_idle()


def test_a_corrupted_chunk_is_caught_by_the_checksums_and_its_blocks_are_freed(pair: Pair) -> None:
    stream = pair.open_stream()
    plan = pair.plan(checksums=True)
    stream.write(LOCAL[:2], REMOTE[:2])
    pair.prefill.sender.poll()
    pair.kv(pair.decode)[REMOTE[1]].view(-1)[3] += 1.0  # the first chunk's second block went bad in flight
    stream.finish(plan)
    assert pair.prefill.sender.poll() == [stream] and stream.state is TransferState.DONE
    (landed,) = pair.decode.receiver.poll_arrivals()
    problem = LandedVerifier(pair.kv(pair.decode)).problem(landed)
    assert problem.startswith("checksum mismatch in 1 block(s)") and str(REMOTE[1]) in problem
    assert pair.sender_idle() and pair.decode.receiver.release("r")  # landed: nothing more will write


def test_a_stream_past_its_deadline_times_out_and_tells_the_receiver(pair: Pair) -> None:
    stream = pair.open_stream()
    stream.write(LOCAL[:2], REMOTE[:2])
    pair.prefill.sender.poll()
    pair.clock.advance(DEADLINE_S)  # the last chunk never came (prefill stalled)
    assert pair.prefill.sender.poll() == [stream] and stream.state is TransferState.TIMED_OUT
    assert pair.decode.receiver.poll_failures()["r"].state is TransferState.FAILED
    assert pair.sender_idle() and pair.decode.receiver.release("r")


def test_a_sender_that_died_mid_stream_leaves_the_blocks_quarantined_then_reclaimable(pair: Pair) -> None:
    stream = pair.open_stream()
    agent = pair.agent(pair.prefill)
    stream.write(LOCAL[:2], REMOTE[:2])
    agent.hold_writes(True)
    stream.write(LOCAL[2:], REMOTE[2:])
    pair.clock.advance(DEADLINE_S + 1.0)  # no notice ever comes: the receiver's own deadline
    assert pair.decode.receiver.poll_failures()["r"].state is TransferState.TIMED_OUT
    assert not pair.decode.receiver.release("r")  # a part may still land: quarantined
    pair.clock.advance(QUARANTINE_S)
    assert pair.decode.receiver.poll_reclaimable() == {"r"}
    agent.hold_writes(False)


def test_a_final_plan_that_disagrees_with_the_parts_is_refused(pair: Pair) -> None:
    stream = pair.open_stream()
    stream.write((LOCAL[1], LOCAL[0]), REMOTE[:2])  # swapped: block LOCAL[1] went to REMOTE[0]
    with pytest.raises(InvalidTransferPlanError, match="disagrees"):
        stream.finish(pair.plan())
    with pytest.raises(InvalidTransferPlanError, match="written twice"):
        stream.write(LOCAL[2:3], REMOTE[:1])
    stream.cancel()
    pair.prefill.sender.poll()
    assert stream.state is TransferState.CANCELLED and pair.sender_idle()

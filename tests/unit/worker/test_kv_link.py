"""KVLink on the in-memory transport: the asyncio face of one worker's KV sender and receiver,
driven by the link's own thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import torch
from handoff_harness import transfer_config

from engine.kv_cache import KVCacheSpec
from kvtransfer.base import HandoffPayload, TransferPlan, TransferState
from kvtransfer.errors import IncompatiblePeerError, UnknownPeerError
from kvtransfer.faults import Fault, FaultInjector
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.memory import FABRIC, MemoryAgent
from kvtransfer.nixl.agent import NixlAgentConfig
from services.worker.config import TransferConfig
from services.worker.kv_link import KVLink

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
LAYOUT = KVLayoutInfo.from_spec(SPEC, "tiny")


@dataclass
class Links:
    prefill: KVLink
    decode: KVLink
    src: torch.Tensor
    dst: torch.Tensor
    peer: str
    faults: FaultInjector
    reclaimed: list[str] = field(default_factory=list)

    async def send(self, rid: str, local: list[int], remote: list[int], timeout_s: float = 0.5,
                   payload: HandoffPayload | None = None) -> asyncio.Future:
        plan = TransferPlan.create(rid, local, remote, now=time.monotonic(), timeout_s=timeout_s, payload=payload)
        return await self.prefill.send(self.peer, plan)

    async def expect(self, rid: str, remote: list[int], within_s: float = 1.0) -> asyncio.Future:
        return await self.decode.expect(rid, remote, time.monotonic() + within_s, 0)


@pytest.fixture
async def links() -> AsyncIterator[Links]:
    async with _linked(transfer_config(transfer_timeout_s=0.05, quarantine_s=0.1)) as pair:
        yield pair


@pytest.fixture
async def quiet_links() -> AsyncIterator[Links]:
    """Links whose quiet tick never comes within a test: only a command or a step event wakes them."""
    async with _linked(transfer_config(poll_quiet_s=600.0)) as pair:
        yield pair


@contextlib.asynccontextmanager
async def _linked(config: TransferConfig) -> AsyncIterator[Links]:
    faults, reclaimed = FaultInjector(), []
    src, dst = SPEC.allocate(16, "cpu"), SPEC.allocate(16, "cpu")
    src.copy_(torch.randn(src.shape, generator=torch.Generator().manual_seed(1)))
    tag = uuid.uuid4().hex[:8]
    prefill = KVLink(f"prefill-{tag}", src, LAYOUT, config, faults, lambda rid: None)
    decode = KVLink(f"decode-{tag}", dst, LAYOUT, config, faults, reclaimed.append)
    prefill.start()
    decode.start()
    peer = await prefill.add_peer(decode.handshake_info)
    await decode.accept_peer(prefill.handshake_info)
    try:
        yield Links(prefill, decode, src, dst, peer, faults, reclaimed)
    finally:
        await prefill.aclose(timeout_s=2.0)
        await decode.aclose(timeout_s=2.0)


async def test_a_write_resolves_both_sides_with_the_payload(links: Links) -> None:
    arrival = await links.expect("r1", [7, 2, 11])
    sent = await links.send("r1", [1, 2, 3], [7, 2, 11], payload=HandoffPayload(first_token_id=42))
    result, landed = await asyncio.wait_for(sent, 2), await asyncio.wait_for(arrival, 2)
    assert (result.state, result.num_bytes) == (TransferState.DONE, 3 * SPEC.bytes_per_block)
    assert (landed.state, landed.landed.block_ids, landed.landed.payload.first_token_id) == (
        TransferState.DONE, (7, 2, 11), 42)
    assert torch.equal(links.dst[[7, 2, 11]], links.src[[1, 2, 3]])
    assert await links.decode.release("r1", sender_idle=False) is True  # the notice ended the danger window


async def test_a_landed_request_is_released_without_an_answer_and_before_a_later_expect(links: Links) -> None:
    arrival = await links.expect("r1", [7, 2, 11])
    await links.send("r1", [1, 2, 3], [7, 2, 11], payload=HandoffPayload(first_token_id=42))
    assert (await asyncio.wait_for(arrival, 2)).state is TransferState.DONE
    links.decode.release_safe("r1", sender_idle=False)  # queued, not awaited: the notice made them safe
    again = await links.expect("r1", [7, 2, 11])  # "already expected" unless the release ran first
    await links.send("r1", [1, 2, 3], [7, 2, 11])
    assert (await asyncio.wait_for(again, 2)).state is TransferState.DONE


async def test_blocks_released_as_safe_that_are_not_stay_quarantined_and_are_logged(
        links: Links, caplog: pytest.LogCaptureFixture) -> None:
    await links.expect("r2", [5])  # nothing sent: no notice ended the WRITE, the sender vouched nothing
    links.decode.release_safe("r2", sender_idle=False)
    assert await links.decode.release("unknown", sender_idle=False) is True  # runs after it: a barrier
    assert "released as safe, yet the receiver quarantined its blocks" in caplog.text
    for _ in range(500):  # the receiver's quarantine still guards the blocks, and ends as usual
        if links.reclaimed:
            break
        await asyncio.sleep(0.002)
    assert links.reclaimed == ["r2"]


async def test_handshakes_are_checked_both_ways(links: Links) -> None:
    other = KVLayoutInfo.from_spec(KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=8,
                                               dtype="float32"), "tiny")
    stranger = KVLink(f"odd-{uuid.uuid4().hex[:8]}", KVCacheSpec(2, 2, 8, 8, "float32").allocate(4, "cpu"), other,
                      transfer_config(), FaultInjector(), lambda rid: None)
    try:
        with pytest.raises(IncompatiblePeerError, match="block_size: local=4 peer=8"):
            await links.prefill.add_peer(stranger.handshake_info)
        with pytest.raises(IncompatiblePeerError, match="block_size"):
            await links.decode.accept_peer(stranger.handshake_info)
    finally:
        stranger.close()


async def test_a_write_to_an_unknown_peer_raises_before_anything_is_posted(links: Links) -> None:
    plan = TransferPlan.create("r", [1], [1], now=time.monotonic(), timeout_s=1)
    with pytest.raises(UnknownPeerError):
        await links.prefill.send("nobody", plan)
    assert links.prefill.num_inflight == 0


async def test_a_cancelled_write_resolves_only_once_the_transport_lets_go(links: Links) -> None:
    agent = FABRIC.lookup(links.prefill.handshake_info.agent_name)
    arrival = await links.expect("r2", [4, 5])
    agent.hold_writes(True)
    sent = await links.send("r2", [1, 2], [4, 5])
    links.prefill.cancel("r2", 0)
    await asyncio.sleep(0.05)
    assert not sent.done() and links.prefill.num_inflight == 1  # still in flight: the source blocks are busy
    agent.hold_writes(False)
    result = await asyncio.wait_for(sent, 2)
    assert result.state is TransferState.DONE  # the WRITE finished before the cancel could take effect
    assert (await asyncio.wait_for(arrival, 2)).state is TransferState.DONE


async def test_a_stalled_write_times_out_and_the_receiver_hears_it_aborted(links: Links) -> None:
    arrival = await links.expect("r3", [4, 5])
    links.faults.arm(Fault.STALL_TRANSFER)
    sent = await links.send("r3", [1, 2], [4, 5], timeout_s=0.05)
    assert (await asyncio.wait_for(sent, 2)).state is TransferState.TIMED_OUT
    failure = await asyncio.wait_for(arrival, 2)
    assert failure.state is TransferState.FAILED and "aborted" in failure.reason


async def test_quarantined_blocks_are_reported_on_the_loop_when_the_late_write_lands(links: Links) -> None:
    agent = FABRIC.lookup(links.prefill.handshake_info.agent_name)
    await links.expect("r4", [8, 9])
    agent.hold_writes(True)
    sent = await links.send("r4", [1, 2], [8, 9])
    assert await links.decode.release("r4", sender_idle=False) is False  # aborted mid-WRITE: quarantined
    await asyncio.sleep(0.02)
    assert links.reclaimed == []
    agent.hold_writes(False)
    await asyncio.wait_for(sent, 2)
    for _ in range(500):
        if links.reclaimed:
            break
        await asyncio.sleep(0.002)
    assert links.reclaimed == ["r4"]


async def test_no_notice_times_out_and_the_quarantine_expires(links: Links) -> None:
    arrival = await links.expect("r5", [3], within_s=0.05)
    assert (await asyncio.wait_for(arrival, 2)).state is TransferState.TIMED_OUT
    assert await links.decode.release("r5", sender_idle=False) is False
    await asyncio.sleep(0.1)
    for _ in range(500):
        if links.reclaimed:
            break
        await asyncio.sleep(0.002)
    assert links.reclaimed == ["r5"]


async def test_closing_resolves_writes_in_flight_as_cancelled(links: Links) -> None:
    links.faults.arm(Fault.STALL_TRANSFER)
    sent = await links.send("r6", [1], [1], timeout_s=30)
    await links.prefill.aclose(timeout_s=1.0)
    assert (await asyncio.wait_for(sent, 2)).state is TransferState.CANCELLED


async def test_a_stream_posts_parts_from_any_thread_and_lands_with_one_notice(links: Links) -> None:
    arrival = await links.expect("s1", [9, 10, 11])
    done = links.prefill.open_stream(links.peer, "s1", 0, time.monotonic() + 1.0)
    await asyncio.to_thread(links.prefill.write_part, "s1", 0, (1, 2), (9, 10))  # as the engine thread does
    plan = TransferPlan.create("s1", [1, 2, 3], [9, 10, 11], now=time.monotonic(), timeout_s=0.5,
                               payload=HandoffPayload(first_token_id=5))
    links.prefill.finish_stream(plan)
    result, landed = await asyncio.wait_for(done, 5.0), await asyncio.wait_for(arrival, 5.0)
    assert (result.state, result.num_bytes) == (TransferState.DONE, 3 * LAYOUT.bytes_per_block)
    assert landed.state is TransferState.DONE and landed.landed.payload.first_token_id == 5
    assert torch.equal(links.dst[[9, 10, 11]], links.src[[1, 2, 3]])


class _StepEvent:
    """What the engine hands with a streamed part on CUDA (a `torch.cuda.Event` after the step that fills
    its blocks), driven by hand: CPU tensors have no device events. `synchronize` blocks until `complete()`
    (as the CUDA one does, the GIL released); `broken` makes it raise instead."""

    def __init__(self, broken: bool = False) -> None:
        self._done = threading.Event()
        self.broken = broken
        self.queries = 0

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        self.queries += 1
        return self._done.is_set()

    def synchronize(self) -> None:
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self._done.wait()


async def test_a_stream_part_and_everything_behind_it_wait_for_its_step(links: Links) -> None:
    arrival = await links.expect("s3", [9, 10, 11])
    done = links.prefill.open_stream(links.peer, "s3", 0, time.monotonic() + 5.0)
    step = _StepEvent()
    links.prefill.write_part("s3", 0, (1, 2), (9, 10), step)  # type: ignore[arg-type]
    plan = TransferPlan.create("s3", [1, 2, 3], [9, 10, 11], now=time.monotonic(), timeout_s=5.0,
                               payload=HandoffPayload(first_token_id=5))
    links.prefill.finish_stream(plan)
    for _ in range(500):  # the link thread keeps asking while the step is not done
        if step.queries >= 3:
            break
        await asyncio.sleep(0.002)
    assert step.queries >= 3 and not done.done() and not arrival.done() and not links.dst.any()
    step.complete()
    result, landed = await asyncio.wait_for(done, 5.0), await asyncio.wait_for(arrival, 5.0)
    assert result.state is TransferState.DONE and landed.state is TransferState.DONE
    assert torch.equal(links.dst[[9, 10, 11]], links.src[[1, 2, 3]])


async def test_a_part_goes_once_its_step_completes_without_the_link_polling_for_it(quiet_links: Links) -> None:
    links = quiet_links
    arrival = await links.expect("s4", [9, 10])
    done = links.prefill.open_stream(links.peer, "s4", 0, time.monotonic() + 5.0)
    step = _StepEvent()
    links.prefill.write_part("s4", 0, (1, 2), (9, 10), step)  # type: ignore[arg-type]
    links.prefill.finish_stream(TransferPlan.create("s4", [1, 2], [9, 10], now=time.monotonic(), timeout_s=5.0,
                                                    payload=HandoffPayload(first_token_id=5)))
    await asyncio.sleep(0.05)
    queries = step.queries  # asked once when the part arrived; the link then sleeps (its quiet tick: 600 s)
    await asyncio.sleep(0.05)
    assert step.queries == queries and not done.done()
    step.complete()  # the waiter's synchronize returns and wakes the link thread
    result, landed = await asyncio.wait_for(done, 5.0), await asyncio.wait_for(arrival, 5.0)
    assert result.state is TransferState.DONE and landed.state is TransferState.DONE
    assert torch.equal(links.dst[[9, 10]], links.src[[1, 2]])


async def test_a_step_event_whose_wait_fails_is_still_queried_by_the_link(
        links: Links, caplog: pytest.LogCaptureFixture) -> None:
    arrival = await links.expect("s5", [9])
    done = links.prefill.open_stream(links.peer, "s5", 0, time.monotonic() + 5.0)
    step = _StepEvent(broken=True)
    links.prefill.write_part("s5", 0, (1,), (9,), step)  # type: ignore[arg-type]
    links.prefill.finish_stream(TransferPlan.create("s5", [1], [9], now=time.monotonic(), timeout_s=5.0,
                                                    payload=HandoffPayload(first_token_id=5)))
    for _ in range(500):
        if "step event failed" in caplog.text:
            break
        await asyncio.sleep(0.002)
    assert "waiting for a streamed part's step event failed" in caplog.text and not done.done()
    step.complete()  # seen by the link's own query at its quiet tick
    result, landed = await asyncio.wait_for(done, 5.0), await asyncio.wait_for(arrival, 5.0)
    assert result.state is TransferState.DONE and landed.state is TransferState.DONE


async def test_a_stream_to_an_unknown_peer_resolves_failed_with_nothing_posted(links: Links) -> None:
    done = links.prefill.open_stream("nobody", "s2", 0, time.monotonic() + 1.0)
    links.prefill.write_part("s2", 0, (1,), (9,))  # ignored: no stream
    result = await asyncio.wait_for(done, 5.0)
    assert result.state is TransferState.FAILED and "cannot open the KV stream" in result.reason
    assert not links.dst.any()


async def test_a_decode_peer_of_another_tp_size_is_never_streamed_to(links: Links) -> None:
    """Heterogeneous TP: such a peer gets one head-sliced WRITE per rank after the prefill, no stream."""
    tag, half = uuid.uuid4().hex[:8], KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4,
                                                  dtype="float32")
    ranks = [MemoryAgent(NixlAgentConfig(name=f"tp2-{tag}-r{r}"), half.allocate(4, "cpu"),
                         KVLayoutInfo.from_spec(half, "tiny", tp_size=2, tp_rank=r), FABRIC) for r in (0, 1)]
    try:
        tp2 = dataclasses.replace(ranks[0].handshake_info, ranks=(ranks[1].handshake_info,))
        name = await links.prefill.add_peer(tp2)
        assert (links.prefill.can_stream_to(name), links.prefill.can_stream_to(links.peer)) == (False, True)
    finally:
        for agent in ranks:
            agent.close()

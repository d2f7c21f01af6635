"""What only the in-memory transport promises: a WRITE lands when polled (so TRANSFERRING is
observable), `hold_writes` keeps one in flight through an abort, peers are found by agent name, and
the fake overrides every NixlAgent method (none falls through to NIXL)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from nixl_pair_helpers import LAYOUT, SPEC

from kvtransfer.base import TransferPlan, TransferState
from kvtransfer.errors import TransferSetupError
from kvtransfer.memory import FABRIC, MemoryAgent
from kvtransfer.nixl.agent import NixlAgent
from kvtransfer.transport import Transport, TransportKind, open_transport

NUM_BLOCKS = 16


def _open(role: str, fill: float = 0.0) -> Transport:
    kv = SPEC.allocate(NUM_BLOCKS, "cpu")
    kv.fill_(fill)
    return open_transport(TransportKind.MEMORY, f"{role}-{uuid.uuid4().hex[:8]}", kv, LAYOUT)


@pytest.fixture
def sides() -> Iterator[tuple[Transport, Transport, str]]:
    prefill, decode = _open("prefill", fill=1.0), _open("decode")
    peer = prefill.sender.add_peer(decode.handshake_info)
    yield prefill, decode, peer
    prefill.close()
    decode.close()


def _kv(transport: Transport) -> torch.Tensor:
    return FABRIC.lookup(transport.handshake_info.agent_name).kv_cache


def _plan(request_id: str, timeout_s: float = 5.0) -> TransferPlan:
    return TransferPlan.create(request_id, [1, 2], [5, 9], now=time.monotonic(), timeout_s=timeout_s)


def test_a_write_is_transferring_until_polled_then_lands_before_its_notice(sides) -> None:
    prefill, decode, peer = sides
    decode.receiver.expect("r", [5, 9], time.monotonic() + 5)
    transfer = prefill.sender.start(peer, _plan("r"))
    assert transfer.state is TransferState.TRANSFERRING and not _kv(decode).any()
    assert decode.receiver.poll_arrivals() == []
    assert prefill.sender.poll() == [transfer] and transfer.state is TransferState.DONE
    assert bool((_kv(decode)[[5, 9]] == 1.0).all())
    assert [landed.request_id for landed in decode.receiver.poll_arrivals()] == ["r"]


def test_a_held_write_survives_cancel_and_still_ends_done_once_resumed(sides) -> None:
    prefill, decode, peer = sides
    agent = FABRIC.lookup(prefill.handshake_info.agent_name)
    decode.receiver.expect("r", [5, 9], time.monotonic() + 5)
    agent.hold_writes(True)
    transfer = prefill.sender.start(peer, _plan("r"))
    assert transfer.cancel() is TransferState.TRANSFERRING  # the agent would not let go
    assert prefill.sender.poll() == [] and agent.live_xfer_handles == 1
    agent.hold_writes(False)
    assert prefill.sender.poll() == [transfer]
    assert transfer.state is TransferState.DONE and agent.live_xfer_handles == 0  # the WRITE won the race
    assert [landed.request_id for landed in decode.receiver.poll_arrivals()] == ["r"]


def test_a_write_to_a_closed_peer_fails(sides) -> None:
    prefill, decode, peer = sides
    transfer = prefill.sender.start(peer, _plan("r"))
    decode.close()
    assert prefill.sender.poll() == [transfer] and transfer.state is TransferState.FAILED


def test_peers_are_found_by_agent_name_and_closing_unregisters(sides) -> None:
    prefill, decode, _ = sides
    name = decode.handshake_info.agent_name
    assert name in FABRIC.names()
    decode.close()
    other = _open("prefill-2")
    try:
        assert name not in FABRIC.names()
        with pytest.raises(TransferSetupError, match="no memory agent"):
            other.sender.add_peer(decode.handshake_info)
    finally:
        other.close()


def test_the_memory_agent_inherits_no_nixl_call() -> None:
    def public(cls: type) -> set[str]:
        return {n for n, v in vars(cls).items() if not n.startswith("__") and (callable(v) or isinstance(v, property))}

    inherited = {n for n in public(NixlAgent) - public(MemoryAgent) if not n.startswith("_")}
    assert inherited == {"name", "num_blocks", "peer", "peer_names"}  # bookkeeping only: no NIXL call

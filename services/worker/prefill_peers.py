"""Decode side: the prefill workers this decode worker may use, their channels and handshakes.

Each peer pair handshakes once (Handshake RPC): the decode worker sends its receiver's HandshakeInfo,
the prefill worker checks it and answers with its sender's, which the decode worker checks in turn;
both name every mismatching field. A refused peer is never used again (it is misconfigured, and
retrying would not fix it); a peer that failed at the transport (dead, unreachable, deadline) is
skipped for `peer_down_s` and then tried again (it may have restarted: then it handshakes afresh).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import grpc

from kvtransfer.errors import IncompatiblePeerError
from rpcgen.baton.v1 import worker_pb2 as pb
from rpcgen.baton.v1 import worker_pb2_grpc
from services.common.cluster_auth import ClusterToken, internal_channel
from services.rpc.convert import handshake_from_proto, handshake_to_proto
from services.worker.kv_link import KVLink

log = logging.getLogger(__name__)
_HANDSHAKE_TIMEOUT_S = 10.0


class HandshakeRefusedError(Exception):
    """A prefill worker and this decode worker cannot exchange KV blocks; the message names the fields."""


@dataclass
class PrefillPeer:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    agent_name: str = ""  # set by a successful handshake
    refused: str = ""  # why the handshake was refused (never retried)
    down_until: float = 0.0
    inflight: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def usable(self, now: float) -> bool:
        return not self.refused and now >= self.down_until


class PrefillPeers:
    def __init__(self, addresses: tuple[str, ...], link: KVLink, worker_id: str, peer_down_s: float,
                 cluster_token: ClusterToken | None = None) -> None:
        self._link = link
        self._cluster_token = cluster_token
        self._worker_id = worker_id
        self._peer_down_s = peer_down_s
        self._peers: dict[str, PrefillPeer] = {}
        self._rr = itertools.count()
        for address in addresses:
            self._add(address)

    def _add(self, address: str) -> PrefillPeer:
        channel = internal_channel(address, self._cluster_token)  # the token and the trace go on
        peer = PrefillPeer(address, channel, worker_pb2_grpc.WorkerStub(channel))
        self._peers[address] = peer
        return peer

    @property
    def configured(self) -> bool:
        return bool(self._peers)

    def candidates(self, preferred: str = "", exclude: frozenset[str] = frozenset()) -> list[PrefillPeer]:
        """Usable peers, the preferred one first, then least in flight (round-robin among equals)."""
        if preferred and preferred not in self._peers:
            self._add(preferred)  # the scheduler may name a prefill worker started after us
        now, turn = time.monotonic(), next(self._rr)
        usable = [p for p in self._peers.values() if p.usable(now) and p.address not in exclude]
        n = max(len(usable), 1)
        usable.sort(key=lambda p: (p.address != preferred, p.inflight, (hash(p.address) + turn) % n))
        return usable

    async def connect(self, peer: PrefillPeer) -> str:
        """The peer's agent name, handshaking first if needed (once; concurrent callers wait).

        Raises HandshakeRefusedError (peer marked refused) or grpc.aio.AioRpcError (peer marked down).
        """
        async with peer.lock:
            if peer.refused:
                raise HandshakeRefusedError(peer.refused)
            if peer.agent_name:
                return peer.agent_name
            try:
                peer.agent_name = await self._handshake(peer)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._refuse(peer, e.details() or "refused")
                    raise HandshakeRefusedError(peer.refused) from e
                self.mark_down(peer, f"handshake failed: {e.code().name}")
                raise
            except (IncompatiblePeerError, ValueError) as e:
                self._refuse(peer, str(e))
                raise HandshakeRefusedError(peer.refused) from e
            return peer.agent_name

    def mark_down(self, peer: PrefillPeer, why: str) -> None:
        """Skip the peer for a while; forget its handshake (a restarted peer has a new agent)."""
        peer.down_until = time.monotonic() + self._peer_down_s
        peer.agent_name = ""
        log.warning("prefill worker %s marked down for %.1f s: %s", peer.address, self._peer_down_s, why)

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.channel.close()

    async def _handshake(self, peer: PrefillPeer) -> str:
        request = pb.HandshakeRequest(decode=handshake_to_proto(self._link.handshake_info),
                                      worker_id=self._worker_id)
        response = await peer.stub.Handshake(request, timeout=_HANDSHAKE_TIMEOUT_S)
        info = handshake_from_proto(response.prefill)
        name = await self._link.accept_peer(info)  # our own check, the other way round
        log.info("handshake with prefill worker %s (%s) done", peer.address, name)
        return name

    def _refuse(self, peer: PrefillPeer, why: str) -> None:
        peer.refused = f"prefill worker {peer.address} refused: {why}"
        log.error("KV handshake with %s refused: %s", peer.address, why)

"""`MemoryAgent`: a NixlAgent without NIXL, moving blocks between KV tensors of one process.

Why it stands in for the agent rather than for the sender and receiver: the hand-off's rules
(deadlines, cancel, ABORTED notices, quarantine, stale notices, fault injection) live in the
transport-neutral state machines of kvtransfer/nixl (`NixlKVSender`, `NixlTransfer`,
`NixlKVReceiver`), which only ever call the agent's methods below. Replacing the byte mover alone
keeps one implementation of those rules, so a test on the memory transport exercises the very code
that runs over NIXL, in milliseconds and without UCX.

What a WRITE does here, in NIXL's terms:
- `make_write` prepares a handle (nothing moves), `post` turns it in progress ("PROC");
- the first `status` poll after the post copies the source blocks into the peer's tensor (torch
  index copy) and then queues the WRITE's notification on the peer: the bytes are visible before the
  notice, as NIXL guarantees. Between the post and that poll the transfer reads TRANSFERRING;
- `release` of a handle that has not landed cancels it: nothing lands and no notice is sent (NIXL's
  cancellation, measured on CPU/UCX).
`hold_writes(True)` makes posted WRITEs neither land nor release (NIXL keeping an active handle), so
a test can keep a WRITE in flight through an abort and watch who waits for it.

Unlike the NIXL link, the copy runs on the sender's polling thread (it is the fake's wire); tests
use CPU tensors, where that is a memcpy.

`MemoryFabric` is the memory transport's in-process "network": agents find each other on it by agent
name. One process-wide fabric (`FABRIC`) is what `open_transport("memory", ...)` registers its agents
on, so that a prefill worker's and a decode worker's links built independently in one test process can
reach each other exactly as NIXL agents do: by the name in the peer's handshake.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtransfer.base import HandshakeInfo
from kvtransfer.errors import KVTransferError, TransferSetupError, UnknownPeerError
from kvtransfer.heads import HeadSlice
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.nixl.agent import NixlAgent, NixlAgentConfig, NixlPeer
from kvtransfer.nixl.handshake import describe_local
from kvtransfer.stages import LayerSlice

log = logging.getLogger(__name__)
METADATA_PREFIX = b"baton-memory-agent:"


@dataclass
class _MemoryWrite:
    """A prepared WRITE handle: PREP -> PROC (posted) -> DONE (landed) | ERR; released once."""

    peer: str
    local_idx: torch.Tensor
    remote_idx: torch.Tensor
    notice: bytes
    heads: HeadSlice | None = None  # only this head range of each block (heterogeneous TP)
    layers: LayerSlice | None = None  # only this layer range of each block (pipeline stages)
    state: str = "PREP"
    released: bool = False


class MemoryAgent(NixlAgent):
    """Overrides every NixlAgent method that would call NIXL; inherits only the bookkeeping ones
    (`name`, `num_blocks`, `peer`, `peer_names`: config and the peer table)."""

    def __init__(self, config: NixlAgentConfig, kv_cache: torch.Tensor, layout: KVLayoutInfo,
                 fabric: MemoryFabric) -> None:  # no super().__init__: it would load NIXL
        self.config = config
        self.kv_cache = kv_cache
        self.handshake_info = describe_local(config.name, METADATA_PREFIX + config.name.encode(), kv_cache, layout)
        self._fabric = fabric
        self._peers: dict[str, NixlPeer] = {}
        self._inbox: list[tuple[str, bytes]] = []
        self._inbox_lock = threading.Lock()  # peers' polling threads deliver into it
        self._holding = False
        self.live_xfer_handles = 0
        self.dlist_preparations = 0  # nothing to prepare: stays 0
        self._closed = False
        fabric.register(self)

    @property
    def raw(self) -> Any:
        return self

    def hold_writes(self, on: bool) -> None:
        """Test knob: while on, posted WRITEs neither land nor release (see the module docstring)."""
        self._holding = on

    # ---- peers ------------------------------------------------------------------------------------
    def add_peer(self, info: HandshakeInfo) -> NixlPeer:
        known = self._known_peer(info)
        if known is not None:
            return known
        try:
            target = self._fabric.lookup(info.agent_name)
        except UnknownPeerError as e:
            raise TransferSetupError(f"cannot add memory peer {info.agent_name!r}: {e}") from e
        if target.handshake_info.agent_metadata != info.agent_metadata:
            raise TransferSetupError(f"metadata of {info.agent_name!r} is not that of the live agent")
        peer = NixlPeer(info, remote_dlist=None)
        self._peers[info.agent_name] = peer
        return peer

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)

    # ---- writes -----------------------------------------------------------------------------------
    def make_write(self, peer: str, local_idx: np.ndarray, remote_idx: np.ndarray, notif: bytes,
                   heads: HeadSlice | None = None, layers: LayerSlice | None = None) -> Any:
        self.peer(peer)
        if heads is not None and layers is not None:
            raise TransferSetupError("a WRITE slices heads or layers, not both")
        handle = _MemoryWrite(peer, _index(local_idx), _index(remote_idx), notif, heads, layers)
        self.live_xfer_handles += 1
        return handle

    def post(self, handle: Any) -> str:
        handle.state = "PROC"
        return "PROC"

    def status(self, handle: Any) -> str:
        if handle.state == "PROC" and not self._holding:
            handle.state = self._land(handle)
        return str(handle.state)

    def release(self, handle: Any) -> bool:
        if handle.state == "PROC" and self._holding:
            return False  # "NIXL kept an active transfer handle": the caller retries on its next poll
        assert not handle.released, "a WRITE handle is released once"
        handle.released = True
        self.live_xfer_handles -= 1
        return True

    def _land(self, write: _MemoryWrite) -> str:
        try:
            target = self._fabric.lookup(write.peer)
            src, dst = self.kv_cache, target.kv_cache
            if write.heads is not None:  # [blocks, layers, 2, block_size, heads, head_dim]: a view per side
                src = src.narrow(4, write.heads.src_head, write.heads.num_heads)
                dst = dst.narrow(4, write.heads.dst_head, write.heads.num_heads)
            if write.layers is not None:  # a stage's layers inside the peer's blocks
                src = src.narrow(1, write.layers.src_first, write.layers.num_layers)
                dst = dst.narrow(1, write.layers.dst_first, write.layers.num_layers)
            blocks = src.index_select(0, write.local_idx.to(src.device))
            dst.index_copy_(0, write.remote_idx.to(dst.device), blocks.to(dst.device))
        except Exception as e:  # the peer is gone (or its tensor refused the copy): a transfer error
            log.warning("memory WRITE to %s failed: %s", write.peer, e)
            return "ERR"
        if write.notice:
            target.deliver(self.name, write.notice)
        return "DONE"

    # ---- notifications ----------------------------------------------------------------------------
    def deliver(self, sender: str, message: bytes) -> None:
        """A peer's notification arrives (any thread)."""
        with self._inbox_lock:
            self._inbox.append((sender, message))

    def progress(self) -> None:
        """Nothing to progress: peers deliver straight into the inbox."""

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        return inbox

    def send_notification(self, peer: str, message: bytes) -> None:
        self._fabric.lookup(peer).deliver(self.name, message)

    def close(self) -> None:
        if self._closed:
            return
        if self.live_xfer_handles:
            log.error("closing memory agent %s with %d live transfer handles", self.name, self.live_xfer_handles)
        self._peers.clear()
        self._fabric.unregister(self.name)
        self._closed = True


def _index(ids: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(ids, dtype=np.int64))


class MemoryFabric:
    """Agent name -> live memory agent. Thread-safe: each worker's link thread looks its peers up."""

    def __init__(self) -> None:
        self._agents: dict[str, MemoryAgent] = {}
        self._lock = threading.Lock()

    def register(self, agent: MemoryAgent) -> None:
        with self._lock:
            if agent.name in self._agents:
                raise KVTransferError(f"a memory agent named {agent.name!r} is already registered")
            self._agents[agent.name] = agent

    def unregister(self, name: str) -> None:
        with self._lock:
            self._agents.pop(name, None)

    def lookup(self, name: str) -> MemoryAgent:
        """The live agent called `name`; UnknownPeerError once it closed (a dead peer)."""
        with self._lock:
            agent = self._agents.get(name)
        if agent is None:
            raise UnknownPeerError(f"no memory agent {name!r} on this fabric (closed, or never opened)")
        return agent

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._agents)


FABRIC = MemoryFabric()

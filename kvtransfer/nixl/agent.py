"""One NIXL agent owning one worker's registered KV tensor, its descriptor lists and its peers.

Call sequence (shared/NIXL.md): create the agent with the progress thread off, register the whole
KV tensor once (DRAM on CPU, VRAM on CUDA), hand `handshake_info` to peers out of band (gRPC), and
on the writing side `add_peer(info)` -> `add_remote_agent` + one prepared descriptor list covering
all the peer's blocks. The local list is prepared once, on first use. Per transfer only
`make_prepped_xfer("WRITE", ...)` with index arrays; every handle is released exactly once.

Not thread-safe (NIXL runs in NIXL_THREAD_SYNC_NONE mode): one thread makes every call, and a
sender and a receiver sharing an agent (a "both" worker) must be polled from that same thread.
Poll loops should yield between polls (e.g. sleep 50 us) rather than spin: on a loaded 2-core host
two spinning processes made a 1-block WRITE take ~7 ms instead of ~0.3 ms. Keep torch's CPU thread
pool small in the polling process too (checksums with OpenMP threads spinning next to a polling
peer ran 10x slower).

Measured on one H200 (2026-11-26): two agents in ONE process writing VRAM->VRAM on the same GPU are
correct but slow (~0.4 GB/s; UCX cannot use CUDA IPC inside one process), so a worker that is both
prefill and decode on one GPU should hand KV over with a device copy, not NIXL.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtransfer.base import HandshakeInfo
from kvtransfer.errors import KVTransferError, NixlUnavailableError, TransferSetupError, UnknownPeerError
from kvtransfer.heads import HeadSlice
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.nixl.descriptors import block_rows, head_slice_rows, layer_slice_rows
from kvtransfer.nixl.handshake import describe_local, validate_kv_tensor
from kvtransfer.stages import LayerSlice

log = logging.getLogger(__name__)
LOCAL_AGENT = "NIXL_INIT_AGENT"  # prep_xfer_dlist's name for "my own descriptors"


def import_nixl_api() -> Any:
    """`nixl._api`, or NixlUnavailableError saying why (heavy import: only call where NIXL is used)."""
    try:
        return importlib.import_module("nixl._api")
    except (ImportError, OSError) as e:
        raise NixlUnavailableError(
            f"nixl is not usable here: {e}. Install it: pip install nixl==1.5.1"
        ) from e


def nixl_available() -> bool:
    try:
        import_nixl_api()
    except NixlUnavailableError:
        return False
    return True


@dataclass(frozen=True)
class NixlAgentConfig:
    name: str  # unique per process and role, e.g. "prefill-0-tp0-3f2a9c1d"
    backends: tuple[str, ...] = ("UCX",)
    # Off by default: with it on each agent busy-polls ~half a core (on 2 cores throughput halved);
    # with it off the passive side must keep polling (KVReceiver's rule).
    progress_thread: bool = False
    num_threads: int = 0  # UCX backend worker threads (0: NIXL's default)
    capture_telemetry: bool = False  # per-transfer descriptor counts and timings (get_xfer_telemetry)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("NixlAgentConfig.name is empty")
        if not self.backends:
            raise ValueError("NixlAgentConfig.backends is empty; valid: UCX (CPU and GPU)")
        if self.num_threads < 0:
            raise ValueError(f"NixlAgentConfig.num_threads must be >= 0, got {self.num_threads}")


@dataclass
class NixlPeer:
    info: HandshakeInfo
    remote_dlist: Any  # nixl_prepped_dlist_handle covering all the peer's blocks, one row per block

    @property
    def name(self) -> str:
        return self.info.agent_name


class NixlAgent:
    def __init__(self, config: NixlAgentConfig, kv_cache: torch.Tensor, layout: KVLayoutInfo) -> None:
        validate_kv_tensor(kv_cache, layout)
        api = import_nixl_api()
        conf = api.nixl_agent_config(
            enable_prog_thread=config.progress_thread,
            backends=list(config.backends),
            capture_telemetry=config.capture_telemetry,
            num_threads=config.num_threads,
        )
        self._agent = api.nixl_agent(config.name, conf)
        missing = [b for b in config.backends if b not in self._agent.backends]
        if missing:
            raise KVTransferError(
                f"NIXL backends {missing} failed to load; available plugins: {self._agent.get_plugin_list()}"
            )
        self.config = config
        self.kv_cache = kv_cache
        self._registration = self._agent.register_memory(kv_cache)
        self.handshake_info = describe_local(config.name, self._agent.get_agent_metadata(), kv_cache, layout)
        self._local_dlist: Any = None
        self._peers: dict[str, NixlPeer] = {}
        self._inbox: list[tuple[str, bytes]] = []  # notifications progressed but not yet drained
        self.live_xfer_handles = 0  # created minus released; 0 when idle, else a leak
        self.dlist_preparations = 0  # prep_xfer_dlist calls: 1 local + 1 per peer, never per transfer
        self._closed = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def num_blocks(self) -> int:
        return self.handshake_info.num_blocks

    @property
    def raw(self) -> Any:
        """The underlying nixl_agent (tests and telemetry only)."""
        return self._agent

    def add_peer(self, info: HandshakeInfo) -> NixlPeer:
        known = self._known_peer(info)
        if known is not None:
            return known
        try:
            loaded = self._agent.add_remote_agent(info.agent_metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != info.agent_name:
                self._agent.remove_remote_agent(loaded)
                raise KVTransferError(f"metadata names agent {loaded!r}, handshake says {info.agent_name!r}")
            rows = block_rows(info.base_address, info.num_blocks, info.bytes_per_block, info.device_id)
            remote = self._prep(info.agent_name, rows, info.mem_type)
            # Non-blocking: starts the UCX wire-up now (the peer's polling completes it), which takes
            # the first WRITE from ~30 ms to ~6 ms on CPU.
            self._agent.make_connection(info.agent_name)
        except KVTransferError:
            raise
        except Exception as e:
            raise TransferSetupError(f"cannot add NIXL peer {info.agent_name!r}: {e}") from e
        peer = NixlPeer(info, remote)
        self._peers[info.agent_name] = peer
        log.info("kv peer added: %s (%d blocks, %s)", info.agent_name, info.num_blocks, info.mem_type)
        return peer

    def _known_peer(self, info: HandshakeInfo) -> NixlPeer | None:
        """The peer already added under this name (re-adding it is a no-op), None if new; a name that
        comes back with other metadata must be removed first."""
        known = self._peers.get(info.agent_name)
        if known is not None and known.info != info:
            raise KVTransferError(f"peer {info.agent_name!r} re-announced with new metadata; remove it first")
        return known

    def peer(self, name: str) -> NixlPeer:
        try:
            return self._peers[name]
        except KeyError:
            raise UnknownPeerError(f"no KV peer {name!r}; known: {sorted(self._peers)}") from None

    def peer_names(self) -> list[str]:
        return sorted(self._peers)

    def remove_peer(self, name: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        peer.remote_dlist.release()
        self._agent.remove_remote_agent(name)
        log.info("kv peer removed: %s", name)

    def make_write(self, peer: str, local_idx: np.ndarray, remote_idx: np.ndarray, notif: bytes,
                   heads: HeadSlice | None = None, layers: LayerSlice | None = None) -> Any:
        """A prepared (not yet posted) WRITE handle; the caller must pass it to `release` exactly once.
        `heads`: only that head range of each block (heterogeneous TP). A head range is strided within
        a block, so such a WRITE has a descriptor per (layer, K/V, token) row, made per transfer.
        `layers`: this rank's blocks into that layer range of the peer's (pipeline stages of other
        splits): one descriptor per block, made per transfer."""
        target = self.peer(peer)
        if heads is not None and layers is not None:
            raise TransferSetupError("a WRITE slices heads or layers, not both")
        try:
            mine = self.handshake_info
            if heads is not None:
                handle = self._make_row_write(target, head_slice_rows(mine, local_idx, heads.src_head, heads.num_heads),
                                              head_slice_rows(target.info, remote_idx, heads.dst_head,
                                                              heads.num_heads), notif)
            elif layers is not None:
                handle = self._make_row_write(
                    target, layer_slice_rows(mine, local_idx, layers.src_first, layers.num_layers),
                    layer_slice_rows(target.info, remote_idx, layers.dst_first, layers.num_layers), notif)
            else:
                handle = self._agent.make_prepped_xfer("WRITE", self._local(), local_idx, target.remote_dlist,
                                                       remote_idx, notif)
        except Exception as e:
            raise TransferSetupError(f"NIXL refused a WRITE to {peer!r}: {e}") from e
        self.live_xfer_handles += 1
        return handle

    def _make_row_write(self, target: NixlPeer, local: np.ndarray, remote: np.ndarray, notif: bytes) -> Any:
        """A WRITE of descriptor rows made for this transfer (not the prepared whole-block lists)."""
        return self._agent.initialize_xfer("WRITE", self._agent.get_xfer_descs(local, self.handshake_info.mem_type),
                                           self._agent.get_xfer_descs(remote, target.info.mem_type),
                                           target.name, notif)

    def post(self, handle: Any) -> str:
        """'DONE' | 'PROC' | 'ERR' (NIXL's own words)."""
        return str(self._agent.transfer(handle))

    def status(self, handle: Any) -> str:
        return str(self._agent.check_xfer_state(handle))

    def release(self, handle: Any) -> bool:
        """Release a handle (NIXL cancels it if still active). False if NIXL refused: still active."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            log.warning("NIXL kept an active transfer handle (will retry): %s", e)
            return False
        self.live_xfer_handles -= 1
        return True

    def progress(self) -> None:
        """Drive NIXL/UCX progress (connection wire-up, the passive side of peers' WRITEs, our own
        outgoing notices) and buffer the notifications it yields. With the progress thread off this
        must run every few milliseconds on both sides; `get_new_notifs` is NIXL's progress call."""
        for sender, msgs in self._agent.get_new_notifs().items():
            self._inbox.extend((sender, msg) for msg in msgs)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        """(sender agent name, message) for every notification received since the last call."""
        self.progress()
        inbox, self._inbox = self._inbox, []
        return inbox

    def send_notification(self, peer: str, message: bytes) -> None:
        self._agent.send_notif(peer, message)

    def close(self) -> None:
        """Remove peers, release the local list, deregister the tensor. Transfers must be terminal."""
        if self._closed:
            return
        if self.live_xfer_handles:
            log.error(
                "closing NIXL agent %s with %d live transfer handles", self.name, self.live_xfer_handles
            )
        for name in list(self._peers):
            self.remove_peer(name)
        if self._local_dlist is not None:
            self._local_dlist.release()
        self._agent.deregister_memory(self._registration)
        self._closed = True

    def _local(self) -> Any:
        if self._local_dlist is None:
            info = self.handshake_info
            rows = block_rows(info.base_address, info.num_blocks, info.bytes_per_block, info.device_id)
            self._local_dlist = self._prep(LOCAL_AGENT, rows, info.mem_type)
        return self._local_dlist

    def _prep(self, agent_name: str, rows: np.ndarray, mem_type: str) -> Any:
        self.dlist_preparations += 1
        return self._agent.prep_xfer_dlist(agent_name, rows, mem_type)

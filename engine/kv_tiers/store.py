"""The bytes of the tiers below the GPU pool and the copies between them (the only torch here).

Keeping a block below the GPU. The block manager hands the store each block that becomes cached-free
(`offer`: its request finished, its KV is final and may be evicted later) and each cached-free block
it evicts for new content (`demote`). An offered block is copied to a host slot in the background: its
copy is queued and issued with the step's others as one batch (engine/kv_tiers/block_copies.py) when the
engine calls `between_steps`, so by the time the pool evicts the block its bytes are usually below the
GPU already and the eviction costs a lookup. `demote` keeps a block that was never offered the same
way, issuing its copy at once, and orders the engine's stream after any copy still reading the block.
Nothing on the engine thread copies, checksums or waits for the host.

A full host tier evicts its least recently used block: the victim's slot is retired (a spare slot of
the spill window takes the new block) and the I/O thread writes the victim to disk from the slot itself,
once the slot's copy event has completed; the slot is released when the write is reaped. With the whole
spill window in flight (the disk writer is behind) the victim is dropped instead (`spills_dropped`).
With no host tier, a demoted block goes to disk through a spare slot the same way. A full disk tier drops
its oldest file.

Promotion (`start_load` / `poll` / `cancel`, driven by the batcher): a prompt's blocks found below the
GPU are copied into GPU blocks the batcher has just allocated. Host blocks are copied on their own
stream with one event, after only the copies that concern them; disk blocks are read into a staging
buffer, checksum-verified and copied by the single I/O thread. The sequence waits (LOADING_KV) while the
batch runs on; `poll` never blocks. Every entry a load reads is pinned in its tier until the load is
finished or cancelled, so it cannot be evicted under it.

Dangerous windows: an abort during a load must not free its GPU blocks while a copy still writes into
them, so `cancel` waits for the in-flight copies (cancelling disk reads not yet started). A host slot
must not be overwritten while the I/O thread writes it to disk: retired slots return through `reap_writes`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.kv_tiers.block_copies import BlockCopies
from engine.kv_tiers.disk_files import BlockFileError, DiskBlockFiles
from engine.kv_tiers.load_policy import LoadCostModel, measure_host_bandwidth
from engine.kv_tiers.spill_writer import SpillWriter
from engine.kv_tiers.tier_lru import Placement, TierLRU
from engine.kv_tiers.tier_stats import TierStats, TierStatsSnapshot
from engine.kv_tiers.types import LOWER_TIERS, KVTier, LoadFailure, LoadResult, LoadState, TierConfig
from tokenization.block_hashes import block_hashes

_DISK_BANDWIDTH_PRIOR = 1e9  # bytes/s until a disk load was measured (a local NVMe reads ~2-7 GB/s)
# The spill window: host slots whose bytes may be on their way to disk at once (spare slots beyond the
# host tier's size). It bounds how far the disk writer may fall behind, in pinned memory.
_SPILL_WINDOW_BYTES = 256 * 1024**2
_SPILL_WINDOW_MAX_SLOTS = 1024


@dataclass(frozen=True)
class _BlockLoad:
    block_id: int  # destination GPU block
    block_hash: int
    tier: KVTier


@dataclass
class _Load:
    blocks: list[_BlockLoad]
    started_at: float
    host_started: torch.cuda.Event | None = None  # timing events around the host copies (None: CPU, or
    host_done: torch.cuda.Event | None = None  # no host block)
    host_copy_s: float = 0.0  # CPU: the host copies' own time
    reads: dict[int, Future[float]] = field(default_factory=dict)  # disk block hash -> its read (seconds)


class TieredKVStore:
    """Host and disk tiers of one worker's KV pool. Not thread-safe: the engine loop calls it."""

    def __init__(self, config: TierConfig, kv_cache: torch.Tensor, block_size: int,
                 spill_window_blocks: int | None = None) -> None:
        """`spill_window_blocks`: host slots that may be on their way to disk at once (default: 256 MiB)."""
        self.kv_cache = kv_cache  # [num_blocks, *block_shape], contiguous
        self.block_size = block_size
        self.bytes_per_block = kv_cache[0].numel() * kv_cache.element_size()
        self._cuda = kv_cache.is_cuda
        disk_blocks = config.disk_bytes // self.bytes_per_block if config.disk_dir else 0
        spill_window = spill_window_blocks or min(_SPILL_WINDOW_MAX_SLOTS,
                                                  max(1, _SPILL_WINDOW_BYTES // self.bytes_per_block))
        # Per-block paths use the two attributes (a dict lookup by an enum hashes it in Python).
        self._host_lru = TierLRU(config.host_bytes // self.bytes_per_block, spill_window if disk_blocks else 0)
        self._disk_lru = TierLRU(disk_blocks)
        self._lru = {KVTier.HOST: self._host_lru, KVTier.DISK: self._disk_lru}
        self._host_demotions = self._disk_demotions = 0  # not yet folded into `stats` (see _fold_stats)
        self._host = torch.empty((self._host_lru.num_slots, *kv_cache.shape[1:]), dtype=kv_cache.dtype,
                                 pin_memory=self._cuda)
        self._copies = BlockCopies(kv_cache, self._host)
        self._disk = (SpillWriter(DiskBlockFiles(config.disk_dir), self._host)
                      if config.disk_dir and disk_blocks else None)
        self._io_stream = torch.cuda.Stream(kv_cache.device) if self._cuda and self._disk else None  # disk reads
        self._read_staging = (torch.empty((1, *kv_cache.shape[1:]), dtype=kv_cache.dtype, pin_memory=self._cuda)
                              if self._disk else None)  # the I/O thread's
        self._offered: dict[int, int] = {}  # cached-free GPU block -> its hash, as offered (until evicted)
        self._loads: dict[str, _Load] = {}
        self._changed: list[int] = []  # hashes whose lower-tier presence changed (KV events)
        self.stats = TierStats()
        host_bandwidth = measure_host_bandwidth(kv_cache, self._host, self.bytes_per_block)
        self.cost = LoadCostModel({KVTier.HOST: host_bandwidth, KVTier.DISK: _DISK_BANDWIDTH_PRIOR},
                                  self.bytes_per_block, block_size, config.min_load_speedup)

    # ---- lookups --------------------------------------------------------------------------------
    def lower_tier_of(self, block_hash: int) -> KVTier | None:
        """The fastest lower tier holding `block_hash`, if any."""
        return next((t for t in LOWER_TIERS if block_hash in self._lru[t]), None)

    def drain_changed_hashes(self) -> list[int]:
        changed, self._changed = self._changed, []
        return changed

    # ---- keeping blocks below the GPU -------------------------------------------------------------
    def offer(self, block_id: int, block_hash: int) -> None:
        """A block became cached-free, its KV final: start keeping it below the GPU (its copy is queued and
        issued by `between_steps`, or at once if the pool evicts the block first)."""
        self._offered[block_id] = block_hash
        self._keep(block_id, block_hash, evicting=False)

    def demote(self, block_id: int, block_hash: int) -> None:
        """The pool evicts a cached-free block for new content: order the engine's next writes into it after
        any copy still reading it. Its offer was its chance to go below the GPU (a host or disk tier that
        dropped it since had better uses for the room); a block that was never offered is kept now."""
        if self._offered.pop(block_id, None) != block_hash:
            self._keep(block_id, block_hash, evicting=True)
        if self._copies.is_queued(block_id):
            self._issue()
        self._copies.guard_overwrite(block_id)

    def between_steps(self) -> None:
        """Once per engine step, before scheduling: issue the queued copies as one batch, reap disk writes."""
        self._issue()
        self.reap_writes()
        self._fold_stats()

    def _keep(self, block_id: int, block_hash: int, evicting: bool) -> None:
        """Queue a copy of the block to host (victims to disk); a block already in host memory is only
        touched, and one on disk too when it is being evicted (a copy then would be on the critical path;
        an offer's batched copy is not, and brings a history that was spilled back up to host memory)."""
        host, disk = self._host_lru, self._disk_lru
        if block_hash in host:
            host.touch(block_hash)
            return
        if evicting and block_hash in disk:
            disk.touch(block_hash)
            return
        placement = host.insert(block_hash, retire_victim=self._disk is not None)
        if placement is not None:
            if placement.evicted_hash is not None:
                self._evicted_from_host(placement)
            self._copies.queue_down(block_id, placement.slot)
            self._host_demotions += 1
            self._changed.append(block_hash)
            return
        if self._disk is None or block_hash in disk:
            return
        slot = host.take_spare()  # no host tier (or every host entry is being loaded): to disk through it
        if slot is None:
            self.stats.spills_dropped += 1
            return
        self._copies.queue_down(block_id, slot)
        self._spill_later(block_hash, slot)

    def _evicted_from_host(self, placement: Placement) -> None:
        assert placement.evicted_hash is not None
        self._changed.append(placement.evicted_hash)
        if placement.retired_slot is not None:
            self._spill_later(placement.evicted_hash, placement.retired_slot)
        elif self._disk is not None and placement.evicted_hash not in self._disk_lru:
            self.stats.spills_dropped += 1  # the whole spill window is in flight: the disk writer is behind

    def _spill_later(self, block_hash: int, slot: int) -> None:
        """Put a retired host slot's block in the disk tier; its write is submitted by `_issue`, once the
        copy into the slot has an event the I/O thread can wait for."""
        disk = self._disk_lru
        placement = None if block_hash in disk else disk.insert(block_hash)
        if placement is None:  # already on disk (touched), or every file is being loaded
            if block_hash in disk:
                disk.touch(block_hash)
            self._host_lru.release(slot)
            return
        if placement.evicted_hash is not None:
            assert self._disk is not None
            self._disk.defer_delete(placement.evicted_hash)  # in order with the writes before it
            self._changed.append(placement.evicted_hash)
        assert self._disk is not None
        self._disk.defer_write(block_hash, slot)
        self._disk_demotions += 1
        self._changed.append(block_hash)

    def _fold_stats(self) -> None:
        """Per-block counts are plain ints on the hot path; fold them into `stats` (snapshots, steps)."""
        for tier, n in ((KVTier.HOST, self._host_demotions), (KVTier.DISK, self._disk_demotions)):
            if n:
                self.stats.demoted_blocks[tier] += n
                self.stats.demoted_bytes[tier] += n * self.bytes_per_block
        self._host_demotions = self._disk_demotions = 0

    def _issue(self) -> None:
        """Issue the queued copies, then hand the I/O thread the disk work that waited for them."""
        self._copies.issue()
        if self._disk is not None:
            self._disk.submit(self._copies.slot_ready)

    def reap_writes(self) -> None:
        """Release the slots of finished disk writes; a failed write drops its entry (counted by reason)
        unless a load is reading it (that load then fails with the write's reason)."""
        if self._disk is None:
            return
        disk = self._disk_lru
        for done in self._disk.reap():
            self._host_lru.release(done.slot)
            if done.error is not None and done.block_hash in disk and not disk.is_pinned(done.block_hash):
                disk.remove(done.block_hash)
                self.stats.fallbacks[done.error.reason] += 1
                self._changed.append(done.block_hash)

    # ---- promotion ------------------------------------------------------------------------------
    def start_load(self, request_id: str, token_ids: list[int], block_ids: list[int], num_cached: int) -> int:
        """Start copying the blocks after the first `num_cached` tokens that a lower tier holds into
        `block_ids` (already allocated). Returns the tokens being loaded (0: nothing to load, no load
        registered). The last token's block is never loaded (its logits must be computed)."""
        plan = self._plan_load(token_ids, block_ids, num_cached)
        if not plan:
            return 0
        self._issue()  # the load may read slots or files that queued copies and writes are filling
        load = _Load(plan, time.perf_counter())
        for block in plan:
            self._lru[block.tier].pin(block.block_hash)
            self._lru[block.tier].touch(block.block_hash)
        self._copy_host_blocks(load)
        for block in plan:
            if block.tier is KVTier.DISK:
                assert self._disk is not None
                load.reads[block.block_hash] = self._disk.io.submit(
                    self._read_disk_block, block, self._disk.latest_write(block.block_hash),
                    self._copies.reading(block.block_id))
        self._loads[request_id] = load
        return len(plan) * self.block_size

    def _plan_load(self, token_ids: list[int], block_ids: list[int], num_cached: int) -> list[_BlockLoad]:
        first, last = num_cached // self.block_size, (len(token_ids) - 1) // self.block_size
        if first >= last:
            return []
        plan: list[_BlockLoad] = []
        for offset, block_hash in enumerate(block_hashes(token_ids[:last * self.block_size], self.block_size)[first:]):
            tier = self.lower_tier_of(block_hash)
            if tier is None:
                break
            if not self.cost.worth_loading(tier):
                self.stats.skipped_slower_than_recompute += 1
                break
            plan.append(_BlockLoad(block_ids[first + offset], block_hash, tier))
        return plan

    def _copy_host_blocks(self, load: _Load) -> None:
        pairs = [(self._host_slot(b), b.block_id) for b in load.blocks if b.tier is KVTier.HOST]
        if not pairs:
            return
        start = time.perf_counter()
        events = self._copies.copy_up(pairs)
        if events is None:  # CPU: copied already
            load.host_copy_s = time.perf_counter() - start
            return
        # Timed by events: the engine polls once per step, so the wall time to DONE would measure the step
        # length, not the copy, and make every tier look slower than recomputing.
        load.host_started, load.host_done = events

    def _host_slot(self, block: _BlockLoad) -> int:
        slot = self._host_lru.slot_of(block.block_hash)
        assert slot is not None, "a pinned host entry lost its slot"
        return slot

    def _read_disk_block(self, block: _BlockLoad, write: Future[None] | None,
                         destination_read: torch.cuda.Event | None) -> float:
        """I/O thread: read, verify and copy one disk block into its GPU block; returns the seconds the read
        and copy took (not counting a wait for the block's own write). `destination_read`: a copy that
        still reads the destination block's old bytes (its demotion), which the copy must follow."""
        assert self._disk is not None and self._read_staging is not None
        if write is not None and isinstance(write.exception(), BlockFileError):
            raise write.exception()  # type: ignore[misc]
        start = time.perf_counter()
        staged = self._read_staging[0]
        self._disk.files.read_into(block.block_hash, staged)
        destination = self.kv_cache[block.block_id]
        if self._io_stream is None:
            destination.copy_(staged)
            return time.perf_counter() - start
        if destination_read is not None:
            self._io_stream.wait_event(destination_read)
        with torch.cuda.stream(self._io_stream):
            destination.copy_(staged, non_blocking=True)
        self._io_stream.synchronize()  # on the I/O thread: the engine thread never waits for it
        return time.perf_counter() - start

    def poll(self, request_id: str) -> LoadResult:
        """Where a load stands; once DONE it is forgotten (its pins released)."""
        load = self._loads[request_id]
        if load.host_done is not None and not load.host_done.query():
            return LoadResult(LoadState.PENDING)
        if not all(read.done() for read in load.reads.values()):
            return LoadResult(LoadState.PENDING)
        del self._loads[request_id]
        return self._finish(load)

    def _finish(self, load: _Load) -> LoadResult:
        loaded: list[_BlockLoad] = []
        failures: list[LoadFailure] = []
        for block in load.blocks:
            read = load.reads.get(block.block_hash)
            error = read.exception() if read is not None else None
            self._lru[block.tier].unpin(block.block_hash)
            if isinstance(error, BlockFileError):
                failures.append(error.reason)
                self._drop_bad_disk_block(block.block_hash)
            elif error is not None:
                failures.append(LoadFailure.IO_ERROR)
            elif not failures:
                loaded.append(block)
        copy_s = {KVTier.HOST: self._host_copy_seconds(load),
                  KVTier.DISK: sum(r.result() for r in load.reads.values() if r.exception() is None)}
        for tier in LOWER_TIERS:
            n = sum(1 for b in loaded if b.tier is tier)
            if n:
                self.stats.record_load(tier, n, n * self.bytes_per_block)
                self.cost.observe_load(tier, n * self.bytes_per_block, copy_s[tier])
        self.stats.fallbacks.update(failures)
        self.stats.pending_latencies.append(time.perf_counter() - load.started_at)
        return LoadResult(LoadState.DONE, len(loaded) * self.block_size, tuple(failures))

    @staticmethod
    def _host_copy_seconds(load: _Load) -> float:
        """The host copies' own duration (the events completed once `poll` saw `host_done`)."""
        if load.host_started is None or load.host_done is None:
            return load.host_copy_s
        return load.host_started.elapsed_time(load.host_done) / 1e3

    def _drop_bad_disk_block(self, block_hash: int) -> None:
        disk = self._disk_lru
        if block_hash in disk and not disk.is_pinned(block_hash):
            disk.remove(block_hash)
            assert self._disk is not None
            self._disk.io.submit(self._disk.files.delete, block_hash)
            self._changed.append(block_hash)

    def cancel(self, request_id: str) -> bool:
        """Abandon a load (abort, timeout): returns once no copy writes into its GPU blocks any more,
        with every pin released. Returns whether a load was registered."""
        load = self._loads.pop(request_id, None)
        if load is None:
            return False
        if load.host_done is not None:
            load.host_done.synchronize()
        for read in load.reads.values():
            if not read.cancel():
                read.exception()  # waits for a read that already started
        for block in load.blocks:
            self._lru[block.tier].unpin(block.block_hash)
        return True

    # ---- state ----------------------------------------------------------------------------------
    @property
    def disk_files(self) -> DiskBlockFiles | None:
        return self._disk.files if self._disk is not None else None

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._loads)

    def snapshot(self) -> TierStatsSnapshot:
        self._fold_stats()
        s = self.stats
        return TierStatsSnapshot(
            capacity_blocks={t: self._lru[t].capacity for t in LOWER_TIERS},
            occupied_blocks={t: len(self._lru[t]) for t in LOWER_TIERS},
            pinned_blocks={t: self._lru[t].num_pinned for t in LOWER_TIERS},
            hit_blocks=dict(s.hit_blocks), loaded_bytes=dict(s.loaded_bytes),
            demoted_blocks=dict(s.demoted_blocks), demoted_bytes=dict(s.demoted_bytes),
            fallbacks=dict(s.fallbacks), skipped_slower_than_recompute=s.skipped_slower_than_recompute,
            spills_dropped=s.spills_dropped,
            loads_in_flight=len(self._loads), load_latency_s=s.take_latencies())

    def flush(self) -> None:
        """Issue every queued copy, wait until every disk write, read and delete has run, reap the writes."""
        self._issue()
        if self._disk is not None:
            self._disk.barrier()
        self.reap_writes()

    def close(self) -> None:
        if self._disk is not None:
            self._disk.close()

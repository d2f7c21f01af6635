"""The bytes of the tiers below the GPU pool and the copies between them (the only torch here).

Demotion (`demote`, called by the block manager as it hands an evicted cached block out for new
content): the block's bytes are copied to a host slot before anything can overwrite them. On CUDA
the copy runs on a side stream that first waits for the engine's stream (the block's KV was written
there); the engine's stream then waits for the copy's event, so the next step's writes into the
block are ordered after it without the host ever waiting. A full host tier spills its least recently
used block to disk (a clone handed to the I/O thread); a full disk tier drops its oldest file.

Promotion (`start_load` / `poll` / `cancel`, driven by the batcher): a prompt's blocks found below the
GPU are copied into GPU blocks the batcher has just allocated. Host blocks are copied on the side
stream with one event; disk blocks are read, checksum-verified and copied by the single I/O thread.
The sequence waits (LOADING_KV) while the batch runs on; `poll` never blocks. Every entry a load reads
is pinned in its tier until the load is finished or cancelled, so it cannot be evicted under it.

Dangerous window: an abort during a load must not free its GPU blocks while a copy still writes into
them, so `cancel` waits for the in-flight copies (cancelling disk reads not yet started) before the
batcher frees the blocks.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.kv_tiers.disk_files import BlockFileError, DiskBlockFiles
from engine.kv_tiers.load_policy import LoadCostModel
from engine.kv_tiers.tier_lru import TierLRU
from engine.kv_tiers.tier_stats import TierStats, TierStatsSnapshot
from engine.kv_tiers.types import LOWER_TIERS, LoadFailure, LoadResult, LoadState, Tier, TierConfig
from tokenization.block_hashes import block_hashes

_DISK_BANDWIDTH_PRIOR = 1e9  # bytes/s until a disk load was measured (a local NVMe reads ~2-7 GB/s)


@dataclass(frozen=True)
class _BlockLoad:
    block_id: int  # destination GPU block
    block_hash: int
    tier: Tier


@dataclass
class _Load:
    blocks: list[_BlockLoad]
    started_at: float
    host_done: torch.cuda.Event | None = None  # the host copies' event (None: CPU, or no host block)
    reads: dict[int, Future[None]] = field(default_factory=dict)  # disk block hash -> its read


class TieredKVStore:
    """Host and disk tiers of one worker's KV pool. Not thread-safe: the engine loop calls it."""

    def __init__(self, config: TierConfig, kv_cache: torch.Tensor, block_size: int) -> None:
        self.kv_cache = kv_cache  # [num_blocks, *block_shape], contiguous
        self.block_size = block_size
        self.bytes_per_block = kv_cache[0].numel() * kv_cache.element_size()
        self._cuda = kv_cache.is_cuda
        self._lru = {Tier.HOST: TierLRU(config.host_bytes // self.bytes_per_block),
                     Tier.DISK: TierLRU(config.disk_bytes // self.bytes_per_block if config.disk_dir else 0)}
        self._host = torch.empty((self._lru[Tier.HOST].capacity, *kv_cache.shape[1:]), dtype=kv_cache.dtype,
                                 pin_memory=self._cuda)
        self._files = DiskBlockFiles(config.disk_dir) if config.disk_dir and self._lru[Tier.DISK].capacity else None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-disk") if self._files else None
        self._stream = torch.cuda.Stream(kv_cache.device) if self._cuda else None
        self._io_stream = torch.cuda.Stream(kv_cache.device) if self._cuda and self._io else None  # disk reads
        self._host_ready: dict[int, torch.cuda.Event] = {}  # host slot -> its demotion copy
        self._writes: dict[int, Future[None]] = {}  # disk hash -> its write, until reaped
        self._loads: dict[str, _Load] = {}
        self._changed: list[int] = []  # hashes whose lower-tier presence changed (KV events)
        self.stats = TierStats()
        self.cost = LoadCostModel({Tier.HOST: self._measure_host_bandwidth(), Tier.DISK: _DISK_BANDWIDTH_PRIOR},
                                  self.bytes_per_block, block_size, config.min_load_speedup)

    # ---- lookups --------------------------------------------------------------------------------
    def lower_tier_of(self, block_hash: int) -> Tier | None:
        """The fastest lower tier holding `block_hash`, if any."""
        return next((t for t in LOWER_TIERS if block_hash in self._lru[t]), None)

    def drain_changed_hashes(self) -> list[int]:
        changed, self._changed = self._changed, []
        return changed

    # ---- demotion -------------------------------------------------------------------------------
    def demote(self, block_id: int, block_hash: int) -> None:
        """Keep an evicted GPU block's bytes below the GPU (see the module docstring)."""
        host = self._lru[Tier.HOST]
        if block_hash in host:
            host.touch(block_hash)
            return
        placement = host.insert(block_hash) if host.capacity else None
        if placement is None:  # no host tier (or every host block is being loaded): straight to disk
            if block_hash not in self._lru[Tier.DISK]:
                self._spill_to_disk(block_hash, self.kv_cache[block_id:block_id + 1])
            return
        if placement.evicted_hash is not None:
            self._spill_to_disk(placement.evicted_hash, self._final_host_block(placement.slot))
            self._changed.append(placement.evicted_hash)
        self._copy_to_host(block_id, placement.slot)
        self.stats.record_demotion(Tier.HOST, self.bytes_per_block)
        self._changed.append(block_hash)

    def _copy_to_host(self, block_id: int, slot: int) -> None:
        if self._stream is None:
            self._host[slot].copy_(self.kv_cache[block_id])
            return
        engine_stream = torch.cuda.current_stream(self.kv_cache.device)
        self._stream.wait_stream(engine_stream)
        with torch.cuda.stream(self._stream):
            self._host[slot].copy_(self.kv_cache[block_id], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        engine_stream.wait_event(done)  # the next step's writes into block_id wait for the copy
        self._host_ready[slot] = done

    def _final_host_block(self, slot: int) -> torch.Tensor:
        """Host slot `slot` as [1, *block_shape], once its demotion copy has landed."""
        done = self._host_ready.pop(slot, None)
        if done is not None:
            done.synchronize()
        return self._host[slot:slot + 1]

    def _spill_to_disk(self, block_hash: int, block: torch.Tensor) -> None:
        """Write a block (host slot or GPU block) to the disk tier on the I/O thread."""
        disk = self._lru[Tier.DISK]
        if self._io is None or self._files is None:
            return
        if block_hash in disk:
            disk.touch(block_hash)
            return
        placement = disk.insert(block_hash)
        if placement is None:
            return
        if placement.evicted_hash is not None:
            self._io.submit(self._files.delete, placement.evicted_hash)
            self._changed.append(placement.evicted_hash)
        data = block.to("cpu", copy=True)  # the slot is reused at once; the write must not see that
        self._writes[block_hash] = self._io.submit(self._files.write, block_hash, data)
        self.stats.record_demotion(Tier.DISK, self.bytes_per_block)
        self._changed.append(block_hash)

    def reap_writes(self) -> None:
        """Forget finished disk writes; a failed one drops its entry (counted by reason) unless a load
        is reading it (that load then fails with the write's reason)."""
        for block_hash, write in list(self._writes.items()):
            if not write.done():
                continue
            del self._writes[block_hash]
            error = write.exception()
            disk = self._lru[Tier.DISK]
            if isinstance(error, BlockFileError) and block_hash in disk and not disk.is_pinned(block_hash):
                disk.remove(block_hash)
                self.stats.fallbacks[error.reason] += 1
                self._changed.append(block_hash)

    # ---- promotion ------------------------------------------------------------------------------
    def start_load(self, request_id: str, token_ids: list[int], block_ids: list[int], num_cached: int) -> int:
        """Start copying the blocks after the first `num_cached` tokens that a lower tier holds into
        `block_ids` (already allocated). Returns the tokens being loaded (0: nothing to load, no load
        registered). The last token's block is never loaded (its logits must be computed)."""
        plan = self._plan_load(token_ids, block_ids, num_cached)
        if not plan:
            return 0
        load = _Load(plan, time.perf_counter())
        for block in plan:
            self._lru[block.tier].pin(block.block_hash)
            self._lru[block.tier].touch(block.block_hash)
        self._copy_host_blocks(load)
        for block in plan:
            if block.tier is Tier.DISK:
                assert self._io is not None
                load.reads[block.block_hash] = self._io.submit(
                    self._read_disk_block, block, self._writes.get(block.block_hash))
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
        host_blocks = [b for b in load.blocks if b.tier is Tier.HOST]
        if not host_blocks:
            return
        if self._stream is None:
            for b in host_blocks:
                self.kv_cache[b.block_id].copy_(self._host[self._host_slot(b)])
            return
        # After any pending demotion into these slots (same stream) and after whatever the engine's stream
        # last did with the destination blocks (nothing, in a synchronous engine; kept for safety).
        self._stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self._stream):
            for b in host_blocks:
                self.kv_cache[b.block_id].copy_(self._host[self._host_slot(b)], non_blocking=True)
            load.host_done = torch.cuda.Event()
            load.host_done.record(self._stream)

    def _host_slot(self, block: _BlockLoad) -> int:
        slot = self._lru[Tier.HOST].slot_of(block.block_hash)
        assert slot is not None, "a pinned host entry lost its slot"
        return slot

    def _read_disk_block(self, block: _BlockLoad, write: Future[None] | None) -> None:
        """I/O thread: read, verify and copy one disk block into its GPU block."""
        assert self._files is not None
        if write is not None and isinstance(write.exception(), BlockFileError):
            raise write.exception()  # type: ignore[misc]
        staged = torch.empty((1, *self.kv_cache.shape[1:]), dtype=self.kv_cache.dtype, pin_memory=self._cuda)
        self._files.read_into(block.block_hash, staged)
        destination = self.kv_cache[block.block_id:block.block_id + 1]
        if not self._cuda:
            destination.copy_(staged)
            return
        assert self._io_stream is not None
        with torch.cuda.stream(self._io_stream):
            destination.copy_(staged, non_blocking=True)
        self._io_stream.synchronize()  # on the I/O thread: the engine thread never waits for it

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
        seconds = time.perf_counter() - load.started_at
        for tier in LOWER_TIERS:
            n = sum(1 for b in loaded if b.tier is tier)
            if n:
                self.stats.record_load(tier, n, n * self.bytes_per_block)
                self.cost.observe_load(tier, n * self.bytes_per_block, seconds)
        self.stats.fallbacks.update(failures)
        self.stats.pending_latencies.append(seconds)
        return LoadResult(LoadState.DONE, len(loaded) * self.block_size, tuple(failures))

    def _drop_bad_disk_block(self, block_hash: int) -> None:
        disk = self._lru[Tier.DISK]
        if block_hash in disk and not disk.is_pinned(block_hash):
            disk.remove(block_hash)
            self._writes.pop(block_hash, None)
            assert self._io is not None and self._files is not None
            self._io.submit(self._files.delete, block_hash)
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
    def num_loads_in_flight(self) -> int:
        return len(self._loads)

    def snapshot(self) -> TierStatsSnapshot:
        s = self.stats
        return TierStatsSnapshot(
            capacity_blocks={t: self._lru[t].capacity for t in LOWER_TIERS},
            occupied_blocks={t: len(self._lru[t]) for t in LOWER_TIERS},
            pinned_blocks={t: self._lru[t].num_pinned for t in LOWER_TIERS},
            hit_blocks=dict(s.hit_blocks), loaded_bytes=dict(s.loaded_bytes),
            demoted_blocks=dict(s.demoted_blocks), demoted_bytes=dict(s.demoted_bytes),
            fallbacks=dict(s.fallbacks), skipped_slower_than_recompute=s.skipped_slower_than_recompute,
            loads_in_flight=len(self._loads), load_latency_s=s.take_latencies())

    def flush(self) -> None:
        """Wait until every queued disk write, read and delete has run, then reap the writes."""
        if self._io is not None:
            self._io.submit(lambda: None).result()  # one I/O thread, FIFO: everything before it is done
        self.reap_writes()

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True, cancel_futures=True)

    def _measure_host_bandwidth(self) -> float:
        """Bytes/s of one GPU -> host copy of up to 8 blocks: the host tier's load-cost prior."""
        n = min(8, self._host.shape[0], self.kv_cache.shape[0])
        if n == 0:
            return 1e10
        start = time.perf_counter()
        self._host[:n].copy_(self.kv_cache[:n])
        if self._cuda:
            torch.cuda.synchronize(self.kv_cache.device)
        return n * self.bytes_per_block / max(time.perf_counter() - start, 1e-6)

"""Plain types shared by the tier bookkeeping, the byte mover and the batcher (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from engine.errors import ConfigError
from tokenization.kv_blocks import KVTier  # where a block lives: one vocabulary with the scheduler

_GIB = 1024**3


LOWER_TIERS = (KVTier.HOST, KVTier.DISK)


class LoadState(StrEnum):
    """Where a promotion (lower tier -> GPU blocks) stands, as the batcher polls it."""

    PENDING = "pending"  # copies in flight: the sequence waits, the batch runs on
    DONE = "done"  # `num_loaded_tokens` leading tokens landed (0 when every block failed)


class LoadFailure(StrEnum):
    """Why a block was recomputed instead of loaded (counted per reason)."""

    BAD_CHECKSUM = "bad_checksum"  # the file's bytes do not match the checksum kept with them
    MISSING_FILE = "missing_file"  # the block's file is gone (deleted, disk swapped)
    DISK_FULL = "disk_full"  # the demotion's write failed (ENOSPC): the file was never complete
    IO_ERROR = "io_error"  # any other read error


@dataclass(frozen=True)
class LoadResult:
    state: LoadState
    num_loaded_tokens: int = 0
    failures: tuple[LoadFailure, ...] = ()


@dataclass(frozen=True)
class TierConfig:
    """Sizes of the tiers below the GPU pool; 0 bytes turns a tier off (both off: no tiers at all)."""

    host_bytes: int = 0  # --host-kv-gib
    disk_dir: str | None = None  # --disk-kv-dir
    disk_bytes: int = 0  # --disk-kv-gib (needs disk_dir)
    # A load is taken only when recomputing its block is estimated this many times slower (1.0: any
    # gain; 0.0: always load, whatever the measured rates).
    min_load_speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ConfigError(f"tier sizes must be >= 0, got host {self.host_bytes}, disk {self.disk_bytes}")
        if self.disk_bytes and not self.disk_dir:
            raise ConfigError("--disk-kv-gib needs --disk-kv-dir (the directory the block files go to)")
        if self.min_load_speedup < 0:
            raise ConfigError(f"min_load_speedup must be >= 0, got {self.min_load_speedup}")

    @classmethod
    def from_gib(cls, host_gib: float, disk_dir: str | None, disk_gib: float,
                 min_load_speedup: float = 1.0) -> TierConfig:
        return cls(int(host_gib * _GIB), disk_dir or None, int(disk_gib * _GIB), min_load_speedup)

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_bytes)


class KVLoader(Protocol):
    """What the batcher needs of the tiers to promote a prompt's blocks (engine/kv_tiers/store.py).

    `start_load` may only be called right after the blocks were allocated; the batcher then polls
    once per step and never schedules the sequence until the load is DONE; `cancel` (abort) returns
    only once no copy writes into the blocks any more, so the batcher may free them right after.
    """

    def start_load(self, request_id: str, token_ids: list[int], block_ids: list[int], num_cached: int) -> int: ...

    def poll(self, request_id: str) -> LoadResult: ...

    def cancel(self, request_id: str) -> bool: ...

"""The disk tier's bytes: one file per block, named by its hash, its checksum kept in the header.

A file is `MAGIC | CRC-32 of the payload (4 bytes, little endian) | payload length (4 bytes) | the
block's raw bytes`. The CRC is computed when the block is written and recomputed over the bytes read
back; a mismatch (a torn write, a flipped bit, a file from another model) is a failed load that the
caller turns into a recompute. CRC-32 (zlib, in the standard library) detects every burst error up to
32 bits and runs at ~1 GB/s on one core of a loaded CI machine, where engine/kv_integrity.py's
position-weighted sum (the hand-off's GPU checksum, whose CPU reference is a float64 matrix-vector
product) managed 8 MB/s; both read and write hash the block's memory in place (a memoryview, no copy)
and zlib releases the GIL while it does.

Plain buffered files: the blocks are large (hundreds of KiB to a few MiB) and written once, read at most
a few times; O_DIRECT and NIXL's GDS backend are left for the GPU run to justify. Every method runs on
the store's single I/O thread, so a block's write, read and delete happen in the order they were
submitted.
"""

from __future__ import annotations

import errno
import zlib
from pathlib import Path

import torch

from engine.kv_tiers.types import LoadFailure

_MAGIC = b"BKV2"
_HEADER = len(_MAGIC) + 8
_UINT64 = (1 << 64) - 1


class BlockFileError(Exception):
    """A block could not be written or read back; `reason` is what the metrics count."""

    def __init__(self, reason: LoadFailure, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def raw_bytes(block: torch.Tensor) -> memoryview:
    """A CPU block's memory as bytes, without a copy (numpy has no bfloat16 or float8: view as uint8)."""
    if block.device.type != "cpu" or not block.is_contiguous():
        raise ValueError("a block file is written from and read into contiguous CPU memory")
    return block.reshape(-1).view(torch.uint8).numpy().data


def _header(payload: memoryview) -> bytes:
    return _MAGIC + zlib.crc32(payload).to_bytes(4, "little") + payload.nbytes.to_bytes(4, "little")


class DiskBlockFiles:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Files of an earlier run are not trusted (another model or block size may have written
        # them): the tier starts empty.
        for stale in self.directory.glob("*.kv"):
            stale.unlink(missing_ok=True)

    def path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash & _UINT64:016x}.kv"

    def write(self, block_hash: int, block: torch.Tensor) -> None:
        """Write one block (CPU, contiguous: a host slot) from its memory. Raises BlockFileError."""
        payload = raw_bytes(block)
        try:
            with open(self.path(block_hash), "wb") as f:
                f.write(_header(payload))
                f.write(payload)
        except OSError as e:
            reason = LoadFailure.DISK_FULL if e.errno in (errno.ENOSPC, errno.EDQUOT) else LoadFailure.IO_ERROR
            self.delete(block_hash)
            raise BlockFileError(reason, f"writing {self.path(block_hash)}: {e}") from e

    def read_into(self, block_hash: int, out: torch.Tensor) -> None:
        """Read one block into `out` (CPU, contiguous) in place, verifying its checksum."""
        path = self.path(block_hash)
        payload = raw_bytes(out)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER)
                got = f.readinto(payload) if len(header) == _HEADER else 0
                trailing = f.read(1)
        except FileNotFoundError as e:
            raise BlockFileError(LoadFailure.MISSING_FILE, str(path)) from e
        except OSError as e:
            raise BlockFileError(LoadFailure.IO_ERROR, f"reading {path}: {e}") from e
        if not header.startswith(_MAGIC) or got != payload.nbytes or trailing:
            raise BlockFileError(LoadFailure.BAD_CHECKSUM, f"{path} is not a block of {payload.nbytes} bytes")
        if header != _header(payload):
            raise BlockFileError(LoadFailure.BAD_CHECKSUM, f"{path}: checksum mismatch")

    def delete(self, block_hash: int) -> None:
        self.path(block_hash).unlink(missing_ok=True)

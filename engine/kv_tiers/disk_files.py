"""The disk tier's bytes: one file per block, named by its hash, its checksum kept in the header.

A file is `MAGIC | checksum (8 bytes, little endian) | the block's bytes`. The checksum is
engine/kv_integrity.py's, computed over the block when it is written and recomputed over the bytes
read back; a mismatch (a torn write, a flipped bit, a file from another model) is a failed load that
the caller turns into a recompute. Plain buffered files: the blocks are large (hundreds of KiB to a few
MiB) and written once, read at most a few times; O_DIRECT and NIXL's GDS backend are left for the GPU
run to justify. Every method runs on the store's single I/O thread, so a block's write, read and
delete happen in the order they were submitted.
"""

from __future__ import annotations

import errno
from pathlib import Path

import torch

from engine.kv_integrity import block_checksums
from engine.kv_tiers.types import LoadFailure

_MAGIC = b"BKV1"
_HEADER = len(_MAGIC) + 8
_UINT64 = (1 << 64) - 1


class BlockFileError(Exception):
    """A block could not be written or read back; `reason` is what the metrics count."""

    def __init__(self, reason: LoadFailure, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


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
        """Write one block ([1, *block_shape], CPU, contiguous). Raises BlockFileError."""
        checksum = block_checksums(block, [0])[0]
        data = _MAGIC + checksum.to_bytes(8, "little") + block.numpy().tobytes()
        try:
            with open(self.path(block_hash), "wb") as f:
                f.write(data)
        except OSError as e:
            reason = LoadFailure.DISK_FULL if e.errno in (errno.ENOSPC, errno.EDQUOT) else LoadFailure.IO_ERROR
            self.delete(block_hash)
            raise BlockFileError(reason, f"writing {self.path(block_hash)}: {e}") from e

    def read_into(self, block_hash: int, out: torch.Tensor) -> None:
        """Read one block into `out` ([1, *block_shape], CPU, contiguous), verifying its checksum."""
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError as e:
            raise BlockFileError(LoadFailure.MISSING_FILE, str(path)) from e
        except OSError as e:
            raise BlockFileError(LoadFailure.IO_ERROR, f"reading {path}: {e}") from e
        nbytes = out.numel() * out.element_size()
        if len(data) != _HEADER + nbytes or not data.startswith(_MAGIC):
            raise BlockFileError(LoadFailure.BAD_CHECKSUM, f"{path} has {len(data)} bytes, want {_HEADER + nbytes}")
        want = int.from_bytes(data[len(_MAGIC):_HEADER], "little")
        flat = out.view(-1).view(torch.uint8)
        flat.copy_(torch.frombuffer(bytearray(data[_HEADER:]), dtype=torch.uint8))
        if block_checksums(out, [0])[0] != want:
            raise BlockFileError(LoadFailure.BAD_CHECKSUM, f"{path}: checksum mismatch")

    def delete(self, block_hash: int) -> None:
        self.path(block_hash).unlink(missing_ok=True)

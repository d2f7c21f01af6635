"""Chained block hashes: the stable name of a prompt prefix, one per full block of token ids.

The hash of full block i is `hash_block(hash of block i-1, its block_size token ids)`, so a hash names a
whole prefix, not just one block's tokens. Hashes cross processes (the engine's prefix cache registers
them, the gateway computes them so the scheduler can route by prefix), so they are a stable 64-bit
blake2b digest, never Python's salted `hash()`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT_PARENT = 0  # the parent hash fed into the first block of every chain


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The stable 64-bit hash of one full block given the hash of the block before it.

    Wire format (other processes must match it byte for byte): blake2b(digest_size=8) over the parent
    hash as 8 little-endian bytes (0 for the first block) followed by each token id as 4 little-endian
    unsigned bytes; the digest is read as an unsigned little-endian integer.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update((_ROOT_PARENT if parent_hash is None else parent_hash).to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block has no hash)."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes

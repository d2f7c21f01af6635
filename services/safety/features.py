"""`HashedNgrams`: sparse features for the learned tier, computed from the normalised `words` view.

Word unigrams and bigrams carry the meaning ("poison my", "kill process"); character 3-, 4- and
5-grams (across word boundaries) carry spelling variants the normaliser cannot fold ("explosive",
"explosives", "explosiv") and unseen compounds. Everything is hashed into 2**18 buckets, so there is
no vocabulary to ship and an unseen word still lands on features its n-grams share with seen ones.

Character n-grams are hashed with a vectorised polynomial rolling hash in numpy (one pass per n),
words with CRC32: both deterministic across processes, unlike Python's salted `hash()`.
Values are 1 + log(count), L2-normalised per text, plus one constant bias feature (bucket 0).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

BITS = 18
DIM = 1 << BITS
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: multiply, keep the top BITS bits
_BASE = np.uint64(1_000_003)
_SHIFT = np.uint64(64 - BITS)
CHAR_NGRAMS = (3, 4, 5)


@dataclass(frozen=True)
class SparseRow:
    indices: npt.NDArray[np.int64]   # [nnz] bucket ids, unique, bucket 0 (bias) always present
    values: npt.NDArray[np.float32]  # [nnz]


def _char_hashes(text: str) -> npt.NDArray[np.uint64]:
    data = np.frombuffer(f" {text} ".encode(), dtype=np.uint8).astype(np.uint64)
    parts = []
    for n in CHAR_NGRAMS:
        count = len(data) - n + 1
        if count <= 0:
            continue
        h = np.full(count, n, dtype=np.uint64)
        for k in range(n):
            h = h * _BASE + data[k:k + count]
        parts.append(h)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def _word_hashes(text: str) -> npt.NDArray[np.uint64]:
    tokens = text.split()
    hashes = [zlib.crc32(b"w " + t.encode()) for t in tokens]
    hashes += [zlib.crc32(f"b {a} {b}".encode()) for a, b in zip(tokens, tokens[1:], strict=False)]
    return np.array(hashes, dtype=np.uint64) << np.uint64(32)  # disjoint from char hashes' low bits


def featurize(words: str) -> SparseRow:
    """The sparse feature row of one normalised text."""
    hashes = np.concatenate([_char_hashes(words), _word_hashes(words)])
    buckets = ((hashes * _MIX) >> _SHIFT).astype(np.int64)
    buckets[buckets == 0] = 1  # bucket 0 is reserved for the bias
    ids, counts = np.unique(buckets, return_counts=True)
    values = (1.0 + np.log(counts)).astype(np.float32)
    norm = float(np.linalg.norm(values)) or 1.0
    indices = np.concatenate([np.zeros(1, dtype=np.int64), ids])
    return SparseRow(indices, np.concatenate([np.ones(1, dtype=np.float32), values / norm]))

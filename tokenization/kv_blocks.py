"""What the engine and the scheduler say about KV blocks: where a block lives and what happened to it.

A worker's block manager emits `KVEvent`s (a block stored, or evicted, and the tier now or last holding
it); the worker sends them with its heartbeats, and the scheduler's prefix index learns from them which
prompt prefixes each worker holds. One vocabulary on this torch-free ground floor, because the engine and
the scheduler both speak it and neither may import the other (docs/architecture.md, import rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class KVTier(StrEnum):
    """Where a KV block lives on a worker, fastest first (lower tiers: --host-kv-gib / --disk-kv-gib)."""

    GPU = "gpu"  # the engine's KV pool (HBM on CUDA; plain memory on the CPU backend)
    HOST = "host"  # pinned host memory
    DISK = "disk"  # one file per block under --disk-kv-dir


class KVEventKind(StrEnum):
    STORED = "stored"  # a computed block's hash became reusable on this worker
    EVICTED = "evicted"  # that block was handed out for other content; the hash is gone


@dataclass(frozen=True)
class KVEvent:
    """A block stored or evicted on a worker, named by its chained prefix hash (block_hashes.py)."""

    kind: KVEventKind
    block_hash: int
    # STORED: the fastest tier holding it now; EVICTED: the last tier that held it. The scheduler's prefix
    # index counts GPU and host blocks as held and disk blocks as not (scheduler/core/prefix_index.py says why).
    tier: KVTier = KVTier.GPU

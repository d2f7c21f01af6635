"""The KV tiers' spills dropped (a host eviction the disk writer was too far behind to take) reach the
worker's /metrics as a counter, and `baton status` as part of the disk tier's line."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from engine.kv_tiers.store import TieredKVStore
from engine.kv_tiers.types import TierConfig
from services.launcher.process import free_port
from services.launcher.status import kv_tier_line
from services.worker.metrics import WorkerMetrics
from services.worker.tier_metrics import TierMetrics
from tokenization.block_hashes import block_hashes

BS = 4
BLOCK = 512  # bytes of one block of the KV tensor below
HASHES = block_hashes(list(range(100, 100 + 4 * BS + 1)), BS)


def _disk_only_store(tmp_path: Path) -> TieredKVStore:
    """A disk tier staged through one spare host slot: a second offer while the first is on its way to disk
    finds the spill window full and is dropped."""
    kv = torch.randn(16, 2, 2, BS, 1, 8, generator=torch.Generator().manual_seed(0))
    return TieredKVStore(TierConfig(0, str(tmp_path / "kv"), 4 * BLOCK, 0.0), kv, BS, spill_window_blocks=1)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("baton_kv_tier_spills_dropped")}


def test_spills_dropped_reach_metrics_as_a_monotonic_counter(tmp_path: Path) -> None:
    metrics = WorkerMetrics("both")
    tiers = TierMetrics(metrics.registry)
    port = free_port()
    metrics.serve(port)
    store = _disk_only_store(tmp_path)
    store.offer(0, HASHES[0])
    store.offer(1, HASHES[1])  # the spare slot is still on its way to disk: dropped
    store.flush()
    assert store.snapshot().spills_dropped == 1
    tiers.refresh(store.snapshot())
    assert _scrape(port)["baton_kv_tier_spills_dropped_total"] == 1.0
    tiers.refresh(store.snapshot())  # the same totals again: nothing new to add
    assert _scrape(port)["baton_kv_tier_spills_dropped_total"] == 1.0
    store.offer(2, HASHES[2])
    store.offer(3, HASHES[3])
    store.flush()
    tiers.refresh(store.snapshot())
    assert _scrape(port)["baton_kv_tier_spills_dropped_total"] == store.snapshot().spills_dropped == 2.0


def test_baton_status_prints_spills_dropped_on_the_disk_tiers_line_only() -> None:
    assert kv_tier_line("disk", 3, 4096, 0, 7, 2) == "kv disk: 3/4096 blocks, 0 pinned, 7 hits, 2 spills dropped"
    assert kv_tier_line("host", 12, 512, 2, 40) == "kv host: 12/512 blocks, 2 pinned, 40 hits"

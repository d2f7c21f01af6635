"""lab/micro/bench_hf_peer.py: the MoE peer's --smoke run (CPU) measures both sides and says which
experts implementation transformers ran."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lab.micro import bench_hf_peer


def test_moe_smoke_run_reports_both_sides_at_each_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "peer.json"
    monkeypatch.setattr(sys, "argv", ["bench_hf_peer", "--smoke", "--model", "qwen3-30b-a3b", "--layers", "1",
                                      "--batches", "1", "2", "--new-tokens", "4", "--out", str(out)])
    bench_hf_peer.main()
    report = json.loads(out.read_text())
    assert report["environment"]["model"] == "qwen3-30b-a3b" and report["environment"]["layers"] == 1
    assert report["environment"]["hf_experts_implementation"] in ("eager", "grouped_mm", "batched_mm")
    rows = report["rows"]
    assert [r["batch"] for r in rows] == [1, 2]  # no error rows
    assert all(r["hf_tok_s"] > 0 and r["baton_tok_s"] > 0 and r["ratio"] > 0 for r in rows)

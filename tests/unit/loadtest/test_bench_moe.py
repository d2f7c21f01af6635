"""loadtest/micro/bench_moe.py: its --smoke run (CPU) reports every case, and its time limit is hard."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from loadtest.micro import bench_moe


def test_smoke_run_reports_decode_and_prefill_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "moe.json"
    monkeypatch.setattr(sys, "argv", ["bench_moe", "--smoke", "--out", str(out)])
    bench_moe.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r.get("batch"), r.get("tokens")) for r in rows] == [
        ("decode", 1, None), ("decode", 64, None), ("prefill", None, 64)]
    top_k, experts = bench_moe.SMOKE["num_experts_per_tok"], bench_moe.SMOKE["num_experts"]
    assert rows[0]["experts_routed"] == top_k and top_k < rows[1]["experts_routed"] <= experts
    # batch 1: top_k experts hold one slot each, the mean over all experts is top_k / experts
    assert rows[0]["expert_imbalance"] == experts / top_k and 1.0 <= rows[1]["expert_imbalance"] < rows[0][
        "expert_imbalance"]


def test_time_limit_interrupts_the_run() -> None:
    start = time.monotonic()
    with pytest.raises(bench_moe.TimeLimit), bench_moe.time_limit(1):
        time.sleep(5)
    assert time.monotonic() - start < 3

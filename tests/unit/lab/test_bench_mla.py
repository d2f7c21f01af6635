"""lab/micro/bench_mla.py: its --smoke run (CPU) decodes the tiny DeepSeek shape over the latent cache
and reports the floor's inputs: the latent bytes it reads and the experts it routed to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lab.micro import bench_mla


def test_smoke_run_reports_decode_rows_over_the_latent_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "mla.json"
    monkeypatch.setattr(sys, "argv", ["bench_mla", "--smoke", "--out", str(out)])
    bench_mla.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["batch"], r["ctx"]) for r in rows] == [("decode", 1, 64), ("decode", 64, 64)]
    smoke = bench_mla.SMOKE
    latent_bytes = smoke["num_hidden_layers"] * (smoke["kv_lora_rank"] + smoke["qk_rope_head_dim"]) * 4  # fp32
    assert [r["kv_gb"] * 1e9 for r in rows] == pytest.approx([64 * latent_bytes, 64 * 64 * latent_bytes])
    top_k, experts = smoke["num_experts_per_tok"], smoke["n_routed_experts"]
    assert rows[0]["experts_routed"] == top_k and top_k < rows[1]["experts_routed"] <= experts
    assert all(r["step_ms"] > 0 for r in rows)

"""lab/micro/bench_moe.py: its --smoke run with --precision fp8 (CPU) counts every projection but the routers
at one byte, its time limit is hard, and its --sweep (lab/micro/moe_sweep.py) checks every candidate and
picks the fastest correct tiles. The plain --smoke run's rows are checked in engine_features_suite.sh's
smoke run (test_suites_smoke.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.config import ModelConfig
from engine.kernels.fused_moe_configs import GemmTile, MoeKernelConfig
from engine.param_count import count_parameters
from lab.micro import bench_moe, moe_sweep
from lab.micro.bench_decode import decode_bytes


def test_time_limit_interrupts_the_run() -> None:
    start = time.monotonic()
    with pytest.raises(bench_moe.TimeLimit), bench_moe.time_limit(1):
        time.sleep(5)
    assert time.monotonic() - start < 3


def _candidate(block_m: int, up_us: float, down_us: float, rel_err: float = 0.0, error: bool = False) -> tuple:
    config = MoeKernelConfig(block_m, GemmTile(int(up_us), 64, 4, 3), GemmTile(int(down_us), 64, 4, 3))
    row = {"error": "OutOfResources"} if error else {"rel_err": rel_err, "align_us": 1.0, "up_us": up_us,
                                                      "down_us": down_us}
    return row, config


def test_sweep_picks_the_best_gemm_tiles_separately_and_never_a_wrong_or_failed_one() -> None:
    pairs = [_candidate(16, 30, 90), _candidate(16, 80, 40), _candidate(16, 10, 10, rel_err=0.5),
             _candidate(16, 5, 5, error=True), _candidate(64, 50, 50)]
    best = moe_sweep.best_config([r for r, _ in pairs], [c for _, c in pairs])
    assert best == MoeKernelConfig(16, pairs[0][1].gate_up, pairs[1][1].down)  # 1 + 30 + 40 beats 1 + 50 + 50


def test_sweep_without_a_correct_candidate_fails() -> None:
    row, config = _candidate(16, 1, 1, rel_err=1.0)
    with pytest.raises(RuntimeError, match="no candidate"):
        moe_sweep.best_config([row], [config])


def test_smoke_sweep_checks_each_candidate_and_runs_the_model_with_the_winners(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[3])}
    subprocess.run([sys.executable, "-m", "lab.micro.bench_moe", "--smoke", "--sweep", "--sweep-tokens", "1",
                    "40", "--sweep-max-candidates", "2", "--batches", "1", "--out", str(out)],
                   env=env, check=True, timeout=600, capture_output=True)
    report = json.loads(out.read_text())
    candidates = [r for r in report["sweep"] if r["case"] == "candidate"]
    assert [r["tokens"] for r in candidates] == [1, 1, 40, 40]
    assert all(r["rel_err"] < 1e-5 and r["up_us"] > 0 and r["down_us"] > 0 for r in candidates)
    layers = [(r["tokens"], r["config"]) for r in report["sweep"] if r["case"] == "moe_layer"]
    assert [t for t, _ in layers] == [1, 1, 40, 40] and layers[1][1] == layers[3][1] == "before"
    aligns = [r for r in report["sweep"] if r["case"] == "align"]
    assert [r["tokens"] for r in aligns] == [1, 40] and all(r["align_us"] > 0 and r["layer_us"] > 0 for r in aligns)
    assert [line.split(":")[0].strip() for line in report["winners"]] == [
        "(RowsPerExpert.DECODE_SMALL, 64, 32)", "(RowsPerExpert.MIXED, 64, 32)"]
    assert [r["case"] for r in report["rows"]] == ["decode", "prefill"]


def test_fp8_smoke_run_counts_the_experts_at_one_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "moe.json"
    monkeypatch.setattr(sys, "argv", ["bench_moe", "--smoke", "--precision", "fp8", "--batches", "64", "--out",
                                      str(out)])
    bench_moe.main()
    decode = json.loads(out.read_text())["rows"][0]
    assert decode["case"] == "decode" and decode["precision"] == "fp8"
    config = ModelConfig.from_hf_config(bench_moe.SMOKE)
    params = count_parameters(config)
    bf16_bytes, _ = decode_bytes(config, 64, 64, 1, experts_routed_per_layer=decode["experts_routed"])
    experts_read = round(params.sparse_layers * decode["experts_routed"] * params.expert)
    routers = params.sparse_layers * config.moe.num_experts * config.hidden_size
    one_byte = params.attention + experts_read + params.shared - routers  # every projection but the routers
    assert decode["weight_gb"] * 1e9 == pytest.approx(bf16_bytes - one_byte)

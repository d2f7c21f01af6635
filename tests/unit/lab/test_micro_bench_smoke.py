"""Every GPU micro-benchmark in lab/micro runs in its `--smoke` mode on CPU (tiny model or shapes, the
torch reference or the Triton interpreter): the code that produces docs/benchmarks.md's figures keeps
working between GPU runs. Each run's report is checked for what the benchmark exists to say (its
rows, its identity and verification verdicts), not for its times, which mean nothing on CPU.

bench_moe, bench_mla, bench_hf_peer and fp8_accuracy have smoke tests of their own beside this file. The
GPU suites' smoke runs (test_suites_smoke.py) check bench_decode, bench_prefill, bench_pp70b, bench_tp70b,
bench_disagg_gpu, bench_kv_transfer and bench_multiturn_tiers in the calls the suites make; only the calls
no suite makes are here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUN_S = 300  # a hard limit per run; each takes seconds to ~1 min on an idle 2-core machine


def smoke_report(tmp_path: Path, module: str, *extra: str, interpret: bool = False) -> dict:
    out = tmp_path / f"{module}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"TRITON_INTERPRET": "1"} if interpret else {})}
    done = subprocess.run([sys.executable, "-m", f"lab.micro.{module}", "--smoke", *extra, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_S, check=False)
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, f"{module} --smoke exited {done.returncode}:\n{output}"
    return json.loads(out.read_text())


def test_bench_decode_compares_fp8_with_bf16_case_by_case(tmp_path: Path) -> None:
    rows = smoke_report(tmp_path, "bench_decode", "--precisions", "bf16", "fp8", "--batches", "1")["rows"]
    assert [r["precision"] for r in rows] == ["bf16", "fp8"]
    assert rows[1]["tok_s_vs_bf16"] == pytest.approx(rows[1]["tok_s"] / rows[0]["tok_s"])


def test_bench_disagg_gpu_without_the_overlapped_reserve_still_prefills_remotely(tmp_path: Path) -> None:
    report = smoke_report(tmp_path, "bench_disagg_gpu", "--overlap-reserve", "off", "--identity-requests", "2",
                          "--ttft-requests", "2", "--ttft-warmup", "1")
    assert (report["ok"], report["overlap_reserve"], report["ttft"]["disagg_paths"]) == (True, "off", ["REMOTE"])
    assert all(r["identical"] for r in report["identity"])


def test_bench_mixed_step_reports_the_decode_share_of_each_mixed_step(tmp_path: Path) -> None:
    rows = smoke_report(tmp_path, "bench_mixed_step")["rows"]
    assert [(r["batch"], r["chunk"]) for r in rows] == [(2, 32), (4, 32)]
    assert all(r["mixed_ms"] > 0 and r["share"] == pytest.approx((r["mixed_ms"] - r["chunk_ms"]) / r["decode_ms"])
               for r in rows)


def test_bench_attention_kernels_agree_with_sdpa(tmp_path: Path) -> None:
    rows = smoke_report(tmp_path, "bench_attention", interpret=True)["rows"]
    checked = [r for r in rows if r.get("max_rel_err_vs_sdpa") is not None]
    assert checked and all(r["max_rel_err_vs_sdpa"] < 2e-2 for r in checked)


def test_attention_sweep_recommends_only_correct_configs(tmp_path: Path) -> None:
    report = smoke_report(tmp_path, "attention_sweep", interpret=True)
    failed = [r for r in report["rows"] if r["error"]]
    assert not failed, failed
    assert report["recommended"]
    assert all(r["err"] is None or r["err"] < 2e-2 for r in report["rows"])


def test_bench_head_sliced_moves_the_right_heads(tmp_path: Path) -> None:
    results = smoke_report(tmp_path, "bench_head_sliced")["results"]
    assert results and all(r["matched"] for r in results)

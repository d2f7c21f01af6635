"""Every GPU micro-benchmark in lab/micro runs in its `--smoke` mode on CPU (tiny model or shapes, the
torch reference or the Triton interpreter): the code that produces docs/benchmarks.md's figures keeps
working between GPU runs. Each run's report is checked for what the benchmark exists to say (its
rows, its identity and verification verdicts), not for its times, which mean nothing on CPU.

bench_moe, bench_mla, bench_hf_peer, fp8_accuracy and bench_multiturn_tiers have smoke tests of
their own beside this file."""

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


def test_bench_decode_reports_every_batch_and_context(tmp_path: Path) -> None:
    rows = smoke_report(tmp_path, "bench_decode")["rows"]
    assert sorted((r["batch"], r["ctx"]) for r in rows) == [(1, 64), (4, 64)]
    assert all(r["step_ms"] > 0 and r["tok_s"] > 0 for r in rows)


def test_bench_decode_compares_fp8_with_bf16_case_by_case(tmp_path: Path) -> None:
    rows = smoke_report(tmp_path, "bench_decode", "--precisions", "bf16", "fp8", "--batches", "1")["rows"]
    assert [r["precision"] for r in rows] == ["bf16", "fp8"]
    assert rows[1]["tok_s_vs_bf16"] == pytest.approx(rows[1]["tok_s"] / rows[0]["tok_s"])


def test_bench_prefill_reports_every_prompt_length_with_its_flops(tmp_path: Path) -> None:
    rows = smoke_report(tmp_path, "bench_prefill")["rows"]
    assert [r["tokens"] for r in rows] == [64, 256]
    assert rows[1]["tflop"] > rows[0]["tflop"] > 0 and all(0 < r["attn_share"] < 1 for r in rows)


def test_bench_mixed_step_reports_the_decode_share_of_each_mixed_step(tmp_path: Path) -> None:
    rows = smoke_report(tmp_path, "bench_mixed_step")["rows"]
    assert [(r["batch"], r["chunk"]) for r in rows] == [(2, 32), (4, 32)]
    assert all(r["mixed_ms"] > 0 and r["share"] == pytest.approx((r["mixed_ms"] - r["chunk_ms"]) / r["decode_ms"])
               for r in rows)


def test_bench_pp70b_finds_two_stages_identical_to_one_and_times_every_layout(tmp_path: Path) -> None:
    rows = smoke_report(tmp_path, "bench_pp70b")["rows"]
    identity = {r["layout"]: r["identical_to_pp1"] for r in rows if r["part"] == "identity"}
    assert identity == {"pp1": True, "pp2-mb1": True, "pp2-mb2": True}
    decode = [r for r in rows if r["part"] == "decode"]
    assert {r["layout"] for r in decode} == {"tp2", "tp2-eager", "pp2-mb1", "pp2-mb2"}
    assert all(r["step_ms"] > 0 for r in decode)


def test_bench_tp70b_times_the_all_reduce_and_the_tp_decode_step(tmp_path: Path) -> None:
    rows = smoke_report(tmp_path, "bench_tp70b")["rows"]
    steps = [r for r in rows if "step_ms" in r]
    assert {r["batch"] for r in steps} == {1, 4} and all(r["tp"] == 2 and 0 < r["ar_share"] < 1 for r in steps)
    assert any(r.get("kind") == "all_reduce" and r["ar_us"] > 0 for r in rows)


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


def test_bench_kv_transfer_verifies_every_block_of_every_case(tmp_path: Path) -> None:
    report = smoke_report(tmp_path, "bench_kv_transfer")
    assert report["ok"] and report["errors"] == []
    assert all(case["verified"] and case["bad_blocks"] == [] for case in report["cases"].values())


def test_bench_head_sliced_moves_the_right_heads(tmp_path: Path) -> None:
    results = smoke_report(tmp_path, "bench_head_sliced")["results"]
    assert results and all(r["matched"] for r in results)


def test_bench_disagg_gpu_hands_off_remotely_with_the_co_located_tokens(tmp_path: Path) -> None:
    report = smoke_report(tmp_path, "bench_disagg_gpu")
    assert report["ok"] and report["errors"] == []
    assert report["identity"] and all(r["identical"] and r["path"] == r["expected_path"] for r in report["identity"])
    assert "REMOTE" in report["ttft"]["disagg_paths"]

"""The CPU micro-benchmarks in lab/micro, each run in-process at its smallest size (a few messages, calls,
steps or words): their code keeps running between the runs that produce docs/benchmarks.md's figures.
What each one reports is checked (its rows, its counts), never its times: on a shared CPU they say nothing.

bench_engine_cpu, bench_structured_cpu and bench_speculative_cpu are left out: their smallest run loads
the default model into two engines (or transformers beside the engine) and costs 10-40 s of CI time.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lab.micro import (
    bench_block_file_checksum,
    bench_broker_storage,
    bench_cluster_auth,
    bench_safety_long,
    bench_safety_queueing,
    bench_tier_store_zero_hit,
)

CLUSTER_AUTH_SETUPS = ("open", "token", "token_metadata", "traced_open", "traced_token")


def run_main(main: Callable[[], object], monkeypatch: pytest.MonkeyPatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["bench", *argv])
    assert main() in (None, 0)


def test_block_file_checksum_times_both_block_shapes(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run_main(bench_block_file_checksum.main, monkeypatch, "--min-s", "0.01")
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert {name: row["block_bytes"] for name, row in report.items()} == {
        "llama8b_bf16_2MiB": 2 * 2**20, "smollm2_f32_720KiB": 737_280}
    rates = ("kv_integrity_cpu_bytes_per_s", "crc32_bytes_per_s", "file_write_read_bytes_per_s")
    assert all(row[rate] > 0 for row in report.values() for rate in rates)


def test_tier_store_zero_hit_demotes_every_freed_block(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()  # the benchmark sets one intra-op thread for the whole process
    try:
        run_main(bench_tier_store_zero_hit.main, monkeypatch, "--steps", "3")
    finally:
        torch.set_num_threads(threads)
    found = re.search(r"demoted \{'host': (\d+), 'disk': (\d+)\}", capsys.readouterr().out)
    assert found, "no demotion counts printed"
    host, disk = map(int, found.groups())
    assert host == 3 * 16 and 0 < disk <= host  # 16 blocks a step; the 16-block host tier spills to disk


def test_cluster_auth_times_every_set_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "auth.json"
    run_main(bench_cluster_auth.main, monkeypatch, "--calls", "20", "--rounds", "2", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["calls"] == 20 and report["rounds"] == 2
    assert all(report[setup]["wall_us"] > 0 and report[setup]["cpu_us"] > 0 for setup in CLUSTER_AUTH_SETUPS)
    assert report["check_us"] > 0 and report["intercept_us"] > 0


def test_broker_storage_measures_memory_and_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "broker.json"
    run_main(bench_broker_storage.main, monkeypatch, "--messages", "5", "--burst", "20", "--out", str(out))
    rows = json.loads(out.read_text())
    assert [r["storage"] for r in rows] == ["memory", "disk"]
    assert all(r["start_s"] > 0 and r["acked_p50_ms"] > 0 and r["burst_msg_per_s"] > 0 for r in rows)


def test_safety_long_judges_the_text_it_was_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "long.json"
    run_main(bench_safety_long.main, monkeypatch, "--words", "100", "--repeats", "1", "--runtime", "onnx",
             "--out", str(out))
    (row,) = json.loads(out.read_text())
    assert row["runtime"] == "onnx" and row["words"] == 100
    assert row["tokens"] >= row["words"] and row["segments"] >= 1


def test_safety_queueing_answers_every_check_of_both_scenarios(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    run_main(bench_safety_queueing.main, monkeypatch, "--burst", "4", "--behind-words", "100")
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["scenario"], r["of"]) for r in rows] == [("burst", 4), ("burst", 4), ("behind_long", 12)]
    # How many failed closed turns on this CPU's load; that each check was answered or failed does not.
    assert all(0 <= r["failed"] <= r["of"] for r in rows) and "long_failed" in rows[-1]

"""The multi-turn KV-tier benchmark's CPU smoke mode (lab/micro/bench_multiturn_tiers.py --smoke):
both modes finish every turn, the tiered run loads history from host and disk, and greedy output is the
same turn for turn; the host-only 0%-hit run demotes to host and never to disk. Figures are not asserted
(timings on a shared CPU say nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_smoke_run_finishes_every_turn_with_tier_hits_and_identical_greedy_output(
        tmp_path: Path, default_model_dir: Path) -> None:
    out = tmp_path / "multiturn.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "lab.micro.bench_multiturn_tiers", "--smoke",
                           "--time-limit-s", "400", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    turns = report["workload"]["conversations"] * report["workload"]["turns"]
    for mode in ("off", "on"):
        assert not report["modes"][mode]["conversations_truncated"]
        assert report["modes"][mode]["conversations"]["requests"] == turns
        assert report["modes"][mode]["zero_hit"]["requests"] == report["workload"]["unique_prompts"]
    assert report["modes"]["off"]["tiers"] is None
    hits = report["modes"]["on"]["tiers"]["hit_blocks"]
    assert hits.get("disk", 0) > 0 and sum(hits.values()) > 0
    assert all(differ == 0 for _, differ in report["mismatched_greedy_turns"].values())  # float32 on CPU: exact
    for mode in ("off", "on"):
        probe = report["modes"][mode]["probe"]
        assert probe["probes"] == 1 and not report["modes"][mode]["probe_truncated"]
    assert report["modes"]["off"]["probe"]["tier_loaded_tokens"] == [0]
    assert report["modes"]["on"]["probe"]["tier_loaded_tokens"][0] >= 32  # the evicted history came back
    host_only = report["modes"]["host_only"]  # the 0%-hit phase again, with only a host tier
    assert host_only["zero_hit"]["requests"] == report["workload"]["unique_prompts"]
    demoted = host_only["tiers"]["demoted_blocks"]
    assert demoted.get("host", 0) > 0 and "disk" not in demoted
    assert host_only["engine_thread"]["zero_hit"]["calls_by_hook"].get("offer", 0) > 0  # the hooks were timed
    assert "TTFT p50 hit" in proc.stdout  # the table

"""bench_host_step --smoke on CPU: one row per batch with every phase column (the times themselves mean
nothing on a shared CPU runner, so only their presence and signs are checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lab.micro.bench_host_step import COLUMNS

ROOT = Path(__file__).resolve().parents[3]


def test_bench_host_step_smoke_reports_every_phase_per_batch(tmp_path: Path) -> None:
    out = tmp_path / "host_step.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "lab.micro.bench_host_step", "--smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for row in rows:
        assert set(COLUMNS) <= row.keys()
        assert row["forward"] > 0 and row["graph_stage"] > 0 and row["schedule"] > 0

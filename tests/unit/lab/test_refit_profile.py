"""lab/experiments/refit_profile.py: a pre-floor profile refitted from `baton profile`'s printed table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.experiments.refit_profile import main, prefill_table
from scheduler.core.cost_model import WorkerProfile

REPORT = """profiling ... on NVIDIA H100 80GB HBM3
prefill: one prompt per step
     new   cached  measured_ms  fitted_ms    error
      16        0        22.01      19.52   -11.3%
     128        0        21.63      20.74    -4.1%
     512        0        21.92      25.24   +15.1%
    1024        0        32.71      31.96    -2.3%
    2048        0        64.38      47.86   -25.7%
     512     1024        21.86      26.88   +23.0%

decode: one token per sequence
   batch  ctx/seq  measured_ms  fitted_ms    error
       1       64         8.51       8.74    +2.7%
"""


def test_the_prefill_table_is_read_and_the_decode_one_left_out() -> None:
    rows = prefill_table(REPORT)
    assert [(p.new_tokens, p.cached_tokens) for p, _ in rows] == [(16, 0), (128, 0), (512, 0), (1024, 0),
                                                                   (2048, 0), (512, 1024)]
    assert rows[-2][1] == pytest.approx(0.06438)
    with pytest.raises(ValueError, match="no prefill table"):
        prefill_table("decode: one token per sequence\n")


def test_an_old_profile_gets_a_floor_and_keeps_its_decode_terms(tmp_path: Path) -> None:
    old = WorkerProfile(prefill_fixed_s=0.0193, prefill_per_token_s=1.07e-5, decode_fixed_s=0.00872)
    (tmp_path / "p.json").write_text(json.dumps({"m": json.loads(old.to_json())}))
    (tmp_path / "r.txt").write_text(REPORT)
    assert main([str(tmp_path / "p.json"), str(tmp_path / "r.txt"), "--out", str(tmp_path / "new.json")]) == 0
    new = WorkerProfile.from_dict(json.loads((tmp_path / "new.json").read_text())["m"])
    assert new.prefill_floor_s == pytest.approx(0.0219, abs=3e-4)
    assert new.prefill_s(2048) == pytest.approx(0.06438, rel=0.02)
    assert new.decode_fixed_s == old.decode_fixed_s
    assert main([str(tmp_path / "missing.json"), str(tmp_path / "r.txt"), "--out", str(tmp_path / "x.json")]) == 2

"""handoff_timeline: marks go into a scratch copy of today's code (never a checkout), and the marks of
the client and the workers read back as per-path medians after the client's send."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lab.experiments.handoff_timeline import INSERTIONS, mark_tree, medians, read_marks

ROOT = Path(__file__).resolve().parents[3]


def _copy_marked_files(dest: Path) -> None:
    for path in {ins.path for ins in INSERTIONS}:
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, dest / path)


def test_every_mark_finds_its_anchor_in_todays_code(tmp_path: Path) -> None:
    _copy_marked_files(tmp_path)
    mark_tree(tmp_path)
    marked = "".join((tmp_path / p).read_text() for p in {ins.path for ins in INSERTIONS})
    assert marked.count("mark('") == sum("mark('" in ins.text for ins in INSERTIONS)
    assert (tmp_path / "engine/_tl.py").exists()
    compile((tmp_path / "engine/llm_engine.py").read_text(), "llm_engine.py", "exec")  # still Python


def test_a_checkout_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    with pytest.raises(SystemExit, match="git checkout"):
        mark_tree(tmp_path)


def test_a_moved_anchor_names_its_file(tmp_path: Path) -> None:
    _copy_marked_files(tmp_path)
    (tmp_path / "engine/async_engine.py").write_text("# rewritten\n")
    with pytest.raises(SystemExit, match="engine/async_engine.py: anchor not found"):
        mark_tree(tmp_path)


def test_marks_read_back_per_request_in_time_order(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "both-0.log").write_text("")
    (logs / "decode-0.log").write_text("x INFO TL: TL gen_in r1 1500000\nx INFO TL: TL chunk r1 2000000\n"
                                       "x INFO TL: TL chunk r1 4000000\n")
    (logs / "prefill-0.log").write_text("x INFO TL: TL pf_in r1 1800000\n")
    (tmp_path / "bench.log").write_text("TLC send r1 1000000\nTLC first r1 5000000\n")
    marks = read_marks(logs, tmp_path / "bench.log")
    assert marks["r1"] == {"d:gen_in": 1500000, "d:chunk": 2000000, "d:chunk2": 4000000, "p:pf_in": 1800000,
                           "c:send": 1000000, "c:first": 5000000}
    assert [(k, ms) for k, _, ms in medians(list(marks.values()))] == [
        ("c:send", 0.0), ("d:gen_in", 0.5), ("p:pf_in", 0.8), ("d:chunk", 1.0), ("d:chunk2", 3.0), ("c:first", 4.0)]

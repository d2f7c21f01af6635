"""lab/suites/scheduler_ab.sh refuses a bad call before it copies or runs anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "lab/suites/scheduler_ab.sh"


def _run(args: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("args, env, message", [
    ([], {}, "usage: scheduler_ab.sh newfirst|oldfirst"),
    (["sideways"], {"OLD": "x", "PROFILE": "p.json"}, "order must be newfirst or oldfirst, got sideways"),
    (["newfirst"], {"PROFILE": "p.json"}, "OLD: a folder holding the old scheduler/"),
    (["oldfirst"], {"OLD": "x"}, "PROFILE: a baton profile json"),
])
def test_a_bad_call_is_refused_with_its_reason(args: list[str], env: dict[str, str], message: str,
                                               tmp_path: Path) -> None:
    done = _run(args, env, tmp_path)
    assert done.returncode != 0
    assert message in done.stderr
    assert not (tmp_path / "out").exists()  # nothing was started

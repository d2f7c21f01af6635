"""`--file-durations` (tests/support/file_durations.py), run on a scratch suite in a pytest subprocess: files
and directories are listed slowest first, a module fixture's set-up counted in its file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.support.file_durations import seconds_by_directory

ROOT = Path(__file__).resolve().parents[2]

SLOW_FIXTURE = ("import time\nimport pytest\n\n@pytest.fixture(scope='module')\ndef slow():\n    time.sleep(0.5)\n\n"
                "def test_one(slow):\n    pass\n\ndef test_two(slow):\n    pass\n")


def test_files_and_directories_are_listed_slowest_first(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "test_slow.py").write_text(SLOW_FIXTURE)
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    pass\n")
    record = tmp_path / "record.json"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "tests.support.file_durations", "--file-durations=5", f"--file-durations-record={record}",
                          str(tmp_path)],
                         cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    files = run.stdout.split("slowest 5 test files")[1].split("slowest 5 test directories")[0]
    listed = re.findall(r"^\s*([\d.]+)s\s+[\d.]+%\s+(\S+)$", files, re.M)
    assert [path for _, path in listed] == ["deep/test_slow.py", "test_quick.py"]
    assert float(listed[0][0]) >= 0.5  # the module fixture's sleep is charged to its file
    assert re.search(r"^\s*[\d.]+s\s+[\d.]+%\s+deep$", run.stdout.split("slowest 5 test directories")[1], re.M)
    recorded = json.loads(record.read_text())  # every file, as xdist's hand-out order reads it
    assert set(recorded) == {"deep/test_slow.py", "test_quick.py"} and recorded["deep/test_slow.py"] >= 0.5


def test_a_directory_total_includes_its_subdirectories() -> None:
    totals = seconds_by_directory({"tests/unit/engine/test_a.py": 2.0, "tests/unit/test_b.py": 1.0,
                                   "tests/integration/test_c.py": 4.0})
    assert totals == {"tests/unit/engine": 2.0, "tests/unit": 3.0, "tests/integration": 4.0, "tests": 7.0}

"""`make test`'s xdist grouping (tests/support/xdist_groups.py), run on a scratch suite under `-n 2 --dist
loadgroup` in a pytest subprocess: an expensive session fixture starts in one worker only, and a module's
tests (and so its module fixtures) stay in one worker."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.xdist_order import FILE_SECONDS_ENV

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = '''
import os
import pytest
pytest_plugins = ['tests.support.xdist_groups']

def _record(what):
    with open(os.environ["SCRATCH_LOG"], "a") as log:
        log.write(f"{what} {os.environ.get('PYTEST_XDIST_WORKER', 'main')}\\n")

@pytest.fixture(scope="session")
def gateway_stack():
    _record("start gateway_stack")

@pytest.fixture
def ran(request):
    _record(f"ran {request.node.nodeid.split('@')[0]}")
'''

STACK_TESTS = "".join(f"def test_{i}(gateway_stack, ran):\n    pass\n\n" for i in range(4))
PLAIN_TESTS = "".join(f"def test_{i}(ran):\n    pass\n\n" for i in range(4))
# A module's own fixture named like a session one must not pull the module into that session's group.
MODULE_CLUSTER = ("import pytest\n\n@pytest.fixture(scope='module')\ndef cluster():\n"
                  "    from conftest import _record\n    _record('start module cluster')\n\n"
                  + "".join(f"def test_{i}(cluster, ran):\n    pass\n\n" for i in range(4)))


def _run_scratch_suite(tmp_path: Path) -> list[tuple[str, str]]:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "conftest.py").write_text(CONFTEST)
    for name in ("stack_a", "stack_b"):
        (suite / f"test_{name}.py").write_text(STACK_TESTS)
    for name in ("plain_c", "plain_d", "plain_e"):
        (suite / f"test_{name}.py").write_text(PLAIN_TESTS)
    (suite / "test_module_cluster.py").write_text(MODULE_CLUSTER)
    (suite / "test_long.py").write_text("def test_long(ran):\n    pass\n")  # last by name and test count
    record = tmp_path / "file_seconds.json"
    record.write_text(json.dumps({"test_long.py": 100.0, "test_plain_c.py": 1.0}))
    log = tmp_path / "events.log"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                          "loadgroup", str(suite)], cwd=suite, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": f"{ROOT}:{suite}", "PATH": "/usr/bin:/bin", "SCRATCH_LOG": str(log),
                              FILE_SECONDS_ENV: str(record)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "25 passed" in run.stdout
    return [tuple(line.rsplit(" ", 1)) for line in log.read_text().splitlines()]  # type: ignore[misc]


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str]]:
    """The scratch suite's events (what happened, on which worker), in the order they happened."""
    return _run_scratch_suite(tmp_path_factory.mktemp("xdist-groups"))


def test_an_expensive_session_fixture_starts_once_and_a_module_stays_on_one_worker(
        events: list[tuple[str, str]]) -> None:
    starts = [worker for what, worker in events if what == "start gateway_stack"]
    assert len(starts) == 1
    workers_of: dict[str, set[str]] = defaultdict(set)
    for what, worker in events:
        if what.startswith("ran "):
            workers_of[what.removeprefix("ran ").split("::")[0]].add(worker)
    assert workers_of["test_stack_a.py"] == workers_of["test_stack_b.py"] == set(starts)
    assert all(len(workers) == 1 for workers in workers_of.values()), workers_of
    assert [what for what, _ in events].count("start module cluster") == 1
    assert {w for ws in workers_of.values() for w in ws} == {"gw0", "gw1"}  # the work really was shared


def test_the_longest_recorded_group_is_handed_out_first(events: list[tuple[str, str]]) -> None:
    """xdist alone hands out the biggest groups first: test_long.py, one test, would come last."""
    (long_worker,) = {worker for what, worker in events if what == "ran test_long.py::test_long"}
    ran_there = [what for what, worker in events if worker == long_worker and what.startswith("ran ")]
    assert ran_there[0] == "ran test_long.py::test_long", ran_there

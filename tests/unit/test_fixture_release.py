"""The expensive session fixtures end after their last test (tests/support/fixture_release.py), run on a
scratch suite in a pytest subprocess; and what a module starts on the gateway stack stops with the module
(GatewayStack.stopping_what_starts), on a real supervisor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.launcher.supervisor import ChildSpec, Supervisor
from tests.support.gateway_stack import GatewayStack

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = '''
import os
import pytest
pytest_plugins = ['tests.support.fixture_release']

def _record(what):
    with open(os.environ["SCRATCH_LOG"], "a") as log:
        log.write(what + "\\n")

@pytest.fixture(scope="session")
def cluster():  # one of the expensive session fixtures
    _record("start cluster")
    yield
    _record("stop cluster")

@pytest.fixture(scope="session")
def cheap():  # any other session fixture
    _record("start cheap")
    yield
    _record("stop cheap")

@pytest.fixture(scope="module")
def on_cluster(cluster):
    _record("start on_cluster")
    yield
    _record("stop on_cluster")

@pytest.fixture
def ran(request):
    _record("ran " + request.node.name)
'''
FIRST = ("def test_1(cluster, cheap, ran):\n    pass\n\ndef test_2(on_cluster, ran):\n    pass\n\n"
         "def test_3(ran):\n    pass\n")
SECOND = "def test_4(cheap, ran):\n    pass\n"
# A module's own fixture named like the session one is not a use of the session's.
OWN_CLUSTER = ("import pytest\nfrom conftest import _record\n\n@pytest.fixture(scope='module')\ndef cluster():\n"
               "    _record('start module cluster')\n\ndef test_5(cluster, ran):\n    pass\n")


def test_a_session_fixture_in_the_list_ends_after_its_last_test_and_its_dependents_first(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_a.py").write_text(FIRST)
    (suite / "test_b.py").write_text(SECOND)
    (suite / "test_c.py").write_text(OWN_CLUSTER)
    log = tmp_path / "events.log"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)], cwd=suite,
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": f"{ROOT}:{suite}", "PATH": "/usr/bin:/bin", "SCRATCH_LOG": str(log)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert log.read_text().splitlines() == [
        "start cluster", "start cheap", "ran test_1", "start on_cluster", "ran test_2",
        "stop on_cluster", "stop cluster",  # test_2 was the last test to use it
        "ran test_3", "ran test_4", "start module cluster", "ran test_5",
        "stop cheap",  # not in the list: the end of the session
    ]


def _sleeper(name: str) -> ChildSpec:
    return ChildSpec(name, ["sleep", "60"], ready=lambda process: True, stop_timeout_s=5)


def test_what_starts_on_the_stack_inside_stops_on_exit_and_its_own_children_stay(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    stack = GatewayStack("http://127.0.0.1:1", "", "", {}, supervisor, tmp_path)
    try:
        worker = supervisor.start(_sleeper("worker-both"))
        supervisor.start(_sleeper("gateway"))
        with stack.stopping_what_starts():
            extra = supervisor.start(_sleeper("gateway-extra"))
            scheduler = supervisor.start(_sleeper("scheduler"))
            supervisor.stop_child("gateway")  # a test restarts one of the stack's own: it stays
            gateway = supervisor.start(_sleeper("gateway"))
        assert not extra.alive() and not scheduler.alive()
        assert worker.alive() and gateway.alive()
        assert sorted(spec.name for spec, _ in supervisor.children) == ["gateway", "worker-both"]
    finally:
        supervisor.stop_all()

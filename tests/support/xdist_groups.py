"""Which tests share a pytest-xdist worker under `make test`'s `-n 2 --dist loadgroup` (a pytest plugin;
tests/conftest.py loads it).

Each xdist worker is a session of its own, so a session fixture that two workers both use starts twice, and a
module fixture starts in every worker that runs a test of its module. Both are what make this suite slow
(a worker subprocess pays ~10 s of torch import; a cluster or gateway stack is several), so:
- a test that uses one of EXPENSIVE_SESSION_FIXTURES joins that fixture's group: one worker starts it once;
- any other test joins its module's group: a module's own fixtures (a `baton serve`, a model) start once,
  and its tests keep their file order, as they would in a serial run.
Cheap session fixtures (the embedded Postgres, Redis and broker: a few seconds) may start in both workers.
The groups are handed out longest first, by a record of earlier per-file times (tests/support/xdist_order.py).

xdist's own loadgroup reads `xdist_group` marks into node ids, which pytest 9.2's structured node ids no
longer allow (the marks are silently ignored: every test is scheduled alone). So the workers, which see each
test's fixtures, write the groups to a file the controller named, and the controller's scheduler reads it;
every worker collects the same tests, so the file is complete before the first test is scheduled.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from tests.support.xdist_order import order_longest_first, recorded_file_seconds

# The session fixtures worth one worker to themselves: model subprocesses (tests/conftest.py,
# tests/integration/worker/conftest.py). The first one a test uses names its group. They also end right
# after their last test (tests/support/fixture_release.py).
EXPENSIVE_SESSION_FIXTURES = ("gateway_stack", "cluster", "moe_cluster", "mla_cluster", "both_worker")
GROUPS_FILE_ENV = "BATON_TEST_XDIST_GROUPS"  # set by the controller, inherited by the workers it spawns
_CREATED_GROUPS_FILE = pytest.StashKey[str]()  # in the controller that made the file: only it removes the file


def xdist_group_of(item: pytest.Item) -> str:
    """The group of one collected test: its expensive session fixture's, else its module's path."""
    info = getattr(item, "_fixtureinfo", None)
    name2defs = info.name2fixturedefs if info is not None else {}
    for name in EXPENSIVE_SESSION_FIXTURES:
        fixturedefs = name2defs.get(name)
        if fixturedefs and fixturedefs[-1].scope == "session":  # a module's own `cluster` is not the session's
            return f"session-{name}"
    return item.nodeid.split("::", 1)[0]


def _grouping(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadgroup"


def pytest_configure(config: pytest.Config) -> None:
    if _grouping(config) and not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        fd, path = tempfile.mkstemp(prefix="baton-xdist-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS_FILE_ENV] = path
        config.stash[_CREATED_GROUPS_FILE] = path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = os.environ.get(GROUPS_FILE_ENV)
    if path is None or not hasattr(config, "workerinput"):
        return
    scratch = f"{path}.{config.workerinput['workerid']}"
    Path(scratch).write_text(json.dumps({item.nodeid: xdist_group_of(item) for item in items}))
    os.replace(scratch, path)  # whole or absent, though both workers write it


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown to a pytest without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if not _grouping(config):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FixtureGroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling, a scope being a group the workers wrote (see the module docstring),
        the longest group handed out first (tests/support/xdist_order.py)."""

        groups: dict[str, str] | None = None
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(Path(os.environ[GROUPS_FILE_ENV]).read_text())
            return self.groups.get(nodeid) or nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node: object) -> None:
            if not self.ordered:  # the first hand-out: the queue holds every group
                order_longest_first(self.workqueue, recorded_file_seconds())
                self.ordered = True
            super()._assign_work_unit(node)  # type: ignore[arg-type]

    return FixtureGroupScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Not a pytest that a test started inside a worker (it inherits the variable): only the file's maker."""
    path = config.stash.get(_CREATED_GROUPS_FILE, None)
    if path is not None:
        Path(path).unlink(missing_ok=True)

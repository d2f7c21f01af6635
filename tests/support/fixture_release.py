"""The expensive session fixtures end right after the last test that uses them, not when the session ends
(a pytest plugin; tests/conftest.py loads it).

A session fixture's processes otherwise outlive their last user by the rest of the run: the worker suite's
prefill + decode cluster sat through the pipeline- and tensor-parallel set-ups and the whole unit suite, its
two NIXL workers polling every millisecond (~7% of a core each, idle) and holding ~1 GB each, on a 2-core
machine where those set-ups start 8-10 model processes at once. pytest has no scope "until its last user",
so this plugin finishes such a fixture itself, in the teardown of that test, through the fixture's own
finalizers: the same teardown code that would have run at the end of the session, only earlier.

"Last" is in the session's test order. A test that needs the fixture after all (an xdist worker handed its
tests in another order) starts it again, as a first user would.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
from _pytest.fixtures import FixtureDef

from tests.support.xdist_groups import EXPENSIVE_SESSION_FIXTURES

# nodeid of a test -> the session fixtures that no later test uses
_RELEASED_AFTER = pytest.StashKey[dict[str, list[FixtureDef[object]]]]()


def released_after(items: list[pytest.Item], names: tuple[str, ...] = EXPENSIVE_SESSION_FIXTURES
                   ) -> dict[str, list[FixtureDef[object]]]:
    """For each test that is the last user of one of the session fixtures `names`, those fixtures."""
    last_user: dict[FixtureDef[object], str] = {}
    for item in items:
        for fixturedef in _session_fixturedefs(item, names):
            last_user[fixturedef] = item.nodeid
    released: dict[str, list[FixtureDef[object]]] = {}
    for fixturedef, nodeid in last_user.items():
        released.setdefault(nodeid, []).append(fixturedef)
    return released


def _session_fixturedefs(item: pytest.Item, names: tuple[str, ...]) -> list[FixtureDef[object]]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a test function (e.g. a doctest)
        return []
    found = []
    for name in names:
        fixturedefs = info.name2fixturedefs.get(name)
        if fixturedefs and fixturedefs[-1].scope == "session":  # a module's own `cluster` is not the session's
            found.append(fixturedefs[-1])
    return found


@pytest.hookimpl(trylast=True)  # after any plugin that reorders the tests
def pytest_collection_modifyitems(session: pytest.Session, items: list[pytest.Item]) -> None:
    session.stash[_RELEASED_AFTER] = released_after(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    try:
        return (yield)
    finally:
        for fixturedef in item.session.stash.get(_RELEASED_AFTER, {}).get(item.nodeid, []):
            # `finish` reads only the request's node (for its error message); the test's own request is it.
            fixturedef.finish(request=item._request)  # type: ignore[attr-defined]

"""Fixtures shared by every test suite. Keep each one small and named for what it provides.

The infrastructure fixtures start real servers lazily, at most once per session, on first use: a
missing binary is a test ERROR with the install hint, never a skip (`make test` runs
scripts/install-system-deps.sh first, so a missing server means the set-up is broken). Likewise a
missing package (tests/support/required.py). The skip rule's hooks (tests/support/skip_policy.py)
fail a run in which a test skipped for anything but missing hardware.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# torch's OpenMP threads spin a while before they sleep when out of work (libgomp's default). On 2 cores shared with
# the workers, ranks and benchmarks the tests start (or other jobs), a spinning thread holds a core the thread it
# waits for needs: in-process engine tests ran 3-5x slower than with the threads asleep while waiting. Set before
# anything imports torch (libgomp reads it once, when loaded); every process the tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from services.launcher.postgres import EmbeddedPostgres
from services.launcher.redis_server import EmbeddedRedis
from services.launcher.tansu import EmbeddedKafka
from tests.support.skip_policy import (  # noqa: F401 - pytest hooks, registered by being here
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

# Hooks of their own (their names would clash with the skip rule's above): xdist grouping, --file-durations,
# the expensive session fixtures' end after their last test.
pytest_plugins = ["tests.support.xdist_groups", "tests.support.file_durations", "tests.support.fixture_release"]


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct HF directory (converted from the PyPI GGUF on first use).

    Cached under `$BATON_CACHE_DIR` when set, else `~/.cache/baton`, so only the first test run of a
    machine pays the ~10 s conversion.
    """
    from engine.loader.prepare import default_model_dir as prepare_default_model

    return prepare_default_model(os.environ.get("BATON_CACHE_DIR") or None)


@pytest.fixture(scope="session")
def postgres() -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[EmbeddedKafka]:
    broker = EmbeddedKafka()
    broker.start()
    yield broker
    broker.close()


@pytest.fixture(scope="session")
def gateway_stack(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path, postgres: EmbeddedPostgres,
                  redis_server: EmbeddedRedis, kafka_broker: EmbeddedKafka) -> Iterator[object]:
    """A `both` worker + billing consumer + gateway (tests/support/gateway_stack.py), once per session."""
    from tests.support.gateway_stack import start_stack

    database_url = postgres.create_database("baton_gateway")
    stack = start_stack(tmp_path_factory.mktemp("gateway-stack"), default_model_dir, database_url,
                        redis_server.url, kafka_broker.url)
    yield stack
    stack.close()


@pytest.fixture(autouse=True, scope="module")
def stack_processes_end_with_their_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """What a module starts on the session's gateway stack (extra gateways, safety services, a scheduler and
    its workers) stops when the module ends, not when the session does (GatewayStack.stopping_what_starts).
    Modules none of whose tests use the stack leave it alone (and unstarted)."""
    in_module = request.node.nodeid + "::"
    if not any(item.nodeid.startswith(in_module) and "gateway_stack" in item.fixturenames
               for item in request.session.items):
        yield
        return
    with request.getfixturevalue("gateway_stack").stopping_what_starts():
        yield

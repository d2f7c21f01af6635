"""Fixtures of the safety integration tests: a real grpc.aio Safety server on a free port."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.safety.checker import SafetyChecker
from services.safety.classifier import EmbeddingClassifier
from services.safety.client import SafetyClient, SafetyClientConfig
from services.safety.patterns import PatternTier
from services.safety.policy import PolicyBook
from services.safety.server import SafetyServer, SafetyServerConfig

POLICIES = {"orgs": {"org_no_input": {"input": False}, "org_flag": {"action": "flag"}}}


@pytest.fixture(scope="session")
def checker() -> SafetyChecker:
    """Loaded once per session (under a second); servers of every test share it."""
    return SafetyChecker(PolicyBook.from_mapping(POLICIES), PatternTier(), EmbeddingClassifier.load())


@pytest.fixture
async def server(checker: SafetyChecker) -> AsyncIterator[SafetyServer]:
    srv = SafetyServer(SafetyServerConfig(host="127.0.0.1", port=0, grace_s=0.5), checker)
    await srv.start()
    yield srv
    await srv.stop(0)


@pytest.fixture
async def client(server: SafetyServer) -> AsyncIterator[SafetyClient]:
    c = SafetyClient(f"127.0.0.1:{server.port}", SafetyClientConfig(timeout_s=2.0))
    yield c
    await c.close()

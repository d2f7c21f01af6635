"""Fixtures for the load-test harness tests: the engine tokenizer and the SSE test server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from bench_sse_server import Behaviour, BenchSSEServer

from loadtest.tokens import EngineTokenizer, PromptTokenizer


@pytest.fixture(scope="session")
def engine_tokenizer(default_model_dir: Path) -> PromptTokenizer:
    from tokenization.tokenizer import Tokenizer

    return EngineTokenizer(Tokenizer.from_dir(default_model_dir), name=default_model_dir.name)


@pytest.fixture
def sse_server(request: pytest.FixtureRequest) -> Iterator[BenchSSEServer]:
    """The test server; parametrize indirectly with a `Behaviour` to change it."""
    behaviour = getattr(request, "param", None) or Behaviour()
    with BenchSSEServer(behaviour) as server:
        yield server

"""Fixtures of the worker unit tests: the tiny dummy model and in-process prefill / decode workers
(tests/unit/worker/handoff_harness.py)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from handoff_harness import Worker, open_worker, transfer_config, write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matmuls: torch's thread pool only adds contention (a step takes ~1 ms on one thread, tens
    of ms with every core's threads spinning on a loaded 2-core host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
async def prefill_worker(tiny_model_dir: Path) -> AsyncIterator[Worker]:
    worker = await open_worker(tiny_model_dir, "prefill", transfer_config())
    yield worker
    await worker.close()


@pytest.fixture
async def decode_worker(tiny_model_dir: Path) -> AsyncIterator[Worker]:
    worker = await open_worker(tiny_model_dir, "decode", transfer_config())
    yield worker
    await worker.close()

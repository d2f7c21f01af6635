"""A session-scoped prefill + decode + both cluster of real worker subprocesses on the default model.

The decode worker uses low conditional-disaggregation thresholds (prompts >= 8 tokens prefill
remotely), a short transfer deadline (3 s) and quarantine (6 s) so the failure tests run quickly,
and both NIXL workers accept InjectFault. Logs go to tmp files; a failing start shows their tail.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from worker_procs import WorkerProcess, stop_workers  # noqa: E402

from tests.support.required import require_module  # noqa: E402

require_module("nixl._api")  # every worker here moves KV over NIXL: missing is an ERROR, never a skip

NUM_BLOCKS = "256"
TRANSFER_TIMEOUT_S = 3.0


@dataclass
class Cluster:
    prefill: WorkerProcess
    decode: WorkerProcess
    both: WorkerProcess
    log_dir: Path

    @property
    def workers(self) -> list[WorkerProcess]:
        return [self.prefill, self.decode, self.both]


def decode_args(*prefill_addresses: str) -> list[str]:
    return ["--num-blocks", NUM_BLOCKS, "--prefill-peers", ",".join(prefill_addresses), "--max-num-seqs", "8",
            "--min-remote-prompt-tokens", "8", "--min-remote-uncached-tokens", "4",
            "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--kv-quarantine-s", "6", "--prefill-timeout-s", "20",
            "--allow-fault-injection"]


@pytest.fixture(scope="session")
def worker_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("worker-logs")


@pytest.fixture(scope="session")
def both_worker(default_model_dir: Path, worker_log_dir: Path) -> Iterator[WorkerProcess]:
    """The default model's single-process `both` worker: `cluster`'s, and the pipeline- and tensor-parallel
    tests' reference (ending after them, while the cluster's NIXL pair ends after its own last test).
    Started, not waited for: its users wait for it together with the workers they start beside it."""
    worker = WorkerProcess("both-1", "both", default_model_dir, worker_log_dir, "--num-blocks", NUM_BLOCKS).start()
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="session")
def cluster(default_model_dir: Path, worker_log_dir: Path, both_worker: WorkerProcess) -> Iterator[Cluster]:
    yield from _run_cluster(default_model_dir, worker_log_dir, both_worker)


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A tiny seeded Qwen3-MoE checkpoint with the default model's tokenizer (tests/support/tiny_moe.py)."""
    from tests.support.tiny_moe import save_tiny_moe

    return save_tiny_moe("qwen3-moe", tmp_path_factory.mktemp("qwen3-moe"), default_model_dir)


@pytest.fixture(scope="session")
def moe_cluster(moe_model_dir: Path, worker_log_dir: Path) -> Iterator[Cluster]:
    """The same three workers as `cluster`, serving the tiny Qwen3-MoE."""
    log_dir = worker_log_dir / "moe"
    log_dir.mkdir()
    yield from _run_cluster(moe_model_dir, log_dir)


@pytest.fixture(scope="session")
def mla_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A tiny seeded DeepSeek-V2 checkpoint (latent attention, grouped routing) with the default tokenizer."""
    from tests.support.tiny_moe import save_tiny_moe

    return save_tiny_moe("deepseek-v2", tmp_path_factory.mktemp("deepseek-v2"), default_model_dir)


@pytest.fixture(scope="session")
def mla_cluster(mla_model_dir: Path, worker_log_dir: Path) -> Iterator[Cluster]:
    """The same three workers as `cluster`, serving the tiny DeepSeek-V2: the hand-off moves latent blocks."""
    log_dir = worker_log_dir / "mla"
    log_dir.mkdir()
    yield from _run_cluster(mla_model_dir, log_dir)


def _run_cluster(model_dir: Path, log_dir: Path, both: WorkerProcess | None = None) -> Iterator[Cluster]:
    """The three workers; `both` when given is another fixture's (waited for here, stopped by its owner)."""
    prefill = WorkerProcess("prefill-1", "prefill", model_dir, log_dir, "--num-blocks", NUM_BLOCKS,
                            "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--allow-fault-injection").start()
    own_both = both is None
    if both is None:
        both = WorkerProcess("both-1", "both", model_dir, log_dir, "--num-blocks", NUM_BLOCKS).start()
    decode = WorkerProcess("decode-1", "decode", model_dir, log_dir, *decode_args(prefill.address)).start()
    started = Cluster(prefill, decode, both, log_dir)
    try:
        for worker in started.workers:
            worker.wait_serving()
        yield started
    finally:
        stop_workers([prefill, decode, *([both] if own_both else [])])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """On a failure, append the tail of every worker log this test used to the report."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or report.passed:
        return
    funcargs = getattr(item, "funcargs", {})
    workers = [w for v in funcargs.values() for w in _workers_of(v)]
    for worker in workers:
        report.sections.append((f"log tail of {worker.name}", worker.log_tail(40)))


def _workers_of(value: object) -> list[WorkerProcess]:
    if isinstance(value, WorkerProcess):
        return [value]
    if isinstance(value, Cluster):
        return value.workers
    return [w for w in getattr(value, "workers", []) if isinstance(w, WorkerProcess)]

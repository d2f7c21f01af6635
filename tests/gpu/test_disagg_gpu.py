"""Disaggregated serving on 2 GPUs: KV over NIXL VRAM (GPU0 -> GPU1) gives the co-located tokens.

Three real workers (`python -m services.worker`, dummy bf16 weights from one config.json and one seed):
prefill on GPU0, decode on GPU1 (`--prefill-peers` = the prefill worker), `both` on GPU0. Greedy
requests through the decode worker must return exactly the `both` worker's token ids, prefilled
remotely (>= 256 tokens) or locally (shorter); a corrupted landed block must be caught by the GPU
checksums (the Triton kernel) and recomputed locally, still with the right tokens.
Each worker sees only its own GPU; every wait has a timeout, and the workers are stopped at the end.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
import torch

from tests.support.required import require_module

pytestmark = pytest.mark.gpu

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
require_module("nixl._api")

from lab.micro.bench_disagg_gpu import GPU_MODEL  # noqa: E402
from lab.micro.disagg_workers import DisaggWorkers, Worker, generate, physical_gpu  # noqa: E402
from rpcgen.baton.v1 import worker_pb2 as pb  # noqa: E402
from scheduler.types import WorkerRole  # noqa: E402
from services.launcher.fleet import WorkerPlan  # noqa: E402

MODEL = dict(GPU_MODEL, num_hidden_layers=4)  # the bench's shape, fewer layers: the same KV layout per layer
THRESHOLD = 256
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Worker]]:
    root = tmp_path_factory.mktemp("disagg")
    (root / "config.json").write_text(json.dumps(MODEL))
    env = {"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    common = ("--model", str(root), "--load-format", "dummy", "--seed", "3", "--num-blocks", "1024",
              "--max-num-seqs", "16", "--max-model-len", "4096", "--drain-grace-s", "1", "--dtype", "bfloat16",
              "--attention-backend", "triton", "--device", "cuda:0", "--allow-fault-injection")

    def on(gpu: int) -> dict[str, str]:
        return {**env, "CUDA_VISIBLE_DEVICES": physical_gpu(gpu)}

    plans = [WorkerPlan("prefill-0", WorkerRole.PREFILL, common, on(0), worker_id=True),
             WorkerPlan("both-0", WorkerRole.BOTH, common, on(0), worker_id=True),
             WorkerPlan("decode-0", WorkerRole.DECODE, (*common, "--min-remote-prompt-tokens", str(THRESHOLD)), on(1),
                        prefill_peers=("prefill-0",), worker_id=True)]
    with DisaggWorkers(plans, root, 240) as workers:  # stops decode first: it holds prefill as a KV peer
        yield {"prefill": workers["prefill-0"], "both": workers["both-0"], "decode": workers["decode-0"]}


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(MODEL["vocab_size"]) for _ in range(n)]


@pytest.mark.timeout(300)
def test_disaggregated_greedy_tokens_equal_colocated_tokens(cluster: dict[str, Worker]) -> None:
    lengths = [300, 1500, 64, 2000, 513, 257]
    for i, n in enumerate(lengths):
        prompt = _prompt(n, seed=i)
        got = generate(cluster["decode"], prompt, MAX_TOKENS, 120)
        want = generate(cluster["both"], prompt, MAX_TOKENS, 120)
        assert not got["error"] and not want["error"], (got["error"], want["error"])
        expected_path = pb.PREFILL_PATH_REMOTE if n >= THRESHOLD else pb.PREFILL_PATH_LOCAL
        assert (got["path"], got["fallback_reason"]) == (expected_path, ""), n
        assert got["tokens"] == want["tokens"], n


@pytest.mark.timeout(300)
def test_a_corrupted_landed_block_is_caught_on_the_gpu_and_recomputed(cluster: dict[str, Worker]) -> None:
    cluster["decode"].stub.InjectFault(pb.InjectFaultRequest(fault="corrupt_destination", times=1), timeout=10)
    prompt = _prompt(700, seed=42)
    got = generate(cluster["decode"], prompt, MAX_TOKENS, 120)
    want = generate(cluster["both"], prompt, MAX_TOKENS, 120)
    assert (got["path"], got["fallback_reason"]) == (pb.PREFILL_PATH_LOCAL_FALLBACK, "checksum_mismatch")
    assert got["tokens"] == want["tokens"]

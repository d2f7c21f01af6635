"""Benchmark (not a test): per-token RPC overhead of Generate vs the in-process AsyncEngine, and the
CPU KV hand-off times of a prefill + decode pair. Run: .venv/bin/python tests/integration/worker/bench_overhead.py
"""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from worker_client import QUESTIONS, generate, request  # noqa: E402
from worker_procs import WorkerProcess  # noqa: E402

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import CacheConfig, EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader.prepare import default_model_dir  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tokenization.tokenizer import Tokenizer  # noqa: E402

TOKENS = 32


def _prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} #{i}"}]) for i in range(n)]


async def _in_process(engine: AsyncEngine, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)

    async def one(p: list[int]) -> None:
        async for _ in engine.generate(p, params):
            pass

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - start


def _over_rpc(worker: WorkerProcess, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: generate(worker, request(p, TOKENS)), prompts))
    return time.perf_counter() - start


def _histogram(text: str, name: str) -> tuple[float, float]:
    total = sum(float(v) for v in re.findall(rf"^{name}_sum{{.*}} (\S+)$|^{name}_sum (\S+)$", text, re.M)[0] if v)
    count = sum(float(v) for v in re.findall(rf"^{name}_count{{.*}} (\S+)$|^{name}_count (\S+)$", text, re.M)[0] if v)
    return total, count


def main() -> None:
    torch.set_num_threads(1)
    model = default_model_dir(None)
    tok = Tokenizer.from_dir(model)
    logs = Path(tempfile.mkdtemp())
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model), cache=CacheConfig(num_blocks=256))))
    both = WorkerProcess("bench-both", "both", model, logs, "--num-blocks", "256").start().wait_serving()
    for n in (1, 16):
        prompts = _prompts(tok, n)
        asyncio.run(_in_process(engine, prompts))  # warm-up
        local = min(asyncio.run(_in_process(engine, prompts)) for _ in range(2))
        remote = min(_over_rpc(both, prompts) for _ in range(2))
        tokens = n * TOKENS
        print(f"batch {n:2d}: in-process {tokens / local:6.1f} tok/s, Generate {tokens / remote:6.1f} tok/s, "
              f"overhead {(remote - local) / tokens * 1e3:+.2f} ms/token")
    engine.shutdown()
    both.stop()
    prefill = WorkerProcess("bench-p", "prefill", model, logs, "--num-blocks", "256").start()
    decode = WorkerProcess("bench-d", "decode", model, logs, "--num-blocks", "256", "--prefill-peers",
                           prefill.address, "--min-remote-prompt-tokens", "1",
                           "--min-remote-uncached-tokens", "1").start()
    prefill.wait_serving()
    decode.wait_serving()
    text = " ".join(QUESTIONS * 12)
    for i, n in enumerate((32, 64, 128, 256, 400, 64, 128, 256, 400)):
        generate(decode, request([100 + i] + tok.encode(text)[:n - 1], 2))  # distinct first token: no cache hit
    total, count = _histogram(prefill.metrics_text(), "baton_kv_transfer_seconds")
    nbytes = float(re.search(r"^baton_kv_transfer_bytes_total (\S+)$", prefill.metrics_text(), re.M).group(1))
    hand_total, hand_count = _histogram(decode.metrics_text(), "baton_pd_handoff_seconds")
    print(f"KV WRITE (CPU, UCX/DRAM): {count:.0f} transfers, mean {total / count * 1e3:.2f} ms, "
          f"{nbytes / 2**20:.1f} MiB at {nbytes / total / 2**30:.2f} GiB/s")
    print(f"decode-side hand-off (reserve -> committed, includes the remote prefill): "
          f"mean {hand_total / hand_count * 1e3:.1f} ms over {hand_count:.0f}")
    decode.stop()
    prefill.stop()


if __name__ == "__main__":
    main()

"""Blocking gRPC client helpers for the worker tests (threads give the concurrency)."""

from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from worker_procs import WorkerProcess

from rpcgen.baton.v1 import worker_pb2 as pb

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and then list three colours of the rainbow.",
    "hi",
    "Translate 'good morning' into German, Spanish and Italian, one per line.",
    "Give me three tips for learning to play the guitar as an adult beginner with little free time.",
    "What is 17 times 23?",
    "Name a famous painting.",
]


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = 0
    prefill_path: int = 0
    fallback_reason: str = ""
    error: str = ""
    num_cached_tokens: int = 0
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    code: grpc.StatusCode | None = None  # set when the stream ended with an error status


def request(prompt: list[int], max_tokens: int, *, rid: str = "", mode: int = pb.PREFILL_MODE_AUTO,
            prefill_worker: str = "", logprobs: int | None = None, ignore_eos: bool = True) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    if logprobs is not None:
        sampling.logprobs = logprobs
    return pb.GenerateRequest(request_id=rid or uuid.uuid4().hex, prompt_token_ids=prompt, sampling=sampling,
                              prefill_mode=mode, prefill_worker=prefill_worker)


def collect(call: object) -> Result:
    """Drain a Generate stream into one Result (an error status lands in `code`)."""
    out = Result()
    try:
        for msg in call:  # type: ignore[attr-defined]
            if msg.prefill_path:
                out.prefill_path, out.fallback_reason = msg.prefill_path, msg.fallback_reason
                out.num_cached_tokens = msg.num_cached_tokens
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            out.logprobs.extend(msg.logprobs)
            if msg.finish_reason:
                out.finish_reason, out.error = msg.finish_reason, msg.error
    except grpc.RpcError as e:
        out.code = e.code()  # type: ignore[attr-defined]
        out.error = e.details() or ""  # type: ignore[attr-defined]
    return out


def generate(worker: WorkerProcess, req: pb.GenerateRequest, timeout_s: float = 180.0) -> Result:
    return collect(worker.stub.Generate(req, timeout=timeout_s))


def generate_many(worker: WorkerProcess, reqs: list[pb.GenerateRequest], concurrency: int = 16) -> list[Result]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda r: generate(worker, r), reqs))


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:  # noqa: ANN001
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def settled(worker: WorkerProcess) -> tuple[int, int, int, int, int]:
    """(free blocks, held, quarantined, waiting for remote KV, running + queued) from GetStatus."""
    s = worker.status()
    return s.free_blocks, s.held_blocks, s.quarantined_requests, s.waiting_for_remote_kv, s.running_seqs + s.queue_depth


def wait_baseline(workers: list[WorkerProcess], timeout_s: float = 20.0) -> None:
    """Every worker back to all blocks free, nothing held, quarantined or in flight."""
    for worker in workers:
        _wait_one_baseline(worker, timeout_s)


def _wait_one_baseline(worker: WorkerProcess, timeout_s: float) -> None:
    total = worker.status().total_blocks
    last: list[tuple[int, ...]] = []

    def back() -> bool:
        last[:] = [settled(worker)]
        return last[0] == (total, 0, 0, 0, 0)

    try:
        wait_for(back, timeout_s, f"{worker.name} to return to its baseline")
    except AssertionError as e:
        raise AssertionError(f"{e}: (free, held, quarantined, remote, seqs) = {last} of {total}") from None


def metric(worker: WorkerProcess, series: str) -> float:
    """The value of one series of the worker's /metrics (`name{labels}` as exposed), 0 when absent."""
    match = re.search(rf'^{re.escape(series)} (\S+)$', worker.metrics_text(), re.M)
    return float(match.group(1)) if match else 0.0


def generated_tokens(worker: WorkerProcess) -> int:
    """Tokens the worker's engine generated since it started (`baton_worker_tokens_total{kind="generated"}`)."""
    return int(metric(worker, 'baton_worker_tokens_total{kind="generated"}'))


def fallbacks(worker: WorkerProcess, reason: str) -> float:
    """Remote prefills that fell back to local for `reason` (`baton_pd_fallback_total`), from /metrics."""
    return metric(worker, f'baton_pd_fallback_total{{reason="{reason}"}}')

"""The load scenario of `bench_safety_queueing --load`: output streams and prompts at once, as the
gateway sends them under load, against the in-process Safety service without and with batching
(`Batching.OFF` with the 2/1/1 threads the service had before, then `Batching.ON` with the defaults)."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from lab.micro.bench_safety_long import sharegpt_text
from services.safety.batcher import Batching
from services.safety.categories import Detector
from services.safety.client import SafetyClient
from services.safety.encoder import EncoderRuntime
from services.safety.server import SafetyServer, SafetyServerConfig

DELTA_CHARS = 6         # ~1.5 tokens of English a delta
DELTA_INTERVAL_S = 0.02
STREAM_CHARS = 1_500    # ~375 tokens a generation, then the stream is replaced
LONG_PROMPT_WORDS = 5_000


@dataclass(frozen=True)
class LoadShape:
    streams: int
    checks_per_s: float
    seconds: float
    long_per_s: float = 0.0  # LONG_PROMPT_WORDS-word prompts a second (the random 2k-token prompts of the suite)


def _short_prompt(i: int) -> str:
    return f"Please write a short poem about the sea and ship number {i}."


def _long_prompt(corpus: str, i: int) -> str:
    words = corpus.split(" ")
    start = (i * 3_571) % (len(words) - LONG_PROMPT_WORDS)
    return f"Prompt {i}: " + " ".join(words[start:start + LONG_PROMPT_WORDS])


@dataclass
class _Tally:
    input_s: list[float] = field(default_factory=list)
    window_s: list[float] = field(default_factory=list)  # output chunks the classifier judged
    long_s: list[float] = field(default_factory=list)    # LONG_PROMPT_WORDS-word prompts
    failed: int = 0
    halted: int = 0


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


async def _one_stream(client: SafetyClient, text: str, stop_at: float, tally: _Tally) -> None:
    stream = await client.open_output_filter("bench", "load")
    try:
        for i in range(0, len(text), DELTA_CHARS):
            if time.monotonic() >= stop_at:
                return
            start = time.perf_counter()
            verdict = await stream.feed(text[i:i + DELTA_CHARS])
            elapsed = time.perf_counter() - start
            if verdict.tier == Detector.UNAVAILABLE:
                tally.failed += 1
                return
            if verdict.tier == Detector.CLASSIFIER:
                tally.window_s.append(elapsed)
            if not verdict.allowed:  # halted: the client answers later deltas itself, the generation ends
                tally.halted += 1
                return
            await asyncio.sleep(max(0.0, DELTA_INTERVAL_S - elapsed))
    finally:
        await stream.close()


async def _streams(client: SafetyClient, corpus: str, slot: int, stop_at: float, tally: _Tally) -> None:
    """One stream slot: generations one after another, each from a different place in `corpus`."""
    n = 0
    while time.monotonic() < stop_at:
        offset = (slot * 7919 + n * 104_729) % (len(corpus) - STREAM_CHARS)
        await _one_stream(client, corpus[offset:offset + STREAM_CHARS], stop_at, tally)
        n += 1


async def _check(client: SafetyClient, text: str, seconds: list[float], tally: _Tally) -> None:
    start = time.perf_counter()
    verdict = await client.check_input("bench", text)
    if verdict.tier == Detector.UNAVAILABLE:
        tally.failed += 1
    else:
        seconds.append(time.perf_counter() - start)


async def _prompts(client: SafetyClient, rate: float, text_of: Callable[[int], str], seconds: list[float],
                   stop_at: float, tally: _Tally) -> None:
    """Prompts `text_of(0)`, `text_of(1)`, ... at `rate` a second (Poisson) until `stop_at`."""
    if rate <= 0:
        return
    rng, pending, i = random.Random(7), [], 0
    while time.monotonic() < stop_at:
        pending.append(asyncio.ensure_future(_check(client, text_of(i), seconds, tally)))
        i += 1
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*pending)


async def _measure(config: SafetyServerConfig, shape: LoadShape, corpus: str) -> dict[str, object]:
    server = SafetyServer(config)
    client = SafetyClient(f"127.0.0.1:{await server.start()}")
    tally = _Tally()
    try:
        await client.check_input("bench", "warm up")
        start = time.monotonic()
        stop_at = start + shape.seconds
        await asyncio.gather(_prompts(client, shape.checks_per_s, _short_prompt, tally.input_s, stop_at, tally),
                             _prompts(client, shape.long_per_s, functools.partial(_long_prompt, corpus),
                                      tally.long_s, stop_at, tally),
                             *(_streams(client, corpus, slot, stop_at, tally) for slot in range(shape.streams)))
        wall = time.monotonic() - start
    finally:
        await client.close()
        await server.stop(0)
    judged = len(tally.input_s) + len(tally.long_s) + len(tally.window_s)
    return {"classifier_verdicts_per_s": round(judged / wall, 1), "input_checks": len(tally.input_s),
            "input_p50_s": _percentile(tally.input_s, 0.5), "input_p99_s": _percentile(tally.input_s, 0.99),
            "windows": len(tally.window_s), "window_p50_s": _percentile(tally.window_s, 0.5),
            "window_p99_s": _percentile(tally.window_s, 0.99), "long_checks": len(tally.long_s),
            "long_p50_s": _percentile(tally.long_s, 0.5), "long_p99_s": _percentile(tally.long_s, 0.99),
            "failed": tally.failed, "streams_halted": tally.halted}


async def run_load(shape: LoadShape, runtime: EncoderRuntime, device: str, corpus_path: Path | None) -> None:
    """`corpus_path`: a text file to cut streams and long prompts from (default: ShareGPT's first 40,000 words)."""
    corpus = corpus_path.read_text(encoding="utf-8") if corpus_path else sharegpt_text(40_000)
    base = SafetyServerConfig(host="127.0.0.1", port=0, encoder_runtime=runtime, device=device)
    # Unbatched, the server keeps the 2/1/1 threads the service had before batching.
    variants = [("unbatched", replace(base, batching=Batching.OFF)),
                ("batched", replace(base, batching=Batching.ON))]
    for name, config in variants:
        row = await _measure(config, shape, corpus)
        batching = vars(config.batch) if config.batching is Batching.ON else None
        print(json.dumps({"scenario": "load", "service": name, "runtime": runtime.value, **vars(shape),
                          "batching": batching,
                          **row}), flush=True)

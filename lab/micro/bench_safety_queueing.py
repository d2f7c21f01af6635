"""Short safety checks under concurrency: how many miss their deadline, and how long they take.

    python -m lab.micro.bench_safety_queueing [--burst 24] [--behind-words 1000]
    python -m lab.micro.bench_safety_queueing --load [--streams 24] [--checks-per-s 10] [--seconds 15]
                                                  [--long-per-s 0] [--runtime onnx] [--device cuda]

Starts the Safety gRPC service in this process (port 0) and calls it with the gateway's client at its
default deadlines. Two scenarios: `--burst` distinct one-sentence prompts at once (twice), and a
`--behind-words`-word ShareGPT check followed 50 ms later by 12 short ones. Prints, per scenario, how
many checks failed closed (tier "unavailable") and the short checks' p50 and max latency.

`--load` drives the service as the gateway does under load, once without cross-request batching (the
service as it was: 2/1/1 threads, one encoder call per check) and once with the defaults (batching):
`--streams` output streams open at all times (a 6-character delta every 20 ms each, ~60 tokens/s: a
new generation replaces one that ends), plus `--checks-per-s` one-sentence prompts and `--long-per-s`
5,000-word prompts a second (Poisson).
Prints classifier verdicts a second (prompts + output windows), the p50/p99 latency of input checks and
of output chunks that ran the classifier, and how many failed (the fail mode applied).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from lab.micro.bench_safety_load import LoadShape, run_load
from lab.micro.bench_safety_long import sharegpt_text
from services.safety.client import SafetyClient
from services.safety.encoder import EncoderRuntime
from services.safety.server import SafetyServer, SafetyServerConfig


async def _short(client: SafetyClient, i: int) -> tuple[bool, float]:
    start = time.perf_counter()
    verdict = await client.check_input("bench", f"Please write a short poem about the sea and ship number {i}.")
    return verdict.tier == "unavailable", time.perf_counter() - start


def _report(name: str, results: list[tuple[bool, float]], **extra: object) -> None:
    latencies = sorted(t for _, t in results)
    print(json.dumps({"scenario": name, "failed": sum(f for f, _ in results), "of": len(results),
                      "p50_s": round(latencies[len(latencies) // 2], 3), "max_s": round(latencies[-1], 3),
                      **extra}), flush=True)


async def run(burst: int, behind_words: int) -> None:
    server = SafetyServer(SafetyServerConfig(host="127.0.0.1", port=0))
    client = SafetyClient(f"127.0.0.1:{await server.start()}")
    try:
        await client.check_input("bench", "warm up")
        for round_ in range(2):
            _report("burst", await asyncio.gather(*(_short(client, i + 1000 * round_) for i in range(burst))))
        start = time.perf_counter()
        long_check = asyncio.ensure_future(client.check_input("bench", sharegpt_text(behind_words)))
        await asyncio.sleep(0.05)
        shorts = await asyncio.gather(*(_short(client, 5000 + i) for i in range(12)))
        long_verdict = await long_check
        _report("behind_long", shorts, long_failed=long_verdict.tier == "unavailable",
                long_s=round(time.perf_counter() - start, 3))
    finally:
        await client.close()
        await server.stop(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--burst", type=int, default=24)
    p.add_argument("--behind-words", type=int, default=1000)
    p.add_argument("--load", action="store_true", help="streams + prompts a second, batching off then on")
    p.add_argument("--streams", type=int, default=24)
    p.add_argument("--checks-per-s", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--long-per-s", type=float, default=0.0, help="5,000-word prompts a second (Poisson)")
    p.add_argument("--corpus", type=Path, default=None, help="text file for streams and long prompts (else ShareGPT)")
    p.add_argument("--runtime", default="onnx", choices=[r.value for r in EncoderRuntime])
    p.add_argument("--device", default="cuda", help="the torch runtime's device")
    args = p.parse_args()
    if args.load:
        shape = LoadShape(args.streams, args.checks_per_s, args.seconds, args.long_per_s)
        asyncio.run(run_load(shape, EncoderRuntime(args.runtime), args.device, args.corpus))
    else:
        asyncio.run(run(args.burst, args.behind_words))


if __name__ == "__main__":
    main()

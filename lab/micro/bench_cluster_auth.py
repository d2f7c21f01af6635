"""What the cluster token costs per gRPC call (services/common/cluster_auth.py).

Two measurements, both in one process on loopback:

- `check_us`: the server-side check alone (SHA-256 of the presented token, constant-time compare),
  timed over many calls of `ClusterToken.admits`; `intercept_us`: the server interceptor's whole
  Python work per admitted call (metadata scan and check; the handler lookup stubbed).
- per-call cost of whole unary calls (`Scheduler.ListWorkers` on a real `SchedulerService`) in five
  set-ups: `open` (no token anywhere, no interceptors); `token_metadata` (the server checks the token,
  the client passes it in each call's metadata, as the gateway's per-request worker calls do);
  `token` (the client's token interceptors, as the heartbeat channel); and with the tracing
  interceptors the product's traced channels carry (`traced_open`, `traced_token`: scheduler routing,
  safety, decode -> prefill). Client and server share the process, so `cpu_us` (this process's
  CPU time per call: both ends) is what the token adds to the cluster's work, and it is far less
  disturbed by other processes on a shared machine than `wall_us`. Rounds alternate between the
  set-ups so that load from elsewhere falls on all alike; the best round of each is reported.

    .venv/bin/python -m lab.micro.bench_cluster_auth [--calls 500] [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path
from typing import NamedTuple

import grpc

from rpcgen.baton.v1 import scheduler_pb2 as spb
from rpcgen.baton.v1 import scheduler_pb2_grpc
from scheduler.adapters.server import SchedulerService, SchedulerServiceConfig
from services.common.cluster_auth import ClusterToken, ClusterTokenServerInterceptor, token_interceptors
from services.common.tracing import client_interceptors


class _Details(NamedTuple):  # what grpc hands a server interceptor
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


def check_us(token: ClusterToken, calls: int) -> float:
    presented = token.value.encode()
    start = time.perf_counter()
    for _ in range(calls):
        token.admits(presented)
    return (time.perf_counter() - start) / calls * 1e6


async def intercept_us(token: ClusterToken, calls: int) -> float:
    """The server interceptor's whole Python work per admitted call (the handler lookup stubbed)."""
    interceptor, handler = ClusterTokenServerInterceptor(token), object()
    details = _Details("/baton.v1.Scheduler/ListWorkers", (("traceparent", "00-x-y-01"), token.metadata))

    async def continuation(_: object) -> object:
        return handler

    start = time.perf_counter()
    for _ in range(calls):
        await interceptor.intercept_service(continuation, details)  # type: ignore[arg-type]
    return (time.perf_counter() - start) / calls * 1e6


async def _round_us(stub: scheduler_pb2_grpc.SchedulerStub, calls: int,
                    metadata: tuple[tuple[str, str], ...] | None) -> tuple[float, float]:
    """(wall, CPU) microseconds per call."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        await stub.ListWorkers(spb.ListWorkersRequest(), timeout=5, metadata=metadata)
    return (time.perf_counter() - wall) / calls * 1e6, (time.process_time() - cpu) / calls * 1e6


def _channel(port: int, token: ClusterToken | None, traced: bool) -> grpc.aio.Channel:
    interceptors = [*token_interceptors(token), *(client_interceptors() if traced else [])]
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=interceptors or None)


async def rpc_us(calls: int, rounds: int) -> dict[str, dict[str, float]]:
    token = ClusterToken.generate()
    services = {name: SchedulerService(SchedulerServiceConfig(host="127.0.0.1", port=0, drain_grace_s=0,
                                                              cluster_token=t))
                for name, t in (("open", None), ("token", token))}
    for service in services.values():
        await service.start()
    channels = {f"{'traced_' if traced else ''}{name}": _channel(s.port, token if name == "token" else None, traced)
                for traced in (False, True) for name, s in services.items()}
    channels["token_metadata"] = _channel(services["token"].port, None, traced=False)
    stubs = {name: scheduler_pb2_grpc.SchedulerStub(c) for name, c in channels.items()}
    metadata = {name: (token.metadata,) if name == "token_metadata" else None for name in stubs}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in stubs}
    try:
        for name, stub in stubs.items():  # warm-up: connections, first-call set-up
            await _round_us(stub, 100, metadata[name])
        for _ in range(rounds):
            for name, stub in stubs.items():
                samples[name].append(await _round_us(stub, calls, metadata[name]))
    finally:
        for channel in channels.values():
            await channel.close()
        for service in services.values():
            await service.stop()
    # Best of the rounds, as timeit reports: contention from other processes only ever adds time.
    return {name: {"wall_us": min(w for w, _ in values), "cpu_us": min(c for _, c in values)}
            for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500, help="calls per round and set-up")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the scheduler's loop-lag warnings on a busy machine
    calls = asyncio.run(rpc_us(args.calls, args.rounds))
    added = {f"{k}_added_cpu_us": calls[t]["cpu_us"] - calls[o]["cpu_us"]
             for k, t, o in (("metadata", "token_metadata", "open"), ("interceptor", "token", "open"),
                             ("traced", "traced_token", "traced_open"))}
    token = ClusterToken.generate()
    report = {"check_us": check_us(token, 100_000), "intercept_us": asyncio.run(intercept_us(token, 100_000)),
              **calls, **added, "calls": args.calls, "rounds": args.rounds}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text)


if __name__ == "__main__":
    main()

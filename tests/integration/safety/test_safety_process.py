"""`python -m services.safety` as a process: serves, exports baton_safety_* metrics, drains on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safety_harness import free_port

from services.safety.client import SafetyClient

ROOT = Path(__file__).resolve().parents[3]


async def _wait_serving(address: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                if time.monotonic() > end:
                    raise
            await asyncio.sleep(0.2)


async def test_serves_exports_metrics_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    policy = tmp_path / "policy.json"
    policy.write_text('{"orgs": {"acme": {"action": "flag"}}}')
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.safety", "--host", "127.0.0.1", "--port", str(port),
         "--metrics-port", str(metrics_port), "--policy", str(policy), "--grace-s", "1"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        await _wait_serving(f"127.0.0.1:{port}", deadline_s=30)
        client = SafetyClient(f"127.0.0.1:{port}")
        flagged = await client.check_input("acme", "write me a keylogger")
        await client.close()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert flagged.allowed and flagged.category == "malware"
    assert ('baton_safety_verdicts_total{category="malware",direction="input",outcome="flagged",tier="pattern"} 1.0'
            in metrics)
    assert 'baton_safety_tier_latency_seconds_count{tier="pattern"}' in metrics

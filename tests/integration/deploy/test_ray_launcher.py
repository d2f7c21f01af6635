"""`baton ray up` on a local Ray head (CPU, the default model): Ray places the scheduler, a prefill and
a decode worker and the gateway as actors; one chat request goes through the gateway and is prefilled
remotely (the decode worker's metrics count a remote prefill), and `down()` stops every process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.launcher.ray_cluster import RayCluster, RayClusterConfig
from tests.support.required import require_module

pytestmark = pytest.mark.timeout(600)
# Above the remote-prefill threshold (256 uncached tokens).
LONG_PROMPT = "Summarise this in one word: " + "the sea is calm and blue today. " * 45


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """`ray start --head --block` in its own process group, killed by that group at the end (never
    `ray stop`, which would stop every Ray on the machine). Without a drain timeout of 0, the head's
    SIGTERM handler first asks the GCS to drain the node and waits up to 30 s for the answer, but the
    GCS got the same SIGTERM and never answers: the teardown took 30 s instead of ~4."""
    require_module("ray")
    require_module("nixl._api")  # the prefill -> decode hand-off
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rayt-")  # short: Ray's unix socket paths must fit 107 bytes
    ray_bin = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=4", "--num-gpus=0",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
         "--node-ip-address=127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
    try:
        yield f"127.0.0.1:{port}"
    finally:
        import ray

        ray.shutdown()
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


@pytest.fixture  # torn down before the next test: the head has 4 CPUs, this cluster reserves 3
def cluster(ray_head: str, default_model_dir: Path) -> Iterator[RayCluster]:
    config = RayClusterConfig(
        address=ray_head, worker_cpus=1, service_cpus=0.5,
        worker_args=("--num-blocks=256", "--torch-threads=1"),
        # Round robin sends a long prompt to the prefill worker whatever the cost model predicts.
        scheduler_args=("--policy=round_robin", "--heartbeat-interval-s=0.5"),
        gateway_env={"BATON_AUTH_MODE": "none"})
    ray_cluster = RayCluster(config)
    try:
        ray_cluster.up()
        yield ray_cluster
    finally:
        ray_cluster.down()


def _wait_until_registered(scheduler_metrics: str, roles: tuple[str, ...], timeout_s: float = 60) -> None:
    """Until the scheduler counts a live worker of each role (a worker registers on its first heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"http://{scheduler_metrics}", timeout=5).text
        live = {role: any(line.startswith(f'baton_scheduler_live_workers{{role="{role}"}} 1') for line in
                          text.splitlines()) for role in roles}
        if all(live.values()):
            return
        time.sleep(0.5)
    pytest.fail(f"workers not registered with the scheduler after {timeout_s} s: {live}")


def test_one_request_is_prefilled_remotely_through_ray_placed_services(cluster: RayCluster) -> None:
    e = cluster.endpoints
    assert len(e.prefill) == 1 and len(e.decode) == 1 and e.scheduler and e.gateway
    request = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
               "messages": [{"role": "user", "content": LONG_PROMPT}]}
    _wait_until_registered(e.metrics["scheduler"], roles=("prefill", "decode"))
    deadline = time.monotonic() + 20
    url = f"http://{e.gateway}/v1/chat/completions"
    while (reply := httpx.post(url, json=request, timeout=120)).status_code != 200:
        assert time.monotonic() < deadline, reply.text
        time.sleep(0.5)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
    metrics = httpx.get(f"http://{e.metrics['decode-0']}", timeout=10).text
    remote = [line for line in metrics.splitlines() if line.startswith('baton_pd_prefill_path_total{path="remote"}')]
    paths = [line for line in metrics.splitlines() if "prefill_path" in line or "fallback" in line]
    assert remote and float(remote[0].split()[-1]) >= 1, (paths, cluster.log_tail("decode-0"))
    assert cluster.dead() == []


def _service_log_dirs() -> set[str]:
    return {str(p) for p in Path(tempfile.gettempdir()).glob("baton-ray-*")}


def test_down_stops_every_service_process(ray_head: str, default_model_dir: Path) -> None:
    log_dirs_before = _service_log_dirs()
    ray_cluster = RayCluster(RayClusterConfig(address=ray_head, prefill_workers=0, gateway=False,
                                              worker_args=("--num-blocks=64", "--torch-threads=1")))
    try:
        endpoints = ray_cluster.up()
    finally:
        ray_cluster.down()
    assert _service_log_dirs() - log_dirs_before == set()  # a clean stop leaves no temp dir behind
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(tuple(endpoints.decode[0].rsplit(":", 1)), timeout=1).close()  # type: ignore[arg-type]
        except OSError:
            return
        time.sleep(0.2)
    pytest.fail(f"the decode worker at {endpoints.decode[0]} still accepts connections after down()")

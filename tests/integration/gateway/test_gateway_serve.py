"""`baton serve`: one command brings up scheduler, worker, safety, billing and the gateway; two run side
by side on one machine; `baton status` shows each; SIGTERM stops every child. Uses the session's
Postgres/Redis/broker through BATON_* URLs (the embedded path is covered by the infra tests)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import grpc
import httpx
from openai import OpenAI

from rpcgen.baton.v1 import safety_pb2, safety_pb2_grpc, worker_pb2, worker_pb2_grpc
from rpcgen.baton.v1 import scheduler_pb2 as spb
from rpcgen.baton.v1 import scheduler_pb2_grpc as spb_grpc
from services.client import BatonClient, Sampling
from services.common.cluster_auth import ClusterToken, sync_internal_channel
from services.gateway.tenancy.auth import generate_api_key
from services.launcher.postgres import EmbeddedPostgres
from services.launcher.process import free_port, port_in_use
from services.launcher.redis_server import EmbeddedRedis
from services.launcher.tansu import EmbeddedKafka
from tests.support.gateway_stack import MODEL

SERVE = ("import sys, argparse\nfrom services.launcher.serve import register_serve_command\n"
         "p = argparse.ArgumentParser(); register_serve_command(p.add_subparsers())\n"
         "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _wait_for(log: Path, marker: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while marker not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"baton serve exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not ready:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _port_pair() -> int:
    """A free port whose next port is free too (`baton serve --port P` puts its gRPC API on P + 1)."""
    while port_in_use("127.0.0.1", (port := free_port()) + 1):
        pass
    return port


def _start_serve(tmp_path: Path, name: str, env: dict[str, str], *argv: str) -> subprocess.Popen[bytes]:
    with open(tmp_path / f"{name}.log", "wb") as out:
        return subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--workers-role", "both", "--num-blocks", "128",
                                 *argv], stdout=out, stderr=subprocess.STDOUT, env=env)


def _status(env: dict[str, str], port: int) -> tuple[int, dict]:
    result = subprocess.run([sys.executable, "-m", "services.cli", "status", "--port", str(port), "--json"],
                            capture_output=True, text=True, env=env, timeout=120)
    return result.returncode, json.loads(result.stdout)


def test_two_clusters_serve_side_by_side_and_stop_every_child(tmp_path: Path, postgres: EmbeddedPostgres,
                                                              redis_server: EmbeddedRedis, kafka_broker: EmbeddedKafka,
                                                              default_model_dir: Path) -> None:
    """Cluster A is the full default (scheduler, worker, safety, billing, gateway), B the lightest (no
    scheduler, no safety); both on their --port and the gRPC API on the next port (no --grpc-port).
    `baton status` shows each one's components, pids, probes, metrics ports and model."""
    key, port, other = generate_api_key(), _port_pair(), _port_pair()
    env = {**os.environ, "BATON_API_KEY": key, "BATON_REDIS_URL": redis_server.url,
           "BATON_KAFKA_BOOTSTRAP": kafka_broker.url, "BATON_SERVED_MODEL_NAME": MODEL, "TMPDIR": str(tmp_path)}
    env_a = {**env, "BATON_DATABASE_URL": postgres.create_database("baton_serve"),
             "BATON_USAGE_TOPIC": f"serve.{uuid.uuid4().hex[:8]}"}
    env_b = {**env, "BATON_DATABASE_URL": postgres.create_database("baton_serve_b"),
             "BATON_USAGE_TOPIC": f"serve.{uuid.uuid4().hex[:8]}"}
    proc = _start_serve(tmp_path, "a", env_a, "--port", str(port), "--model", str(default_model_dir))
    proc_b = _start_serve(tmp_path, "b", env_b, "--port", str(other), "--model", str(default_model_dir),
                          "--no-safety", "--no-scheduler")
    log = tmp_path / "a.log"
    try:
        _wait_for(log, f"Baton is ready: http://127.0.0.1:{port}", proc, 300)
        _wait_for(tmp_path / "b.log", f"Baton is ready: http://127.0.0.1:{other}", proc_b, 300)
        assert "API key (shown once" not in log.read_text()  # BATON_API_KEY was registered instead
        children = _children(proc.pid)
        assert len(children) == 5  # scheduler, worker, safety, billing consumer, gateway
        assert len(_children(proc_b.pid)) == 3  # worker, billing consumer, gateway
        for p in (port, other):
            reply = OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key=key, max_retries=0).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4)
            assert reply.choices[0].finish_reason in ("stop", "length", "content_filter")
        assert f"gRPC API: 127.0.0.1:{port + 1}" in log.read_text()
        with BatonClient(f"127.0.0.1:{port + 1}", key, model=MODEL) as client:  # the internal API, same key
            assert client.chat("Name a colour.", sampling=Sampling(max_tokens=4)).usage is not None
        _check_status(env, port, children, ("scheduler", "worker-both", "safety", "billing", "gateway"))
        _check_status(env, other, _children(proc_b.pid), ("worker-both", "billing", "gateway"))
        _check_internal_ports_refuse_strangers(log.read_text())
        for p in (proc, proc_b):
            p.send_signal(signal.SIGTERM)
        assert (proc.wait(timeout=90), proc_b.wait(timeout=90)) == (0, 0)
        assert not any(_is_live(pid) for pid in children)
        assert _status(env, port) == (3, {"running": False, "error": ANY})
    finally:
        for p in (proc, proc_b):
            if p.poll() is None:
                p.kill()


def _check_status(env: dict[str, str], port: int, children: list[int], names: tuple[str, ...]) -> None:
    code, status = _status(env, port)
    assert (code, status["state"], status["healthy"]) == (0, "ready", True), status
    components = {c["name"]: c for c in status["components"]}
    assert set(names) <= set(components)
    assert {components[n]["pid"] for n in names} == set(children)
    assert components["worker-both"]["model"] == MODEL
    assert components["gateway"]["ports"] == {"http": port, "grpc": port + 1}
    for name in names:  # every child serves Prometheus metrics, and run.json lists where
        assert any(p["check"] == "metrics" and p["ok"] for p in components[name]["probes"]), components[name]
        assert "baton_" in httpx.get(status["metrics"][name], timeout=10).text, name


def _list_workers(channel: grpc.Channel) -> object:
    return spb_grpc.SchedulerStub(channel).ListWorkers(spb.ListWorkersRequest(), timeout=10)


def _worker_status(channel: grpc.Channel) -> object:
    return worker_pb2_grpc.WorkerStub(channel).GetStatus(worker_pb2.StatusRequest(), timeout=10)


def _check_input(channel: grpc.Channel) -> object:
    return safety_pb2_grpc.SafetyStub(channel).CheckInput(safety_pb2.CheckInputRequest(text="hi"), timeout=10)


def _filter_output(channel: grpc.Channel) -> object:  # bidi-streaming
    chunks = iter([safety_pb2.OutputChunk(request_id="r", delta="hi", final=True)])
    return list(safety_pb2_grpc.SafetyStub(channel).FilterOutput(chunks, timeout=10))


# One call on each internal port: (the port's name in run.json, the call).
_INTERNAL_CALLS = {"scheduler": ("scheduler", _list_workers), "worker": ("worker-both", _worker_status),
                   "safety": ("safety", _check_input), "safety-stream": ("safety", _filter_output)}


def _call_each(ports: dict[str, int], token: ClusterToken | None) -> dict[str, Any]:
    """call name -> its reply, or the status code it was refused with."""
    results: dict[str, Any] = {}
    for name, (port, call) in _INTERNAL_CALLS.items():
        with sync_internal_channel(f"127.0.0.1:{ports[port]}", token) as channel:
            try:
                results[name] = call(channel)
            except grpc.RpcError as e:
                results[name] = e.code()  # type: ignore[attr-defined]
    return results


def _check_internal_ports_refuse_strangers(serve_log: str) -> None:
    """Scheduler, worker and safety answer only callers with the cluster token; the run file holding it
    is its owner's only."""
    match = re.search(r"run file \(pids, ports\): (\S+)", serve_log)
    assert match is not None
    run_file = Path(match.group(1))
    assert run_file.stat().st_mode & 0o777 == 0o600
    run = json.loads(run_file.read_text())
    token, ports = ClusterToken(run["cluster_token"]), run["ports"]
    refused = dict.fromkeys(_INTERNAL_CALLS, grpc.StatusCode.UNAUTHENTICATED)
    assert _call_each(ports, None) == refused
    assert _call_each(ports, ClusterToken("not-this-clusters-token")) == refused
    admitted = _call_each(ports, token)
    assert [w.status.worker_id for w in admitted["scheduler"].workers] == [admitted["worker"].worker_id]
    assert admitted["safety"].allowed and len(admitted["safety-stream"]) >= 1


def _is_live(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

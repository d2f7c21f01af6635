"""`baton serve`: one command brings up scheduler, worker, safety, billing and the gateway; SIGTERM
stops every child. Uses the session's Postgres/Redis/broker through BATON_* URLs (the embedded path
is covered by the infra tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from openai import OpenAI

from services.client import BatonClient, Sampling
from services.gateway.auth import generate_api_key
from services.launcher.postgres import EmbeddedPostgres
from services.launcher.process import free_port
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


def test_serve_runs_the_cluster_and_stops_every_child(tmp_path: Path, postgres: EmbeddedPostgres,
                                                      redis_server: EmbeddedRedis, kafka_broker: EmbeddedKafka,
                                                      default_model_dir: Path) -> None:
    key, port, grpc_port = generate_api_key(), free_port(), free_port()
    env = {**os.environ, "BATON_API_KEY": key, "BATON_DATABASE_URL": postgres.create_database("baton_serve"),
           "BATON_REDIS_URL": redis_server.url, "BATON_KAFKA_BOOTSTRAP": kafka_broker.url,
           "BATON_USAGE_TOPIC": f"serve.{uuid.uuid4().hex[:8]}", "BATON_SERVED_MODEL_NAME": MODEL}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--port", str(port), "--workers-role", "both",
                                 "--model", str(default_model_dir), "--num-blocks", "128",
                                 "--grpc-port", str(grpc_port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for(log, f"Baton is ready: http://127.0.0.1:{port}", proc, 180)
        assert "API key (shown once" not in log.read_text()  # BATON_API_KEY was registered instead
        children = _children(proc.pid)
        assert len(children) == 5  # scheduler, worker, safety, billing consumer, gateway
        reply = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length", "content_filter")
        assert f"gRPC API: 127.0.0.1:{grpc_port}" in log.read_text()
        with BatonClient(f"127.0.0.1:{grpc_port}", key, model=MODEL) as client:  # the internal API, same key
            assert client.chat("Name a colour.", sampling=Sampling(max_tokens=4)).usage is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        assert not any(_is_live(pid) for pid in children)
    finally:
        if proc.poll() is None:
            proc.kill()


def _is_live(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

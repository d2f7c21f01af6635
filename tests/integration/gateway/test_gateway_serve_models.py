"""`baton serve` with two models: workers for each, one gateway serving both, routed by model. The second is a
tiny DeepSeek-V2 checkpoint (latent attention, routed + shared experts): `baton serve --model NAME=DIR` serves
a mixture-of-experts model like any other."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
from openai import OpenAI

from services.gateway.tenancy.auth import generate_api_key
from services.launcher.postgres import EmbeddedPostgres
from services.launcher.process import free_port
from services.launcher.redis_server import EmbeddedRedis
from services.launcher.tansu import EmbeddedKafka
from tests.integration.gateway.test_gateway_serve import SERVE, _children, _wait_for
from tests.support.gateway_stack import MODEL
from tests.support.tiny_moe import save_tiny_moe


def test_serve_starts_workers_for_two_models_and_routes_by_model(
        tmp_path: Path, postgres: EmbeddedPostgres, redis_server: EmbeddedRedis, kafka_broker: EmbeddedKafka,
        default_model_dir: Path) -> None:
    key, port = generate_api_key(), free_port()
    env = {**os.environ, "BATON_API_KEY": key, "BATON_DATABASE_URL": postgres.create_database("baton_serve_models"),
           "BATON_REDIS_URL": redis_server.url, "BATON_KAFKA_BOOTSTRAP": kafka_broker.url,
           "BATON_USAGE_TOPIC": f"serve.{uuid.uuid4().hex[:8]}", "BATON_CACHE_DIR": str(default_model_dir.parents[1])}
    log = tmp_path / "serve.log"
    moe_dir = save_tiny_moe("deepseek-v2", tmp_path / "tiny-deepseek-v2", default_model_dir)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--port", str(port), "--workers-role", "both",
                                 "--no-safety", "--model", MODEL, "--model", f"tiny={moe_dir}",
                                 "--num-blocks", "128", "--data-dir", str(tmp_path / "run"),
                                 "--grpc-port", str(free_port())],  # the default, --port + 1, may be taken
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for(log, f"Baton is ready: http://127.0.0.1:{port}", proc, 180)
        assert len(_children(proc.pid)) == 5  # scheduler, a worker per model, billing consumer, gateway
        assert (tmp_path / "run" / "logs" / "worker-tiny-both.log").is_file()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [MODEL, "tiny"]
        for model in ("tiny", MODEL):
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=3, temperature=0)
            assert reply.model == model
        missing = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

"""A real `baton serve` (embedded Postgres/Redis/broker) under a light, steady load of streaming chats.

`ServeProcess` starts it as `baton serve` would be started and reads its run file (pids, ports, infra
URLs). `SteadyLoad` runs a few client threads, each sending one streaming chat after another and
recording how each ended: completed (`[DONE]` with no error event), failed (an error status, an error
event or a dropped connection) or hung (no end within the client timeout).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.gateway.tenancy.auth import generate_api_key
from services.launcher.process import free_port

SERVE = ("import sys, argparse\nfrom services.launcher.serve import register_serve_command\n"
         "p = argparse.ArgumentParser(); register_serve_command(p.add_subparsers())\n"
         "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
_EXTERNAL = ("BATON_DATABASE_URL", "BATON_REDIS_URL", "BATON_KAFKA_BOOTSTRAP", "BATON_KAFKA_CONSUMER_CONFIG")


class ServeProcess:
    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.key, self.port = generate_api_key(), free_port()
        env = {k: v for k, v in os.environ.items() if k not in _EXTERNAL}  # everything embedded
        env |= {"BATON_API_KEY": self.key, "OMP_NUM_THREADS": "1", "BATON_SERVED_MODEL_NAME": model_dir.name}
        self.log_path = log_path
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVE, "serve", "--port", str(self.port), "--model", str(model_dir),
                 "--num-blocks", "128", "--no-safety", "--grpc-port", str(free_port())],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        self.run_file: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.run_file is None:
            text = self.log_path.read_text(errors="replace")
            assert self.proc.poll() is None, f"baton serve exited:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"baton serve not ready:\n{text[-3000:]}"
            for line in text.splitlines():
                if line.startswith("run file (pids, ports): "):
                    self.run_file = Path(line.split(": ", 1)[1].strip())
            time.sleep(0.2)

    def run(self) -> dict:
        assert self.run_file is not None
        return json.loads(self.run_file.read_text())

    def stop(self, timeout_s: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@dataclass
class Outcome:
    started: float
    ended: float
    result: str  # completed | failed | hung
    request_id: str = ""
    detail: str = ""


class SteadyLoad:
    def __init__(self, url: str, key: str, model: str, clients: int = 2, timeout_s: float = 30.0) -> None:
        self.url, self.key, self.model, self.timeout_s = url, key, model, timeout_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, name=f"load-{i}", daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)

    def completed_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.result == "completed" and o.started >= t)

    def _client(self) -> None:
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"},
                          timeout=httpx.Timeout(self.timeout_s)) as client:
            while not self._stop.is_set():
                outcome = self._one(client)
                with self._lock:
                    self.outcomes.append(outcome)
                if outcome.result != "completed":
                    time.sleep(0.2)  # a dead gateway refuses at once: don't spin

    def _one(self, client: httpx.Client) -> Outcome:
        started = time.monotonic()
        body = {"model": self.model, "stream": True, "max_tokens": 6,
                "messages": [{"role": "user", "content": "Name a colour."}]}
        request_id, done = "", False
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    return Outcome(started, time.monotonic(), "failed", detail=f"HTTP {response.status_code}")
                for line in response.iter_lines():
                    if time.monotonic() - started > self.timeout_s:
                        return Outcome(started, time.monotonic(), "hung", request_id)
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return Outcome(started, time.monotonic(), "failed", request_id, str(chunk["error"])[:200])
                    request_id = chunk.get("id", request_id)
        except httpx.TimeoutException:
            return Outcome(started, time.monotonic(), "hung", request_id)
        except httpx.HTTPError as e:
            return Outcome(started, time.monotonic(), "failed", request_id, type(e).__name__)
        return Outcome(started, time.monotonic(), "completed" if done else "failed", request_id)

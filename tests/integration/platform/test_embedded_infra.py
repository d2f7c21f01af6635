"""Embedded services: clear failures, same address across restarts, no orphans after a parent crash."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from services.common.errors import InfraStartError
from services.common.settings import BatonSettings
from services.launcher.infra import EmbeddedInfra, InfraConfig
from services.launcher.postgres import EmbeddedPostgres, PostgresConfig
from services.launcher.redis_server import EmbeddedRedis, RedisConfig
from services.launcher.tansu import EmbeddedKafka

REPO = Path(__file__).resolve().parents[3]

_PARENT = """
import sys, time
from services.launcher.redis_server import EmbeddedRedis
redis = EmbeddedRedis()
redis.start()
print(redis._process.pid, redis.work_dir, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (it is only waiting to be reaped by init).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_children_die_when_the_parent_is_sigkilled() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid, work_dir = parent.stdout.readline().split()
    child_pid = int(pid)
    assert _alive(child_pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)
    shutil.rmtree(work_dir)  # the killed parent could not clean up


def test_start_failure_raises_with_the_log_tail(redis_server: EmbeddedRedis) -> None:
    clash = EmbeddedRedis(RedisConfig(port=redis_server.port))  # a fixed port that is taken
    with pytest.raises(InfraStartError, match="(?s)exited during start-up.*Address already in use"):
        clash.start()
    clash.close()


def test_missing_postgres_binaries_name_the_install_step(tmp_path: Path) -> None:
    server = EmbeddedPostgres(PostgresConfig(bin_dir=tmp_path, work_dir=tmp_path / "pg"))
    with pytest.raises(InfraStartError, match="install-system-deps.sh"):
        server.start()


def test_broker_restart_keeps_its_address() -> None:
    broker = EmbeddedKafka()
    try:
        broker.start()
        before = broker.url
        broker.stop()
        assert not broker.alive()
        broker.start()
        assert broker.url == before and broker.alive()
    finally:
        broker.close()


def test_postgres_serves_its_database(postgres: EmbeddedPostgres) -> None:
    import psycopg

    with psycopg.connect(postgres.url) as conn:
        row = conn.execute("SELECT current_database(), current_setting('server_version_num')::int").fetchone()
    assert row is not None and row[0] == "baton" and 150000 <= row[1] < 160000


def test_infra_uses_given_urls_and_embeds_the_rest(postgres: EmbeddedPostgres) -> None:
    import redis

    settings = BatonSettings(database_url=postgres.url)  # as if BATON_DATABASE_URL were set
    infra = EmbeddedInfra(InfraConfig.from_settings(settings))
    endpoints = infra.start()
    try:
        assert infra.postgres is None and endpoints.database_url == postgres.url
        assert redis.Redis.from_url(endpoints.redis_url).ping()
        assert infra.kafka is not None and infra.kafka.alive()
    finally:
        infra.stop()
    assert infra.redis is not None and not infra.redis.alive() and not infra.kafka.alive()


def test_postgres_keeps_every_acknowledged_commit_across_a_sigkill() -> None:
    # The usage outbox promises a request's usage is durable before its response ends: a commit
    # Postgres acknowledged must survive its crash (`baton serve` and the chaos test SIGKILL it).
    import psycopg

    server = EmbeddedPostgres()  # its data directory outlives a kill until close()
    server.start()
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE acked (n int)")
            for n in range(50):  # each its own acknowledged commit, the last ones just before the kill
                conn.execute("INSERT INTO acked VALUES (%s)", (n,))
            server.kill()
        server.start()
        with psycopg.connect(server.url) as conn:
            row = conn.execute("SELECT count(*) FROM acked").fetchone()
        assert row is not None and row[0] == 50
    finally:
        server.close()


def test_redis_refuses_clients_without_its_password(redis_server: EmbeddedRedis) -> None:
    import redis

    for password in (None, "wrong-password"):
        client = redis.Redis(host="127.0.0.1", port=redis_server.port, password=password, socket_timeout=2)
        with pytest.raises(redis.AuthenticationError):
            client.ping()
        client.close()
    assert redis.Redis.from_url(redis_server.url).ping()  # the URL the children get carries it
    assert "requirepass" not in " ".join(Path(f"/proc/{redis_server.pid}/cmdline").read_text().split("\0"))


@pytest.mark.parametrize("where", ["tcp", "socket"])
def test_postgres_refuses_connections_without_its_password(postgres: EmbeddedPostgres, where: str) -> None:
    import psycopg

    host = "127.0.0.1" if where == "tcp" else str(postgres.work_dir)  # local socket connections too
    for password in ("", "wrong-password"):
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(host=host, port=postgres.port, user="postgres", dbname="baton", password=password,
                            connect_timeout=5)
    with psycopg.connect(postgres.url) as conn:  # the URL the children get carries it
        assert conn.execute("SELECT count(*) FROM pg_hba_file_rules WHERE auth_method <> 'scram-sha-256'"
                            ).fetchone() == (0,)


def test_a_trust_data_dir_of_an_older_baton_gets_a_password_and_deleting_it_rotates_it() -> None:
    import psycopg

    work_dir = Path(tempfile.mkdtemp(prefix="baton-pg-legacy-"))  # not under pytest's tmp: postgres must traverse
    server = EmbeddedPostgres(PostgresConfig(work_dir=work_dir))
    server.start()
    server.stop()
    (server.data_dir / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n")
    (work_dir / "superuser-password").unlink()  # as an older Baton left it: no password
    server = EmbeddedPostgres(PostgresConfig(work_dir=work_dir))
    try:
        server.start()
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(host="127.0.0.1", port=server.port, user="postgres", dbname="baton", connect_timeout=5)
        with psycopg.connect(server.url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        old_password = server.password
        server.stop()
        (work_dir / "superuser-password").unlink()  # the rotation procedure of docs/operations.md
        server = EmbeddedPostgres(PostgresConfig(work_dir=work_dir))
        server.start()
        assert server.password != old_password
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(server.url.replace(server.password, old_password), connect_timeout=5)
        with psycopg.connect(server.url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.close()
        shutil.rmtree(work_dir, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to the postgres account")
def test_a_work_dir_the_postgres_account_cannot_reach_is_refused_by_name() -> None:
    root_only = Path(tempfile.mkdtemp(prefix="baton-root-only-"))  # mkdtemp: mode 0700
    try:
        server = EmbeddedPostgres(PostgresConfig(work_dir=root_only / "run" / "pg"))
        with pytest.raises(InfraStartError, match=f"cannot reach .*{root_only} is mode 0700"):
            server.start()
    finally:
        shutil.rmtree(root_only)

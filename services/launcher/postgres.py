"""`EmbeddedPostgres`: a private PostgreSQL 15 server on 127.0.0.1 for `baton serve` and the tests.

PostgreSQL refuses to run as root, so when we are root both `initdb` and the server run as the
`postgres` system account (created by Debian's package). Unlike `runuser -u postgres`, which stays in
between as a parent, subprocess switches the uid itself, so the server is our direct child: it gets
our signals and the parent-death signal (see process.py). The work directory is chmod 755 and owned by
postgres so the server can create its socket there and traverse into its data directory.

Password auth only (SCRAM-SHA-256), also for local socket connections: the superuser's password is
generated on first start and kept beside the data directory (`<work dir>/superuser-password`, 0600),
so a kept data directory keeps its password; `url` carries it. It is set in single-user mode, before
the server ever listens, and so is a new one when that file was deleted (a rotation) or when the data
directory was made by an older Baton with `trust` auth; then the password-only `pg_hba.conf` is written.

Crash-safe, not power-safe, by default (`durable=False` turns off fsync and full-page writes): a
commit is acknowledged once its WAL is written to the kernel, so it survives a SIGKILL of the server
(what `baton serve`'s restarts and the chaos test do) but not a machine crash. Synchronous commit
stays on even then: with it off, a commit is acknowledged before its WAL leaves the server's memory,
and a SIGKILL lost usage rows the gateway had been told were stored (seen in a CI chaos run).
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InfraStartError
from services.launcher.embedded import EmbeddedService
from services.launcher.process import SupervisedProcess

DEFAULT_BIN_DIR = Path("/usr/lib/postgresql/15/bin")
_INSTALL_HINT = "run scripts/install-system-deps.sh (it does `apt-get install -y postgresql`)"
PASSWORD_FILE = "superuser-password"
# Every connection, socket or TCP, must prove the password; nothing is trusted for being local.
_PG_HBA = """# Written by Baton (services/launcher/postgres.py) at every start: password auth only.
local all all scram-sha-256
host all all 127.0.0.1/32 scram-sha-256
host all all ::1/128 scram-sha-256
"""


@dataclass(frozen=True)
class PostgresConfig:
    bin_dir: Path = DEFAULT_BIN_DIR
    port: int | None = None  # None: a free port
    work_dir: Path | None = None  # None: a temp dir removed on close(); else reused across runs
    database: str = "baton"
    durable: bool = False
    start_timeout_s: float = 30.0


class EmbeddedPostgres(EmbeddedService):
    name = "postgres"

    def __init__(self, config: PostgresConfig | None = None) -> None:
        self.config = config or PostgresConfig()
        super().__init__(self.config.port, self.config.work_dir, self.config.start_timeout_s)
        self._user = "postgres" if os.geteuid() == 0 else None
        self._password: str | None = None

    @property
    def data_dir(self) -> Path:
        return self.work_dir / "data"

    @property
    def password(self) -> str:
        """The superuser's password (generated on the first start, kept in the work directory)."""
        if self._password is None:
            raise InfraStartError("postgres has not been started: it has no password yet")
        return self._password

    @property
    def url(self) -> str:
        return self.url_for(self.config.database)

    def url_for(self, database: str) -> str:
        """Address of another database on this server (tests create one per case)."""
        return f"postgresql://postgres:{self.password}@127.0.0.1:{self.port}/{database}"

    def _binary(self, name: str) -> Path:
        path = self.config.bin_dir / name
        if not os.access(path, os.X_OK):
            raise InfraStartError(f"PostgreSQL binary {path} not found; {_INSTALL_HINT}")
        return path

    def _prepare(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir.chmod(0o755)
        if self._user is not None:
            shutil.chown(self.work_dir, self._user, self._user)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        # No server runs during any of this: the trust auth initdb leaves is never reachable.
        password_file, hba = self.work_dir / PASSWORD_FILE, self.data_dir / "pg_hba.conf"
        stored = password_file.read_text().strip() if password_file.exists() else None
        self._password = stored or secrets.token_urlsafe(24)  # URL-safe: it goes into URLs as it is
        if stored is None or hba.read_text() != _PG_HBA:  # new, rotated, or trust auth of an older Baton
            self._run_as_owner("set the superuser password", [
                str(self._binary("postgres")), "--single", "-D", str(self.data_dir), "postgres"],
                stdin=f"ALTER ROLE postgres PASSWORD '{self._password}';\n")
            hba.write_text(_PG_HBA)
            if self._user is not None:
                shutil.chown(hba, self._user, self._user)
        if stored is None:
            password_file.touch(mode=0o600)
            password_file.write_text(self._password)

    def _initdb(self) -> None:
        self._run_as_owner("initdb", [
            str(self._binary("initdb")), "-D", str(self.data_dir), "-U", "postgres", "--auth=trust", "-E", "UTF8",
            "--no-locale", "--no-sync"])

    def _run_as_owner(self, what: str, argv: list[str], stdin: str | None = None) -> None:
        if self._user is not None:
            _check_reachable_by(self._user, self.work_dir)
        result = subprocess.run(argv, cwd=self.work_dir, user=self._user, group=self._user,
                                extra_groups=[] if self._user else None, env=_clean_env(), input=stdin,
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise InfraStartError(f"{what} failed (code {result.returncode}):\n"
                                  f"{(result.stdout + result.stderr)[-3000:]}")

    def _make_process(self, port: int) -> SupervisedProcess:
        settings = {"listen_addresses": "127.0.0.1", "unix_socket_directories": str(self.work_dir),
                    "max_connections": "200", "shared_buffers": "64MB"}
        if not self.config.durable:
            settings |= {"fsync": "off", "full_page_writes": "off"}
        argv = [str(self._binary("postgres")), "-D", str(self.data_dir), "-p", str(port)]
        for key, value in settings.items():
            argv += ["-c", f"{key}={value}"]
        # SIGINT is Postgres's "fast" shutdown: roll back open transactions and stop now;
        # SIGTERM ("smart") would wait for every pooled client connection to go away.
        return SupervisedProcess("postgres", argv, self.work_dir / "postgres.log", user=self._user,
                                 env=_clean_env(), cwd=self.work_dir, stop_signal=signal.SIGINT)

    def _probe(self) -> bool:
        import psycopg

        with psycopg.connect(self.url_for("postgres"), connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True

    def _after_ready(self) -> None:
        import psycopg

        with psycopg.connect(self.url_for("postgres"), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                  (self.config.database,)).fetchone()
            if exists is None:
                conn.execute(f'CREATE DATABASE "{self.config.database}"')

    def create_database(self, name: str, template: str | None = None) -> str:
        """Create an empty database (or a copy of `template`) and return its URL."""
        import psycopg
        from psycopg import sql

        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            query = sql.SQL("{} TEMPLATE {}").format(query, sql.Identifier(template))
        with psycopg.connect(self.url_for("postgres"), autocommit=True) as conn:
            conn.execute(query)
        return self.url_for(name)


def _check_reachable_by(user: str, work_dir: Path) -> None:
    """Refuse, naming the directory, a work dir that `user` cannot reach: initdb would fail with a bare EACCES.

    Seen when TMPDIR is a root-only (0700) directory, e.g. pytest's temp root.
    """
    account = pwd.getpwnam(user)
    for directory in work_dir.resolve().parents:
        st = directory.stat()
        if st.st_uid == account.pw_uid:
            bit = stat.S_IXUSR
        elif st.st_gid == account.pw_gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            raise InfraStartError(
                f"the embedded Postgres runs as user {user} (PostgreSQL refuses root) and cannot reach {work_dir}: "
                f"{directory} is mode {stat.S_IMODE(st.st_mode):04o}. Put the run directory where others may "
                f"traverse (TMPDIR or --data-dir), or set BATON_DATABASE_URL to a server")


def _clean_env() -> dict[str, str]:
    # PG* variables of the caller (PGDATA, PGPORT, ...) must not redirect the embedded server.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return env

"""A real, throwaway PostgreSQL server for tests, made by Debian's cluster tools.

``pg_createcluster`` builds and starts the cluster and ``pg_dropcluster --stop`` ends it; they
run the server as the ``postgres`` OS user when the tests run as root (PostgreSQL refuses to
run as root) and as the caller otherwise. ``PG_CLUSTER_CONF_ROOT`` points the tools at a config
directory inside the test's own temp dir, so nothing is written under /etc/postgresql and
systemd is not involved. The server listens on a Unix socket in that temp dir only (no TCP
port), trusts local connections, and runs with ``fsync=off`` (a test database need not
survive a power cut).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

VERSION = "15"


def available() -> str | None:
    """None when a server can be started here, else why not."""
    if not Path(f"/usr/lib/postgresql/{VERSION}/bin/postgres").exists():
        return f"PostgreSQL {VERSION} not found (apt-get install postgresql)"
    if shutil.which("pg_createcluster") is None:
        return "pg_createcluster not found (apt-get install postgresql-common)"
    return None


class PostgresServer:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="dsec-pg-"))
        self.socket_dir = self.root / "sock"
        self.log = self.root / "postgres.log"
        self.cluster = f"dsec{os.getpid()}"  # also names its pid file in /run/postgresql
        self.port = 5432  # only names the socket file: listen_addresses is empty
        self.user = "postgres" if os.geteuid() == 0 else os.environ.get("USER", "postgres")
        self.started = False
        self._databases = 0
        self._env = {**os.environ, "PG_CLUSTER_CONF_ROOT": str(self.root / "etc")}

    def start(self) -> None:
        self.socket_dir.mkdir()
        if os.geteuid() == 0:
            os.chmod(self.root, 0o755)
            shutil.chown(self.socket_dir, "postgres", "postgres")
        # fmt: off
        create = [
            "pg_createcluster", VERSION, self.cluster,
            "-d", str(self.root / "data"), "-s", str(self.socket_dir), "-p", str(self.port),
            "-l", str(self.log), "--locale=C", "--encoding=UTF8", "--", "--auth=trust",
        ]
        # fmt: on
        self.started = True  # stop() drops whatever part of the cluster was made
        self._run(create)
        (self.root / "etc" / VERSION / self.cluster / "conf.d" / "test.conf").write_text(
            "listen_addresses = ''\nfsync = off\nsynchronous_commit = off\n"
            "full_page_writes = off\nmax_connections = 200\n"
        )
        self._run(["pg_ctlcluster", VERSION, self.cluster, "start"])

    def _run(self, cmd: list[str]) -> None:
        done = subprocess.run(cmd, env=self._env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {done.stderr.strip()}\n{self.log_tail()}")

    def stop(self) -> None:
        if self.started:
            subprocess.run(
                ["pg_dropcluster", "--stop", VERSION, self.cluster],
                env=self._env,
                capture_output=True,
            )
            self.started = False
        shutil.rmtree(self.root, ignore_errors=True)

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@/{database}?host={self.socket_dir}&port={self.port}"

    def create_database(self, prefix: str = "t") -> str:
        """A fresh empty database; returns its DSN."""
        import psycopg

        self._databases += 1
        name = f"{prefix}{os.getpid()}_{self._databases}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_postgres() -> PostgresServer:
    """A started server; a missing installation fails (the issue requires the real server)."""
    why = available()
    if why is not None:
        pytest.fail(
            f"no PostgreSQL server: {why} (scripts/setup.sh installs the postgresql package)"
        )
    server = PostgresServer()
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    return server

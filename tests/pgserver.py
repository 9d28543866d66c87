"""A real, throwaway PostgreSQL server for tests, from the Debian package's binaries.

``initdb`` refuses to run as root, so the cluster belongs to the ``postgres``
OS user (``runuser``). It listens on a Unix socket in its own temp dir only (no
TCP port), trusts local connections, and runs with ``fsync=off`` (a test
database need not survive a power cut). :meth:`PostgresServer.stop` ends it with
``pg_ctl stop -m immediate`` and removes every file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

BIN = Path("/usr/lib/postgresql/15/bin")


def available() -> str | None:
    """None when a server can be started here, else why not."""
    if not (BIN / "initdb").exists():
        return f"{BIN}/initdb not found (apt-get install postgresql)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "runuser not found"
    return None


class PostgresServer:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="dsec-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "sock"
        self.log = self.root / "postgres.log"
        self.port = 5432  # only names the socket file: listen_addresses is empty
        self.user = "postgres"
        self.started = False
        self._databases = 0

    def _as_owner(self, *cmd: str) -> list[str]:
        if os.geteuid() == 0:
            return ["runuser", "-u", "postgres", "--", *cmd]
        return list(cmd)

    def start(self) -> None:
        self.socket_dir.mkdir()
        self.log.touch()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(self.socket_dir, "postgres", "postgres")
            shutil.chown(self.log, "postgres", "postgres")
            os.chmod(self.root, 0o755)
        else:
            self.user = os.environ.get("USER", "postgres")
        subprocess.run(
            self._as_owner(
                str(BIN / "initdb"),
                "-D",
                str(self.data),
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "-U",
                self.user,
            ),
            check=True,
            capture_output=True,
        )
        options = (
            f"-k {self.socket_dir} -c listen_addresses='' -p {self.port} -c fsync=off"
            " -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        subprocess.run(
            self._as_owner(
                str(BIN / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log),
                "-o",
                options,
                "-w",
                "-t",
                "60",
                "start",
            ),
            check=True,
            capture_output=True,
        )
        self.started = True

    def stop(self) -> None:
        if self.started:
            subprocess.run(
                self._as_owner(
                    str(BIN / "pg_ctl"), "-D", str(self.data), "stop", "-m", "immediate", "-w"
                ),
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

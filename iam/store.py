"""Durable IAM state: projects, tokens, quota reservations.

The store is an interface (:class:`IamStore`) with a SQLite implementation
here; every method is one transaction, so quota checks and reservations are
exact under concurrency (SQLite serializes writers with BEGIN IMMEDIATE).
Subtree usage is kept per project and updated in the same transaction as the
reservation, so a reservation costs O(depth), not a scan.

Blocking: callers run these methods in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libdsec.errors import AlreadyExists, FailedPrecondition, NotFound, QuotaExceeded

SCHEMA = """
CREATE TABLE IF NOT EXISTS projects (
    project_id TEXT PRIMARY KEY,
    parent_id TEXT NOT NULL,
    quota_json TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS usage (
    project_id TEXT PRIMARY KEY,
    cpu_millis INTEGER NOT NULL DEFAULT 0,
    memory_mb INTEGER NOT NULL DEFAULT 0,
    sandboxes INTEGER NOT NULL DEFAULT 0,
    by_backend_json TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS tokens (
    token_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    project_id TEXT NOT NULL,
    kind INTEGER NOT NULL,
    role INTEGER NOT NULL,
    secret_hash TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    revoked INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS tokens_project ON tokens(project_id);
CREATE TABLE IF NOT EXISTS reservations (
    sandbox_id TEXT PRIMARY KEY,
    project_id TEXT NOT NULL,
    backend TEXT NOT NULL,
    cpu_millis INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    edge_id TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS reservations_edge ON reservations(edge_id);
"""


@dataclass
class Quota:
    """Limits of a project subtree; 0 = no limit of its own (ancestors still bound it)."""

    cpu_millis: int = 0
    memory_mb: int = 0
    sandboxes: int = 0
    sandboxes_by_backend: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "cpu_millis": self.cpu_millis,
                "memory_mb": self.memory_mb,
                "sandboxes": self.sandboxes,
                "by_backend": self.sandboxes_by_backend,
            }
        )

    @classmethod
    def from_json(cls, raw: str) -> Quota:
        d = json.loads(raw)
        return cls(d["cpu_millis"], d["memory_mb"], d["sandboxes"], dict(d.get("by_backend", {})))


@dataclass
class Usage:
    cpu_millis: int = 0
    memory_mb: int = 0
    sandboxes: int = 0
    sandboxes_by_backend: dict[str, int] = field(default_factory=dict)


@dataclass
class ProjectRecord:
    project_id: str
    parent_id: str
    quota: Quota
    usage: Usage
    created_at: float


@dataclass
class TokenRecord:
    token_id: str
    name: str
    project_id: str
    kind: int
    role: int
    secret_hash: str
    created_at: float
    expires_at: float | None
    revoked: bool


@dataclass(frozen=True)
class Reservation:
    sandbox_id: str
    project_id: str
    backend: str
    cpu_millis: int
    memory_mb: int
    edge_id: str


def ancestors(project_id: str) -> list[str]:
    """``"root/a/b"`` -> ``["root/a/b", "root/a", "root"]`` (self first)."""
    parts = project_id.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]


class SqliteIamStore:
    """:class:`IamStore` on SQLite (WAL mode, one connection, one writer at a time)."""

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ------------------------------------------------------------ projects

    def is_empty(self) -> bool:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM projects").fetchone()[0] == 0

    def create_project(self, project_id: str, parent_id: str, quota: Quota) -> ProjectRecord:
        with self._tx() as db:
            if db.execute("SELECT 1 FROM projects WHERE project_id=?", (project_id,)).fetchone():
                raise AlreadyExists(f"project {project_id} exists", reason="PROJECT_EXISTS")
            if (
                parent_id
                and not db.execute(
                    "SELECT 1 FROM projects WHERE project_id=?", (parent_id,)
                ).fetchone()
            ):
                raise NotFound(f"parent project {parent_id} not found", reason="PROJECT_NOT_FOUND")
            now = time.time()
            db.execute(
                "INSERT INTO projects VALUES (?,?,?,?)",
                (project_id, parent_id, quota.to_json(), now),
            )
            db.execute("INSERT INTO usage(project_id) VALUES (?)", (project_id,))
        return ProjectRecord(project_id, parent_id, quota, Usage(), now)

    def _project(self, db: sqlite3.Connection, project_id: str) -> ProjectRecord | None:
        row = db.execute(
            "SELECT p.project_id, p.parent_id, p.quota_json, p.created_at, u.cpu_millis, u.memory_mb,"
            " u.sandboxes, u.by_backend_json FROM projects p JOIN usage u USING (project_id)"
            " WHERE p.project_id=?",
            (project_id,),
        ).fetchone()
        if row is None:
            return None
        return ProjectRecord(
            row[0],
            row[1],
            Quota.from_json(row[2]),
            Usage(row[4], row[5], row[6], json.loads(row[7])),
            row[3],
        )

    def get_project(self, project_id: str) -> ProjectRecord | None:
        with self._lock:
            return self._project(self._db, project_id)

    def list_projects(self, parent_id: str, recursive: bool) -> list[ProjectRecord]:
        with self._lock:
            if recursive:
                rows = self._db.execute(
                    "SELECT project_id FROM projects WHERE project_id LIKE ? ORDER BY project_id",
                    (parent_id + "/%",),
                ).fetchall()
            else:
                rows = self._db.execute(
                    "SELECT project_id FROM projects WHERE parent_id=? ORDER BY project_id",
                    (parent_id,),
                ).fetchall()
            out = [self._project(self._db, r[0]) for r in rows]
        return [p for p in out if p is not None]

    def set_quota(self, project_id: str, quota: Quota) -> ProjectRecord:
        with self._tx() as db:
            if (
                db.execute(
                    "UPDATE projects SET quota_json=? WHERE project_id=?",
                    (quota.to_json(), project_id),
                ).rowcount
                == 0
            ):
                raise NotFound(f"project {project_id} not found", reason="PROJECT_NOT_FOUND")
            rec = self._project(db, project_id)
        assert rec is not None
        return rec

    def delete_project(self, project_id: str) -> None:
        with self._tx() as db:
            if db.execute("SELECT 1 FROM projects WHERE parent_id=?", (project_id,)).fetchone():
                raise FailedPrecondition(
                    f"project {project_id} has subprojects", reason="PROJECT_NOT_EMPTY"
                )
            if db.execute(
                "SELECT 1 FROM reservations WHERE project_id=?", (project_id,)
            ).fetchone():
                raise FailedPrecondition(
                    f"project {project_id} has sandboxes", reason="PROJECT_NOT_EMPTY"
                )
            if db.execute("DELETE FROM projects WHERE project_id=?", (project_id,)).rowcount == 0:
                raise NotFound(f"project {project_id} not found", reason="PROJECT_NOT_FOUND")
            db.execute("DELETE FROM usage WHERE project_id=?", (project_id,))
            db.execute("UPDATE tokens SET revoked=1 WHERE project_id=?", (project_id,))

    # -------------------------------------------------------------- tokens

    def add_token(self, rec: TokenRecord) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO tokens VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    rec.token_id,
                    rec.name,
                    rec.project_id,
                    rec.kind,
                    rec.role,
                    rec.secret_hash,
                    rec.created_at,
                    rec.expires_at,
                    int(rec.revoked),
                ),
            )

    def get_token(self, token_id: str) -> TokenRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM tokens WHERE token_id=?", (token_id,)).fetchone()
        return _token(row) if row else None

    def list_tokens(self, project_id: str, include_revoked: bool) -> list[TokenRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM tokens WHERE project_id=? AND (revoked=0 OR ?) ORDER BY created_at",
                (project_id, int(include_revoked)),
            ).fetchall()
        return [_token(r) for r in rows]

    def revoke_token(self, token_id: str) -> None:
        with self._tx() as db:
            if (
                db.execute("UPDATE tokens SET revoked=1 WHERE token_id=?", (token_id,)).rowcount
                == 0
            ):
                raise NotFound(f"token {token_id} not found", reason="TOKEN_NOT_FOUND")

    # --------------------------------------------------------------- quota

    def reserve(self, res: Reservation) -> bool:
        """Reserves quota for a sandbox in its project and every ancestor.

        Returns False when this sandbox id already holds a reservation (a
        retry). Raises QuotaExceeded naming the limiting project.
        """
        with self._tx() as db:
            if db.execute(
                "SELECT 1 FROM reservations WHERE sandbox_id=?", (res.sandbox_id,)
            ).fetchone():
                return False
            chain = []
            for pid in ancestors(res.project_id):
                rec = self._project(db, pid)
                if rec is None:
                    raise NotFound(f"project {pid} not found", reason="PROJECT_NOT_FOUND")
                chain.append(rec)
            for rec in chain:
                _check_fits(rec, res)
            for rec in chain:
                by_backend = dict(rec.usage.sandboxes_by_backend)
                by_backend[res.backend] = by_backend.get(res.backend, 0) + 1
                db.execute(
                    "UPDATE usage SET cpu_millis=cpu_millis+?, memory_mb=memory_mb+?, sandboxes=sandboxes+1,"
                    " by_backend_json=? WHERE project_id=?",
                    (res.cpu_millis, res.memory_mb, json.dumps(by_backend), rec.project_id),
                )
            db.execute(
                "INSERT INTO reservations VALUES (?,?,?,?,?,?,?)",
                (
                    res.sandbox_id,
                    res.project_id,
                    res.backend,
                    res.cpu_millis,
                    res.memory_mb,
                    res.edge_id,
                    time.time(),
                ),
            )
        return True

    def release(self, sandbox_ids: list[str]) -> int:
        released = 0
        with self._tx() as db:
            for sid in sandbox_ids:
                row = db.execute(
                    "SELECT project_id, backend, cpu_millis, memory_mb FROM reservations WHERE sandbox_id=?",
                    (sid,),
                ).fetchone()
                if row is None:
                    continue
                project_id, backend, cpu, mem = row
                for pid in ancestors(project_id):
                    urow = db.execute(
                        "SELECT by_backend_json FROM usage WHERE project_id=?", (pid,)
                    ).fetchone()
                    if urow is None:
                        continue
                    by_backend = json.loads(urow[0])
                    by_backend[backend] = max(0, by_backend.get(backend, 0) - 1)
                    db.execute(
                        "UPDATE usage SET cpu_millis=cpu_millis-?, memory_mb=memory_mb-?, sandboxes=sandboxes-1,"
                        " by_backend_json=? WHERE project_id=?",
                        (cpu, mem, json.dumps(by_backend), pid),
                    )
                db.execute("DELETE FROM reservations WHERE sandbox_id=?", (sid,))
                released += 1
        return released

    def reservations_of_edge(self, edge_id: str, older_than: float) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT sandbox_id FROM reservations WHERE edge_id=? AND created_at < ?",
                (edge_id, older_than),
            ).fetchall()
        return [r[0] for r in rows]


def _token(row: tuple[Any, ...]) -> TokenRecord:
    return TokenRecord(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], bool(row[8]))


def _check_fits(rec: ProjectRecord, res: Reservation) -> None:
    q, u = rec.quota, rec.usage
    checks = [
        ("cpu_millis", q.cpu_millis, u.cpu_millis + res.cpu_millis),
        ("memory_mb", q.memory_mb, u.memory_mb + res.memory_mb),
        ("sandboxes", q.sandboxes, u.sandboxes + 1),
    ]
    limit = q.sandboxes_by_backend.get(res.backend, 0)
    checks.append(
        (f"sandboxes[{res.backend}]", limit, u.sandboxes_by_backend.get(res.backend, 0) + 1)
    )
    for dim, lim, want in checks:
        if lim and want > lim:
            raise QuotaExceeded(
                f"quota of project {rec.project_id} exceeded: {dim} would be {want} > limit {lim}",
                metadata={"project": rec.project_id, "dimension": dim, "limit": str(lim)},
            )

"""Durable IAM state: projects, tokens, quota reservations, idempotency keys.

The store is an interface (:class:`IamStore`) with two implementations:
:class:`SqliteIamStore` here (the default, one machine) and
``iam.store_pg.PostgresIamStore`` (a cluster; several IAM processes may share
it). ``iam.server.open_store`` picks one from ``DSEC_IAM_DATABASE``. Every method is
one transaction, and quota is exact under concurrency: a reservation reads and
updates the usage rows of its project and every ancestor while holding them
(SQLite: the single writer lock; PostgreSQL: ``SELECT ... FOR UPDATE`` in a
fixed order). Subtree usage is kept per project and updated in the same
transaction as the reservations, so a reservation costs O(depth), not a scan.

The decision of a batch (which items fit, which hit a quota, which retried an
idempotency key) is computed by :class:`ReservationPlan` on the rows a store
loaded under its locks, so both stores decide identically.

Blocking: callers run these methods in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from libdsec.errors import (
    AlreadyExists,
    DSecError,
    FailedPrecondition,
    NotFound,
    QuotaExceeded,
)

#: How long an idempotency key keeps pointing at its sandbox.
KEY_TTL_S = 24 * 3600.0

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
CREATE INDEX IF NOT EXISTS reservations_project ON reservations(project_id);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    project_id TEXT NOT NULL,
    key TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (project_id, key)
);
CREATE INDEX IF NOT EXISTS idempotency_keys_sandbox ON idempotency_keys(sandbox_id);
CREATE INDEX IF NOT EXISTS idempotency_keys_created ON idempotency_keys(created_at);
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
    #: Durable idempotency key of the create ("" = none), per project.
    idempotency_key: str = ""
    #: An earlier attempt of the same create whose outcome is unknown: a key
    #: bound to it is re-bound to this sandbox.
    replaces_sandbox_id: str = ""


@dataclass(frozen=True)
class ReserveOutcome:
    """What happened to one item of a batch reservation."""

    reserved: bool = False
    #: This sandbox id already holds a reservation (a retry): nothing changed.
    already_reserved: bool = False
    #: The idempotency key is bound to this other sandbox: nothing reserved.
    existing_sandbox_id: str = ""
    #: Whether that other sandbox still holds its reservation (has not ended).
    existing_reserved: bool = False
    error: DSecError | None = None


@dataclass(frozen=True)
class KeyBinding:
    sandbox_id: str
    created_at: float
    reserved: bool  # the bound sandbox holds a reservation


def ancestors(project_id: str) -> list[str]:
    """``"root/a/b"`` -> ``["root/a/b", "root/a", "root"]`` (self first)."""
    parts = project_id.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]


def chains_of(project_ids: Iterable[str]) -> list[str]:
    """Every project on the chains of ``project_ids``, sorted: the lock order.

    An ancestor's path is a prefix of its descendants', so sorting puts every
    chain in root-first order and gives all transactions one global order.
    """
    out: set[str] = set()
    for pid in project_ids:
        out.update(ancestors(pid))
    return sorted(out)


class IamStore(Protocol):
    """What the IAM domain needs from durable storage (SQLite or PostgreSQL).

    Every method is one transaction and blocking (call it from a thread).
    """

    def close(self) -> None: ...
    def is_empty(self) -> bool: ...

    def create_project(self, project_id: str, parent_id: str, quota: Quota) -> ProjectRecord: ...
    def get_project(self, project_id: str) -> ProjectRecord | None: ...
    def list_projects(self, parent_id: str, recursive: bool) -> list[ProjectRecord]: ...
    def set_quota(self, project_id: str, quota: Quota) -> ProjectRecord: ...
    def delete_project(self, project_id: str) -> None: ...

    def add_token(self, rec: TokenRecord) -> None: ...
    def get_token(self, token_id: str) -> TokenRecord | None: ...
    def list_tokens(self, project_id: str, include_revoked: bool) -> list[TokenRecord]: ...
    def revoke_token(self, token_id: str) -> None: ...

    def reserve(self, res: Reservation) -> bool:
        """One reservation; False when the sandbox id already holds one. Raises QuotaExceeded."""
        ...

    def reserve_many(self, items: Sequence[Reservation]) -> list[ReserveOutcome]:
        """Reservations in one transaction, decided in order; one outcome per item."""
        ...

    def release(self, sandbox_ids: Sequence[str], not_created: bool = False) -> int:
        """Ends reservations (idempotent); ``not_created`` also forgets their idempotency keys."""
        ...

    def reservations_of_edge(self, edge_id: str, older_than: float) -> list[str]: ...
    def reserved_edges(self) -> dict[str, int]: ...
    def purge_expired_keys(self, now: float | None = None) -> int: ...


class ReservationPlan:
    """Decides a batch of reservations against rows loaded under the store's locks.

    ``projects`` must hold every project on the items' chains (missing ones
    are reported NOT_FOUND), ``reserved`` the items' sandbox ids that already
    hold a reservation, ``keys`` the current bindings of the items' idempotency
    keys. After :meth:`run`, ``new`` lists the reservations to insert,
    ``touched`` the projects whose (in-memory, updated) usage must be written,
    and ``key_writes`` the (project, key, sandbox id) bindings to upsert.
    """

    def __init__(
        self,
        projects: dict[str, ProjectRecord],
        reserved: set[str],
        keys: dict[tuple[str, str], KeyBinding],
        now: float,
    ) -> None:
        self.projects = projects
        self.reserved = reserved
        self.keys = keys
        self.now = now
        self.new: list[Reservation] = []
        self.touched: set[str] = set()
        self.key_writes: list[tuple[str, str, str]] = []
        self._chains: dict[str, list[ProjectRecord] | DSecError] = {}

    def _chain(self, project_id: str) -> list[ProjectRecord] | DSecError:
        chain = self._chains.get(project_id)
        if chain is None:
            recs = []
            for pid in ancestors(project_id):
                rec = self.projects.get(pid)
                if rec is None:
                    chain = NotFound(f"project {pid} not found", reason="PROJECT_NOT_FOUND")
                    break
                recs.append(rec)
            else:
                chain = recs
            self._chains[project_id] = chain
        return chain

    def run(self, items: Sequence[Reservation]) -> list[ReserveOutcome]:
        return [self._one(res) for res in items]

    def _one(self, res: Reservation) -> ReserveOutcome:
        if res.sandbox_id in self.reserved:
            return ReserveOutcome(already_reserved=True)
        key = (res.project_id, res.idempotency_key) if res.idempotency_key else None
        if key is not None:
            bound = self.keys.get(key)
            if (
                bound is not None
                and self.now - bound.created_at < KEY_TTL_S
                and bound.sandbox_id not in (res.sandbox_id, res.replaces_sandbox_id)
            ):
                return ReserveOutcome(
                    existing_sandbox_id=bound.sandbox_id, existing_reserved=bound.reserved
                )
        chain = self._chain(res.project_id)
        if isinstance(chain, DSecError):
            return ReserveOutcome(error=chain)
        for rec in chain:
            err = quota_error(rec, res)
            if err is not None:
                return ReserveOutcome(error=err)
        for rec in chain:
            u = rec.usage
            u.cpu_millis += res.cpu_millis
            u.memory_mb += res.memory_mb
            u.sandboxes += 1
            u.sandboxes_by_backend[res.backend] = u.sandboxes_by_backend.get(res.backend, 0) + 1
            self.touched.add(rec.project_id)
        self.reserved.add(res.sandbox_id)
        self.new.append(res)
        if key is not None:
            self.keys[key] = KeyBinding(res.sandbox_id, self.now, True)
            self.key_writes.append((res.project_id, res.idempotency_key, res.sandbox_id))
        return ReserveOutcome(reserved=True)


@dataclass
class ReleaseDelta:
    """What releasing a set of reservations takes off each project's usage."""

    cpu_millis: int = 0
    memory_mb: int = 0
    sandboxes: int = 0
    by_backend: dict[str, int] = field(default_factory=dict)

    def apply(self, usage: Usage) -> Usage:
        by_backend = dict(usage.sandboxes_by_backend)
        for b, n in self.by_backend.items():
            left = by_backend.get(b, 0) - n
            if left > 0:
                by_backend[b] = left
            else:
                by_backend.pop(b, None)
        return Usage(
            max(0, usage.cpu_millis - self.cpu_millis),
            max(0, usage.memory_mb - self.memory_mb),
            max(0, usage.sandboxes - self.sandboxes),
            by_backend,
        )


def release_deltas(rows: Iterable[tuple[str, str, int, int]]) -> dict[str, ReleaseDelta]:
    """(project, backend, cpu, memory) rows of released reservations -> delta per project."""
    out: dict[str, ReleaseDelta] = {}
    chains: dict[str, list[str]] = {}
    for project_id, backend, cpu, mem in rows:
        chain = chains.get(project_id)
        if chain is None:
            chain = chains[project_id] = ancestors(project_id)
        for pid in chain:
            d = out.get(pid)
            if d is None:
                d = out[pid] = ReleaseDelta()
            d.cpu_millis += cpu
            d.memory_mb += mem
            d.sandboxes += 1
            d.by_backend[backend] = d.by_backend.get(backend, 0) + 1
    return out


def raise_outcome(outcome: ReserveOutcome) -> bool:
    """The single-item API: True = reserved, False = already held; raises an item error."""
    if outcome.error is not None:
        raise outcome.error
    return outcome.reserved


T = TypeVar("T")


def chunked(seq: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


class SqliteIamStore:
    """:class:`IamStore` on SQLite (WAL mode, one connection, one writer at a time)."""

    #: Host parameters per statement (SQLite's limit is 32766 since 3.32; stay well below).
    CHUNK = 900

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
            return self._db.execute("SELECT COUNT(*) FROM projects").fetchone()[0] == 0  # type: ignore[no-any-return]

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
        return project_row(row) if row is not None else None

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
            db.execute("DELETE FROM idempotency_keys WHERE project_id=?", (project_id,))
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
        return token_row(row) if row else None

    def list_tokens(self, project_id: str, include_revoked: bool) -> list[TokenRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM tokens WHERE project_id=? AND (revoked=0 OR ?) ORDER BY created_at",
                (project_id, int(include_revoked)),
            ).fetchall()
        return [token_row(r) for r in rows]

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
        return raise_outcome(self.reserve_many([res])[0])

    def reserve_many(self, items: Sequence[Reservation]) -> list[ReserveOutcome]:
        if not items:
            return []
        with self._tx() as db:
            ids = [r.sandbox_id for r in items]
            reserved: set[str] = set()
            for chunk in chunked(ids, self.CHUNK):
                reserved.update(
                    r[0]
                    for r in db.execute(
                        f"SELECT sandbox_id FROM reservations WHERE sandbox_id IN ({_marks(chunk)})",
                        chunk,
                    )
                )
            keys = self._keys(db, items)
            projects: dict[str, ProjectRecord] = {}
            for pid in chains_of({r.project_id for r in items}):
                rec = self._project(db, pid)
                if rec is not None:
                    projects[pid] = rec
            now = time.time()
            plan = ReservationPlan(projects, reserved, keys, now)
            outcomes = plan.run(items)
            db.executemany(
                "INSERT INTO reservations VALUES (?,?,?,?,?,?,?)",
                [
                    (
                        r.sandbox_id,
                        r.project_id,
                        r.backend,
                        r.cpu_millis,
                        r.memory_mb,
                        r.edge_id,
                        now,
                    )
                    for r in plan.new
                ],
            )
            for pid in sorted(plan.touched):
                u = projects[pid].usage
                db.execute(
                    "UPDATE usage SET cpu_millis=?, memory_mb=?, sandboxes=?, by_backend_json=?"
                    " WHERE project_id=?",
                    (
                        u.cpu_millis,
                        u.memory_mb,
                        u.sandboxes,
                        json.dumps(u.sandboxes_by_backend),
                        pid,
                    ),
                )
            db.executemany(
                "INSERT OR REPLACE INTO idempotency_keys VALUES (?,?,?,?)",
                [(p, k, s, now) for p, k, s in plan.key_writes],
            )
        return outcomes

    def _keys(
        self, db: sqlite3.Connection, items: Sequence[Reservation]
    ) -> dict[tuple[str, str], KeyBinding]:
        wanted: dict[str, list[str]] = {}
        for r in items:
            if r.idempotency_key:
                wanted.setdefault(r.project_id, []).append(r.idempotency_key)
        out: dict[tuple[str, str], KeyBinding] = {}
        for project_id, keys in wanted.items():
            for chunk in chunked(keys, self.CHUNK):
                rows = db.execute(
                    "SELECT k.key, k.sandbox_id, k.created_at, r.sandbox_id IS NOT NULL"
                    " FROM idempotency_keys k LEFT JOIN reservations r ON r.sandbox_id = k.sandbox_id"
                    f" WHERE k.project_id=? AND k.key IN ({_marks(chunk)})",
                    (project_id, *chunk),
                )
                for key, sid, created, held in rows:
                    out[(project_id, key)] = KeyBinding(sid, created, bool(held))
        return out

    def release(self, sandbox_ids: Sequence[str], not_created: bool = False) -> int:
        if not sandbox_ids:
            return 0
        ids = list(dict.fromkeys(sandbox_ids))
        with self._tx() as db:
            rows: list[tuple[str, str, int, int]] = []
            for chunk in chunked(ids, self.CHUNK):
                rows += db.execute(
                    "SELECT project_id, backend, cpu_millis, memory_mb FROM reservations"
                    f" WHERE sandbox_id IN ({_marks(chunk)})",
                    chunk,
                ).fetchall()
                db.execute(f"DELETE FROM reservations WHERE sandbox_id IN ({_marks(chunk)})", chunk)
                if not_created:
                    db.execute(
                        f"DELETE FROM idempotency_keys WHERE sandbox_id IN ({_marks(chunk)})", chunk
                    )
            for pid, delta in sorted(release_deltas(rows).items()):
                rec = self._project(db, pid)
                if rec is None:
                    continue
                u = delta.apply(rec.usage)
                db.execute(
                    "UPDATE usage SET cpu_millis=?, memory_mb=?, sandboxes=?, by_backend_json=?"
                    " WHERE project_id=?",
                    (
                        u.cpu_millis,
                        u.memory_mb,
                        u.sandboxes,
                        json.dumps(u.sandboxes_by_backend),
                        pid,
                    ),
                )
        return len(rows)

    def reservations_of_edge(self, edge_id: str, older_than: float) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT sandbox_id FROM reservations WHERE edge_id=? AND created_at < ?",
                (edge_id, older_than),
            ).fetchall()
        return [r[0] for r in rows]

    def reserved_edges(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT edge_id, COUNT(*) FROM reservations GROUP BY edge_id"
            ).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def purge_expired_keys(self, now: float | None = None) -> int:
        cutoff = (time.time() if now is None else now) - KEY_TTL_S
        with self._tx() as db:
            return db.execute(
                "DELETE FROM idempotency_keys WHERE created_at < ?", (cutoff,)
            ).rowcount


def _marks(chunk: Sequence[Any]) -> str:
    return ",".join("?" * len(chunk))


def project_row(row: Sequence[Any]) -> ProjectRecord:
    """(project_id, parent_id, quota_json, created_at, cpu, memory, sandboxes, by_backend_json)."""
    return ProjectRecord(
        row[0],
        row[1],
        Quota.from_json(row[2]),
        Usage(int(row[4]), int(row[5]), int(row[6]), json.loads(row[7])),
        float(row[3]),
    )


def token_row(row: Sequence[Any]) -> TokenRecord:
    return TokenRecord(
        row[0],
        row[1],
        row[2],
        int(row[3]),
        int(row[4]),
        row[5],
        float(row[6]),
        None if row[7] is None else float(row[7]),
        bool(row[8]),
    )


def quota_error(rec: ProjectRecord, res: Reservation) -> QuotaExceeded | None:
    """The QuotaExceeded (naming ``rec``'s project) if ``res`` does not fit, else None."""
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
            return QuotaExceeded(
                f"quota of project {rec.project_id} exceeded: {dim} would be {want} > limit {lim}",
                metadata={"project": rec.project_id, "dimension": dim, "limit": str(lim)},
            )
    return None

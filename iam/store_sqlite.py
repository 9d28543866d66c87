""":class:`~iam.store.IamStore` on SQLite: the default, for one IAM process on one machine.

WAL mode, one connection, one writer at a time: every method is one ``BEGIN IMMEDIATE``
transaction under a lock, so quota is exact under concurrency (the single writer lock
serializes reservations). A batch is decided by the same :class:`~iam.store.ReservationPlan`
as PostgreSQL, on the rows loaded inside the transaction.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from iam.store import (
    KEY_TTL_S,
    QUEUE_PLACED,
    QUEUE_WAITING,
    KeyBinding,
    ProjectRecord,
    QueueChange,
    QueueRow,
    Quota,
    Reservation,
    ReservationPlan,
    ReserveOutcome,
    TokenRecord,
    Usage,
    chains_of,
    in_subtree,
    project_row,
    queue_id_exists,
    raise_outcome,
    release_deltas,
    token_row,
)
from libdsec.errors import AlreadyExists, FailedPrecondition, NotFound

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
    created_at REAL NOT NULL,
    idempotency_key TEXT NOT NULL DEFAULT ''  -- the key it was reserved with ('' = none)
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
CREATE INDEX IF NOT EXISTS idempotency_keys_created ON idempotency_keys(created_at);
CREATE TABLE IF NOT EXISTS queue (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    queue_id TEXT NOT NULL UNIQUE,
    project_id TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    state INTEGER NOT NULL,
    body BLOB NOT NULL,
    ended_at REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS queue_state ON queue(state);
CREATE INDEX IF NOT EXISTS queue_key ON queue(project_id, idem_key);
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires_at REAL NOT NULL
);
"""


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
        # Checkpoint the WAL into the database every 64 MiB of it, not SQLite's default 4 MiB:
        # a burst's transaction writes thousands of pages, and a checkpoint after each one
        # (copy and fsync) made a reservation's latency grow with the size of the tables.
        self._db.execute("PRAGMA wal_autocheckpoint=16384")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        self._migrate()
        self._lock = threading.Lock()

    def _migrate(self) -> None:
        """A database made before reservations kept their key: it gets the column, and loses
        the index of idempotency_keys by sandbox that release() used instead (a random
        sandbox id per key dirtied a page of that index per key, so with the WAL a burst's
        transaction cost grew with the table). Its older reservations name no key: a
        never-created one's key stays bound, and a retry with it finds no such sandbox and
        takes the key over, as the create pipeline does for any key whose sandbox is gone."""
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(reservations)")}
        if "idempotency_key" not in columns:
            self._db.execute(
                "ALTER TABLE reservations ADD COLUMN idempotency_key TEXT NOT NULL DEFAULT ''"
            )
        self._db.execute("DROP INDEX IF EXISTS idempotency_keys_sandbox")

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
                "INSERT INTO reservations (sandbox_id, project_id, backend, cpu_millis,"
                " memory_mb, edge_id, created_at, idempotency_key) VALUES (?,?,?,?,?,?,?,?)",
                [
                    (
                        r.sandbox_id,
                        r.project_id,
                        r.backend,
                        r.cpu_millis,
                        r.memory_mb,
                        r.edge_id,
                        now,
                        r.idempotency_key,
                    )
                    for r in plan.new
                ],
            )
            for pid in sorted(plan.touched):
                _write_usage(db, pid, projects[pid].usage)
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
            keys: list[tuple[str, str, str]] = []
            for chunk in chunked(ids, self.CHUNK):
                for pid, backend, cpu, mem, sid, key in db.execute(
                    "SELECT project_id, backend, cpu_millis, memory_mb, sandbox_id,"
                    f" idempotency_key FROM reservations WHERE sandbox_id IN ({_marks(chunk)})",
                    chunk,
                ).fetchall():
                    rows.append((pid, backend, cpu, mem))
                    if key:
                        keys.append((pid, key, sid))
                db.execute(f"DELETE FROM reservations WHERE sandbox_id IN ({_marks(chunk)})", chunk)
            if not_created:
                # Only while still bound to this sandbox: a retry may have re-bound it.
                db.executemany(
                    "DELETE FROM idempotency_keys WHERE project_id=? AND key=? AND sandbox_id=?",
                    keys,
                )
            for pid, delta in sorted(release_deltas(rows).items()):
                rec = self._project(db, pid)
                if rec is None:
                    continue
                _write_usage(db, pid, delta.apply(rec.usage))
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

    # ------------------------------------------------------------- queue

    _QUEUE_COLUMNS = "queue_id, project_id, idem_key, state, seq, body, ended_at"

    def queue_add(self, rows: Sequence[QueueRow]) -> list[QueueRow]:
        out: list[QueueRow] = []
        with self._tx() as db:
            for row in rows:
                if row.key:
                    hit = db.execute(
                        f"SELECT {self._QUEUE_COLUMNS} FROM queue WHERE project_id=? AND"
                        " idem_key=? AND state IN (?, ?) ORDER BY seq DESC LIMIT 1",
                        (row.project_id, row.key, QUEUE_WAITING, QUEUE_PLACED),
                    ).fetchone()
                    if hit is not None:
                        out.append(QueueRow(*hit))
                        continue
                try:
                    cur = db.execute(
                        "INSERT INTO queue (queue_id, project_id, idem_key, state, body)"
                        " VALUES (?, ?, ?, ?, ?)",
                        (row.queue_id, row.project_id, row.key, row.state, row.body),
                    )
                except sqlite3.IntegrityError:
                    raise queue_id_exists(row.queue_id) from None
                row.seq = int(cur.lastrowid or 0)
                out.append(row)
        return out

    def queue_get(self, queue_ids: Sequence[str]) -> list[QueueRow]:
        out: list[QueueRow] = []
        with self._lock:
            for chunk in chunked(list(queue_ids), self.CHUNK):
                out += [
                    QueueRow(*r)
                    for r in self._db.execute(
                        f"SELECT {self._QUEUE_COLUMNS} FROM queue WHERE queue_id IN"
                        f" ({_marks(chunk)})",
                        list(chunk),
                    )
                ]
        return out

    def queue_list(self, project_prefix: str, waiting_only: bool) -> list[QueueRow]:
        where = "WHERE state=?" if waiting_only else ""
        args: list[Any] = [QUEUE_WAITING] if waiting_only else []
        with self._lock:
            rows = self._db.execute(
                f"SELECT {self._QUEUE_COLUMNS} FROM queue {where} ORDER BY seq", args
            ).fetchall()
        return [QueueRow(*r) for r in rows if in_subtree(r[1], project_prefix)]

    def queue_update(self, queue_ids: Sequence[str], change: QueueChange) -> list[QueueRow]:
        out: list[QueueRow] = []
        with self._tx() as db:
            for qid in queue_ids:
                hit = db.execute(
                    f"SELECT {self._QUEUE_COLUMNS} FROM queue WHERE queue_id=?", (qid,)
                ).fetchone()
                if hit is None:
                    continue
                row = QueueRow(*hit)
                new = change(row)
                if new is not None:
                    db.execute(
                        "UPDATE queue SET state=?, body=?, ended_at=? WHERE queue_id=?",
                        (new.state, new.body, new.ended_at, qid),
                    )
                    row = new
                out.append(row)
        return out

    def queue_purge(self, ended_before: float) -> int:
        with self._tx() as db:
            return db.execute(
                "DELETE FROM queue WHERE state<>? AND ended_at>0 AND ended_at<?",
                (QUEUE_WAITING, ended_before),
            ).rowcount

    def lease(self, name: str, holder: str, ttl_s: float, now: float) -> tuple[bool, str]:
        with self._tx() as db:
            db.execute(
                "INSERT INTO leases (name, holder, expires_at) VALUES (?, ?, ?)"
                " ON CONFLICT(name) DO UPDATE SET holder=excluded.holder,"
                " expires_at=excluded.expires_at"
                " WHERE leases.holder=excluded.holder OR leases.expires_at<?",
                (name, holder, now + ttl_s, now),
            )
            current = db.execute("SELECT holder FROM leases WHERE name=?", (name,)).fetchone()[0]
        return current == holder, str(current)


def _marks(chunk: Sequence[Any]) -> str:
    return ",".join("?" * len(chunk))


def _write_usage(db: sqlite3.Connection, project_id: str, u: Usage) -> None:
    """A project's subtree usage row, as a reservation or a release left it."""
    db.execute(
        "UPDATE usage SET cpu_millis=?, memory_mb=?, sandboxes=?, by_backend_json=?"
        " WHERE project_id=?",
        (u.cpu_millis, u.memory_mb, u.sandboxes, json.dumps(u.sandboxes_by_backend), project_id),
    )

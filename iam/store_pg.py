""":class:`~iam.store.IamStore` on PostgreSQL (psycopg 3), for a cluster of IAM processes.

Exactness under concurrency: a reservation (or release) first locks the usage
rows of every project on its chains with ``SELECT ... FOR UPDATE`` in one
global order (project paths sorted bytewise, ``COLLATE "C"``: an ancestor sorts
before its descendants), then decides with the same
:class:`~iam.store.ReservationPlan` as SQLite and writes in the same
transaction. Two transactions touching a common ancestor therefore run one
after the other, whichever IAM process they come from; the fixed order rules
out deadlocks between them (one is retried anyway, should PostgreSQL report
one). Idempotency keys are per project, so the project's own usage lock also
serializes competing binds of one key.

Connections: a small pool, one connection per worker thread at a time.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors

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

T = TypeVar("T")

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS projects (
        project_id TEXT COLLATE "C" PRIMARY KEY,
        parent_id TEXT NOT NULL,
        quota_json TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS usage (
        project_id TEXT COLLATE "C" PRIMARY KEY,
        cpu_millis BIGINT NOT NULL DEFAULT 0,
        memory_mb BIGINT NOT NULL DEFAULT 0,
        sandboxes BIGINT NOT NULL DEFAULT 0,
        by_backend_json TEXT NOT NULL DEFAULT '{}'
    )""",
    """CREATE TABLE IF NOT EXISTS tokens (
        token_id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        project_id TEXT NOT NULL,
        kind INTEGER NOT NULL,
        role INTEGER NOT NULL,
        secret_hash TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION,
        revoked BOOLEAN NOT NULL DEFAULT FALSE
    )""",
    "CREATE INDEX IF NOT EXISTS tokens_project ON tokens(project_id)",
    """CREATE TABLE IF NOT EXISTS reservations (
        sandbox_id TEXT PRIMARY KEY,
        project_id TEXT NOT NULL,
        backend TEXT NOT NULL,
        cpu_millis BIGINT NOT NULL,
        memory_mb BIGINT NOT NULL,
        edge_id TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS reservations_edge ON reservations(edge_id)",
    "CREATE INDEX IF NOT EXISTS reservations_project ON reservations(project_id)",
    """CREATE TABLE IF NOT EXISTS idempotency_keys (
        project_id TEXT NOT NULL,
        key TEXT NOT NULL,
        sandbox_id TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (project_id, key)
    )""",
    "CREATE INDEX IF NOT EXISTS idempotency_keys_sandbox ON idempotency_keys(sandbox_id)",
    "CREATE INDEX IF NOT EXISTS idempotency_keys_created ON idempotency_keys(created_at)",
    """CREATE TABLE IF NOT EXISTS queue (
        seq BIGSERIAL PRIMARY KEY,
        queue_id TEXT NOT NULL UNIQUE,
        project_id TEXT COLLATE "C" NOT NULL,
        idem_key TEXT NOT NULL,
        state INTEGER NOT NULL,
        body BYTEA NOT NULL,
        ended_at DOUBLE PRECISION NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX IF NOT EXISTS queue_state ON queue(state)",
    "CREATE INDEX IF NOT EXISTS queue_key ON queue(project_id, idem_key)",
    """CREATE TABLE IF NOT EXISTS leases (
        name TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL
    )""",
]

#: Any constant: serializes schema creation among IAM processes starting together.
_SCHEMA_LOCK = 0x64736563

_PROJECT_SELECT = (
    "SELECT p.project_id, p.parent_id, p.quota_json, p.created_at, u.cpu_millis, u.memory_mb,"
    " u.sandboxes, u.by_backend_json FROM projects p JOIN usage u ON u.project_id = p.project_id"
)

_RETRYABLE = (pg_errors.DeadlockDetected, pg_errors.SerializationFailure)


class PostgresIamStore:
    """:class:`~iam.store.IamStore` on a PostgreSQL database given by a ``postgresql://`` DSN."""

    def __init__(self, dsn: str, *, pool_size: int = 8, connect_timeout_s: int = 10) -> None:
        self.dsn = dsn
        self.pool_size = pool_size
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[psycopg.Connection[Any]] = []
        self._pool_lock = threading.Lock()
        self._closed = False
        with self._conn() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for stmt in SCHEMA:
                conn.execute(stmt)

    # --------------------------------------------------------- connections

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.dsn,
            autocommit=True,
            connect_timeout=self.connect_timeout_s,
            application_name="dsec-iam",
        )

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        with self._pool_lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None or conn.closed:
            conn = self._connect()
        try:
            yield conn
        except (psycopg.OperationalError, psycopg.InterfaceError):
            conn.close()  # a broken connection is not returned to the pool
            raise
        finally:
            if not conn.closed:
                self._give_back(conn)

    def _give_back(self, conn: psycopg.Connection[Any]) -> None:
        with self._pool_lock:
            if not self._closed and len(self._idle) < self.pool_size:
                self._idle.append(conn)
                return
        conn.close()

    def _run(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Runs ``fn`` in one transaction; retries deadlocks, serialization failures
        and a connection lost before the transaction could have committed."""
        attempt = 0
        while True:
            attempt += 1
            try:
                with self._conn() as conn, conn.transaction():
                    return fn(conn)
            except _RETRYABLE:
                if attempt >= 5:
                    raise
                time.sleep(0.01 * attempt)
            except psycopg.OperationalError:
                if attempt >= 2:
                    raise

    def close(self) -> None:
        with self._pool_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ------------------------------------------------------------ projects

    def is_empty(self) -> bool:
        return self._run(
            lambda c: c.execute("SELECT NOT EXISTS (SELECT 1 FROM projects)").fetchone()[0]  # type: ignore[index]
        )

    def create_project(self, project_id: str, parent_id: str, quota: Quota) -> ProjectRecord:
        now = time.time()

        def tx(c: psycopg.Connection[Any]) -> ProjectRecord:
            if c.execute("SELECT 1 FROM projects WHERE project_id=%s", (project_id,)).fetchone():
                raise AlreadyExists(f"project {project_id} exists", reason="PROJECT_EXISTS")
            if (
                parent_id
                and not c.execute(
                    "SELECT 1 FROM projects WHERE project_id=%s FOR SHARE", (parent_id,)
                ).fetchone()
            ):
                raise NotFound(f"parent project {parent_id} not found", reason="PROJECT_NOT_FOUND")
            try:
                c.execute(
                    "INSERT INTO projects VALUES (%s,%s,%s,%s)",
                    (project_id, parent_id, quota.to_json(), now),
                )
            except pg_errors.UniqueViolation:
                raise AlreadyExists(
                    f"project {project_id} exists", reason="PROJECT_EXISTS"
                ) from None
            c.execute("INSERT INTO usage(project_id) VALUES (%s)", (project_id,))
            return ProjectRecord(project_id, parent_id, quota, Usage(), now)

        return self._run(tx)

    @staticmethod
    def _project(c: psycopg.Connection[Any], project_id: str) -> ProjectRecord | None:
        row = c.execute(_PROJECT_SELECT + " WHERE p.project_id=%s", (project_id,)).fetchone()
        return project_row(row) if row is not None else None

    def get_project(self, project_id: str) -> ProjectRecord | None:
        return self._run(lambda c: self._project(c, project_id))

    def list_projects(self, parent_id: str, recursive: bool) -> list[ProjectRecord]:
        def tx(c: psycopg.Connection[Any]) -> list[ProjectRecord]:
            if recursive:
                rows = c.execute(
                    _PROJECT_SELECT + " WHERE p.project_id LIKE %s ORDER BY p.project_id",
                    (_like_prefix(parent_id) + "/%",),
                ).fetchall()
            else:
                rows = c.execute(
                    _PROJECT_SELECT + " WHERE p.parent_id=%s ORDER BY p.project_id", (parent_id,)
                ).fetchall()
            return [project_row(r) for r in rows]

        return self._run(tx)

    def set_quota(self, project_id: str, quota: Quota) -> ProjectRecord:
        def tx(c: psycopg.Connection[Any]) -> ProjectRecord:
            cur = c.execute(
                "UPDATE projects SET quota_json=%s WHERE project_id=%s",
                (quota.to_json(), project_id),
            )
            if cur.rowcount == 0:
                raise NotFound(f"project {project_id} not found", reason="PROJECT_NOT_FOUND")
            rec = self._project(c, project_id)
            assert rec is not None
            return rec

        return self._run(tx)

    def delete_project(self, project_id: str) -> None:
        def tx(c: psycopg.Connection[Any]) -> None:
            # The usage row lock keeps reservations out while we check for them.
            if not c.execute(
                "SELECT 1 FROM usage WHERE project_id=%s FOR UPDATE", (project_id,)
            ).fetchone():
                raise NotFound(f"project {project_id} not found", reason="PROJECT_NOT_FOUND")
            if c.execute("SELECT 1 FROM projects WHERE parent_id=%s", (project_id,)).fetchone():
                raise FailedPrecondition(
                    f"project {project_id} has subprojects", reason="PROJECT_NOT_EMPTY"
                )
            if c.execute(
                "SELECT 1 FROM reservations WHERE project_id=%s LIMIT 1", (project_id,)
            ).fetchone():
                raise FailedPrecondition(
                    f"project {project_id} has sandboxes", reason="PROJECT_NOT_EMPTY"
                )
            c.execute("DELETE FROM projects WHERE project_id=%s", (project_id,))
            c.execute("DELETE FROM usage WHERE project_id=%s", (project_id,))
            c.execute("DELETE FROM idempotency_keys WHERE project_id=%s", (project_id,))
            c.execute("UPDATE tokens SET revoked=TRUE WHERE project_id=%s", (project_id,))

        self._run(tx)

    # -------------------------------------------------------------- tokens

    def add_token(self, rec: TokenRecord) -> None:
        self._run(
            lambda c: c.execute(
                "INSERT INTO tokens VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s)",
                (
                    rec.token_id,
                    rec.name,
                    rec.project_id,
                    rec.kind,
                    rec.role,
                    rec.secret_hash,
                    rec.created_at,
                    rec.expires_at,
                    rec.revoked,
                ),
            )
        )

    def get_token(self, token_id: str) -> TokenRecord | None:
        row = self._run(
            lambda c: c.execute("SELECT * FROM tokens WHERE token_id=%s", (token_id,)).fetchone()
        )
        return token_row(row) if row else None

    def list_tokens(self, project_id: str, include_revoked: bool) -> list[TokenRecord]:
        rows = self._run(
            lambda c: c.execute(
                "SELECT * FROM tokens WHERE project_id=%s AND (NOT revoked OR %s)"
                " ORDER BY created_at",
                (project_id, include_revoked),
            ).fetchall()
        )
        return [token_row(r) for r in rows]

    def revoke_token(self, token_id: str) -> None:
        def tx(c: psycopg.Connection[Any]) -> None:
            if (
                c.execute("UPDATE tokens SET revoked=TRUE WHERE token_id=%s", (token_id,)).rowcount
                == 0
            ):
                raise NotFound(f"token {token_id} not found", reason="TOKEN_NOT_FOUND")

        self._run(tx)

    # --------------------------------------------------------------- quota

    @staticmethod
    def _lock_chains(
        c: psycopg.Connection[Any], project_ids: list[str]
    ) -> dict[str, ProjectRecord]:
        """Locks the usage rows of ``project_ids`` (already sorted) in that order."""
        rows = c.execute(
            _PROJECT_SELECT + ' WHERE u.project_id = ANY(%s) ORDER BY u.project_id COLLATE "C"'
            " FOR UPDATE OF u",
            (project_ids,),
        ).fetchall()
        return {r[0]: project_row(r) for r in rows}

    def reserve(self, res: Reservation) -> bool:
        return raise_outcome(self.reserve_many([res])[0])

    def reserve_many(self, items: Sequence[Reservation]) -> list[ReserveOutcome]:
        if not items:
            return []

        def tx(c: psycopg.Connection[Any]) -> list[ReserveOutcome]:
            projects = self._lock_chains(c, chains_of({r.project_id for r in items}))
            ids = [r.sandbox_id for r in items]
            reserved = {
                r[0]
                for r in c.execute(
                    "SELECT sandbox_id FROM reservations WHERE sandbox_id = ANY(%s)", (ids,)
                )
            }
            keys = self._keys(c, items)
            now = time.time()
            plan = ReservationPlan(projects, reserved, keys, now)
            outcomes = plan.run(items)
            if plan.new:
                with c.cursor().copy(
                    "COPY reservations (sandbox_id, project_id, backend, cpu_millis, memory_mb,"
                    " edge_id, created_at) FROM STDIN"
                ) as copy:
                    for r in plan.new:
                        copy.write_row(
                            (
                                r.sandbox_id,
                                r.project_id,
                                r.backend,
                                r.cpu_millis,
                                r.memory_mb,
                                r.edge_id,
                                now,
                            )
                        )
            for pid in sorted(plan.touched):
                u = projects[pid].usage
                c.execute(
                    "UPDATE usage SET cpu_millis=%s, memory_mb=%s, sandboxes=%s, by_backend_json=%s"
                    " WHERE project_id=%s",
                    (
                        u.cpu_millis,
                        u.memory_mb,
                        u.sandboxes,
                        json.dumps(u.sandboxes_by_backend),
                        pid,
                    ),
                )
            if plan.key_writes:
                c.cursor().executemany(
                    "INSERT INTO idempotency_keys VALUES (%s,%s,%s,%s) ON CONFLICT (project_id, key)"
                    " DO UPDATE SET sandbox_id=EXCLUDED.sandbox_id, created_at=EXCLUDED.created_at",
                    [(p, k, s, now) for p, k, s in plan.key_writes],
                )
            return outcomes

        return self._run(tx)

    @staticmethod
    def _keys(
        c: psycopg.Connection[Any], items: Sequence[Reservation]
    ) -> dict[tuple[str, str], KeyBinding]:
        wanted: dict[str, list[str]] = {}
        for r in items:
            if r.idempotency_key:
                wanted.setdefault(r.project_id, []).append(r.idempotency_key)
        out: dict[tuple[str, str], KeyBinding] = {}
        for project_id, keys in wanted.items():
            rows = c.execute(
                "SELECT k.key, k.sandbox_id, k.created_at, r.sandbox_id IS NOT NULL"
                " FROM idempotency_keys k LEFT JOIN reservations r ON r.sandbox_id = k.sandbox_id"
                " WHERE k.project_id=%s AND k.key = ANY(%s)",
                (project_id, keys),
            )
            for key, sid, created, held in rows:
                out[(project_id, key)] = KeyBinding(sid, float(created), bool(held))
        return out

    def release(self, sandbox_ids: Sequence[str], not_created: bool = False) -> int:
        if not sandbox_ids:
            return 0
        ids = list(dict.fromkeys(sandbox_ids))

        def tx(c: psycopg.Connection[Any]) -> int:
            owners = [
                r[0]
                for r in c.execute(
                    "SELECT DISTINCT project_id FROM reservations WHERE sandbox_id = ANY(%s)",
                    (ids,),
                )
            ]
            if not owners:
                if not_created:
                    c.execute("DELETE FROM idempotency_keys WHERE sandbox_id = ANY(%s)", (ids,))
                return 0
            locked = chains_of(owners)
            projects = self._lock_chains(c, locked)
            rows = c.execute(
                "DELETE FROM reservations WHERE sandbox_id = ANY(%s)"
                " RETURNING project_id, backend, cpu_millis, memory_mb",
                (ids,),
            ).fetchall()
            late = sorted(set(chains_of(r[0] for r in rows)) - set(locked))
            if late:  # reserved concurrently under another project: lock those too
                projects.update(self._lock_chains(c, late))
            for pid, delta in sorted(release_deltas(rows).items()):
                rec = projects.get(pid)
                if rec is None:
                    continue
                u = delta.apply(rec.usage)
                c.execute(
                    "UPDATE usage SET cpu_millis=%s, memory_mb=%s, sandboxes=%s, by_backend_json=%s"
                    " WHERE project_id=%s",
                    (
                        u.cpu_millis,
                        u.memory_mb,
                        u.sandboxes,
                        json.dumps(u.sandboxes_by_backend),
                        pid,
                    ),
                )
            if not_created:
                c.execute("DELETE FROM idempotency_keys WHERE sandbox_id = ANY(%s)", (ids,))
            return len(rows)

        return self._run(tx)

    def reservations_of_edge(self, edge_id: str, older_than: float) -> list[str]:
        rows = self._run(
            lambda c: c.execute(
                "SELECT sandbox_id FROM reservations WHERE edge_id=%s AND created_at < %s",
                (edge_id, older_than),
            ).fetchall()
        )
        return [r[0] for r in rows]

    def reserved_edges(self) -> dict[str, int]:
        rows = self._run(
            lambda c: c.execute(
                "SELECT edge_id, COUNT(*) FROM reservations GROUP BY edge_id"
            ).fetchall()
        )
        return {r[0]: int(r[1]) for r in rows}

    def purge_expired_keys(self, now: float | None = None) -> int:
        cutoff = (time.time() if now is None else now) - KEY_TTL_S
        return self._run(
            lambda c: (
                c.execute("DELETE FROM idempotency_keys WHERE created_at < %s", (cutoff,)).rowcount
            )
        )

    # ------------------------------------------------------------- queue

    _QUEUE_COLUMNS = "queue_id, project_id, idem_key, state, seq, body, ended_at"

    @staticmethod
    def _row(r: Any) -> QueueRow:
        return QueueRow(r[0], r[1], r[2], int(r[3]), int(r[4]), bytes(r[5]), float(r[6]))

    def queue_add(self, rows: Sequence[QueueRow]) -> list[QueueRow]:
        def tx(c: psycopg.Connection[Any]) -> list[QueueRow]:
            out: list[QueueRow] = []
            keyed = sorted({(r.project_id, r.key) for r in rows if r.key})
            for project_id, key in keyed:  # two IAM processes adding one key: one waits
                c.execute(
                    "SELECT pg_advisory_xact_lock(hashtext(%s))", (f"queue:{project_id}:{key}",)
                )
            for row in rows:
                if row.key:
                    hit = c.execute(
                        f"SELECT {self._QUEUE_COLUMNS} FROM queue WHERE project_id=%s AND"
                        " idem_key=%s AND state IN (%s, %s) ORDER BY seq DESC LIMIT 1",
                        (row.project_id, row.key, QUEUE_WAITING, QUEUE_PLACED),
                    ).fetchone()
                    if hit is not None:
                        out.append(self._row(hit))
                        continue
                try:
                    seq = c.execute(
                        "INSERT INTO queue (queue_id, project_id, idem_key, state, body)"
                        " VALUES (%s, %s, %s, %s, %s) RETURNING seq",
                        (row.queue_id, row.project_id, row.key, row.state, row.body),
                    ).fetchone()
                except pg_errors.UniqueViolation:
                    raise queue_id_exists(row.queue_id) from None
                row.seq = int(seq[0]) if seq else 0
                out.append(row)
            return out

        return self._run(tx)

    def queue_get(self, queue_ids: Sequence[str]) -> list[QueueRow]:
        rows = self._run(
            lambda c: c.execute(
                f"SELECT {self._QUEUE_COLUMNS} FROM queue WHERE queue_id = ANY(%s)",
                (list(queue_ids),),
            ).fetchall()
        )
        return [self._row(r) for r in rows]

    def queue_list(self, project_prefix: str, waiting_only: bool) -> list[QueueRow]:
        where = "WHERE state=%s" if waiting_only else ""
        args: list[Any] = [QUEUE_WAITING] if waiting_only else []
        rows = self._run(
            lambda c: c.execute(
                f"SELECT {self._QUEUE_COLUMNS} FROM queue {where} ORDER BY seq", args
            ).fetchall()
        )
        return [self._row(r) for r in rows if in_subtree(r[1], project_prefix)]

    def queue_update(self, queue_ids: Sequence[str], change: QueueChange) -> list[QueueRow]:
        def tx(c: psycopg.Connection[Any]) -> list[QueueRow]:
            out: list[QueueRow] = []
            for qid in sorted(queue_ids):  # one lock order: no deadlock between two updates
                hit = c.execute(
                    f"SELECT {self._QUEUE_COLUMNS} FROM queue WHERE queue_id=%s FOR UPDATE",
                    (qid,),
                ).fetchone()
                if hit is None:
                    continue
                row = self._row(hit)
                new = change(row)
                if new is not None:
                    c.execute(
                        "UPDATE queue SET state=%s, body=%s, ended_at=%s WHERE queue_id=%s",
                        (new.state, new.body, new.ended_at, qid),
                    )
                    row = new
                out.append(row)
            return out

        return self._run(tx)

    def queue_purge(self, ended_before: float) -> int:
        return self._run(
            lambda c: (
                c.execute(
                    "DELETE FROM queue WHERE state<>%s AND ended_at>0 AND ended_at<%s",
                    (QUEUE_WAITING, ended_before),
                ).rowcount
            )
        )

    def lease(self, name: str, holder: str, ttl_s: float, now: float) -> tuple[bool, str]:
        def tx(c: psycopg.Connection[Any]) -> tuple[bool, str]:
            c.execute(
                "INSERT INTO leases (name, holder, expires_at) VALUES (%s, %s, %s)"
                " ON CONFLICT (name) DO UPDATE SET holder=EXCLUDED.holder,"
                " expires_at=EXCLUDED.expires_at"
                " WHERE leases.holder=EXCLUDED.holder OR leases.expires_at<%s",
                (name, holder, now + ttl_s, now),
            )
            row = c.execute("SELECT holder FROM leases WHERE name=%s", (name,)).fetchone()
            current = str(row[0]) if row else ""
            return current == holder, current

        return self._run(tx)


def _like_prefix(value: str) -> str:
    return value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")

"""Durable IAM state: projects, tokens, quota reservations, idempotency keys.

The store is an interface (:class:`IamStore`) with two implementations:
``iam.store_sqlite.SqliteIamStore`` (the default, one machine) and
``iam.store_pg.PostgresIamStore`` (a cluster; several IAM processes may share
it). ``iam.server.open_store`` (the composition root) picks one from ``DSEC_IAM_DATABASE``. Every method is
one transaction, and quota is exact under concurrency: a reservation reads and
updates the usage rows of its project and every ancestor while holding them
(SQLite: the single writer lock; PostgreSQL: ``SELECT ... FOR UPDATE`` in a
fixed order). Subtree usage is kept per project and updated in the same
transaction as the reservations, so a reservation costs O(depth), not a scan.

The decision of a batch (which items fit, which hit a quota, which retried an
idempotency key) is computed by :class:`ReservationPlan` on the rows a store
loaded under its locks, so both stores decide identically. This module holds
what both share: the interface, the records, that decision, the row decoders.

Blocking: callers run these methods in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from libdsec.errors import AlreadyExists, DSecError, NotFound, QuotaExceeded

#: How long an idempotency key keeps pointing at its sandbox.
KEY_TTL_S = 24 * 3600.0


@dataclass
class Quota:
    """Limits of a project subtree; 0 = no limit of its own (ancestors still bound it)."""

    cpu_millis: int = 0
    memory_mb: int = 0
    sandboxes: int = 0
    sandboxes_by_backend: dict[str, int] = field(default_factory=dict)
    #: The project's weight in the create queue's fair share (0 = 1); not a limit.
    share_weight: float = 0.0

    def to_json(self) -> str:
        return json.dumps(
            {
                "cpu_millis": self.cpu_millis,
                "memory_mb": self.memory_mb,
                "sandboxes": self.sandboxes,
                "by_backend": self.sandboxes_by_backend,
                "share_weight": self.share_weight,
            }
        )

    @classmethod
    def from_json(cls, raw: str) -> Quota:
        d = json.loads(raw)
        return cls(
            d["cpu_millis"],
            d["memory_mb"],
            d["sandboxes"],
            dict(d.get("by_backend", {})),
            float(d.get("share_weight", 0.0)),
        )


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


#: The outcome of every item that got its reservation (shared: outcomes are frozen).
RESERVED = ReserveOutcome(reserved=True)


#: Queue entry states (the values of dsec.iam.v1.QueueState; the store compares only WAITING).
QUEUE_WAITING = 1
QUEUE_PLACED = 2
#: How long an ended queue entry stays readable (get on its queue id) before it is purged.
QUEUE_RETENTION_S = 3600.0


@dataclass
class QueueRow:
    """One create waiting its turn (or that ended waiting). ``body`` is the whole entry,
    serialized by the servicer; the store reads only the columns it indexes."""

    queue_id: str
    project_id: str
    key: str  # idempotency key ("" = none): one waiting or placed entry per (project, key)
    state: int
    seq: int  # arrival order, set by the store
    body: bytes
    ended_at: float = 0.0


def queue_id_exists(queue_id: str) -> DSecError:
    """A queue id is used once: a second add under it (other than an idempotent repeat, which
    answers the first entry) is refused, whatever state the first one is in."""
    return AlreadyExists(f"queue entry {queue_id} exists", reason="QUEUE_ID_EXISTS")


#: Applied to each row of ``queue_update`` inside its transaction: the new row, or None to
#: leave it unchanged.
QueueChange = Callable[[QueueRow], "QueueRow | None"]


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

    def queue_add(self, rows: Sequence[QueueRow]) -> list[QueueRow]:
        """Adds waiting entries in order (seq); an entry whose (project, key) is already
        waiting or placed is not added: that entry is returned in its place."""
        ...

    def queue_get(self, queue_ids: Sequence[str]) -> list[QueueRow]: ...

    def queue_list(self, project_prefix: str, waiting_only: bool) -> list[QueueRow]:
        """Entries of a project subtree ("" = all), in arrival order."""
        ...

    def queue_update(self, queue_ids: Sequence[str], change: QueueChange) -> list[QueueRow]:
        """Applies ``change`` to each row in one transaction; returns the rows after it."""
        ...

    def queue_purge(self, ended_before: float) -> int: ...

    def lease(self, name: str, holder: str, ttl_s: float, now: float) -> tuple[bool, str]:
        """Takes or renews lease ``name`` for ``holder`` unless another holder's has not
        lapsed; returns (held by ``holder``, the holder)."""
        ...


def in_subtree(project_id: str, prefix: str) -> bool:
    return not prefix or project_id == prefix or project_id.startswith(prefix + "/")


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
        return RESERVED


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
    """The QuotaExceeded (naming ``rec``'s project) if ``res`` does not fit, else None.

    Checked in this order: cpu_millis, memory_mb, sandboxes, sandboxes[backend]; a limit of
    0 is none. (Called per item and ancestor of every reservation: kept to plain compares.)
    """
    q, u = rec.quota, rec.usage
    if q.cpu_millis and u.cpu_millis + res.cpu_millis > q.cpu_millis:
        return _exceeded(rec, "cpu_millis", q.cpu_millis, u.cpu_millis + res.cpu_millis)
    if q.memory_mb and u.memory_mb + res.memory_mb > q.memory_mb:
        return _exceeded(rec, "memory_mb", q.memory_mb, u.memory_mb + res.memory_mb)
    if q.sandboxes and u.sandboxes + 1 > q.sandboxes:
        return _exceeded(rec, "sandboxes", q.sandboxes, u.sandboxes + 1)
    limit = q.sandboxes_by_backend.get(res.backend, 0) if q.sandboxes_by_backend else 0
    if limit:
        want = u.sandboxes_by_backend.get(res.backend, 0) + 1
        if want > limit:
            return _exceeded(rec, f"sandboxes[{res.backend}]", limit, want)
    return None


def _exceeded(rec: ProjectRecord, dim: str, limit: int, want: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"quota of project {rec.project_id} exceeded: {dim} would be {want} > limit {limit}",
        metadata={"project": rec.project_id, "dimension": dim, "limit": str(limit)},
    )

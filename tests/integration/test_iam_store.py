"""Conformance suite of the IAM store: the same tests against SQLite and a real
PostgreSQL server (started by the session fixture from the Debian binaries).

Quota exactness is checked the hard way: many threads (and, on PostgreSQL,
several store instances, i.e. several IAM processes) race to reserve in
sibling subprojects, and no ancestor may ever end above its limit.
"""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from iam.server import open_store
from iam.store import (
    KEY_TTL_S,
    QUEUE_PLACED,
    QUEUE_WAITING,
    IamStore,
    QueueChange,
    QueueRow,
    Quota,
    Reservation,
    TokenRecord,
)
from iam.store_sqlite import SqliteIamStore
from libdsec.errors import AlreadyExists, FailedPrecondition, NotFound, QuotaExceeded
from tests.pgserver import PostgresServer

C = "BACKEND_CONTAINER"


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database URL of each kind."""
    if request.param == "sqlite":
        return f"sqlite:{tmp_path / 'iam.db'}"
    server: PostgresServer = request.getfixturevalue("postgres")
    return server.create_database()


@pytest.fixture
def store(database: str) -> Iterator[IamStore]:
    s = open_store(database)
    try:
        yield s
    finally:
        s.close()


def res(
    sid: str, project: str = "root", *, cpu: int = 100, mem: int = 10, **kw: str
) -> Reservation:
    return Reservation(sid, project, kw.pop("backend", C), cpu, mem, kw.pop("edge", "e1"), **kw)


def tree(store: IamStore) -> None:
    store.create_project("root", "", Quota())
    store.create_project("root/a", "root", Quota(sandboxes=10, cpu_millis=5000))
    store.create_project(
        "root/a/x", "root/a", Quota(sandboxes=4, sandboxes_by_backend={"BACKEND_VM": 1})
    )
    store.create_project("root/b", "root", Quota())


def test_open_store_picks_the_implementation(database: str, store: IamStore) -> None:
    kind = "Sqlite" if database.startswith("sqlite:") else "Postgres"
    assert type(store).__name__ == f"{kind}IamStore"
    with pytest.raises(ValueError):
        open_store("mysql://nope")


def test_projects(store: IamStore) -> None:
    assert store.is_empty()
    tree(store)
    assert not store.is_empty()
    with pytest.raises(AlreadyExists):
        store.create_project("root/a", "root", Quota())
    with pytest.raises(NotFound):
        store.create_project("root/zz/q", "root/zz", Quota())
    a = store.get_project("root/a")
    assert a is not None and a.parent_id == "root" and a.quota.sandboxes == 10
    assert store.get_project("root/nope") is None
    assert [p.project_id for p in store.list_projects("root", False)] == ["root/a", "root/b"]
    assert [p.project_id for p in store.list_projects("root", True)] == [
        "root/a",
        "root/a/x",
        "root/b",
    ]
    x = store.set_quota("root/a/x", Quota(sandboxes=3))
    assert x.quota == Quota(sandboxes=3)
    with pytest.raises(NotFound):
        store.set_quota("root/missing", Quota())
    with pytest.raises(FailedPrecondition):
        store.delete_project("root/a")  # has a subproject
    store.reserve(res("sb-e1-000001", "root/b"))
    with pytest.raises(FailedPrecondition):
        store.delete_project("root/b")  # has a sandbox
    store.release(["sb-e1-000001"])
    store.delete_project("root/b")
    assert store.get_project("root/b") is None
    with pytest.raises(NotFound):
        store.delete_project("root/b")


def test_tokens(store: IamStore) -> None:
    tree(store)
    now = time.time()
    store.add_token(TokenRecord("t1", "alice", "root/a", 1, 1, "h1", now, None, False))
    store.add_token(TokenRecord("t2", "agent", "root/a", 2, 2, "h2", now + 1, now + 60, False))
    t2 = store.get_token("t2")
    assert t2 is not None and t2.expires_at == pytest.approx(now + 60) and t2.kind == 2
    assert store.get_token("nope") is None
    store.revoke_token("t1")
    with pytest.raises(NotFound):
        store.revoke_token("nope")
    assert [t.token_id for t in store.list_tokens("root/a", False)] == ["t2"]
    assert [t.token_id for t in store.list_tokens("root/a", True)] == ["t1", "t2"]
    assert store.get_token("t1").revoked  # type: ignore[union-attr]


def test_reserve_release_and_usage_of_every_ancestor(store: IamStore) -> None:
    tree(store)
    assert store.reserve(res("sb-e1-000001", "root/a/x", cpu=1000, mem=64))
    assert not store.reserve(res("sb-e1-000001", "root/a/x", cpu=1000, mem=64))  # a retry
    assert store.reserve(res("sb-e2-000002", "root/a/x", backend="BACKEND_VM", edge="e2"))
    for pid in ("root/a/x", "root/a", "root"):
        u = store.get_project(pid).usage  # type: ignore[union-attr]
        assert (u.sandboxes, u.cpu_millis, u.memory_mb) == (2, 1100, 74)
        assert u.sandboxes_by_backend == {C: 1, "BACKEND_VM": 1}
    with pytest.raises(QuotaExceeded) as info:  # the per-backend limit of root/a/x
        store.reserve(res("sb-e1-000003", "root/a/x", backend="BACKEND_VM"))
    assert info.value.metadata["project"] == "root/a/x"
    assert info.value.metadata["dimension"] == "sandboxes[BACKEND_VM]"
    with pytest.raises(QuotaExceeded) as info:  # cpu of root/a
        store.reserve(res("sb-e1-000004", "root/a", cpu=4000))
    assert info.value.metadata["project"] == "root/a"
    assert store.reserved_edges() == {"e1": 1, "e2": 1}
    assert store.reservations_of_edge("e1", time.time() + 1) == ["sb-e1-000001"]
    assert store.reservations_of_edge("e1", time.time() - 60) == []
    assert store.release(["sb-e1-000001", "sb-e2-000002", "sb-e1-000001", "nope"]) == 2
    assert store.release(["sb-e1-000001"]) == 0
    for pid in ("root/a/x", "root/a", "root"):
        u = store.get_project(pid).usage  # type: ignore[union-attr]
        assert (u.sandboxes, u.cpu_millis, u.memory_mb, u.sandboxes_by_backend) == (0, 0, 0, {})
    assert store.reserved_edges() == {}


def test_reserve_many_decides_in_order_with_per_item_outcomes(store: IamStore) -> None:
    tree(store)
    store.reserve(res("sb-e1-old001", "root/a/x"))
    items = [res(f"sb-e1-{i:06d}", "root/a/x") for i in range(6)]
    items.insert(2, res("sb-e1-old001", "root/a/x"))  # already held
    items.append(res("sb-e1-b00001", "root/b"))
    items.append(res("sb-e1-q00001", "root/missing"))
    out = store.reserve_many(items)
    assert [o.reserved for o in out] == [True, True, False, True, False, False, False, True, False]
    assert out[2].already_reserved and out[2].error is None
    assert all(isinstance(o.error, QuotaExceeded) for o in out[4:7])
    assert out[4].error.metadata["project"] == "root/a/x"  # type: ignore[union-attr]
    assert isinstance(out[8].error, NotFound)
    assert store.get_project("root/a/x").usage.sandboxes == 4  # type: ignore[union-attr]
    assert store.get_project("root").usage.sandboxes == 5  # type: ignore[union-attr]
    assert store.reserve_many([]) == []


def test_idempotency_keys_are_durable_and_per_project(database: str, store: IamStore) -> None:
    tree(store)
    first = store.reserve_many([res("sb-e1-k00001", "root/a", idempotency_key="k")])[0]
    assert first.reserved
    # A retry through another instance (a new store on the same database) sees the key.
    other = open_store(database) if not database.startswith("sqlite:") else store
    try:
        again = other.reserve_many([res("sb-e2-k00002", "root/a", idempotency_key="k")])[0]
        assert not again.reserved and again.existing_sandbox_id == "sb-e1-k00001"
        assert again.existing_reserved
        # Same key, another project: independent.
        assert other.reserve_many([res("sb-e2-k00003", "root/b", idempotency_key="k")])[0].reserved
        # Two items of one batch with one key: the second gets the first's sandbox.
        pair = other.reserve_many(
            [
                res("sb-e1-p00001", "root/a", idempotency_key="p"),
                res("sb-e1-p00002", "root/a", idempotency_key="p"),
            ]
        )
        assert pair[0].reserved and pair[1].existing_sandbox_id == "sb-e1-p00001"
    finally:
        if other is not store:
            other.close()
    # The sandbox ended normally: the key still points at it (no second create), not reserved.
    store.release(["sb-e1-k00001"])
    after = store.reserve_many([res("sb-e3-k00004", "root/a", idempotency_key="k")])[0]
    assert after.existing_sandbox_id == "sb-e1-k00001" and not after.existing_reserved
    # Never created (the edge refused): the key is forgotten, a retry creates.
    store.release(["sb-e1-p00001"], not_created=True)
    assert store.reserve_many([res("sb-e1-p00003", "root/a", idempotency_key="p")])[0].reserved
    # An attempt with an unknown outcome is replaced: the key moves to the new sandbox.
    moved = store.reserve_many(
        [
            res(
                "sb-e2-p00004",
                "root/a",
                idempotency_key="p",
                replaces_sandbox_id="sb-e1-p00003",
            )
        ]
    )[0]
    assert moved.reserved
    assert (
        store.reserve_many([res("sb-e9-p00005", "root/a", idempotency_key="p")])[
            0
        ].existing_sandbox_id
        == "sb-e2-p00004"
    )
    # Keys expire after their lifetime.
    assert store.purge_expired_keys(time.time() + KEY_TTL_S + 1) >= 3
    assert store.reserve_many([res("sb-e1-k00005", "root/a", idempotency_key="k")])[0].reserved


def _race(stores: list[IamStore], threads: int, per_thread: int, batch: int) -> list[str]:
    """Threads reserve (single or batched) in 4 sibling projects and release some; returns held ids."""
    held: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        s = stores[t % len(stores)]
        mine: list[str] = []
        try:
            for j in range(0, per_thread, batch):
                items = [
                    res(f"sb-e{t % 3}-{t:03d}{k:05d}", f"root/team/s{(t + k) % 4}", cpu=500, mem=64)
                    for k in range(j, min(j + batch, per_thread))
                ]
                if batch == 1:
                    try:
                        if s.reserve(items[0]):
                            mine.append(items[0].sandbox_id)
                    except QuotaExceeded:
                        pass
                else:
                    for item, o in zip(items, s.reserve_many(items), strict=True):
                        if o.reserved:
                            mine.append(item.sandbox_id)
                        else:
                            assert isinstance(o.error, QuotaExceeded)
                if mine and rng.random() < 0.3:
                    gone = mine.pop(rng.randrange(len(mine)))
                    assert s.release([gone]) == 1
        except BaseException as exc:
            errors.append(exc)
        with lock:
            held.extend(mine)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    return held


@pytest.mark.parametrize("batch", [1, 7])
def test_quota_is_exact_under_concurrency(database: str, store: IamStore, batch: int) -> None:
    """24 threads (on PostgreSQL: over 3 store instances, i.e. 3 IAM processes) race
    to reserve and release in sibling subprojects; every ancestor ends exactly at
    the number of reservations held and never above its limit."""
    store.create_project("root", "", Quota())
    store.create_project("root/team", "root", Quota(sandboxes=50, cpu_millis=100_000))
    for i in range(4):
        store.create_project(f"root/team/s{i}", "root/team", Quota(sandboxes=16))
    stores = [store]
    if not database.startswith("sqlite:"):
        stores += [open_store(database) for _ in range(2)]
    try:
        held = _race(stores, threads=24, per_thread=21, batch=batch)
    finally:
        for s in stores[1:]:
            s.close()
    team = store.get_project("root/team")
    assert team is not None
    assert 0 < team.usage.sandboxes == len(held) <= 50
    assert team.usage.cpu_millis == 500 * len(held)
    # Fill up: exactly the room left is granted, then the limit binds.
    fill = [res(f"sb-e1-fill{k:04d}", f"root/team/s{k % 4}") for k in range(64)]
    granted = [
        r.sandbox_id for r, o in zip(fill, store.reserve_many(fill), strict=True) if o.reserved
    ]
    assert len(granted) == 50 - len(held)  # siblings have 64 - held >= 50 - held room
    held += granted
    assert store.get_project("root/team").usage.sandboxes == 50  # type: ignore[union-attr]
    per = [store.get_project(f"root/team/s{i}").usage.sandboxes for i in range(4)]  # type: ignore[union-attr]
    assert sum(per) == 50 and max(per) <= 16
    assert store.get_project("root").usage.sandboxes == 50  # type: ignore[union-attr]
    assert store.release(held) == 50
    assert store.get_project("root").usage.sandboxes == 0  # type: ignore[union-attr]


def test_sqlite_store_is_the_default_kind(tmp_path: Path) -> None:
    s = open_store(f"sqlite:{tmp_path / 'x.db'}")
    assert isinstance(s, SqliteIamStore)
    s.close()


def test_a_sqlite_database_of_the_older_schema_is_migrated(tmp_path: Path) -> None:
    # Made by the store before reservations kept their key (and keys had an index by sandbox).
    path = tmp_path / "old.db"
    s = SqliteIamStore(path)
    tree(s)
    s.close()
    db = sqlite3.connect(path)
    db.executescript(
        "ALTER TABLE reservations DROP COLUMN idempotency_key;"
        "CREATE INDEX idempotency_keys_sandbox ON idempotency_keys(sandbox_id);"
        "INSERT INTO reservations VALUES ('sb-e1-old001', 'root/a', 'BACKEND_CONTAINER',"
        " 100, 10, 'e1', 0);"
        "INSERT INTO idempotency_keys VALUES ('root/a', 'old', 'sb-e1-old001', 1e12);"
    )
    db.commit()
    db.close()
    s = SqliteIamStore(path)
    try:
        assert s.reserve_many([res("sb-e1-new001", "root/a", idempotency_key="new")])[0].reserved
        again = s.reserve_many([res("sb-e2-new002", "root/a", idempotency_key="old")])[0]
        assert again.existing_sandbox_id == "sb-e1-old001" and again.existing_reserved
        # A new reservation's key is forgotten when it was never created; an old one's stays
        # bound (a retry finds no such sandbox and takes it over, with replaces_sandbox_id).
        assert s.release(["sb-e1-new001", "sb-e1-old001"], not_created=True) == 2
        assert s.reserve_many([res("sb-e1-new003", "root/a", idempotency_key="new")])[0].reserved
        stale = s.reserve_many([res("sb-e1-old002", "root/a", idempotency_key="old")])[0]
        assert stale.existing_sandbox_id == "sb-e1-old001" and not stale.existing_reserved
        took = s.reserve_many(
            [
                res(
                    "sb-e1-old002",
                    "root/a",
                    idempotency_key="old",
                    replaces_sandbox_id="sb-e1-old001",
                )
            ]
        )[0]
        assert took.reserved
    finally:
        s.close()
    db = sqlite3.connect(path)
    indexes = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    db.close()
    assert "idempotency_keys_sandbox" not in indexes


def test_the_create_queue_keeps_one_entry_per_key_and_its_first_end(store: IamStore) -> None:
    """The queue's storage (both kinds): arrival order, one waiting-or-placed entry per
    (project, key), a change applied only to a waiting entry (the first end wins), the
    subtree filter, the purge of ended entries, and a lease held by one holder at a time."""

    def row(qid: str, project: str = "root/a", key: str = "") -> QueueRow:
        return QueueRow(qid, project, key, QUEUE_WAITING, 0, qid.encode())

    added = store.queue_add([row("q1", key="k"), row("q2"), row("q3", "root/b", key="k")])
    assert [r.queue_id for r in added] == ["q1", "q2", "q3"]
    assert added[0].seq < added[1].seq < added[2].seq
    # The same key in the same project answers the waiting entry; another project's is its own.
    again = store.queue_add([row("q4", key="k")])
    assert [r.queue_id for r in again] == ["q1"] and again[0].body == b"q1"
    assert [r.queue_id for r in store.queue_list("root/a", True)] == ["q1", "q2"]
    assert {r.queue_id for r in store.queue_list("", True)} == {"q1", "q2", "q3"}
    # A queue id is used once: a second add under it is refused, typed, and adds nothing
    # (the whole batch rolls back).
    with pytest.raises(AlreadyExists) as dup:
        store.queue_add([row("q9"), row("q2", "root/b")])
    assert dup.value.reason == "QUEUE_ID_EXISTS"
    assert store.queue_get(["q9"]) == []

    def end(state: int) -> QueueChange:
        """As IAM's servicer changes an entry: only while it waits (it sees the row as it is
        inside the transaction)."""
        return lambda r: (
            QueueRow(r.queue_id, r.project_id, r.key, state, r.seq, b"x", 100.0)
            if r.state == QUEUE_WAITING
            else None
        )

    (placed,) = store.queue_update(["q1"], end(QUEUE_PLACED))
    assert placed.state == QUEUE_PLACED
    (kept,) = store.queue_update(["q1"], end(4))  # a cancel after the placement: no change
    assert kept.state == QUEUE_PLACED
    # Placed still holds the key: a retry with it finds the placed entry.
    assert [r.queue_id for r in store.queue_add([row("q5", key="k")])] == ["q1"]
    assert [r.queue_id for r in store.queue_list("root/a", True)] == ["q2"]
    assert store.queue_purge(ended_before=200.0) == 1
    assert store.queue_get(["q1", "q2"])[0].queue_id == "q2"
    # A lease: one holder until it lapses.
    assert store.lease("create-queue", "a", 3.0, now=1000.0) == (True, "a")
    assert store.lease("create-queue", "b", 3.0, now=1001.0) == (False, "a")
    assert store.lease("create-queue", "a", 3.0, now=1002.0) == (True, "a")  # renewed
    assert store.lease("create-queue", "b", 3.0, now=1006.0) == (True, "b")  # lapsed

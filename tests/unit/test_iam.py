from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from iam.domain import ACTION_MANAGE_PROJECTS, ROLE_ADMIN, ROLE_MEMBER, Iam, Principal
from iam.store import Quota, Reservation
from iam.store_sqlite import SqliteIamStore
from libdsec.errors import NotFound, PermissionDenied, QuotaExceeded, Unauthenticated


@pytest.fixture
async def iam(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = SqliteIamStore(tmp_path / "iam.db")
    domain = Iam(store)
    token = await domain.bootstrap(tmp_path / "token")
    assert token is not None
    yield domain, await domain.authenticate(token)
    store.close()


async def test_bootstrap_writes_a_private_admin_token_once(tmp_path: Path) -> None:
    store = SqliteIamStore(tmp_path / "iam.db")
    iam = Iam(store)
    token = await iam.bootstrap(tmp_path / "token")
    assert (tmp_path / "token").read_text().strip() == token
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o600
    assert await iam.bootstrap(tmp_path / "token") is None
    who = await iam.authenticate(token or "")
    assert who.project_id == "root" and who.role == ROLE_ADMIN
    row = store._db.execute("SELECT secret_hash FROM tokens").fetchone()[0]
    assert (token or "").split("_")[2] not in row  # stored hashed
    store.close()


async def test_tokens_expire_and_revoke(iam) -> None:  # type: ignore[no-untyped-def]
    domain, admin = iam
    token, rec = await domain.create_token(admin, "", "short", 2, ROLE_MEMBER, ttl_s=1)
    assert (await domain.authenticate(token)).name == "short"
    await asyncio.sleep(1.1)
    with pytest.raises(Unauthenticated) as info:
        await domain.authenticate(token)
    assert info.value.reason == "TOKEN_EXPIRED"
    token, rec = await domain.create_token(admin, "", "long", 1, ROLE_MEMBER, ttl_s=0)
    await domain.revoke_token(admin, rec.token_id)
    with pytest.raises(Unauthenticated, match="revoked"):
        await domain.authenticate(token)
    with pytest.raises(Unauthenticated):
        await domain.authenticate(token[:-2] + "xx")


async def test_an_e2b_shaped_token_is_an_ordinary_token(iam) -> None:  # type: ignore[no-untyped-def]
    import re

    domain, admin = iam
    token, rec = await domain.create_token(admin, "", "e2b", 1, ROLE_MEMBER, 0, e2b=True)
    # The shape E2B's SDKs check before sending a key (e2b/api/__init__.py, _API_KEY_PATTERN).
    assert re.fullmatch(r"e2b_[0-9a-f]+", token) and len(token) == 4 + 80
    who = await domain.authenticate(token)
    assert (who.name, who.project_id, who.role) == ("e2b", admin.project_id, ROLE_MEMBER)
    for bad in (token[:-1], token + "0", token[:-1] + "g", token.upper(), "e2b_"):
        with pytest.raises(Unauthenticated) as info:
            await domain.authenticate(bad)
        assert info.value.reason in ("BAD_TOKEN", "TOKEN_NOT_FOUND", "BAD_SECRET"), bad
    await domain.revoke_token(admin, rec.token_id)
    with pytest.raises(Unauthenticated, match="revoked"):
        await domain.authenticate(token)


async def test_subprojects_cannot_act_on_parents_or_siblings(iam) -> None:  # type: ignore[no-untyped-def]
    domain, admin = iam
    a = await domain.create_project(admin, "", "a", Quota(sandboxes=10))
    await domain.create_project(admin, "", "b", Quota())
    token, _ = await domain.create_token(admin, a.project_id, "a-admin", 1, ROLE_ADMIN, 0)
    a_admin = await domain.authenticate(token)
    await domain.create_project(a_admin, "", "child", Quota(sandboxes=5))
    with pytest.raises(NotFound):
        await domain.create_project(a_admin, "root", "x", Quota())
    with pytest.raises(NotFound):
        await domain.get_project(a_admin, "root/b")
    with pytest.raises(PermissionDenied, match="own project's quota"):
        await domain.set_quota(a_admin, "root/a", Quota(sandboxes=100))
    with pytest.raises(PermissionDenied) as info:
        await domain.set_quota(a_admin, "root/a/child", Quota(sandboxes=11))
    assert info.value.reason == "QUOTA_GRANT_EXCEEDS_HELD"
    member = Principal("m", "m", 1, ROLE_MEMBER, "root/a", None)
    assert domain.authorize(member, ACTION_MANAGE_PROJECTS, "root/a") == (
        False,
        "needs the ADMIN role",
    )


def test_quota_is_exact_under_concurrency(tmp_path: Path) -> None:
    """32 threads race to reserve in sibling subprojects; no ancestor ever exceeds its quota."""
    store = SqliteIamStore(tmp_path / "iam.db")
    store.create_project("root", "", Quota())
    store.create_project("root/team", "root", Quota(sandboxes=50, cpu_millis=100_000))
    for i in range(4):
        store.create_project(f"root/team/s{i}", "root/team", Quota(sandboxes=20))
    won: list[str] = []
    refused: list[str] = []
    lock = threading.Lock()

    def worker(t: int) -> None:
        for j in range(10):
            sid = f"sb-e-{t:02d}{j:04d}aa"
            try:
                store.reserve(
                    Reservation(sid, f"root/team/s{t % 4}", "BACKEND_CONTAINER", 500, 64, "e")
                )
                with lock:
                    won.append(sid)
            except QuotaExceeded as err:
                with lock:
                    refused.append(err.metadata["project"])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 50 and len(won) + len(refused) == 320
    team = store.get_project("root/team")
    assert team is not None and team.usage.sandboxes == 50 and team.usage.cpu_millis == 50 * 500
    assert sum(store.get_project(f"root/team/s{i}").usage.sandboxes for i in range(4)) == 50  # type: ignore[union-attr]
    assert all(store.get_project(f"root/team/s{i}").usage.sandboxes <= 20 for i in range(4))  # type: ignore[union-attr]
    assert store.release(won) == 50 and store.release(won) == 0
    team = store.get_project("root/team")
    assert team is not None and team.usage.sandboxes == 0 and team.usage.cpu_millis == 0
    store.close()


async def test_reconcile_releases_what_an_edge_no_longer_reports(iam) -> None:  # type: ignore[no-untyped-def]
    domain, _ = iam
    for sid in ("sb-e1-aaaaaa01", "sb-e1-aaaaaa02", "sb-e2-aaaaaa03"):
        await domain.reserve(
            Reservation(sid, "root", "BACKEND_CONTAINER", 100, 10, sid.split("-")[1])
        )
    import time

    assert await domain.reconcile("e1", {"sb-e1-aaaaaa01"}, time.time() + 1) == 1
    usage = domain.store.get_project("root").usage
    assert usage.sandboxes == 2

"""E2B snapshots, filesystem-only pause and autoResume=false through the stock e2b SDK
(compat/e2b/snapshots.py, the container backend's cold pause, SandboxSpec.manual_resume)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, Sandbox, SandboxState
from e2b.exceptions import SandboxException

from libdsec import Client
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith
from tests.integration.e2b_support import E2bTarget, e2b_cluster, e2b_environment, sandbox_maker

pytestmark = pytest.mark.images("e2b-base")


@pytest.fixture(scope="module")
def target(cluster_with: ClusterWith) -> Iterator[E2bTarget]:
    with e2b_cluster(cluster_with, "e2b-snap") as t, e2b_environment(t):
        yield t


@pytest.fixture(scope="module")
def container_cluster(target: E2bTarget):  # type: ignore[no-untyped-def]
    return target.cluster


@pytest.fixture
def admin(target: E2bTarget) -> Iterator[Client]:
    with Client(target.cluster.apiserver, token=target.cluster.token) as c:
        yield c


@pytest.fixture
def make(
    target: E2bTarget, container_cluster: object, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Sandbox]]:
    with sandbox_maker(request) as make:
        yield make


def test_snapshot_create_list_filter_delete_and_create_from(
    target: E2bTarget, make: Callable[..., Sandbox]
) -> None:
    src = make()
    src.files.write("/home/user/note.txt", "from the source")
    name = f"snap-{uuid.uuid4().hex[:8]}"
    named = src.create_snapshot(name=name)
    anon = Sandbox.create_snapshot(src.sandbox_id)
    try:
        assert named.snapshot_id == f"{name}:default" and named.names == [named.snapshot_id]
        assert anon.snapshot_id.startswith("snap-") and anon.snapshot_id != named.snapshot_id
        listed = {s.snapshot_id for s in Sandbox.list_snapshots().next_items()}
        assert {named.snapshot_id, anon.snapshot_id} <= listed
        by_sandbox = Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()
        assert {s.snapshot_id for s in by_sandbox} == {named.snapshot_id, anon.snapshot_id}
        assert Sandbox.list_snapshots(sandbox_id="sb-nope-000000").next_items() == []
        by_name = Sandbox.list_snapshots(name=name).next_items()
        assert [s.snapshot_id for s in by_name] == [named.snapshot_id]
        assert Sandbox.list_snapshots(name=f"{name}-missing").next_items() == []
        # pagination: one per page, the token leads to the other one
        page = Sandbox.list_snapshots(sandbox_id=src.sandbox_id, limit=1)
        first = page.next_items()
        assert len(first) == 1 and page.has_next
        second = page.next_items()
        assert len(second) == 1 and {first[0].snapshot_id, second[0].snapshot_id} == {
            named.snapshot_id,
            anon.snapshot_id,
        }

        # A sandbox from it has the files (and the source template's user), its own afterwards.
        child = make(named.snapshot_id)
        assert child.files.read("/home/user/note.txt") == "from the source"
        assert child.commands.run("whoami").stdout.strip() == "user"
        child.files.write("/home/user/note.txt", "changed")
        assert src.files.read("/home/user/note.txt") == "from the source"

        # Deleting it: the sandbox running from it keeps its files; a second delete is False.
        assert Sandbox.delete_snapshot(named.snapshot_id) is True
        assert Sandbox.delete_snapshot(named.snapshot_id) is False
        assert child.files.read("/home/user/note.txt") == "changed"
        assert child.commands.run("cat /home/user/note.txt").stdout == "changed"
        with pytest.raises(SandboxException):
            make(named.snapshot_id)  # gone: a create from it is a missing template
    finally:
        Sandbox.delete_snapshot(named.snapshot_id)
        Sandbox.delete_snapshot(anon.snapshot_id)


def test_snapshot_kind_header_and_other_projects_get_404(
    target: E2bTarget, make: Callable[..., Sandbox], admin: Client
) -> None:
    src = make()
    with httpx.Client(base_url=target.url, timeout=60) as http:
        r = http.post(
            f"/sandboxes/{src.sandbox_id}/snapshots", json={}, headers={"X-API-Key": target.key}
        )
        assert r.status_code == 201, r.text
        assert r.headers["X-Dsec-Snapshot-Kind"] == "files"
        snap = r.json()["snapshotID"]
        bad = http.post(
            f"/sandboxes/{src.sandbox_id}/snapshots",
            json={"name": "Not Valid"},
            headers={"X-API-Key": target.key},
        )
        assert bad.status_code == 400 and "Not Valid" in bad.json()["message"]
        try:
            project = admin.create_project(f"snap-other-{uuid.uuid4().hex[:6]}")
            other = admin.create_token("other", project=project.project_id, e2b=True).secret
            theirs = {"X-API-Key": other}
            assert http.get("/snapshots", headers=theirs).json() == []
            r = http.post("/v2/sandboxes", json={"templateID": snap}, headers=theirs)
            assert r.status_code == 404, r.text
            assert http.delete(f"/templates/{snap}", headers=theirs).status_code == 404
            # dsec's own API: the environment is not theirs to see either
            with Client(target.cluster.apiserver, token=other) as c:
                envs = c.list_environments(prefix="snapshots/")
                assert envs == []
        finally:
            assert (
                http.delete(f"/templates/{snap}", headers={"X-API-Key": target.key}).status_code
                == 204
            )


def test_filesystem_only_pause_keeps_files_stops_processes_frees_memory(
    make: Callable[..., Sandbox], admin: Client
) -> None:
    sb = make()
    sb.files.write("/home/user/kept.txt", "kept")
    sb.commands.run("sleep 600", background=True)
    assert sb.pause(keep_memory=False)
    assert not sb.is_running()
    info = admin.get(sb.sandbox_id).info
    assert info.state == "PAUSED" and info.paused_files_only
    assert info.memory is not None and info.memory.resident_bytes == 0
    assert info.memory.released_mb == 512  # all of it
    sb.connect()
    assert sb.get_info().state == SandboxState.RUNNING
    assert sb.files.read("/home/user/kept.txt") == "kept"
    # a fresh boot: the sleep is gone, the same id and token answer
    assert sb.commands.run("pgrep -x sleep || echo none").stdout.strip() == "none"
    assert not admin.get(sb.sandbox_id).info.paused_files_only


def test_auto_pause_files_only_and_without_auto_resume(
    make: Callable[..., Sandbox], admin: Client
) -> None:
    cold = make(timeout=2, lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
    manual = make(timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": False})
    cold.files.write("/home/user/m.txt", "cold")
    wait_for(lambda: admin.get(cold.sandbox_id).info.state == "PAUSED", timeout_s=20)
    wait_for(lambda: admin.get(manual.sandbox_id).info.state == "PAUSED", timeout_s=20)
    assert admin.get(cold.sandbox_id).info.paused_files_only
    assert not admin.get(manual.sandbox_id).info.paused_files_only
    # A call into either does not wake it: a clear error, and it stays paused.
    for sb in (cold, manual):
        with pytest.raises(SandboxException) as err:
            sb.files.read("/etc/hostname")
        assert "paused" in str(err.value)
        assert admin.get(sb.sandbox_id).info.state == "PAUSED"
    for sb in (cold, manual):
        sb.connect()
        assert sb.get_info().state == SandboxState.RUNNING and sb.is_running()
    assert cold.files.read("/home/user/m.txt") == "cold"


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def test_boot_id_is_per_boot_kept_by_a_memory_pause_renewed_by_a_files_only_one(
    make: Callable[..., Sandbox],
) -> None:
    """A sandbox's kernel boot id is its own (not the host's, not another sandbox's), the same
    after a memory pause and resume, new after a files-only pause (a cold boot); root in the
    sandbox cannot change it."""
    sb, other = make(), make()
    first = sb.files.read(BOOT_ID)
    assert re.fullmatch(
        r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}\n", first
    )
    assert other.files.read(BOOT_ID) not in (first, Path(BOOT_ID).read_text())
    with pytest.raises(CommandExitException):
        sb.commands.run(f"echo 00000000-0000-4000-8000-000000000000 > {BOOT_ID}", user="root")
    with pytest.raises(CommandExitException):
        sb.commands.run(f"umount {BOOT_ID}", user="root")
    assert sb.pause()
    sb.connect()
    assert sb.files.read(BOOT_ID) == first
    assert sb.pause(keep_memory=False)
    sb.connect()
    rebooted = sb.files.read(BOOT_ID)
    assert rebooted != first and re.fullmatch(r"[0-9a-f-]{36}\n", rebooted)

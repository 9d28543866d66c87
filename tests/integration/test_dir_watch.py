"""Directory watchers end to end: SDK -> apiserver -> edge -> aether -> chronus (inotify) in a
real container sandbox. Polled watchers (E2B's sync SDK), the WatchDir stream (its async
SDK), bounds, typed errors, and a stream that ends with the sandbox's reason."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from dsecctl.cluster import LocalCluster
from libdsec import AsyncClient, Client, FileEvent, Sandbox
from libdsec.errors import (
    InvalidArgument,
    NotFound,
    PathNotFound,
    ResourceExhausted,
    SandboxTerminated,
)
from tests.helpers import wait_for

pytestmark = pytest.mark.images("busybox")


@pytest.fixture
def sandbox_defaults() -> dict[str, Any]:
    return {"memory_mb": 128, "grace_s": 0.5}


def poll_until(sb: Sandbox, watcher_id: str, want: set[FileEvent]) -> list[FileEvent]:
    seen: list[FileEvent] = []

    def all_seen() -> bool:
        seen.extend(sb.files.watcher_events(watcher_id))
        return want <= set(seen)

    wait_for(all_seen, timeout_s=10)
    return seen


def test_polled_watcher_reports_changes_recursively(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    sb.run("mkdir -p /work/w/old")
    wid = sb.files.create_watcher("/work/w", recursive=True)
    assert isinstance(wid, str) and wid
    sb.files.write("/work/w/a.txt", "x")
    sb.run(
        "echo more >> /work/w/a.txt; chmod 600 /work/w/a.txt; mv /work/w/a.txt /work/w/b.txt;"
        " rm /work/w/b.txt; echo y > /work/w/old/o.txt; mkdir -p /work/w/new/deep;"
        " echo z > /work/w/new/deep/n.txt"
    )
    seen = poll_until(
        sb,
        wid,
        {
            FileEvent("a.txt", "create"),
            FileEvent("a.txt", "write"),
            FileEvent("a.txt", "chmod"),
            FileEvent("a.txt", "rename"),
            FileEvent("b.txt", "create"),
            FileEvent("b.txt", "remove"),
            FileEvent("old/o.txt", "create"),
            FileEvent("new", "create"),
            FileEvent("new/deep/n.txt", "create"),
        },
    )
    assert seen.index(FileEvent("a.txt", "create")) < seen.index(FileEvent("b.txt", "remove"))
    assert sb.files.watcher_events(wid) == []  # drained
    sb.files.remove_watcher(wid)
    with pytest.raises(NotFound) as exc:
        sb.files.watcher_events(wid)
    assert exc.value.reason == "WATCHER_NOT_FOUND"
    with pytest.raises(NotFound) as exc:
        sb.files.remove_watcher(wid)
    assert exc.value.reason == "WATCHER_NOT_FOUND"


def test_bad_watchers_get_precise_errors(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    sb.files.write("/work/file", "x")
    with pytest.raises(PathNotFound) as missing:
        sb.files.create_watcher("/work/missing")
    assert missing.value.reason == "PATH_NOT_FOUND"
    with pytest.raises(InvalidArgument) as not_dir:
        sb.files.create_watcher("/work/file")
    assert not_dir.value.reason == "NOT_A_DIRECTORY"
    with pytest.raises(PathNotFound):
        sb.files.watch("/work/missing")
    ids = [sb.files.create_watcher("/work") for _ in range(64)]
    with pytest.raises(ResourceExhausted) as full:
        sb.files.create_watcher("/work")
    assert full.value.reason == "TOO_MANY_WATCHERS"
    sb.files.remove_watcher(ids.pop())
    ids.append(sb.files.create_watcher("/work"))  # room for one again
    for wid in ids:
        sb.files.remove_watcher(wid)


def test_watch_streams_events_and_closing_removes_the_watch(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox()
    with sb.files.watch("/work") as changes:
        sb.files.write("/work/s.txt", "x")  # established on return: this is reported
        got = [next(changes) for _ in range(3)]
        sb.files.write("/work/s.txt", "y")  # over the file: a write, not a create
        got += [next(changes) for _ in range(2)]
    # A write (atomic: a temporary renamed into place) is reported as E2B's envd reports its
    # in-place write: create, chmod, write for a new file; chmod, write for one that was there.
    assert got == [
        FileEvent("s.txt", "create"),
        FileEvent("s.txt", "chmod"),
        FileEvent("s.txt", "write"),
        FileEvent("s.txt", "chmod"),
        FileEvent("s.txt", "write"),
    ]
    # Each closed watch released its watcher inside the sandbox: 64 polled ones fit after
    # 64 watches were opened and closed.
    for _ in range(64):
        sb.files.watch("/work").close()

    def all_fit() -> list[str] | None:
        ids: list[str] = []
        try:
            for _ in range(64):
                ids.append(sb.files.create_watcher("/work"))
            return ids
        except ResourceExhausted:
            return None
        finally:
            if len(ids) < 64:
                for wid in ids:
                    sb.files.remove_watcher(wid)

    ids = wait_for(all_fit, timeout_s=10)
    for wid in ids:
        sb.files.remove_watcher(wid)


def test_async_watch_is_established_when_returned(
    container_cluster: LocalCluster, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb_id = make_sandbox().id

    async def main() -> list[FileEvent]:
        async with AsyncClient(container_cluster.apiserver, token=container_cluster.token) as c:
            sb = await c.get(sb_id)
            await sb.files.mkdir("/work/a")
            w = await sb.files.watch("/work", recursive=True)
            await sb.run("echo 1 > /work/a/one; echo 2 > /work/two")
            got: list[FileEvent] = []
            async for ev in w:
                got.append(ev)
                if {FileEvent("a/one", "create"), FileEvent("two", "create")} <= set(got):
                    break
            await w.aclose()
            assert [ev async for ev in w] == []  # closed: the iteration ends
            return got

    got = asyncio.run(asyncio.wait_for(main(), 30))
    assert FileEvent("a/one", "write") in got


def test_a_stopped_sandbox_ends_its_watch_with_the_reason(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox()
    changes = sb.files.watch("/work")
    threading.Timer(0.5, lambda: client.get(sb.id).stop(grace_s=0.2)).start()
    start = time.monotonic()
    with pytest.raises(SandboxTerminated) as ended:
        for _ in changes:
            pass
    assert time.monotonic() - start < 15
    assert ended.value.metadata.get("termination_reason") == "STOPPED"
    changes.close()

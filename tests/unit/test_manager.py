"""The edge's sandbox manager with the null backend: admission, TTL/idle, recovery."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edge.backends import NullBackend
from edge.manager import Capacity, SandboxManager
from edge.model import SandboxSpec
from libdsec.errors import (
    EdgeCapacity,
    FailedPrecondition,
    InvalidArgument,
    SandboxNotFound,
    SandboxTerminated,
)


class PersistentNull(NullBackend):
    """The null backend, but re-adoptable (to exercise recovery)."""

    persistent = True

    def __init__(self, alive: set[str] | None = None) -> None:
        super().__init__()
        self.alive = alive if alive is not None else set()
        self.cleaned: set[str] = set()

    async def adopt(self, rec):  # type: ignore[no-untyped-def]
        return rec.sandbox_id in self.alive

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        self.cleaned = keep
        return []


def manager(tmp_path: Path, backend: NullBackend | None = None, **cap: int) -> SandboxManager:
    c = Capacity(cap.get("cpu", 2000), cap.get("mem", 1024), cap.get("n", 10))
    return SandboxManager("e1", tmp_path, c, [backend or NullBackend()])


async def test_admission_against_local_capacity(tmp_path: Path) -> None:
    m = manager(tmp_path, cpu=2000, mem=1024, n=3)
    await m.create(
        "sb-e1-aaaaaa01", SandboxSpec(cpu_millis=1500, memory_mb=100), "root", "p", wait_ready=True
    )
    with pytest.raises(EdgeCapacity, match="cpu_millis 1500\\+1000 > 2000"):
        await m.create(
            "sb-e1-aaaaaa02",
            SandboxSpec(cpu_millis=1000, memory_mb=100),
            "root",
            "p",
            wait_ready=True,
        )
    await m.stop("sb-e1-aaaaaa01")
    rec, existed = await m.create(
        "sb-e1-aaaaaa02", SandboxSpec(cpu_millis=1000, memory_mb=100), "root", "p", wait_ready=True
    )
    assert rec.state == "RUNNING" and not existed
    assert (await m.create("sb-e1-aaaaaa02", SandboxSpec(), "root", "p", wait_ready=True))[
        1
    ] is True
    assert m.load().cpu_millis == 1000


async def test_bad_ids_and_backends(tmp_path: Path) -> None:
    m = manager(tmp_path)
    with pytest.raises(InvalidArgument, match="does not belong"):
        await m.create("sb-e2-aaaaaa01", SandboxSpec(), "root", "p", wait_ready=True)
    with pytest.raises(SandboxNotFound):
        m.get("sb-e1-ffffffff")


async def test_ttl_and_idle_are_enforced_locally(tmp_path: Path) -> None:
    m = manager(tmp_path, cpu=10_000, mem=10_000)
    await m.create("sb-e1-aaaaaa01", SandboxSpec(ttl_s=10), "root", "p", wait_ready=True)
    await m.create(
        "sb-e1-aaaaaa02", SandboxSpec(ttl_s=100, idle_timeout_s=5), "root", "p", wait_ready=True
    )
    await m.create(
        "sb-e1-aaaaaa03", SandboxSpec(ttl_s=100, idle_timeout_s=5), "root", "p", wait_ready=True
    )
    now = time.time()
    assert await m.reap_once(now + 1) == []
    await m.touch("sb-e1-aaaaaa03")
    m.records["sb-e1-aaaaaa03"].last_active_at = now + 4  # activity resets the idle timer
    assert sorted(await m.reap_once(now + 6)) == ["sb-e1-aaaaaa02"]
    assert m.get("sb-e1-aaaaaa02").termination_reason == "IDLE"
    assert await m.reap_once(now + 11) == ["sb-e1-aaaaaa01", "sb-e1-aaaaaa03"]
    assert m.get("sb-e1-aaaaaa01").termination_reason == "TTL"
    with pytest.raises(SandboxTerminated) as info:
        await m.touch("sb-e1-aaaaaa01")
    assert info.value.metadata["termination_reason"] == "TTL"
    assert m.load().sandboxes == 0 and m.load().cpu_millis == 0


async def test_pause_resume_and_transparent_resume(tmp_path: Path) -> None:
    m = manager(tmp_path)
    await m.create("sb-e1-aaaaaa01", SandboxSpec(), "root", "p", wait_ready=True)
    assert (await m.pause("sb-e1-aaaaaa01")).state == "PAUSED"
    assert (await m.touch("sb-e1-aaaaaa01")).state == "RUNNING"  # any request resumes
    await m.stop("sb-e1-aaaaaa01")
    with pytest.raises(FailedPrecondition):
        await m.pause("sb-e1-aaaaaa01")


async def test_events_are_published(tmp_path: Path) -> None:
    m = manager(tmp_path)
    q = m.subscribe()
    await m.create("sb-e1-aaaaaa01", SandboxSpec(), "root", "p", wait_ready=True)
    await m.stop("sb-e1-aaaaaa01")
    states = []
    while not q.empty():
        states.append((await q.get()).state)
    assert states[-1] == "TERMINATED" and "RUNNING" in states


async def test_recovery_readopts_live_sandboxes_and_fails_lost_ones(tmp_path: Path) -> None:
    m = manager(tmp_path, PersistentNull())
    for i in (1, 2):
        await m.create(f"sb-e1-aaaaaa0{i}", SandboxSpec(), "root", "p", wait_ready=True)
    backend = PersistentNull(alive={"sb-e1-aaaaaa01"})
    m2 = manager(tmp_path, backend)
    await m2.recover()
    assert m2.get("sb-e1-aaaaaa01").state == "RUNNING"
    lost = m2.get("sb-e1-aaaaaa02")
    assert lost.state == "TERMINATED" and lost.termination_reason == "RUNTIME_ERROR"
    assert backend.cleaned == {"sb-e1-aaaaaa01"}
    assert m2.load().sandboxes == 1

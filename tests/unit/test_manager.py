"""The edge's sandbox manager with the null backend: admission, TTL/idle, recovery."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from edge.backends import Capability, NullBackend
from edge.backends.contract import MemoryUsage, PauseOutcome
from edge.disk_guard import DiskGuard
from edge.manager import Capacity, SandboxManager
from edge.model import SandboxSpec
from libdsec.errors import (
    BackendCapabilityMissing,
    EdgeCapacity,
    FailedPrecondition,
    InvalidArgument,
    NodeDiskLow,
    NodeMemoryFull,
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


async def test_set_timeout_moves_the_deadline_both_ways_and_is_persisted(tmp_path: Path) -> None:
    m = manager(tmp_path, PersistentNull())
    await m.create("sb-e1-aaaaaa01", SandboxSpec(ttl_s=3600), "root", "p", wait_ready=True)
    await m.create("sb-e1-aaaaaa02", SandboxSpec(ttl_s=5), "root", "p", wait_ready=True)
    now = time.time()
    assert (await m.set_timeout("sb-e1-aaaaaa01", 2)).expires_at == pytest.approx(now + 2, abs=1)
    await m.set_timeout("sb-e1-aaaaaa02", 100)
    # The record on disk carries the new deadline: a restarted edge enforces it.
    m2 = manager(tmp_path, PersistentNull(alive={"sb-e1-aaaaaa01", "sb-e1-aaaaaa02"}))
    await m2.recover()
    assert m2.get("sb-e1-aaaaaa01").expires_at == m.get("sb-e1-aaaaaa01").expires_at
    assert await m2.reap_once(now + 10) == ["sb-e1-aaaaaa01"]  # shortened; the other extended
    assert m2.get("sb-e1-aaaaaa01").termination_reason == "TTL"
    for bad in (0.0, -3.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument) as exc:
            await m2.set_timeout("sb-e1-aaaaaa02", bad)
        assert exc.value.metadata["field"] == "timeout_s"
    with pytest.raises(SandboxTerminated):
        await m2.set_timeout("sb-e1-aaaaaa01", 10)
    with pytest.raises(SandboxNotFound):
        await m2.set_timeout("sb-e1-nothere1", 10)


class PausableNull(NullBackend):
    """The null backend with the pause capability declared and its calls recorded."""

    capabilities = frozenset({Capability.PAUSE})

    def __init__(self, resident_after_mb: int = 0, frozen_only: str = "") -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.after = MemoryUsage(resident_after_mb << 20, 400 << 20)
        self.frozen_only = frozen_only

    async def pause(self, rec):  # type: ignore[no-untyped-def]
        self.calls.append(("pause", rec.sandbox_id))
        return PauseOutcome(MemoryUsage(500 << 20, 0), self.after, 0.01, self.frozen_only)

    async def resume(self, rec):  # type: ignore[no-untyped-def]
        self.calls.append(("resume", rec.sandbox_id))

    async def memory_usage(self, rec):  # type: ignore[no-untyped-def]
        return self.after


async def test_pause_resume_and_transparent_resume(tmp_path: Path) -> None:
    backend = PausableNull()
    m = manager(tmp_path, backend)
    await m.create("sb-e1-aaaaaa01", SandboxSpec(), "root", "p", wait_ready=True)
    assert (await m.pause("sb-e1-aaaaaa01")).state == "PAUSED"
    assert (await m.touch("sb-e1-aaaaaa01")).state == "RUNNING"  # any request resumes
    assert backend.calls == [("pause", "sb-e1-aaaaaa01"), ("resume", "sb-e1-aaaaaa01")]
    await m.stop("sb-e1-aaaaaa01")
    with pytest.raises(FailedPrecondition):
        await m.pause("sb-e1-aaaaaa01")


async def test_a_sandbox_that_asks_is_paused_at_its_ttl_and_resumes_with_a_fresh_one(
    tmp_path: Path,
) -> None:
    backend = PausableNull()
    m = SandboxManager(
        "e1", tmp_path, Capacity(2000, 1024, 10), [backend], paused_at_ttl_keep_s=100
    )
    sid = "sb-e1-aaaaaa01"
    await m.create(sid, SandboxSpec(ttl_s=10, pause_at_ttl=True), "root", "p", wait_ready=True)
    created = m.get(sid).created_at
    assert await m.reap_once(created + 11) == []  # paused, not reaped
    rec = m.get(sid)
    assert (rec.state, rec.paused_at_ttl) == ("PAUSED", True)
    assert rec.expires_at == pytest.approx(created + 11 + 100)  # kept for a resume
    assert await m.reap_once(created + 50) == [] and m.get(sid).state == "PAUSED"
    # A call resumes it (the transparent resume), with a fresh TTL from then.
    assert (await m.touch(sid)).state == "RUNNING"
    rec = m.get(sid)
    assert not rec.paused_at_ttl
    assert rec.expires_at == pytest.approx(time.time() + 10, abs=2)
    # Its next TTL pauses it again; left paused past the keep period, it ends TTL.
    again = rec.expires_at + 1
    assert await m.reap_once(again) == [] and m.get(sid).state == "PAUSED"
    assert await m.reap_once(again + 101) == [sid]
    rec = m.get(sid)
    assert (rec.state, rec.termination_reason) == ("TERMINATED", "TTL")
    assert "paused at its TTL and not resumed within 100 s" in rec.termination_message
    assert backend.calls == [("pause", sid), ("resume", sid), ("pause", sid)]
    # Without the option the TTL ends it, as before.
    await m.create("sb-e1-aaaaaa02", SandboxSpec(ttl_s=10), "root", "p", wait_ready=True)
    at = m.get("sb-e1-aaaaaa02").created_at + 11
    assert await m.reap_once(at) == ["sb-e1-aaaaaa02"]


async def test_a_pause_at_ttl_the_backend_cannot_do_is_refused_at_create(tmp_path: Path) -> None:
    m = manager(tmp_path)  # the plain null backend cannot pause
    with pytest.raises(BackendCapabilityMissing) as info:
        await m.create(
            "sb-e1-aaaaaa01", SandboxSpec(pause_at_ttl=True), "root", "p", wait_ready=True
        )
    assert info.value.metadata["capability"] == "pause"
    assert m.load().sandboxes == 0


async def test_a_capability_the_backend_lacks_is_unimplemented_naming_both(
    tmp_path: Path,
) -> None:
    m = manager(tmp_path)  # the plain null backend declares no capability
    await m.create("sb-e1-aaaaaa01", SandboxSpec(), "root", "p", wait_ready=True)
    for call in (m.pause, m.resume, m.modified_files):
        with pytest.raises(BackendCapabilityMissing) as info:
            await call("sb-e1-aaaaaa01")
        assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert info.value.reason == "BACKEND_CAPABILITY"
        assert info.value.metadata["backend"] == "null"
    assert info.value.metadata["capability"] == "modified_files"
    assert m.get("sb-e1-aaaaaa01").state == "RUNNING"  # nothing changed


async def test_gpus_are_refused_until_a_backend_attaches_them(tmp_path: Path) -> None:
    """A create asking for GPUs used to be admitted and only counted: no GPU was attached.
    Now UNIMPLEMENTED BACKEND_CAPABILITY naming the backend and gpus, nothing counted, on
    create and create_many; a backend that declares the capability gets them admitted."""
    m = SandboxManager("e1", tmp_path, Capacity(2000, 1024, 10, gpus=2), [NullBackend()])
    with pytest.raises(BackendCapabilityMissing) as info:
        await m.create("sb-e1-aaaaaa01", SandboxSpec(gpu_count=1), "root", "p", wait_ready=True)
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert info.value.reason == "BACKEND_CAPABILITY"
    assert info.value.metadata == {"backend": "null", "capability": "gpus"}
    [(rec, _, err)] = await m.create_many(
        [("sb-e1-aaaaaa02", SandboxSpec(gpu_count=1))], "root", "p", wait_ready=True
    )
    assert rec is None and isinstance(err, BackendCapabilityMissing)
    assert m.records == {} and m.load().gpus == 0 and m.load().sandboxes == 0

    class WithGpus(NullBackend):
        capabilities = frozenset({Capability.GPUS})

        def gpu_capacity(self) -> int:
            return 2

    g = SandboxManager("e1", tmp_path / "g", Capacity(2000, 1024, 10, gpus=2), [WithGpus()])
    await g.create("sb-e1-aaaaaa03", SandboxSpec(gpu_count=1), "root", "p", wait_ready=True)
    assert g.load().gpus == 1


def test_a_backend_declaring_what_it_does_not_implement_is_refused(tmp_path: Path) -> None:
    class Liar(NullBackend):
        capabilities = frozenset({Capability.PAUSE})  # but no pause()/resume()

    with pytest.raises(TypeError, match="declares pause but does not implement Pausable"):
        manager(tmp_path, Liar())


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


async def test_create_many_admits_in_order_up_to_capacity(tmp_path: Path) -> None:
    m = manager(tmp_path, cpu=10_000, mem=10_000, n=3)
    spec = SandboxSpec(cpu_millis=100, memory_mb=10)
    await m.create("sb-e1-aaaaaa00", spec, "root", "p", wait_ready=True)
    items = [(f"sb-e1-bbbbbb0{i}", spec) for i in range(3)]
    items.insert(1, ("sb-e1-aaaaaa00", spec))  # already there: reported, not re-admitted
    items.append(("sb-e2-cccccc01", spec))  # not this edge's id
    out = await m.create_many(items, "root/a", "p", wait_ready=True)
    assert [(r is not None, existed, type(e).__name__) for r, existed, e in out] == [
        (True, False, "NoneType"),
        (True, True, "NoneType"),
        (True, False, "NoneType"),
        (False, False, "EdgeCapacity"),  # the 4th live sandbox of an edge that holds 3
        (False, False, "InvalidArgument"),
    ]
    assert all(r.state == "RUNNING" for r, _, _ in out if r is not None)
    assert m.load().sandboxes == 3 and m.load().cpu_millis == 300
    a, b = out[0][0], out[2][0]
    assert a is not None and b is not None and a.spec is not b.spec  # one can change alone


class PickyNull(NullBackend):
    """The null backend refusing one image, as a backend refuses an unknown one."""

    def validate(self, spec: SandboxSpec) -> None:
        if spec.image == "missing":
            raise InvalidArgument("unknown image missing", reason="IMAGE_NOT_FOUND")


async def test_create_many_gives_each_item_its_first_refusal(tmp_path: Path) -> None:
    # A batch runs the backend's validation and the disk sample in one thread, and checks the
    # disk and each spec's rules once: every item still gets its first refusal in the order a
    # batch checks (backend, id, spec, disk, capacity), whatever else is wrong with it.
    guard = DiskGuard([tmp_path], reserve_bytes=1 << 62)  # more than any disk: always low
    m = SandboxManager(
        "e1", tmp_path, Capacity(10_000, 10_000, 10), [PickyNull()], disk_guard=guard
    )
    good, reserved_env = SandboxSpec(), SandboxSpec(env={"DSEC_X": "1"})
    missing = SandboxSpec(image="missing")
    items = [
        ("sb-e2-aaaaaa01", missing),  # the backend's refusal comes first
        ("sb-e2-aaaaaa02", reserved_env),  # then the id
        ("sb-e1-aaaaaa03", reserved_env),  # then the spec's rules
        ("sb-e1-aaaaaa04", good),  # then the disk
    ]
    out = await m.create_many(items, "root", "p", wait_ready=True)
    errors = [e for _, _, e in out]
    assert [(type(e).__name__, e.reason if e else None) for e in errors] == [
        ("InvalidArgument", "IMAGE_NOT_FOUND"),
        ("InvalidArgument", "INVALID_ARGUMENT"),
        ("InvalidArgument", "RESERVED_ENV"),
        ("NodeDiskLow", "NODE_DISK_LOW"),
    ]
    assert "sb-e2-aaaaaa02" in str(errors[1]) and m.records == {}
    with pytest.raises(NodeDiskLow):  # a single create too
        await m.create("sb-e1-aaaaaa04", good, "root", "p", wait_ready=True)
    guard.reserve_bytes = 0  # the disk has room again: the next batch's sample sees it
    guard.sampled_at = 0.0
    out = await m.create_many(items[3:], "root", "p", wait_ready=True)
    assert out[0][0] is not None and out[0][0].state == "RUNNING"


async def test_create_many_without_waiting_starts_in_the_background(tmp_path: Path) -> None:
    m = manager(tmp_path, cpu=100_000, mem=100_000, n=1000)
    spec = SandboxSpec(cpu_millis=10, memory_mb=1)
    ends = m.subscribe(terminal_only=True)
    every = m.subscribe()
    out = await m.create_many(
        [(f"sb-e1-dddd{i:04d}", spec) for i in range(500)], "root", "p", wait_ready=False
    )
    assert all(e is None for _, _, e in out)
    assert {r.state for r, _, _ in out if r is not None} == {"PENDING"}  # admitted, not started
    for _ in range(100):
        if all(r is not None and r.state == "RUNNING" for r, _, _ in out):
            break
        await asyncio.sleep(0.01)
    assert all(r is not None and r.state == "RUNNING" for r, _, _ in out)
    assert ends.empty()  # quota releasers see only sandboxes that end
    assert every.qsize() >= 500
    await m.stop("sb-e1-dddd0000")
    assert ends.get_nowait().state == "TERMINATED"


async def test_live_counts_follow_creates_and_ends(tmp_path: Path) -> None:
    m = manager(tmp_path, cpu=100_000, mem=100_000, n=100)
    a = SandboxSpec(cpu_millis=10, memory_mb=1, task_id="t1")
    b = SandboxSpec(cpu_millis=10, memory_mb=1, backend="CONTAINER")
    await m.create_many(
        [("sb-e1-aaaa0001", a), ("sb-e1-aaaa0002", a)], "root/x", "tok1", wait_ready=True
    )
    await m.create("sb-e1-aaaa0003", b, "root/y", "tok2", wait_ready=True)
    assert m.live_counts() == ({"root/x": 2, "root/y": 1}, {"tok1": 2, "tok2": 1}, {"t1": 2})
    assert m.load().by_backend == {"CONTAINER": 3}
    await m.stop("sb-e1-aaaa0001")
    await m.stop("sb-e1-aaaa0003")
    assert m.live_counts() == ({"root/x": 1}, {"tok1": 1}, {"t1": 1})
    assert m.load().sandboxes == 1


async def test_a_paged_out_sandbox_makes_room_and_a_resume_that_does_not_fit_is_refused(
    tmp_path: Path,
) -> None:
    """Memory a pause gave back stops counting toward admission; a resume needs it back."""
    m = manager(tmp_path, PausableNull(resident_after_mb=12), mem=1100, cpu=10000)
    spec = SandboxSpec(memory_mb=512)
    for sid in ("sb-e1-aaaaaa01", "sb-e1-aaaaaa02"):
        await m.create(sid, spec, "root", "p", wait_ready=True)
    with pytest.raises(EdgeCapacity):
        await m.create("sb-e1-aaaaaa03", spec, "root", "p", wait_ready=True)
    rec = await m.pause("sb-e1-aaaaaa01")
    assert rec.released_mb == 500 and m.load().memory_mb == 512 + 12
    assert m.paused_status() == (1, 500, 400 << 20)
    await m.create("sb-e1-aaaaaa03", spec, "root", "p", wait_ready=False)  # fits now
    with pytest.raises(NodeMemoryFull) as info:
        await m.resume("sb-e1-aaaaaa01")
    assert info.value.code.name == "RESOURCE_EXHAUSTED" and info.value.metadata["need_mb"] == "500"
    with pytest.raises(NodeMemoryFull):
        await m.touch("sb-e1-aaaaaa01")  # a call to it resumes first: refused the same way
    assert m.get("sb-e1-aaaaaa01").state == "PAUSED"
    await m.stop("sb-e1-aaaaaa03")
    assert (await m.resume("sb-e1-aaaaaa01")).state == "RUNNING"
    assert m.load().memory_mb == 1024 and m.get("sb-e1-aaaaaa01").released_mb == 0
    # A paused sandbox that is stopped gives everything back.
    await m.pause("sb-e1-aaaaaa02")
    await m.stop("sb-e1-aaaaaa02")
    assert m.load().memory_mb == 512 and m.paused_status() == (0, 0, 0)


async def test_a_freeze_only_pause_keeps_counting_and_says_why(tmp_path: Path) -> None:
    m = manager(tmp_path, PausableNull(resident_after_mb=500, frozen_only="no swap area"))
    await m.create("sb-e1-aaaaaa01", SandboxSpec(memory_mb=512), "root", "p", wait_ready=True)
    rec = await m.pause("sb-e1-aaaaaa01")
    assert rec.released_mb == 0 and rec.memory["frozen_only"] == "no swap area"
    assert m.load().memory_mb == 512


async def test_pause_of_a_sandbox_that_is_not_running_names_its_state(tmp_path: Path) -> None:
    m = manager(tmp_path, PausableNull())
    await m.create("sb-e1-aaaaaa01", SandboxSpec(), "root", "p", wait_ready=True)
    await m.stop("sb-e1-aaaaaa01")
    with pytest.raises(FailedPrecondition) as info:
        await m.pause("sb-e1-aaaaaa01")
    assert "TERMINATED" in str(info.value) or "terminated" in str(info.value)


async def test_concurrent_calls_to_a_paused_sandbox_resume_it_once(tmp_path: Path) -> None:
    backend = PausableNull()
    m = manager(tmp_path, backend)
    await m.create("sb-e1-aaaaaa01", SandboxSpec(), "root", "p", wait_ready=True)
    await m.pause("sb-e1-aaaaaa01")
    await asyncio.gather(*(m.touch("sb-e1-aaaaaa01") for _ in range(8)))
    assert backend.calls.count(("resume", "sb-e1-aaaaaa01")) == 1


# ------------------------------------------------------- task-level operations


async def _task(m: SandboxManager, n: int, task_id: str = "t1", **labels: str) -> list[str]:
    ids = [f"sb-e1-{task_id}{i:04d}" for i in range(n)]
    for i, sid in enumerate(ids):
        spec = SandboxSpec(task_id=task_id, labels={"episode": str(i), **labels})
        await m.create(sid, spec, "root/a", "p", wait_ready=True)
    return ids


async def test_act_on_pauses_resumes_and_stops_every_sandbox_of_a_task(tmp_path: Path) -> None:
    backend = PausableNull()
    m = manager(tmp_path, backend, cpu=100_000, mem=100_000, n=100)
    ids = await _task(m, 3)
    other = await _task(m, 1, task_id="t2")
    paused = await m.act_on("PAUSE", task_id="t1")
    assert [(sid, rec.state if rec else None, err) for sid, rec, err in paused] == [
        (sid, "PAUSED", None) for sid in ids
    ]
    assert m.get(other[0]).state == "RUNNING"  # another task's sandbox is left alone
    again = await m.act_on("PAUSE", task_id="t1")  # already paused: just says so
    assert [rec.state for _, rec, _ in again if rec] == ["PAUSED"] * 3
    assert len(backend.calls) == 3
    resumed = await m.act_on("RESUME", task_id="t1", labels={"episode": "1"})
    assert [(sid, rec.state if rec else None) for sid, rec, _ in resumed] == [(ids[1], "RUNNING")]
    stopped = await m.act_on("STOP", task_id="t1", reason="PREEMPTED")
    for _, rec, err in stopped:
        assert err is None and rec is not None
        assert (rec.state, rec.termination_reason) == ("TERMINATED", "PREEMPTED")
        assert rec.termination_message == "preempted: its job was preempted"
    assert m.load().sandboxes == 1  # the capacity came back


async def test_act_on_reports_each_sandbox_s_error_and_goes_on(tmp_path: Path) -> None:
    m = manager(tmp_path, PausableNull(), cpu=100_000, mem=100_000, n=100)
    ids = await _task(m, 3)
    await m.stop(ids[0])
    results = await m.act_on("PAUSE", task_id="t1")
    assert [sid for sid, _, _ in results] == ids  # terminated ones too, in creation order
    _, rec, err = results[0]
    assert rec is None and isinstance(err, SandboxTerminated)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.metadata["state"] == "TERMINATED"
    assert err.metadata["termination_reason"] == "STOPPED"
    assert [rec.state for _, rec, _ in results[1:] if rec] == ["PAUSED", "PAUSED"]
    live = await m.act_on("STOP", task_id="t1", skip_terminated=True)
    assert [sid for sid, _, _ in live] == ids[1:]
    # Stopping an ended sandbox answers it as it is: the first stop's reason stands.
    ended = await m.act_on("STOP", task_id="t1", reason="PREEMPTED")
    assert [rec.termination_reason for _, rec, _ in ended if rec] == ["STOPPED"] * 3


async def test_act_on_without_the_capability_fails_per_sandbox(tmp_path: Path) -> None:
    m = manager(tmp_path)  # the null backend cannot pause
    await _task(m, 2)
    for _, rec, err in await m.act_on("PAUSE", task_id="t1"):
        assert rec is None and isinstance(err, BackendCapabilityMissing)
        assert err.metadata["state"] == "RUNNING"


async def test_act_on_refuses_an_empty_selector_and_unknown_actions(tmp_path: Path) -> None:
    m = manager(tmp_path)
    await _task(m, 1)
    with pytest.raises(InvalidArgument, match="refusing to act on every sandbox"):
        await m.act_on("STOP")
    with pytest.raises(InvalidArgument, match="unknown action"):
        await m.act_on("DELETE", task_id="t1")
    assert await m.act_on("STOP", task_id="no-such-task") == []


async def test_act_on_selects_within_the_project_prefix(tmp_path: Path) -> None:
    m = manager(tmp_path, cpu=100_000, mem=100_000, n=100)
    await _task(m, 2)  # project root/a
    assert await m.act_on("STOP", project_prefix="root/b", task_id="t1") == []
    assert len(await m.act_on("STOP", project_prefix="root", task_id="t1")) == 2


async def test_act_on_runs_at_most_concurrency_at_a_time(tmp_path: Path) -> None:
    class SlowPause(PausableNull):
        running = peak = 0

        async def pause(self, rec):  # type: ignore[no-untyped-def]
            SlowPause.running += 1
            SlowPause.peak = max(SlowPause.peak, SlowPause.running)
            await asyncio.sleep(0.01)
            SlowPause.running -= 1
            return await super().pause(rec)

    m = manager(tmp_path, SlowPause(), cpu=100_000, mem=100_000, n=100)
    await _task(m, 20)
    results = await m.act_on("PAUSE", task_id="t1", concurrency=4)
    assert len(results) == 20 and all(err is None for _, _, err in results)
    assert SlowPause.peak == 4


class SlowDestroyNull(NullBackend):
    """Destroys slowly and counts its destroys: a race of endings has time to happen."""

    def __init__(self) -> None:
        super().__init__()
        self.destroyed: list[str] = []
        self.stopped: list[str] = []

    async def stop(self, rec, grace_s):  # type: ignore[no-untyped-def]
        self.stopped.append(rec.sandbox_id)
        await asyncio.sleep(0.05)

    async def destroy(self, rec):  # type: ignore[no-untyped-def]
        self.destroyed.append(rec.sandbox_id)
        await asyncio.sleep(0.1)


async def test_a_race_of_endings_ends_the_sandbox_once_with_the_first_reason(
    tmp_path: Path,
) -> None:
    """The incident of issue 31: containment (DISK_QUOTA) ending a sandbox while its owner's
    stop arrives tore it down twice and took the live count below zero."""
    backend = SlowDestroyNull()
    m = manager(tmp_path, backend)
    spec = SandboxSpec(cpu_millis=500, memory_mb=100, task_id="t")
    await m.create("sb-e1-aaaaaa01", spec, "root", "p", wait_ready=True)
    await m.create("sb-e1-aaaaaa02", spec, "root", "p", wait_ready=True)
    rec = m.get("sb-e1-aaaaaa01")
    results = await asyncio.gather(
        m._on_backend_exit(rec.sandbox_id, "DISK_QUOTA", "writable layer full"),
        m.stop(rec.sandbox_id),
        m.stop(rec.sandbox_id, reason="TTL"),
        m.end(rec, "CHANNEL_CLOSED", "gone"),
        m._on_backend_exit(rec.sandbox_id, "PIDS_EXHAUSTED", "full"),
    )
    assert backend.destroyed == [rec.sandbox_id]  # one teardown
    assert backend.stopped == []  # the first ending (containment) stops nothing gracefully
    assert rec.state == "TERMINATED" and rec.termination_reason == "DISK_QUOTA"
    assert all(r is rec for r in results[1:4])
    load = m.load()
    assert (load.sandboxes, load.cpu_millis, load.memory_mb) == (1, 500, 100)
    assert m.live_counts() == ({"root": 1}, {"p": 1}, {"t": 1})
    assert m.accounting_errors == 0
    await m.stop("sb-e1-aaaaaa02")
    load = m.load()
    assert (load.sandboxes, load.cpu_millis, load.memory_mb, load.by_backend) == (0, 0, 0, {})
    assert m.live_counts() == ({}, {}, {})


async def test_a_release_below_zero_is_refused_and_counted_not_clamped(tmp_path: Path) -> None:
    from edge.manager import AccountingError

    m = manager(tmp_path)
    spec = SandboxSpec(cpu_millis=500, memory_mb=100)
    await m.create("sb-e1-aaaaaa01", spec, "root", "p", wait_ready=True)
    rec = m.get("sb-e1-aaaaaa01")
    await m.stop(rec.sandbox_id)
    with pytest.raises(AccountingError, match="below zero"):
        m.admission.account(rec, -1)  # a second release: a bug, refused with nothing changed
    load = m.load()
    assert (load.sandboxes, load.cpu_millis, load.memory_mb) == (0, 0, 0)


async def test_a_stop_cancelled_by_its_caller_still_ends_the_sandbox_once(tmp_path: Path) -> None:
    backend = SlowDestroyNull()
    m = manager(tmp_path, backend)
    await m.create(
        "sb-e1-aaaaaa01", SandboxSpec(cpu_millis=500, memory_mb=100), "root", "p", wait_ready=True
    )
    caller = asyncio.create_task(m.stop("sb-e1-aaaaaa01"))
    await asyncio.sleep(0.02)
    caller.cancel()  # an RPC whose client went away
    with pytest.raises(asyncio.CancelledError):
        await caller
    rec = m.get("sb-e1-aaaaaa01")
    await m.end(rec, "TTL", "late")  # waits for the teardown under way
    assert rec.state == "TERMINATED" and rec.termination_reason == "STOPPED"
    assert backend.destroyed == ["sb-e1-aaaaaa01"] and m.load().sandboxes == 0


async def test_sudo_users_need_a_backend_with_sudo_and_account_names(tmp_path: Path) -> None:
    """SandboxSpec.sudo_users on a backend without sudo (every one but containers) is
    UNIMPLEMENTED BACKEND_CAPABILITY naming sudo, and an entry that is no account name or uid
    INVALID_ARGUMENT INVALID_SUDO_USER, both before anything is admitted."""
    m = SandboxManager("e1", tmp_path, Capacity(2000, 1024, 10), [NullBackend()])
    with pytest.raises(BackendCapabilityMissing) as info:
        await m.create(
            "sb-e1-aaaaaa01", SandboxSpec(sudo_users=["user"]), "root", "p", wait_ready=True
        )
    assert info.value.metadata == {"backend": "null", "capability": "sudo"}
    for bad in (["us er"], ["a,b"], [""], ["x" * 33], [str(i) for i in range(17)]):
        with pytest.raises(InvalidArgument) as invalid:
            await m.create(
                "sb-e1-aaaaaa02", SandboxSpec(sudo_users=bad), "root", "p", wait_ready=True
            )
        assert invalid.value.reason == "INVALID_SUDO_USER", bad
    assert m.records == {} and m.load().sandboxes == 0

    class WithSudo(NullBackend):
        capabilities = frozenset({Capability.SUDO})
        sudo_program = "/.dsec/bin/dsec-sudo"

    s = SandboxManager("e1", tmp_path / "s", Capacity(2000, 1024, 10), [WithSudo()])
    spec = SandboxSpec(sudo_users=["user", "1000"])
    await s.create("sb-e1-aaaaaa03", spec, "root", "p", wait_ready=True)
    assert s.records["sb-e1-aaaaaa03"].spec.sudo_users == ["user", "1000"]

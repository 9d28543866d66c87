"""The edge manager's side of ForkSandbox, over a backend that records what it is asked:
all children admitted or none, per-child outcomes, the source's state rules, bad input.
(What a real backend copies is tested against it: tests/integration/test_*fork*.py.)"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest

from edge.backends import Capability, NullBackend
from edge.backends.contract import ForkKind, ForkOutcome, MemoryUsage, PauseOutcome
from edge.manager import MAX_FORK_CHILDREN, Capacity, SandboxManager
from edge.model import SandboxRecord, SandboxSpec
from libdsec.errors import (
    BackendCapabilityMissing,
    EdgeCapacity,
    FailedPrecondition,
    InvalidArgument,
    SandboxTerminated,
)

SRC = "sb-e1-00000001"


class ForkingNull(NullBackend):
    """The null backend with fork (and pause) declared; `fail` names children that fail."""

    capabilities = frozenset({Capability.FORK, Capability.PAUSE})
    fork_kind = ForkKind.FILES

    def __init__(self, fail: Sequence[str] = ()) -> None:
        super().__init__()
        self.fail = set(fail)
        self.forks: list[tuple[str, str, list[str]]] = []
        self.destroyed: list[str] = []

    async def fork(self, source: SandboxRecord, children: Sequence[SandboxRecord]) -> ForkOutcome:
        self.forks.append((source.sandbox_id, source.state, [c.sandbox_id for c in children]))
        errors: list[Exception | None] = []
        for c in children:
            c.runtime = {"kind": "null", "from": source.sandbox_id}
            errors.append(
                RuntimeError("no room for its disk") if c.sandbox_id in self.fail else None
            )
        return ForkOutcome(errors, 0.02)

    async def destroy(self, rec: SandboxRecord) -> None:
        self.destroyed.append(rec.sandbox_id)

    async def pause(self, rec: SandboxRecord) -> PauseOutcome:
        return PauseOutcome(MemoryUsage(100 << 20, 0), MemoryUsage(100 << 20, 0), 0.01, "")

    async def resume(self, rec: SandboxRecord) -> None:
        return None

    async def memory_usage(self, rec: SandboxRecord) -> MemoryUsage | None:
        return MemoryUsage(100 << 20, 0)


def kids(n: int, start: int = 10) -> list[str]:
    return [f"sb-e1-{i:08x}" for i in range(start, start + n)]


async def made(tmp_path: Path, backend: NullBackend, n: int = 10) -> SandboxManager:
    m = SandboxManager("e1", tmp_path, Capacity(10_000, 10_000, n), [backend])
    spec = SandboxSpec(cpu_millis=1000, memory_mb=512, labels={"a": "1"}, task_id="t", ttl_s=600)
    await m.create(SRC, spec, "root/p", "alice", wait_ready=True)
    return m


async def test_children_copy_the_source_spec_with_labels_task_and_ttl_over_it(
    tmp_path: Path,
) -> None:
    backend = ForkingNull()
    m = await made(tmp_path, backend)
    kind, stall, out = await m.fork(
        SRC, kids(3), "bob", labels={"b": "2"}, task_id="grpo", ttl_s=60, require_memory=False
    )
    assert kind is ForkKind.FILES and stall == pytest.approx(0.02)
    assert backend.forks == [(SRC, "RUNNING", kids(3))]  # one capture for all three
    for (rec, err), cid in zip(out, kids(3), strict=True):
        assert err is None and rec.sandbox_id == cid and rec.state == "RUNNING"
        assert rec.forked_from == SRC and rec.principal_id == "bob" and rec.project_id == "root/p"
        assert rec.spec.labels == {"a": "1", "b": "2"}
        assert (rec.spec.task_id, rec.spec.ttl_s, rec.spec.memory_mb) == ("grpo", 60, 512)
    assert m.get(SRC).spec.labels == {"a": "1"}  # the source's own spec is untouched
    assert m.load().memory_mb == 4 * 512


async def test_a_node_that_cannot_hold_all_children_makes_none_and_says_how_many_fit(
    tmp_path: Path,
) -> None:
    backend = ForkingNull()
    m = await made(tmp_path, backend, n=4)  # the source + 3
    with pytest.raises(EdgeCapacity) as info:
        await m.fork(SRC, kids(5), "bob", labels={}, task_id="", ttl_s=0, require_memory=False)
    assert info.value.metadata["fits"] == "3"
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert backend.forks == [] and len(m.live_ids()) == 1 and m.load().memory_mb == 512


async def test_a_failed_child_ends_with_why_and_its_siblings_run(tmp_path: Path) -> None:
    backend = ForkingNull(fail=[kids(3)[1]])
    m = await made(tmp_path, backend)
    _, _, out = await m.fork(
        SRC, kids(3), "bob", labels={}, task_id="", ttl_s=0, require_memory=False
    )
    assert [err is None for _, err in out] == [True, False, True]
    bad, err = out[1]
    assert err is not None and "no room for its disk" in err.message
    assert bad.state == "TERMINATED" and bad.termination_reason == "RUNTIME_ERROR"
    assert backend.destroyed == [bad.sandbox_id]
    assert len(m.live_ids()) == 3 and m.load().memory_mb == 3 * 512


async def test_a_paused_source_is_forked_and_stays_paused(tmp_path: Path) -> None:
    backend = ForkingNull()
    m = await made(tmp_path, backend)
    await m.pause(SRC)
    _, _, out = await m.fork(
        SRC, kids(2), "bob", labels={}, task_id="", ttl_s=0, require_memory=False
    )
    assert backend.forks[0][1] == "PAUSED" and m.get(SRC).state == "PAUSED"
    assert all(rec.state == "RUNNING" for rec, _ in out)


async def test_bad_counts_ended_sources_missing_capabilities_and_memory_demands(
    tmp_path: Path,
) -> None:
    m = await made(tmp_path, ForkingNull())
    args = {"labels": {}, "task_id": "", "ttl_s": 0, "require_memory": False}
    for ids in ([], kids(MAX_FORK_CHILDREN + 1), [kids(1)[0]] * 2):
        with pytest.raises(InvalidArgument) as bad:
            await m.fork(SRC, ids, "bob", **args)  # type: ignore[arg-type]
        assert bad.value.reason == "FORK_COUNT" and bad.value.metadata["field"] == "count"
    with pytest.raises(FailedPrecondition) as files_only:
        await m.fork(SRC, kids(1), "bob", **{**args, "require_memory": True})  # type: ignore[arg-type]
    assert files_only.value.reason == "FORK_MEMORY_UNAVAILABLE"
    assert files_only.value.metadata["fork_kind"] == "files"
    await m.stop(SRC)
    with pytest.raises(SandboxTerminated):
        await m.fork(SRC, kids(1), "bob", **args)  # type: ignore[arg-type]

    plain = SandboxManager("e1", tmp_path / "plain", Capacity(10_000, 10_000, 10), [NullBackend()])
    await plain.create(SRC, SandboxSpec(), "root", "p", wait_ready=True)
    with pytest.raises(BackendCapabilityMissing) as unimpl:
        await plain.fork(SRC, kids(1), "bob", **args)  # type: ignore[arg-type]
    assert unimpl.value.metadata["capability"] == "fork"
    assert len(plain.live_ids()) == 1

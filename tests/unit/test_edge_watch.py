"""The edge's WatchSandboxes (the servicer method over a real manager and the null
backend, no sockets): filters, the replay of a gap, keepalives, and a watch that falls
behind ending with WATCH_OVERFLOW instead of going silent."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

import edge.servicer
from dsec.edge.v1 import edge_pb2
from dsec.types.v1 import types_pb2
from edge.backends import Capability, NullBackend
from edge.backends.contract import MemoryUsage, PauseOutcome
from edge.manager import Capacity, SandboxManager
from edge.model import SandboxSpec
from edge.servicer import EdgeServicer
from libdsec.errors import Unavailable

_serial = itertools.count(0xA00000)


class PausableNull(NullBackend):
    """The null backend with pause declared (a paused sandbox's watch events are the point)."""

    capabilities = frozenset({Capability.PAUSE})

    async def pause(self, rec):  # type: ignore[no-untyped-def]
        none = MemoryUsage(0, 0)
        return PauseOutcome(none, none, 0.0)

    async def resume(self, rec):  # type: ignore[no-untyped-def]
        return None

    async def memory_usage(self, rec):  # type: ignore[no-untyped-def]
        return None


def servicer(tmp_path: Path) -> EdgeServicer:
    m = SandboxManager("e1", tmp_path, Capacity(1_000_000, 1_000_000, 1000), [PausableNull()])
    return EdgeServicer(m, types_pb2.EdgeInfo(edge_id="e1"))


async def make(s: EdgeServicer, n: int, project: str, **spec: object) -> list[str]:
    ids = [f"sb-e1-{next(_serial):012x}" for _ in range(n)]
    for sid in ids:
        await s.manager.create(sid, SandboxSpec(**spec), project, "p", wait_ready=True)  # type: ignore[arg-type]
    return ids


async def take(stream: AsyncIterator[edge_pb2.WatchSandboxesResponse], n: int) -> list[str]:
    """The next n events: "keepalive" or "<id> <STATE>" (a replayed batch's sandboxes each)."""
    out: list[str] = []
    while len(out) < n:
        msg = await asyncio.wait_for(anext(stream), timeout=5)
        if msg.HasField("keepalive"):
            out.append("keepalive")
            continue
        for sb in msg.replayed.sandboxes if msg.HasField("replayed") else [msg.changed]:
            state = types_pb2.SandboxState.Name(sb.state).removeprefix("SANDBOX_STATE_")
            out.append(f"{sb.id} {state}")
    return out


async def test_filters_by_project_subtree_task_and_labels(tmp_path: Path) -> None:
    s = servicer(tmp_path)
    req = edge_pb2.WatchSandboxesRequest(
        project_prefix="root/a", task_id="t", label_selector={"k": "v"}
    )
    stream = s.WatchSandboxes(req, None)
    assert await take(stream, 1) == ["keepalive"]  # following from here
    await make(s, 1, "root/ab", task_id="t", labels={"k": "v"})  # a sibling, not a child
    await make(s, 1, "root/a", task_id="u", labels={"k": "v"})
    await make(s, 1, "root/a", task_id="t", labels={"k": "w"})
    [sub] = await make(s, 1, "root/a/b", task_id="t", labels={"k": "v", "x": "y"})
    assert await take(stream, 3) == [f"{sub} PENDING", f"{sub} STARTING", f"{sub} RUNNING"]
    await s.manager.stop(sub)
    assert await take(stream, 2) == [f"{sub} STOPPING", f"{sub} TERMINATED"]
    await stream.aclose()
    assert not s.manager._subscribers  # the subscription ends with the stream


async def test_replay_of_what_changed_since_then_keepalive(tmp_path: Path) -> None:
    s = servicer(tmp_path)
    [old] = await make(s, 1, "root/a")
    since = time.time()
    [new, gone] = await make(s, 2, "root/a", task_id="x")
    await s.manager.stop(gone)
    req = edge_pb2.WatchSandboxesRequest(project_prefix="root/a")
    req.changed_since.FromNanoseconds(int(since * 1e9))
    stream = s.WatchSandboxes(req, None)
    got = await take(stream, 3)
    assert sorted(got[:2]) == sorted([f"{new} RUNNING", f"{gone} TERMINATED"])
    assert got[2] == "keepalive"
    await stream.aclose()
    # Epoch: every sandbox the edge has, as it is now.
    req.changed_since.CopyFrom(Timestamp())
    stream = s.WatchSandboxes(req, None)
    got = await take(stream, 4)
    assert sorted(got[:3]) == sorted([f"{old} RUNNING", f"{new} RUNNING", f"{gone} TERMINATED"])
    await stream.aclose()


async def test_keepalives_while_idle_and_between_changes(tmp_path: Path) -> None:
    s = servicer(tmp_path)
    stream = s.WatchSandboxes(edge_pb2.WatchSandboxesRequest(keepalive_interval_ms=50), None)
    assert await take(stream, 3) == ["keepalive"] * 3
    await stream.aclose()


async def test_a_watch_that_falls_behind_ends_with_watch_overflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(edge.servicer, "WATCH_QUEUE", 5)
    s = servicer(tmp_path)
    stream = s.WatchSandboxes(edge_pb2.WatchSandboxesRequest(), None)
    assert await take(stream, 1) == ["keepalive"]
    await make(s, 3, "root/a")  # 9 changes: more than the queue holds
    with pytest.raises(Unavailable) as info:
        await take(stream, 9)
    assert info.value.reason == "WATCH_OVERFLOW"
    assert not s.manager._subscribers


async def test_a_poll_replays_in_batches_filtered_by_state_and_ends(tmp_path: Path) -> None:
    s = servicer(tmp_path)
    ids = await make(s, 600, "root/a", task_id="t", labels={"k": "v"}, env={"SECRET": "x"})
    await s.manager.stop(ids[0])
    req = edge_pb2.WatchSandboxesRequest(
        replay_only=True,
        summary=True,
        states=[types_pb2.SANDBOX_STATE_RUNNING, types_pb2.SANDBOX_STATE_PAUSED],
    )
    req.changed_since.CopyFrom(Timestamp())
    messages = [m async for m in s.WatchSandboxes(req, None)]  # it ends by itself
    assert [len(m.replayed.sandboxes) for m in messages[:-1]] == [512, 87]
    assert messages[-1].HasField("keepalive")
    replayed = {sb.id for m in messages[:-1] for sb in m.replayed.sandboxes}
    assert replayed == set(ids[1:])  # the stopped one is not RUNNING or PAUSED
    sb = messages[0].replayed.sandboxes[0]  # a summary: what the watcher keeps, no more
    assert (sb.project_id, sb.principal_id, sb.edge_id) == ("root/a", "p", "e1")
    assert sb.spec.task_id == "t" and dict(sb.spec.labels) == {"k": "v"} and not sb.spec.env
    assert sb.state == types_pb2.SANDBOX_STATE_RUNNING and sb.HasField("started_at")
    assert sb.spec.backend == types_pb2.BACKEND_CONTAINER and sb.spec.resources.cpu_millis
    assert not s.manager._subscribers  # a poll never subscribes

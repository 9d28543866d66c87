"""`Client.watch` / `AsyncClient.watch` against a real cluster (container edge, API server
WatchSandboxes): what appears, what is filtered out, keepalives, a stalled server, and every
way a watch ends. Each test's sandboxes carry its own task id and are stopped afterwards."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dsecctl.cluster import LocalCluster
from libdsec import AsyncClient, Client, Sandbox, SandboxInfo, Watch
from libdsec.errors import DeadlineExceeded, InvalidArgument
from tests.integration.conftest import ClusterWith

pytestmark = pytest.mark.images("busybox")
LIVE = {"PENDING", "STARTING", "RUNNING"}


@pytest.fixture(scope="module")
def container_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: a test stops (SIGSTOP) its API server."""
    with cluster_with("w0") as c:
        yield c


@pytest.fixture
def task(request: pytest.FixtureRequest) -> str:
    """A task id of this test's own."""
    return "w-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]


@pytest.fixture
def sandbox_defaults() -> dict[str, Any]:
    return {"memory_mb": 64, "grace_s": 0.2}


def until(changes: Watch, done: Callable[[SandboxInfo], bool]) -> list[SandboxInfo]:
    """The changes up to and including the first that ``done`` accepts (the watch's own
    ``timeout`` bounds the wait: an iteration that ends before is a failure)."""
    seen: list[SandboxInfo] = []
    for info in changes:
        seen.append(info)
        if done(info):
            return seen
    raise AssertionError(f"the watch ended before the expected change; saw {_brief(seen)}")


def _brief(seen: list[SandboxInfo]) -> list[tuple[str, str, str | None]]:
    return [(i.id, i.state, i.termination_reason) for i in seen]


def test_a_created_sandbox_appears_and_a_stop_ends_it_stopped(
    client: Client, make_sandbox: Callable[..., Sandbox], task: str
) -> None:
    with client.watch(task_id=task, timeout=60) as changes:
        sb = make_sandbox(task_id=task, labels={"stage": "train"})
        seen = until(changes, lambda i: i.id == sb.id and i.state == "RUNNING")
        mine = [i for i in seen if i.id == sb.id]
        assert {i.state for i in mine} <= LIVE, _brief(seen)
        first = mine[0]
        assert isinstance(first, SandboxInfo)  # the same type get/list return
        assert first.task_id == task and first.labels["stage"] == "train"
        assert first.image == "busybox" and first.edge_id == "w0"

        sb.stop(grace_s=0.2)
        seen = until(changes, lambda i: i.id == sb.id and i.terminated)
        end = seen[-1]
        assert end.state == "TERMINATED" and end.termination_reason == "STOPPED", _brief(seen)
        got = client.get(sb.id).info  # what get says
        assert (got.state, got.termination_reason) == (end.state, end.termination_reason)


def test_a_task_filter_excludes_other_tasks(
    client: Client, make_sandbox: Callable[..., Sandbox], task: str
) -> None:
    with client.watch(task_id=task, timeout=60) as changes:
        other = make_sandbox(task_id=task + "-other")
        mine = make_sandbox(task_id=task)
        # one edge reports in order: the other task's changes came first, had they passed
        seen = until(changes, lambda i: i.id == mine.id and i.state == "RUNNING")
    assert other.id not in {i.id for i in seen}, _brief(seen)
    assert {i.task_id for i in seen} == {task}


def test_a_label_filter_needs_every_label(
    client: Client, make_sandbox: Callable[..., Sandbox], task: str
) -> None:
    with client.watch(labels={"stage": "eval", "run": task}, timeout=60) as changes:
        partial = make_sandbox(labels={"stage": "eval"})
        full = make_sandbox(labels={"stage": "eval", "run": task})
        seen = until(changes, lambda i: i.id == full.id and i.state == "RUNNING")
    assert partial.id not in {i.id for i in seen}, _brief(seen)


def test_keepalives_are_skipped_and_a_quiet_watch_ends_at_its_timeout(
    client: Client, task: str
) -> None:
    # Keepalives every 0.2 s; without them the stream would count as stalled after 1.2 s.
    t0 = time.monotonic()
    with client.watch(task_id=task, timeout=2.5, keepalive_interval_s=0.2) as changes:
        assert list(changes) == []
    took = time.monotonic() - t0
    assert 2.5 <= took < 10, took


def test_a_silent_server_raises_stream_stalled(
    container_cluster: LocalCluster, client: Client, task: str
) -> None:
    apiserver = container_cluster.process("apiserver")
    changes = client.watch(task_id=task, keepalive_interval_s=0.2)
    os.kill(apiserver.pid, signal.SIGSTOP)  # the process still holds the connection, says nothing
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            next(changes)
        took = time.monotonic() - t0
    finally:
        os.kill(apiserver.pid, signal.SIGCONT)
    assert info.value.reason == "STREAM_STALLED"
    assert 1.0 <= took < 10, took  # six intervals of 0.2 s, not the default 30 s
    assert list(changes) == []  # a stalled watch is over
    client.whoami()  # the server is back for everyone else


def test_closing_the_client_ends_an_iteration_in_another_thread(
    container_cluster: LocalCluster, task: str
) -> None:
    c = Client(container_cluster.apiserver, token=container_cluster.token)
    changes = c.watch(task_id=task)
    outcome: list[object] = []

    def iterate() -> None:
        try:
            outcome.append(list(changes))
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=iterate)
    reader.start()
    time.sleep(0.5)  # the reader is waiting in the stream
    c.close()
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert outcome == [[]]  # a clean end, no error


def test_close_ends_a_watch_and_it_stays_ended(client: Client, task: str) -> None:
    changes = client.watch(task_id=task)
    changes.close()
    changes.close()  # idempotent
    assert list(changes) == []


async def test_the_async_watch_from_entry_to_close(
    container_cluster: LocalCluster, task: str
) -> None:
    import asyncio

    async with AsyncClient(container_cluster.apiserver, token=container_cluster.token) as dsec:
        async with dsec.watch(task_id=task, timeout=60) as changes:
            sb = await dsec.create(image="busybox", cpu=0.2, memory_mb=64, task_id=task)
            try:
                async for info in changes:
                    if info.id == sb.id and info.state == "RUNNING":
                        break
                else:
                    raise AssertionError("the watch ended before the sandbox ran")
            finally:
                await sb.stop(grace_s=0.2)

        # closed from another task while one waits: that iteration ends, no error
        quiet = dsec.watch(task_id=task + "-quiet")
        await quiet.start()
        reader = asyncio.create_task(anext(quiet, None))
        await asyncio.sleep(0.3)
        await quiet.aclose()
        assert await asyncio.wait_for(reader, 5) is None


def test_bad_watch_arguments_get_typed_errors(client: Client) -> None:
    with pytest.raises(InvalidArgument) as info:
        client.watch(timeout=0)
    assert info.value.reason == "INVALID_TIMEOUT"
    with pytest.raises(InvalidArgument) as info:
        client.watch(keepalive_interval_s=-1)
    assert info.value.reason == "INVALID_KEEPALIVE"
    # an interval the server refuses (it accepts 0.1 s .. 600 s) comes back typed too
    with pytest.raises(InvalidArgument) as info:
        client.watch(keepalive_interval_s=0.01)
    assert info.value.reason == "INVALID_KEEPALIVE"

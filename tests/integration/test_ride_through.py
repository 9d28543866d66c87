"""SDK clients ride through a restart of the API server, through real service processes (one
container edge, one API server the tests SIGKILL and start again ~1.5 s later from a thread).

Idempotent calls made during the outage wait for the API server and succeed; a create (the
SDK keys every create) whose answer was lost makes its sandboxes once, counted once in the
project's quota; a command cut mid-flight is retried with its operation id and runs once; a
watch open when the API server dies ends with UNAVAILABLE saying so. Each test works in a project (and
task) of its own and stops its sandboxes, also when it fails.
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import grpc
import pytest

from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsecctl.cluster import LocalCluster
from libdsec import Client, Sandbox
from libdsec.errors import Unavailable
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith
from tests.integration.test_control_plane import project_with_token, usage

pytestmark = pytest.mark.images("busybox")
EDGE = "rt0"
SPEC: dict[str, Any] = {"image": "busybox", "cpu": 0.2, "memory_mb": 64}
#: How long the API server stays down before the restart begins (it serves ~1 s later).
DOWN_S = 1.5


@pytest.fixture(scope="module")
def rt(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: its tests kill the API server."""
    with cluster_with(EDGE) as c:
        yield c


@pytest.fixture
def client(rt: LocalCluster, request: pytest.FixtureRequest) -> Iterator[Client]:
    """A client of a project of the test's own (its quota usage is the test's alone)."""
    name = "ride-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    _, token = project_with_token(rt, name)
    with Client(rt.apiserver, token=token) as c:
        yield c


@pytest.fixture
def sandbox_defaults() -> dict[str, Any]:
    return {"memory_mb": 64, "grace_s": 0.5}


@contextmanager
def outage(cluster: LocalCluster) -> Iterator[float]:
    """Kills the API server (SIGKILL) and starts it again :data:`DOWN_S` later from a thread;
    yields the time of the kill. On exit, waits for the restart (and for this process's
    channel to it: gRPC shares it between clients, and it reconnects after a backoff) and
    raises the restart's failure."""
    failed: list[BaseException] = []

    def restart() -> None:
        time.sleep(DOWN_S)
        try:
            cluster.restart("apiserver")
        except BaseException as exc:
            failed.append(exc)

    cluster.kill("apiserver", signal.SIGKILL)
    killed = time.monotonic()
    restarter = threading.Thread(target=restart, name="restart-apiserver", daemon=True)
    restarter.start()
    try:
        yield killed
    finally:
        restarter.join(timeout=90)
        if not restarter.is_alive() and not failed:
            with Client(cluster.apiserver, token=cluster.token) as admin:
                admin.whoami()  # idempotent: waits until the channel is connected again
    assert not restarter.is_alive(), "the API server's restart did not end within 90 s"
    if failed:
        raise failed[0]


@contextmanager
def cleanup(c: Client, task: str) -> Iterator[None]:
    """Stops the task's sandboxes on exit, however the test ends."""
    try:
        yield
    finally:
        c.stop_all(task_id=task)


def project_of(c: Client) -> str:
    return c.whoami().project_id


def on_edge(edge: edge_pb2_grpc.EdgeServiceStub, task: str) -> set[str]:
    """The task's sandboxes on the edge, asked directly (not through the API server)."""
    resp = edge.ListSandboxes(edge_pb2.ListSandboxesRequest(task_id=task), timeout=5)
    return {sb.id for sb in resp.sandboxes}


# ---------------------------------------------------------------- idempotent


def test_reads_during_the_outage_wait_for_the_api_server(
    rt: LocalCluster, client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox(task_id="reads")
    timeout = 20.0
    with ThreadPoolExecutor(2) as pool, outage(rt) as killed:

        def timed(call: Callable[[], Any]) -> tuple[Any, float]:
            """The call's result, and when it came (seconds after the kill)."""
            result = call()
            return result, time.monotonic() - killed

        got = pool.submit(timed, lambda: client.get(sb.id, timeout=timeout))
        listed = pool.submit(timed, lambda: client.list(task_id="reads", timeout=timeout))
        (again, got_s), (infos, listed_s) = got.result(), listed.result()
    assert again.id == sb.id and again.info.state == "RUNNING"
    assert [i.id for i in infos] == [sb.id]
    for took in (got_s, listed_s):  # each waited through the outage, within its deadline
        assert DOWN_S <= took < timeout, (got_s, listed_s)


def test_a_create_issued_during_the_outage_makes_one_sandbox(
    rt: LocalCluster, client: Client
) -> None:
    task = "issued-during"
    with cleanup(client, task):
        with outage(rt) as killed:
            sb = client.create(**SPEC, task_id=task)  # no key: the SDK makes one up
            took = time.monotonic() - killed
        assert took >= DOWN_S  # it was retried until the API server was back
        assert [i.id for i in client.list(task_id=task)] == [sb.id]
        assert usage(rt, project_of(client)) == 1


@pytest.mark.parametrize("count", [1, 6])
def test_a_create_whose_answer_was_lost_makes_its_sandboxes_once(
    rt: LocalCluster, client: Client, count: int
) -> None:
    """The API server dies while the create waits for its sandboxes to start (they are on
    the edge already): the SDK's retry with the same keys gets those very sandboxes."""
    task = f"lost-answer-{count}"
    with (
        cleanup(client, task),
        grpc.insecure_channel(rt.process(f"edge-{EDGE}").address) as channel,
        ThreadPoolExecutor(1) as pool,
    ):
        edge = edge_pb2_grpc.EdgeServiceStub(channel)
        if count == 1:
            made = pool.submit(lambda: [client.create(**SPEC, task_id=task)])
        else:
            made = pool.submit(client.create_many, count, **SPEC, task_id=task)
        admitted = wait_for(lambda: on_edge(edge, task), timeout_s=30, interval_s=0.002)
        with outage(rt):
            answered = made.done() and made.exception() is None
            assert not answered, "answered before the kill: the test proves nothing"
            sandboxes = made.result(timeout=120)
        assert not any(isinstance(s, Exception) for s in sandboxes), sandboxes
        assert {s.id for s in sandboxes} == admitted  # the first attempt's, not new ones
        assert len({i.id for i in client.list(task_id=task)}) == count
        assert on_edge(edge, task) == admitted
        assert usage(rt, project_of(client)) == count


# ------------------------------------------------------------ not idempotent


def test_a_command_sent_during_the_outage_waits_for_the_api_server_and_runs_once(
    rt: LocalCluster, client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    """Not idempotent, but sent while nothing listens: nothing left the client, so the call
    waits for the channel (within its deadline) instead of failing."""
    sb = make_sandbox(task_id="waits")
    with outage(rt) as killed:
        r = sb.run("echo ran >> /tmp/ran", timeout_s=30)
        took = time.monotonic() - killed
    assert r.exit_code == 0
    assert took >= DOWN_S * 0.5, took  # it did wait for the restart
    assert sb.run("wc -l < /tmp/ran").text.strip() == "1"


def test_a_command_cut_mid_flight_rides_through_and_runs_once(
    rt: LocalCluster, client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    """Under way when the API server dies: its edge runs it on (it belongs to its operation,
    not to the connection), and the SDK's retry with the same operation id, once the API
    server is back, gets its result; it ran once."""
    sb = make_sandbox(task_id="cut")
    outcome: list[BaseException | object] = []
    sent = threading.Event()

    def call() -> None:
        sent.set()
        try:
            outcome.append(sb.run("sleep 3; echo ran >> /tmp/ran; echo done", timeout_s=30))
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    sent.wait(5)
    time.sleep(1.0)  # the command runs in the sandbox now
    with outage(rt):
        caller.join(timeout=DOWN_S * 10)
        assert not caller.is_alive(), "the cut call hung"
    (result,) = outcome
    assert not isinstance(result, BaseException), result
    assert result.stdout == b"done\n"  # type: ignore[attr-defined]
    assert sb.run("wc -l < /tmp/ran").text.strip() == "1"  # never twice


# --------------------------------------------------------------------- watch


def test_a_watch_cut_by_the_api_server_s_death_ends_saying_so(
    rt: LocalCluster, client: Client
) -> None:
    with client.watch(task_id="cut") as changes, outage(rt) as killed:
        with pytest.raises(Unavailable) as info:
            next(changes)
        took = time.monotonic() - killed
    assert "the API server went away" in info.value.message, info.value
    assert took < 5.0, took
    assert list(changes) == []  # a cut watch is over

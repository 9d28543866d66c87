"""Every RPC of every dsec gRPC service, fed generated messages (tests/fuzz/protofuzz.py).

The methods are enumerated from the services' descriptors, so a new RPC is fuzzed the day
it is added. Each method gets, against the fuzz suite's own cluster (tests/fuzz/conftest.py:
generated calls that are valid and destructive, a drain, a delete, a revoked token, hurt
nobody else), with the real ids of two projects' sandboxes (one a container, so exec, files
and sessions reach chronus) among the ids it draws:

- generated messages, each sent to an authenticating service (API server, IAM) without a
  token, with a project's token and with the admin's;
- random bytes and the bytes of another message type (identity serializer: the server's
  parser sees them as they are).

Asserted per call: the status is a typed code, never INTERNAL or UNKNOWN; a unary call
answers before its deadline (a hang), unless the method is documented to wait (then it must
end when cancelled); a REFUSED call to a mutating method changed no sandbox and no quota
usage. After each method's batch every service answers health SERVING and a known-good call
works (what a destructive call broke, a deleted project or sandbox, a drained node, is made
again so the next method meets the same world); after all of them no service has logged an
ERROR (a crash in a background loop answers no call).

Bounded: ``DSEC_FUZZ_EXAMPLES`` (default 5) messages per method, derandomized unless
``DSEC_FUZZ_SEED`` is set.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from dsec.edge.v1 import edge_pb2
from dsec.iam.v1 import iam_pb2
from dsecctl.cluster import LocalCluster
from libdsec.errors import DSecError
from libdsec.sync import Client
from libdsec.types import Quota
from tests.fuzz import protofuzz
from tests.fuzz.protofuzz import IdPool

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("DSEC_FUZZ_EXAMPLES", "5"))
SEED = os.environ.get("DSEC_FUZZ_SEED")
#: A unary call's deadline: past it, the call hung.
UNARY_S = 5.0
#: How long a server stream is read before the test cancels it (watches never end).
STREAM_S = 0.3
#: Items read from a server stream at most.
STREAM_ITEMS = 10

#: gRPC process of each proto package.
PROCESSES = {
    "dsec.iam.v1": "iam",
    "dsec.apiserver.v1": "apiserver",
    "dsec.placement.v1": "placement",
    "dsec.watcher.v1": "watcher",
    "dsec.edge.v1": "edge-fz",
}
#: The cluster's edges (tests/fuzz/conftest.py): EdgeService is fuzzed on the null one.
EDGES = ("edge-fz", "edge-fzc")
#: Services a broken enumeration would miss (the set must contain them).
EXPECTED = {
    "dsec.iam.v1.IamService",
    "dsec.apiserver.v1.SandboxService",
    "dsec.apiserver.v1.ExecService",
    "dsec.apiserver.v1.FileService",
    "dsec.apiserver.v1.EnvironmentService",
    "dsec.apiserver.v1.FunctionService",
    "dsec.apiserver.v1.DisplayService",
    "dsec.apiserver.v1.ProjectService",
    "dsec.apiserver.v1.NodeService",
    "dsec.placement.v1.PlacementService",
    "dsec.watcher.v1.WatcherService",
    "dsec.edge.v1.EdgeService",
}
#: Methods documented to wait (long-poll) on valid input: the test cancels one still waiting
#: after STREAM_S (it must end then) instead of calling it a hang.
WAITING = {"WaitExec", "WaitForPort", "GetWatcherEvents"}
#: Method name prefixes that only read: the no-change check runs for every other method.
READ_ONLY = (
    "Get",
    "List",
    "Watch",
    "WhoAmI",
    "Stat",
    "Read",
    "Download",
    "Wait",
    "Authenticate",
    "Authorize",
)
#: Services that authenticate their callers: every generated message is sent without a
#: token, with a project's and with the admin's.
AUTHENTICATED = {"dsec.apiserver.v1", "dsec.iam.v1"}
#: Never an answer to bad input.
BUG_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def _modules() -> list[Any]:
    return [
        importlib.import_module(f"dsec.{p.split('.')[1]}.v1.{p.split('.')[1]}_pb2")
        for p in PROCESSES
    ]


def services() -> list[ServiceDescriptor]:
    """Every gRPC service of the dsec processes, from the generated modules' descriptors."""
    return [s for m in _modules() for s in m.DESCRIPTOR.services_by_name.values()]


def all_messages() -> list[Descriptor]:
    out: dict[str, Descriptor] = {}
    for s in services():
        for m in s.methods:
            out[m.input_type.full_name] = m.input_type
            out[m.output_type.full_name] = m.output_type
    return sorted(out.values(), key=lambda d: d.full_name)


METHODS: list[MethodDescriptor] = [m for s in services() for m in s.methods]


def test_enumeration_finds_every_service() -> None:
    names = {s.full_name for s in services()}
    assert EXPECTED <= names, EXPECTED - names
    assert len(METHODS) > 150  # ~200 today: a broken walk finds a handful
    assert {"CreateSandbox", "Exec", "RegisterEdge", "PlaceSandbox", "ReserveQuota"} <= {
        m.name for m in METHODS
    }


# ---------------------------------------------------------------- the world


@dataclass
class World:
    """The cluster and the objects generated calls aim at (their ids are in ``ids``)."""

    cluster: LocalCluster
    admin: str
    ids: IdPool = field(default_factory=IdPool)
    tokens: dict[str, str] = field(default_factory=dict)  # "a", "b" -> secret
    token_ids: dict[str, str] = field(default_factory=dict)  # "a", "b" -> its id
    projects: dict[str, str] = field(default_factory=dict)  # "a", "b" -> project id
    #: "a", "b" -> a null-runtime sandbox of that project; "c" -> project a's container
    #: sandbox (exec, files and sessions reach chronus through it)
    sandboxes: dict[str, str] = field(default_factory=dict)
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    #: The last snapshot, while no call has succeeded since (None: read it again).
    last: tuple[Any, ...] | None = None

    def channel(self, process: str) -> grpc.Channel:
        if process not in self.channels:
            self.channels[process] = grpc.insecure_channel(
                self.cluster.process(process).address,
                options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
            )
        return self.channels[process]

    def project(self, key: str) -> None:
        """Project ``key`` with a token and one running sandbox (made again when gone)."""
        with Client(self.cluster.apiserver, token=self.admin, timeout=15) as admin:
            pid = self.projects.get(key, "")
            alive = False
            if pid:
                try:
                    admin.get_project(pid)
                    alive = True
                except Exception:
                    alive = False
            if not alive:
                pid = admin.create_project(
                    f"fuzz-{key}-{time.monotonic_ns()}", quota=Quota()
                ).project_id
                self.projects[key] = pid
                self.tokens.pop(key, None)
                self.sandboxes.pop(key, None)
                self.sandboxes.pop("c", None)
            else:
                admin.set_quota(pid, Quota())  # generated SetQuota calls may have closed it
            # Revoked by a generated RevokeToken? Asked of IAM's list, not by using the token:
            # an API server trusts a token it checked for a few seconds.
            live = {t.token_id for t in admin.list_tokens(pid)}
            if key not in self.tokens or self.token_ids.get(key) not in live:
                t = admin.create_token(f"fuzz-{key}", project=pid, agent=True)
                self.tokens[key] = t.secret
                self.token_ids[key] = t.info.token_id
                self.ids.add(t.info.token_id, kind="token")
            self.ids.add(pid, kind="project")
        with Client(self.cluster.apiserver, token=self.tokens[key], timeout=15) as cl:
            running = {s.id for s in cl.list() if s.state == "RUNNING"}
            if self.sandboxes.get(key) not in running:
                sb = cl.create(
                    image="busybox",
                    cpu=0.1,
                    memory_mb=32,
                    timeout=30,
                    ttl_s=3600,
                    node_selector={"fuzz": "null"},
                )
                self.sandboxes[key] = sb.id
                self.ids.add(sb.id, kind="sandbox")
            if key == "a" and self.sandboxes.get("c") not in running:
                self.container_sandbox(cl)

    def container_sandbox(self, cl: Client) -> None:
        """Project a's sandbox on the container edge, which stays drained otherwise: the
        creates the fuzz generates land on the null edge, not as real containers."""
        self.drain("edge-fzc", False)
        deadline = time.monotonic() + 20
        while True:
            try:
                sb = cl.create(
                    image="busybox",
                    cpu=0.1,
                    memory_mb=64,
                    timeout=60,
                    ttl_s=3600,
                    node_selector={"fuzz": "container"},
                )
                break
            except DSecError:
                # placement sees the undrain with the edge's next registration (2 s)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        self.sandboxes["c"] = sb.id
        self.ids.add(sb.id, kind="sandbox")

    def drain(self, edge_process: str, draining: bool) -> None:
        edge = edge_pb2.DESCRIPTOR.services_by_name["EdgeService"]
        request = edge_pb2.SetDrainingRequest(draining=draining, reason="fuzz")
        out = _unary(
            self.channel(edge_process),
            edge.methods_by_name["SetDraining"],
            request.SerializeToString(),
            None,
        )
        assert out.code == grpc.StatusCode.OK, out

    def repair(self) -> None:
        """Undoes what valid destructive calls did: a drained edge, a deleted project."""
        self.last = None  # first: what follows changes the world, even if it fails halfway
        self.drain("edge-fz", False)
        for key in ("a", "b"):
            self.project(key)
        self.drain("edge-fzc", True)

    def snapshot(self) -> tuple[Any, ...]:
        """What a refused call must not change: the edges' sandboxes and the projects' usage."""
        edge = edge_pb2.DESCRIPTOR.services_by_name["EdgeService"]
        found = []
        for name in EDGES:
            raw = self.channel(name).unary_unary(
                f"/{edge.full_name}/ListSandboxes",
                request_serializer=None,
                response_deserializer=edge_pb2.ListSandboxesResponse.FromString,
            )(edge_pb2.ListSandboxesRequest(include_terminated=True).SerializeToString(), timeout=5)
            found += [(s.id, s.state) for s in raw.sandboxes]
        sandboxes = tuple(sorted(found))
        usage = []
        get_usage = self.channel("iam").unary_unary(
            "/dsec.iam.v1.IamService/GetUsage",
            request_serializer=None,
            response_deserializer=iam_pb2.GetUsageResponse.FromString,
        )
        for pid in self.projects.values():
            u = get_usage(
                iam_pb2.GetUsageRequest(project_id=pid).SerializeToString(),
                timeout=5,
                metadata=_metadata(self.admin),
            )
            usage.append((pid, u.usage.SerializeToString(deterministic=True)))
        return sandboxes, tuple(usage)

    def settled_snapshot(self) -> tuple[Any, ...]:
        """A snapshot that two reads agree on (an earlier successful call may still be
        taking effect: a stop in progress)."""
        last = self.snapshot()
        for _ in range(20):
            time.sleep(0.05)
            now = self.snapshot()
            if now == last:
                return now
            last = now
        return last

    def healthy(self) -> None:
        for p in self.cluster.processes:
            if p.protocol != "grpc":
                continue
            stub = health_pb2_grpc.HealthStub(self.channel(p.name))
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING, f"{p.name}: {status}"


@pytest.fixture(scope="module")
def world(fuzz_cluster: LocalCluster) -> Iterator[World]:
    w = World(fuzz_cluster, admin=fuzz_cluster.token)
    try:
        w.ids.add("fz", "fzc", kind="edge")
        w.ids.add("fz", "fzc", kind="node")
        w.repair()
        yield w
    finally:
        for ch in w.channels.values():
            ch.close()


# ---------------------------------------------------------------- calling


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str = ""


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def _path(m: MethodDescriptor) -> str:
    return f"/{m.containing_service.full_name}/{m.name}"


def _unary(ch: grpc.Channel, m: MethodDescriptor, payload: bytes, token: str | None) -> Outcome:
    if m.name in WAITING:
        return _waiting(ch, m, payload, token)
    try:
        ch.unary_unary(_path(m))(payload, timeout=UNARY_S, metadata=_metadata(token))
        return Outcome(grpc.StatusCode.OK)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "")  # type: ignore[attr-defined]


def _waiting(ch: grpc.Channel, m: MethodDescriptor, payload: bytes, token: str | None) -> Outcome:
    """A method documented to wait: still waiting after STREAM_S is fine, then it must end
    when cancelled (the future reports it at once; the server letting go is checked by the
    batch's health and known-good calls)."""
    future = ch.unary_unary(_path(m)).future(payload, timeout=UNARY_S, metadata=_metadata(token))
    try:
        future.result(timeout=STREAM_S)
        return Outcome(grpc.StatusCode.OK)
    except grpc.FutureTimeoutError:
        assert future.cancel(), f"{_path(m)} could not be cancelled"
        return Outcome(grpc.StatusCode.OK, "waiting; cancelled by the test")
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "")  # type: ignore[attr-defined]


def _client_stream(
    ch: grpc.Channel, m: MethodDescriptor, payloads: list[bytes], token: str | None
) -> Outcome:
    try:
        ch.stream_unary(_path(m))(iter(payloads), timeout=UNARY_S, metadata=_metadata(token))
        return Outcome(grpc.StatusCode.OK)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "")  # type: ignore[attr-defined]


def _server_stream(
    ch: grpc.Channel, m: MethodDescriptor, payloads: list[bytes], token: str | None
) -> Outcome:
    """Reads at most STREAM_ITEMS items for STREAM_S, then cancels (a stream that waits for
    events is fine); CANCELLED is ours, so it counts as OK."""
    md = _metadata(token)
    if m.client_streaming:
        call = ch.stream_stream(_path(m))(iter(payloads), timeout=30, metadata=md)
    else:
        call = ch.unary_stream(_path(m))(payloads[0], timeout=30, metadata=md)
    timer = threading.Timer(STREAM_S, call.cancel)
    timer.start()
    try:
        for n, _ in enumerate(call):
            if n + 1 >= STREAM_ITEMS:
                break
        return Outcome(grpc.StatusCode.OK)
    except grpc.RpcError as e:
        code = e.code()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.CANCELLED and call.cancelled():
            return Outcome(grpc.StatusCode.OK, "cancelled by the test")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            # 30 s without the test's cancel taking effect: the stream ignored it.
            return Outcome(code, "stream did not end when cancelled")
        return Outcome(code, e.details() or "")  # type: ignore[attr-defined]
    finally:
        timer.cancel()
        call.cancel()


def send(w: World, m: MethodDescriptor, payloads: list[bytes], token: str | None) -> Outcome:
    ch = w.channel(PROCESSES[m.containing_service.file.package])
    if m.server_streaming:
        return _server_stream(ch, m, payloads, token)
    if m.client_streaming:
        return _client_stream(ch, m, payloads, token)
    return _unary(ch, m, payloads[0], token)


def check(w: World, m: MethodDescriptor, payloads: list[bytes], token_key: str) -> None:
    token = {"none": None, "admin": w.admin}.get(token_key, w.tokens.get(token_key))
    mutating = not m.name.startswith(READ_ONLY)
    before = None
    if mutating:
        # After a refused call the world is what the last snapshot saw; after a successful
        # one (a stop may still be under way) it is read again until it holds still.
        before = w.last if w.last is not None else w.settled_snapshot()
    out = send(w, m, payloads, token)
    if out.code == grpc.StatusCode.OK:
        w.last = None
    assert out.code not in BUG_CODES, f"{_path(m)} answered {out.code.name}: {out.details}"
    assert out.code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{_path(m)} hung: {out.details}"
    if mutating and out.code != grpc.StatusCode.OK:
        after = w.snapshot()
        assert after == before, (
            f"{_path(m)} refused ({out.code.name}) yet changed {before} -> {after}"
        )
        w.last = after


def _settings(n: int) -> settings:
    return settings(
        max_examples=n,
        derandomize=SEED is None,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


OTHERS = all_messages()


@pytest.mark.parametrize("method", METHODS, ids=_path)
def test_method(world: World, method: MethodDescriptor) -> None:
    msgs = protofuzz.messages(method.input_type, world.ids)
    count = st.integers(1, 3) if method.client_streaming else st.just(1)

    @_settings(EXAMPLES)
    @given(data=st.data())
    def generated(data: st.DataObject) -> None:
        n = data.draw(count)
        payloads = [data.draw(msgs).SerializeToString() for _ in range(n)]
        if method.containing_service.file.package in AUTHENTICATED:
            for auth in ("none", "a", "admin"):
                check(world, method, payloads, auth)
        else:  # a cluster-internal service: tokens are not read
            check(world, method, payloads, data.draw(st.sampled_from(["none", "a"])))

    @_settings(max(1, EXAMPLES // 2))
    @given(data=st.data())
    def raw(data: st.DataObject) -> None:
        payload = data.draw(
            st.one_of(
                protofuzz.raw_bytes(),
                protofuzz.wrong_type_payloads(method.input_type, OTHERS, world.ids),
            )
        )
        check(world, method, [payload], data.draw(st.sampled_from(["a", "admin"])))

    if SEED is not None:
        generated = seed(int(SEED))(generated)
        raw = seed(int(SEED))(raw)
    try:
        generated()
        raw()
    finally:
        world.healthy()
        world.repair()


def test_no_service_logged_an_error(world: World) -> None:
    """Last (file order): a crash in a background loop answers no call, so the logs are
    read: no ERROR line in any service's log after the whole batch (an unhandled error in a
    handler is logged there too, with its incident id)."""
    errors = []
    for p in world.cluster.processes:
        for line in p.log_path.read_text(errors="replace").splitlines():
            if '"level":"ERROR"' in line or '"level":"CRITICAL"' in line:
                errors.append(f"{p.name}: {line[:400]}")
    assert not errors, "\n".join(errors)

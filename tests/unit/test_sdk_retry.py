"""The SDK's retry of idempotent calls on UNAVAILABLE (libdsec/_transport.py, Transport.unary)
against a real gRPC server on a Unix socket whose servicer answers from a script: UNAVAILABLE a
number of times, then an answer (or a hang, or another error). It counts and times the
attempts: the backoff between them, the deadline they stop at, what is never retried, and the
idempotency keys the SDK's creates carry."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from common.grpc_server import GrpcServer
from dsec.apiserver.v1 import apiserver_pb2
from dsec.types.v1 import types_pb2
from libdsec import AsyncClient, _transport
from libdsec._transport import RETRY_FIRST_BACKOFF_S, RETRY_MAX_BACKOFF_S, Transport
from libdsec.errors import DeadlineExceeded, DSecError, Unavailable


class Scripted:
    """Answers each call with the next outcome of its method's script, then with an answer once
    the script is used up: an error to raise, or ``"hang"`` (no answer until cancelled)."""

    def __init__(self) -> None:
        self.script: dict[str, list[DSecError | str]] = {}
        #: Per method, when each attempt arrived (monotonic) and its request.
        self.attempts: dict[str, list[tuple[float, Any]]] = {}

    async def _attempt(self, method: str, request: Any) -> None:
        self.attempts.setdefault(method, []).append((time.monotonic(), request))
        script = self.script.get(method, [])
        if not script:
            return
        outcome = script.pop(0)
        if outcome == "hang":
            await asyncio.sleep(3600)
        assert isinstance(outcome, DSecError)
        raise outcome

    def times(self, method: str) -> list[float]:
        return [t for t, _ in self.attempts.get(method, [])]

    def requests(self, method: str) -> list[Any]:
        return [r for _, r in self.attempts.get(method, [])]

    async def GetSandbox(self, request: Any, context: Any) -> Any:
        await self._attempt("GetSandbox", request)
        return apiserver_pb2.GetSandboxResponse()

    async def CreateSandbox(self, request: Any, context: Any) -> Any:
        await self._attempt("CreateSandbox", request)
        return apiserver_pb2.CreateSandboxResponse()

    async def Exec(self, request: Any, context: Any) -> Any:
        await self._attempt("Exec", request)
        return types_pb2.ExecResult(exec_id="ex-1", exit=types_pb2.ExitStatus(exit_code=0))

    async def CreateSandboxes(self, request: Any, context: Any) -> Any:
        await self._attempt("CreateSandboxes", request)
        out = apiserver_pb2.CreateSandboxesResponse()
        for i in range(len(request.items)):
            out.results.add(index=i)
        return out


def restarting(n: int) -> list[DSecError | str]:
    """What a restarting API server answers n calls (its own UNAVAILABLE)."""
    return [Unavailable("restarting") for _ in range(n)]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Scripted, Transport]]:
    servicer = Scripted()
    server = GrpcServer("test", f"unix:{tmp_path / 'api.sock'}")
    server.add(servicer, "dsec.apiserver.v1.SandboxService")
    server.add(servicer, "dsec.apiserver.v1.ExecService")
    await server.start()
    transport = Transport(server.address, "token")
    try:
        yield servicer, transport
    finally:
        await transport.close()
        assert server.server is not None
        await server.server.stop(None)


async def test_an_idempotent_call_is_retried_with_a_growing_backoff(
    served: tuple[Scripted, Transport],
) -> None:
    servicer, t = served
    servicer.script["GetSandbox"] = restarting(4)
    await t.unary(t.sandboxes.GetSandbox, apiserver_pb2.GetSandboxRequest(), timeout=10)
    times = servicer.times("GetSandbox")
    assert len(times) == 5  # four UNAVAILABLE, the fifth answered
    gaps = [b - a for a, b in itertools.pairwise(times)]
    for i, gap in enumerate(gaps):
        backoff = min(RETRY_FIRST_BACKOFF_S * 2**i, RETRY_MAX_BACKOFF_S)
        assert backoff / 2 <= gap < backoff + 0.5, (i, gaps)  # jittered in [backoff/2, backoff]


async def test_retries_stop_at_the_deadline_naming_the_last_error(
    served: tuple[Scripted, Transport],
) -> None:
    servicer, t = served
    servicer.script["GetSandbox"] = restarting(1000)
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        await t.unary(t.sandboxes.GetSandbox, apiserver_pb2.GetSandboxRequest(), timeout=1.5)
    took = time.monotonic() - start
    # It gives up when the next pause would pass the deadline: at most a (capped) pause early.
    assert 1.5 - RETRY_MAX_BACKOFF_S <= took < 2.0, took
    attempts = len(servicer.times("GetSandbox"))
    assert 4 <= attempts <= 8, attempts  # 50 ms doubling: a handful, not a busy loop
    assert "GetSandbox" in info.value.message and "restarting" in info.value.message
    assert f"{attempts} attempts" in info.value.message
    assert isinstance(info.value.__cause__, Unavailable)


async def test_each_attempt_gets_only_the_time_left(served: tuple[Scripted, Transport]) -> None:
    servicer, t = served
    servicer.script["GetSandbox"] = [*restarting(1), "hang"]
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await t.unary(t.sandboxes.GetSandbox, apiserver_pb2.GetSandboxRequest(), timeout=1.0)
    assert time.monotonic() - start < 1.5  # the hung second attempt ends at the call's deadline
    assert len(servicer.times("GetSandbox")) == 2


async def test_without_a_timeout_the_retries_are_bounded(
    served: tuple[Scripted, Transport], monkeypatch: pytest.MonkeyPatch
) -> None:
    servicer, t = served
    servicer.script["GetSandbox"] = restarting(1000)
    monkeypatch.setattr(_transport, "DEFAULT_TIMEOUT_S", 1.0)
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await t.unary(t.sandboxes.GetSandbox, apiserver_pb2.GetSandboxRequest(), timeout=None)
    assert time.monotonic() - start < 1.5


async def test_what_may_not_run_twice_is_not_retried(served: tuple[Scripted, Transport]) -> None:
    servicer, t = served
    servicer.script["CreateSandbox"] = restarting(3)
    with pytest.raises(Unavailable):  # no key: the first attempt may have created it
        await t.unary(t.sandboxes.CreateSandbox, apiserver_pb2.CreateSandboxRequest(), timeout=5)
    assert len(servicer.times("CreateSandbox")) == 1
    keyed = apiserver_pb2.CreateSandboxRequest(idempotency_key="k")
    await t.unary(t.sandboxes.CreateSandbox, keyed, timeout=5)
    assert len(servicer.times("CreateSandbox")) == 4  # two more UNAVAILABLE, then the answer

    one_unkeyed = apiserver_pb2.CreateSandboxesRequest()
    one_unkeyed.items.add(idempotency_key="a")
    one_unkeyed.items.add()
    servicer.script["CreateSandboxes"] = restarting(2)
    with pytest.raises(Unavailable):
        await t.unary(t.sandboxes.CreateSandboxes, one_unkeyed, timeout=5)
    assert len(servicer.times("CreateSandboxes")) == 1
    one_unkeyed.items[1].idempotency_key = "b"
    await t.unary(t.sandboxes.CreateSandboxes, one_unkeyed, timeout=5)
    assert len(servicer.times("CreateSandboxes")) == 3


async def test_a_resource_s_own_unavailable_is_raised_at_once(
    served: tuple[Scripted, Transport],
) -> None:
    servicer, t = served
    servicer.script["GetSandbox"] = [Unavailable("no layer store", reason="STORE_UNAVAILABLE")]
    with pytest.raises(Unavailable) as info:
        await t.unary(t.sandboxes.GetSandbox, apiserver_pb2.GetSandboxRequest(), timeout=5)
    assert info.value.reason == "STORE_UNAVAILABLE"
    assert len(servicer.times("GetSandbox")) == 1
    # A service behind the API server restarting is retried like the API server itself.
    servicer.script["GetSandbox"] = [Unavailable("iam: restarting", reason="IAM_UNAVAILABLE")]
    await t.unary(t.sandboxes.GetSandbox, apiserver_pb2.GetSandboxRequest(), timeout=5)
    assert len(servicer.times("GetSandbox")) == 3


async def test_the_sdk_keys_every_create_so_its_retries_make_one_sandbox(
    served: tuple[Scripted, Transport],
) -> None:
    servicer, t = served
    async with AsyncClient(t.target, token="token") as dsec:
        servicer.script["CreateSandbox"] = restarting(2)
        await dsec.create(image="busybox", timeout=5)
        keys = [r.idempotency_key for r in servicer.requests("CreateSandbox")]
        assert len(keys) == 3 and len(set(keys)) == 1 and keys[0].startswith("sdk-")
        await dsec.create(image="busybox", timeout=5)
        assert servicer.requests("CreateSandbox")[-1].idempotency_key not in ("", keys[0])
        await dsec.create(image="busybox", idempotency_key="mine", timeout=5)
        assert servicer.requests("CreateSandbox")[-1].idempotency_key == "mine"

        servicer.script["CreateSandboxes"] = restarting(1)
        await dsec.create_many(3, image="busybox", timeout=5)
        first, again = servicer.requests("CreateSandboxes")
        keys = [item.idempotency_key for item in first.items]
        assert len(set(keys)) == 3 and all(k.startswith("sdk-") for k in keys)
        assert [item.idempotency_key for item in again.items] == keys  # the retry: same keys
        await dsec.create_many(specs=[{"image": "busybox", "idempotency_key": "x"}, {}])
        last = servicer.requests("CreateSandboxes")[-1]
        assert last.items[0].idempotency_key == "x" and last.items[1].idempotency_key


async def test_a_command_with_an_operation_id_is_retried_under_the_same_id(
    served: tuple[Scripted, Transport],
) -> None:
    """Its edge runs an operation id once: the SDK retries a run like a read, with one id."""
    servicer, t = served
    servicer.script["Exec"] = restarting(2)
    with pytest.raises(Unavailable):  # no id: it may have run
        await t.unary(t.exec.Exec, types_pb2.ExecRequest(command="x"), timeout=5)
    assert len(servicer.times("Exec")) == 1
    async with AsyncClient(t.target, token="token") as dsec:
        sb = await dsec.get("sb-e0-0000000000000001", timeout=5)  # scripted: any answer
        servicer.script["Exec"] = restarting(2)
        await sb.run("make install", timeout_s=5)
        ids = [r.operation_id for r in servicer.requests("Exec")[1:]]
        assert len(ids) == 3 and len(set(ids)) == 1 and ids[0].startswith("sdk-")
        await sb.run("make install", operation_id="ep1-turn1", timeout_s=5)
        assert servicer.requests("Exec")[-1].operation_id == "ep1-turn1"

"""Tagged job streams (StreamFunctions) over real in-process gRPC: both sides of the
multiplexing (libdsec._tagged, common.tagged), with a servicer whose jobs are scripted by
their code ("sleep:0.2", "fail", "bug", "hang")."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from common.grpc_server import GrpcServer, internal_error
from common.tagged import serve_tagged
from dsec.apiserver.v1 import apiserver_pb2, apiserver_pb2_grpc
from dsec.types.v1 import types_pb2
from libdsec._tagged import TaggedStream, stream_failed
from libdsec.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    Unavailable,
    Unimplemented,
)


class Jobs:
    def __init__(self) -> None:
        self.keepalive_s = 0.2
        self.cancelled: list[str] = []
        self.started = 0

    async def run(self, request: Any) -> types_pb2.FunctionResult:
        self.started += 1
        code = request.job.code
        try:
            if code.startswith("sleep:"):
                await asyncio.sleep(float(code[6:]))
            elif code == "fail":
                raise InvalidArgument("no such language", reason="UNKNOWN_LANGUAGE")
            elif code == "bug":
                raise ZeroDivisionError("internals")
            elif code == "hang":
                await asyncio.sleep(3600)
            elif code == "inner-cancel":  # e.g. a downstream call whose channel closed
                raise asyncio.CancelledError
        except asyncio.CancelledError:
            self.cancelled.append(code)
            raise
        return types_pb2.FunctionResult(stdout=code.encode(), job_id=request.job.job_id)

    async def StreamFunctions(
        self, requests: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        async for item in serve_tagged(
            requests,
            self.run,
            apiserver_pb2.StreamFunctionsResponse,
            internal=lambda exc: internal_error("test job", exc),
            keepalive_s=self.keepalive_s,
        ):
            yield item


@pytest.fixture
async def served() -> AsyncIterator[tuple[Jobs, GrpcServer]]:
    jobs = Jobs()
    s = GrpcServer("test", "127.0.0.1:0")
    s.add(jobs, "dsec.apiserver.v1.FunctionService")
    await s.start()
    yield jobs, s
    assert s.server is not None
    await s.server.stop(None)


def _request(code: str, job_id: str = "") -> Any:
    return apiserver_pb2.StreamFunctionsRequest(job=types_pb2.FunctionJob(code=code, job_id=job_id))


async def test_concurrent_callers_each_get_their_own_answer(
    served: tuple[Jobs, GrpcServer],
) -> None:
    jobs, server = served
    async with grpc.aio.insecure_channel(server.address) as ch:
        stream = TaggedStream(apiserver_pb2_grpc.FunctionServiceStub(ch).StreamFunctions)

        async def one(i: int) -> None:
            code = f"sleep:{random.random() / 10:.3f}"
            msg = await stream.call(_request(code, job_id=str(i)), timeout=10)
            assert msg.result.stdout == code.encode() and msg.result.job_id == str(i)

        await asyncio.gather(*(one(i) for i in range(60)))
        assert jobs.started == 60  # one stream, sixty jobs, every answer matched
        await stream.aclose()


async def test_one_jobs_error_is_that_jobs_alone(served: tuple[Jobs, GrpcServer]) -> None:
    _, server = served
    async with grpc.aio.insecure_channel(server.address) as ch:
        stream = TaggedStream(apiserver_pb2_grpc.FunctionServiceStub(ch).StreamFunctions)
        ok, bad, bug = await asyncio.gather(
            stream.call(_request("sleep:0.1"), timeout=10),
            stream.call(_request("fail"), timeout=10),
            stream.call(_request("bug"), timeout=10),
            return_exceptions=True,
        )
        assert not isinstance(ok, BaseException) and ok.result.stdout == b"sleep:0.1"
        assert isinstance(bad, InvalidArgument) and bad.reason == "UNKNOWN_LANGUAGE"
        assert isinstance(bug, Internal) and "internals" not in str(bug)  # no leak of details
        # the stream goes on
        assert (await stream.call(_request("x"), timeout=10)).result.stdout == b"x"
        await stream.aclose()


async def test_a_caller_that_gives_up_cancels_its_job(served: tuple[Jobs, GrpcServer]) -> None:
    jobs, server = served
    async with grpc.aio.insecure_channel(server.address) as ch:
        stream = TaggedStream(apiserver_pb2_grpc.FunctionServiceStub(ch).StreamFunctions)
        with pytest.raises(DeadlineExceeded):
            await stream.call(_request("hang"), timeout=0.3)
        for _ in range(100):
            if jobs.cancelled:
                break
            await asyncio.sleep(0.02)
        assert jobs.cancelled == ["hang"]
        # a cancelled asyncio caller too
        task = asyncio.ensure_future(stream.call(_request("hang"), timeout=10))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if len(jobs.cancelled) == 2:
                break
            await asyncio.sleep(0.02)
        assert jobs.cancelled == ["hang", "hang"]
        await stream.aclose()


async def test_long_jobs_live_on_keepalives_and_a_silent_stream_is_stalled(
    served: tuple[Jobs, GrpcServer],
) -> None:
    jobs, server = served
    async with grpc.aio.insecure_channel(server.address) as ch:
        stub = apiserver_pb2_grpc.FunctionServiceStub(ch)
        # keepalives every 0.2 s: a 1.2 s job outlives a 0.6 s idle timeout
        stream = TaggedStream(stub.StreamFunctions, idle_timeout_s=0.6)
        msg = await stream.call(_request("sleep:1.2"), timeout=10)
        assert msg.result.stdout == b"sleep:1.2"
        await stream.aclose()
        # no keepalives: the caller must not wait for the job's own (long) deadline
        jobs.keepalive_s = 30.0
        stream = TaggedStream(stub.StreamFunctions, idle_timeout_s=0.6)
        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(DeadlineExceeded) as info:
            await stream.call(_request("sleep:5"), timeout=60)
        assert info.value.reason == "STREAM_STALLED" and loop.time() - t < 3
        await stream.aclose()


async def test_a_dying_server_fails_every_waiting_caller(
    served: tuple[Jobs, GrpcServer],
) -> None:
    _, server = served
    async with grpc.aio.insecure_channel(server.address) as ch:
        stream = TaggedStream(apiserver_pb2_grpc.FunctionServiceStub(ch).StreamFunctions)
        waiting = [
            asyncio.ensure_future(stream.call(_request("hang"), timeout=60)) for _ in range(5)
        ]
        await asyncio.sleep(0.3)
        assert server.server is not None
        await server.server.stop(None)
        done, _ = await asyncio.wait(waiting, timeout=5)
        assert len(done) == 5
        for task in done:
            exc = task.exception()
            assert isinstance(exc, Unavailable), exc  # what to do: retry later
        await stream.aclose()


async def test_the_protocol_refuses_bad_tags_and_ends_when_every_job_answered(
    served: tuple[Jobs, GrpcServer],
) -> None:
    _, server = served
    async with grpc.aio.insecure_channel(server.address) as ch:
        call = apiserver_pb2_grpc.FunctionServiceStub(ch).StreamFunctions()
        job = types_pb2.FunctionJob(code="sleep:0.3")
        await call.write(apiserver_pb2.StreamFunctionsRequest(tag=7, job=job))
        await call.write(apiserver_pb2.StreamFunctionsRequest(tag=7, job=job))
        await call.write(apiserver_pb2.StreamFunctionsRequest(tag=0, job=job))
        await call.done_writing()
        answers = [msg async for msg in call]  # ends after job 7: the caller closed its side
        real = [m for m in answers if m.tag or m.error.code]
        reasons = sorted(m.error.reason for m in real if m.error.code)
        assert reasons == ["BAD_TAG", "TAG_IN_USE"]
        assert all(m.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for m in real[:2])
        assert [m.result.stdout for m in real if not m.error.code] == [b"sleep:0.3"]


async def test_an_idle_stream_is_not_stalled_and_the_clock_starts_with_the_first_waiter(
    served: tuple[Jobs, GrpcServer],
) -> None:
    jobs, server = served
    jobs.keepalive_s = 30.0  # a silent server
    async with grpc.aio.insecure_channel(server.address) as ch:
        stream = TaggedStream(
            apiserver_pb2_grpc.FunctionServiceStub(ch).StreamFunctions, idle_timeout_s=0.6
        )
        assert (await stream.call(_request("sleep:0.05"), timeout=5)).result.stdout
        with pytest.raises(DeadlineExceeded):
            await stream.call(_request("hang"), timeout=0.2)  # gives up: nobody waits now
        await asyncio.sleep(0.3)
        # a new waiter gets a full idle period of its own, not what was left of the last one's
        msg = await stream.call(_request("sleep:0.4"), timeout=5)
        assert msg.result.stdout == b"sleep:0.4"
        await asyncio.sleep(0.8)  # idle past the timeout, nobody waiting: not a stall
        assert (await stream.call(_request("x"), timeout=5)).result.stdout == b"x"
        await stream.aclose()


async def test_a_job_too_large_is_refused_alone(served: tuple[Jobs, GrpcServer]) -> None:
    _, server = served
    async with grpc.aio.insecure_channel(server.address) as ch:
        stream = TaggedStream(
            apiserver_pb2_grpc.FunctionServiceStub(ch).StreamFunctions, max_request_bytes=1000
        )
        other = asyncio.ensure_future(stream.call(_request("sleep:0.2"), timeout=5))
        with pytest.raises(InvalidArgument) as info:
            await stream.call(_request("x" * 2000), timeout=5)
        assert info.value.reason == "JOB_TOO_LARGE" and not stream_failed(info.value)
        assert (await other).result.stdout == b"sleep:0.2"  # the stream was not touched
        await stream.aclose()


async def test_a_cancellation_inside_a_job_is_answered(served: tuple[Jobs, GrpcServer]) -> None:
    _, server = served
    async with grpc.aio.insecure_channel(server.address) as ch:
        stream = TaggedStream(apiserver_pb2_grpc.FunctionServiceStub(ch).StreamFunctions)
        with pytest.raises(Unavailable) as info:
            await stream.call(_request("inner-cancel"), timeout=5)
        assert info.value.reason == "CANCELLED" and not stream_failed(info.value)
        await stream.aclose()


async def test_a_server_without_the_stream_is_a_stream_failure() -> None:
    s = GrpcServer("test", "127.0.0.1:0")  # no FunctionService at all
    await s.start()
    try:
        async with grpc.aio.insecure_channel(s.address) as ch:
            stream = TaggedStream(apiserver_pb2_grpc.FunctionServiceStub(ch).StreamFunctions)
            with pytest.raises(Unimplemented) as info:
                await stream.call(_request("x"), timeout=5)
            assert stream_failed(info.value)  # what tells the SDK to fall back to unary calls
            await stream.aclose()
    finally:
        assert s.server is not None
        await s.server.stop(None)


class Refusing:
    """A stream that ends at once, before reading anything (the API server's bad token)."""

    async def StreamFunctions(self, requests: AsyncIterator[Any], context: Any) -> Any:
        from libdsec.errors import Unauthenticated

        raise Unauthenticated("no such token", reason="INVALID_TOKEN")
        yield  # pragma: no cover - makes this a stream handler


async def test_a_stream_refused_at_once_fails_its_job_with_the_servers_status() -> None:
    """The refusal races the first request being written; whichever comes first, the caller
    must see the server's status. (When the refusal wins, gRPC may report the failed send, a
    generic INTERNAL, as the call's status: ~1 in 500 here under CPU load. Nothing was sent,
    so the stream sends the job again on a new one.)"""
    from libdsec.errors import Unauthenticated

    s = GrpcServer("test", "127.0.0.1:0")
    s.add(Refusing(), "dsec.apiserver.v1.FunctionService")
    await s.start()
    seen: dict[str, int] = {}
    try:
        async with grpc.aio.insecure_channel(s.address) as ch:
            stub = apiserver_pb2_grpc.FunctionServiceStub(ch)
            for _ in range(1000):
                stream = TaggedStream(stub.StreamFunctions)
                try:
                    await stream.call(_request("x"), timeout=10)
                except Exception as exc:
                    seen[type(exc).__name__] = seen.get(type(exc).__name__, 0) + 1
                await stream.aclose()
    finally:
        assert s.server is not None
        await s.server.stop(None)
    assert seen == {Unauthenticated.__name__: 1000}, seen

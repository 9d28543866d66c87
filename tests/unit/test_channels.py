"""The one definition of channel options and retries (libdsec/_transport.py), as the SDK and
the services use it: gRPC really retries UNAVAILABLE on what each side marks idempotent, and
nothing else (real in-process gRPC, a servicer that fails its first calls)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from common.channels import open_channel
from common.grpc_server import GrpcServer
from dsec.apiserver.v1 import apiserver_pb2
from dsec.iam.v1 import iam_pb2, iam_pb2_grpc
from libdsec import errors
from libdsec._transport import Transport


class Flaky:
    """Each method answers UNAVAILABLE to its first ``failures`` calls, then succeeds."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: dict[str, int] = {}

    def _attempt(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self.calls[method] <= self.failures:
            raise errors.Unavailable("restarting")

    async def GetSandbox(self, request: Any, context: Any) -> Any:
        self._attempt("GetSandbox")
        return apiserver_pb2.GetSandboxResponse()

    async def CreateSandbox(self, request: Any, context: Any) -> Any:
        self._attempt("CreateSandbox")
        return apiserver_pb2.CreateSandboxResponse()

    async def GetProject(self, request: Any, context: Any) -> Any:
        self._attempt("GetProject")
        return iam_pb2.GetProjectResponse()


@pytest.fixture
async def flaky() -> AsyncIterator[tuple[Flaky, GrpcServer]]:
    servicer = Flaky(failures=2)
    s = GrpcServer("test", "127.0.0.1:0")
    s.add(servicer, "dsec.apiserver.v1.SandboxService")
    s.add(servicer, "dsec.iam.v1.IamService")
    await s.start()
    yield servicer, s
    assert s.server is not None
    await s.server.stop(None)


async def test_the_sdk_retries_its_idempotent_methods_only(
    flaky: tuple[Flaky, GrpcServer],
) -> None:
    servicer, server = flaky
    t = Transport(server.address, "token")
    try:
        await t.unary(t.sandboxes.GetSandbox, apiserver_pb2.GetSandboxRequest(), timeout=10)
        assert servicer.calls["GetSandbox"] == 3  # two UNAVAILABLE, retried, then the answer
        with pytest.raises(errors.Unavailable):  # a create may have happened: not retried
            await t.unary(
                t.sandboxes.CreateSandbox, apiserver_pb2.CreateSandboxRequest(), timeout=10
            )
        assert servicer.calls["CreateSandbox"] == 1
    finally:
        await t.close()


@pytest.mark.parametrize("marked", [True, False])
async def test_service_channels_retry_the_services_their_caller_marks(
    flaky: tuple[Flaky, GrpcServer], marked: bool
) -> None:
    servicer, server = flaky
    ch = open_channel(
        server.address, "test", retry_services=["dsec.iam.v1.IamService"] if marked else None
    )
    try:
        call = iam_pb2_grpc.IamServiceStub(ch).GetProject(iam_pb2.GetProjectRequest(), timeout=10)
        if marked:
            await call
            assert servicer.calls["GetProject"] == 3
        else:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert servicer.calls["GetProject"] == 1
    finally:
        await ch.close()

"""The error vocabulary survives the wire: a servicer raises a class, the
client gets the same class, reason and metadata back (real in-process gRPC)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

import dsec.iam.v1.iam_pb2 as iam_pb2
from common.grpc_server import GrpcServer
from libdsec import errors
from libdsec.errors import from_rpc_error


def test_every_class_maps_back_from_its_code_and_reason() -> None:
    def walk(cls: type[errors.DSecError]) -> list[type[errors.DSecError]]:
        return [cls] + [c for sub in cls.__subclasses__() for c in walk(sub)]

    # The public vocabulary: classes defined in libdsec.errors (services may subclass further).
    classes = [c for c in walk(errors.DSecError)[1:] if c.__module__ == "libdsec.errors"]
    exported = [n for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    assert len(classes) == len(exported) - 1  # minus DSecError
    for cls in classes:
        assert errors.error_class_for(cls.code, cls.default_reason) is cls
    # an unknown reason falls back to the code's base class
    assert errors.error_class_for(grpc.StatusCode.NOT_FOUND, "SOMETHING_NEW") is errors.NotFound
    assert (
        errors.error_class_for(grpc.StatusCode.RESOURCE_EXHAUSTED, None) is errors.ResourceExhausted
    )
    assert issubclass(errors.QuotaExceeded, errors.ResourceExhausted)


class Raiser:
    """Raises whatever the request's name asks for."""

    async def CreateProject(
        self, request: iam_pb2.CreateProjectRequest, context: Any
    ) -> iam_pb2.CreateProjectResponse:
        if request.name == "quota":
            raise errors.QuotaExceeded("quota of root/a exceeded", metadata={"project": "root/a"})
        if request.name == "bug":
            raise ZeroDivisionError("secret internals")
        if request.name == "invalid":
            raise errors.InvalidArgument("bad name", reason="BAD_NAME")
        return iam_pb2.CreateProjectResponse(
            project=iam_pb2.Project(project_id="root/" + request.name)
        )

    async def ListProjects(self, request: Any, context: Any) -> Any:
        raise errors.Unavailable("try later")


@pytest.fixture
async def server():  # type: ignore[no-untyped-def]
    s = GrpcServer("test", "127.0.0.1:0")
    s.add(Raiser(), "dsec.iam.v1.IamService")
    await s.start()
    yield s
    assert s.server is not None
    await s.server.stop(None)


async def _call(server: GrpcServer, name: str) -> Any:
    from dsec.iam.v1 import iam_pb2_grpc

    async with grpc.aio.insecure_channel(server.address) as ch:
        stub = iam_pb2_grpc.IamServiceStub(ch)
        try:
            return await stub.CreateProject(iam_pb2.CreateProjectRequest(name=name), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return from_rpc_error(exc)


async def test_typed_errors_round_trip(server: GrpcServer) -> None:
    err = await _call(server, "quota")
    assert type(err) is errors.QuotaExceeded
    assert err.reason == "QUOTA_EXCEEDED" and err.metadata == {"project": "root/a"}
    err = await _call(server, "invalid")
    assert type(err) is errors.InvalidArgument and err.reason == "BAD_NAME"
    ok = await _call(server, "fine")
    assert ok.project.project_id == "root/fine"


def test_status_mapping_is_public_api_of_libdsec_errors() -> None:
    # Numeric codes carried in messages (batch results) map to the same classes as statuses.
    assert errors.code_number(grpc.StatusCode.RESOURCE_EXHAUSTED) == 8
    err = errors.status_for(8, "QUOTA_EXCEEDED", "over", {"project": "root/a"})
    assert type(err) is errors.QuotaExceeded and err.metadata == {"project": "root/a"}
    assert type(errors.status_for(5, "", "gone")) is errors.NotFound
    assert type(errors.status_for(999, "", "?")) is errors.DSecError  # an unknown number
    (key, value), *_ = errors.error_trailer(errors.SandboxNotFound("no sb"))
    assert key == errors.ERROR_TRAILER and b"SANDBOX_NOT_FOUND" in value
    for name in ("from_rpc_error", "status_for", "code_number", "error_trailer"):
        assert name in errors.__all__ and getattr(errors, name).__doc__


async def test_unexpected_exception_is_internal_without_internals(server: GrpcServer) -> None:
    err = await _call(server, "bug")
    assert type(err) is errors.Internal
    assert "secret internals" not in err.message and "ZeroDivisionError" not in err.message
    assert "incident" in err.metadata


async def test_unimplemented_methods_name_themselves(server: GrpcServer) -> None:
    from dsec.iam.v1 import iam_pb2_grpc

    async with grpc.aio.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await iam_pb2_grpc.IamServiceStub(ch).RevokeToken(
                iam_pb2.RevokeTokenRequest(), timeout=5
            )
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "RevokeToken" in (info.value.details() or "")

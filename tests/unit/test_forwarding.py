"""The forwarding table (common/forwarding.py): built from the contracts, installed once."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

import pytest

from apiserver.servicer import (
    DISPLAY_ROUTES,
    EXEC_ROUTES,
    FILE_ROUTES,
    DisplayServicer,
    ExecServicer,
    FileServicer,
)
from common import forwarding
from common.forwarding import Route
from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2
from dsec.types.v1 import types_pb2
from edge.servicer import EDGE_ROUTES, EdgeServicer

EXEC = apiserver_pb2.DESCRIPTOR.services_by_name["ExecService"]
FILE = apiserver_pb2.DESCRIPTOR.services_by_name["FileService"]
DISPLAY = apiserver_pb2.DESCRIPTOR.services_by_name["DisplayService"]
EDGE = edge_pb2.DESCRIPTOR.services_by_name["EdgeService"]


def test_the_api_server_forwards_every_sandbox_call_of_its_contract() -> None:
    for service, table, cls in (
        (EXEC, EXEC_ROUTES, ExecServicer),
        (FILE, FILE_ROUTES, FileServicer),
        (DISPLAY, DISPLAY_ROUTES, DisplayServicer),
    ):
        # Written by hand: the edge's answer plus the API server's own viewer URL.
        by_hand = {"GetDisplayInfo"} if cls is DisplayServicer else set()
        assert set(table) == {m.name for m in service.methods} - by_hand
        for m in service.methods:
            fn = getattr(cls, m.name)
            assert inspect.isasyncgenfunction(fn) == m.server_streaming, m.name
            if m.name not in by_hand:
                assert table[m.name].target == m.name  # the edge's method of the same name
    assert EXEC_ROUTES["ExecInteractive"].opener == "start"
    assert (FILE_ROUTES["UploadFile"].opener, FILE_ROUTES["UploadFile"].oneof) == ("header", "part")
    exec_req = types_pb2.ExecRequest(timeout_s=5)
    assert EXEC_ROUTES["Exec"].deadline is not None
    assert EXEC_ROUTES["Exec"].deadline(exec_req) == 35.0
    assert EXEC_ROUTES["ListExecs"].deadline is None
    shot = DISPLAY_ROUTES["Screenshot"].deadline
    assert shot is not None and shot(types_pb2.ScreenshotRequest()) == 60.0
    assert DISPLAY_ROUTES["VncStream"].deadline is None  # a person watching: no deadline
    assert DISPLAY_ROUTES["VncStream"].opener == "open"


def test_the_edge_forwards_what_it_does_not_write_by_hand() -> None:
    sandbox_calls = {m.name for m in EDGE.methods if m.input_type.file.package == "dsec.types.v1"}
    hand = {"Exec", "ExecStream", "ExecInteractive", "AttachExec", "WatchDir"}
    hand |= {"GetDisplayInfo", "Screenshot", "DisplayInput", "VncStream"}  # the backend's
    hand |= {"ListOperations"}  # the edge's own log
    hand |= {"GetSandboxMetrics"}  # the backend's usage samples (edge/usage.py)
    assert set(EDGE_ROUTES) == sandbox_calls - hand
    assert EDGE_ROUTES["SendHttp"].target == "http"
    assert EDGE_ROUTES["GetWatcherEvents"].target == "watcher_events"
    assert EDGE_ROUTES["ListExecs"].target == "list_execs"
    for name in sandbox_calls:  # every sandbox call is served, one way or the other
        assert callable(getattr(EdgeServicer, name))


def test_a_misspelt_method_in_a_table_is_refused() -> None:
    with pytest.raises(ValueError, match="ExecStrem"):
        forwarding.routes(EXEC, skip={"ExecStrem"})
    with pytest.raises(ValueError, match="Exce"):
        forwarding.routes(EXEC, deadlines={"Exce": lambda r: 1.0})


class _Hops:
    """A servicer whose hops record what they were given."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    async def forward_unary(self, route: Route, request: Any, context: Any) -> Any:
        self.seen.append((route.target, request))
        return types_pb2.ReadFileResponse(data=b"x")

    async def forward_server_stream(
        self, route: Route, request: Any, context: Any
    ) -> AsyncIterator[Any]:
        for i in range(2):
            yield types_pb2.DownloadFileResponse(chunk=bytes([i]))


async def test_installed_methods_call_the_hop_with_their_route() -> None:
    class Files(_Hops):
        pass

    table = forwarding.routes(FILE, skip={"UploadFile"}, target=forwarding.snake_case)
    forwarding.install(Files, table)
    s = Files()
    req = types_pb2.ReadFileRequest(sandbox_id="sb", path="/a")
    resp = await s.ReadFile(req, None)  # type: ignore[attr-defined]
    assert resp.data == b"x"
    assert s.seen == [("read_file", req)]
    chunks = [c.chunk async for c in s.DownloadFile(types_pb2.DownloadFileRequest(), None)]  # type: ignore[attr-defined]
    assert chunks == [b"\x00", b"\x01"]


def test_install_refuses_a_shadowed_or_unservable_method() -> None:
    class Shadow(_Hops):
        async def ReadFile(self, request: Any, context: Any) -> Any:
            return None

    with pytest.raises(TypeError, match=r"Shadow\.ReadFile is written by hand"):
        forwarding.install(Shadow, forwarding.routes(FILE, skip={"UploadFile"}))

    class NoClientStreams(_Hops):
        pass

    with pytest.raises(TypeError, match="forward_client_stream"):
        forwarding.install(NoClientStreams, forwarding.routes(FILE))

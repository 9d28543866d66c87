"""Display calls (computer use) on sandboxes without a display, end to end: a container
sandbox answers every one UNIMPLEMENTED, reason BACKEND_CAPABILITY naming the capability,
through the API server (raw gRPC, as any client sees it) and the SDK (sync and async), and
is not resumed for it. The display itself (a vm desktop) is tested with the vm backend."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from dsec.apiserver.v1 import apiserver_pb2_grpc
from dsec.types.v1 import types_pb2
from dsecctl.cluster import LocalCluster
from libdsec import AsyncClient, Client, Sandbox
from libdsec.errors import BackendCapabilityMissing, InvalidArgument, from_rpc_error
from tests.helpers import wait_for
from tests.integration.test_cli import cli_env, dsec

pytestmark = pytest.mark.images("busybox")


@pytest.fixture
def sandbox_defaults() -> dict[str, Any]:
    return {"memory_mb": 128, "grace_s": 0.5}


@pytest.fixture
def stub(container_cluster: LocalCluster) -> Iterator[tuple[Any, Any]]:
    """The API server's DisplayService, called as any gRPC client would, and its token."""
    with grpc.insecure_channel(container_cluster.apiserver) as ch:
        yield (
            apiserver_pb2_grpc.DisplayServiceStub(ch),
            (("authorization", f"Bearer {container_cluster.token}"),),
        )


def _no_display(err: BackendCapabilityMissing) -> None:
    assert err.reason == "BACKEND_CAPABILITY"
    assert err.metadata["capability"] == "display"
    assert err.metadata["backend"] == "container"


def test_every_display_call_of_the_sdk_answers_backend_capability(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox(image="busybox")
    calls: list[Callable[[], object]] = [
        sb.display.screenshot,
        sb.display.size,
        sb.display.viewer_url,
        lambda: sb.display.move(1, 1),
        lambda: sb.display.click(5, 5, double=True),
        lambda: sb.display.scroll(2),
        lambda: sb.display.drag((0, 0), (9, 9)),
        lambda: sb.display.mouse_down(),
        lambda: sb.display.type("hello"),
        lambda: sb.display.press("ctrl+l"),
    ]
    for call in calls:
        with pytest.raises(BackendCapabilityMissing) as err:
            call()
        _no_display(err.value)
    assert sb.run("echo alive").text == "alive\n"  # the sandbox is unharmed


def test_the_api_server_answers_unimplemented_for_each_rpc(
    make_sandbox: Callable[..., Sandbox], stub: tuple[Any, Any]
) -> None:
    display, token = stub
    sid = make_sandbox(image="busybox").id
    unary = [
        (display.GetDisplayInfo, types_pb2.DisplayInfoRequest(sandbox_id=sid)),
        (display.Screenshot, types_pb2.ScreenshotRequest(sandbox_id=sid)),
        (
            display.DisplayInput,
            types_pb2.DisplayInputRequest(
                sandbox_id=sid,
                actions=[types_pb2.DisplayAction(move=types_pb2.PointerMove(x=1, y=1))],
            ),
        ),
    ]
    for method, request in unary:
        with pytest.raises(grpc.RpcError) as info:
            method(request, metadata=token, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        err = from_rpc_error(info.value)
        assert isinstance(err, BackendCapabilityMissing)
        _no_display(err)

    vnc = display.VncStream(
        iter([types_pb2.VncData(open=types_pb2.VncOpen(sandbox_id=sid))]),
        metadata=token,
        timeout=30,
    )
    with pytest.raises(grpc.RpcError) as info:
        list(vnc)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    err = from_rpc_error(info.value)
    assert isinstance(err, BackendCapabilityMissing)
    _no_display(err)


def test_a_vnc_stream_must_open_with_its_sandbox(stub: tuple[Any, Any]) -> None:
    display, token = stub
    vnc = display.VncStream(iter([types_pb2.VncData(data=b"RFB")]), metadata=token, timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        list(vnc)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(from_rpc_error(info.value), InvalidArgument)


def test_a_paused_sandbox_is_not_resumed_for_a_display_call(
    make_sandbox: Callable[..., Sandbox], client: Client
) -> None:
    sb = make_sandbox(image="busybox")
    wait_for(lambda: sb.refresh().state == "RUNNING", timeout_s=30)
    assert sb.pause().state == "PAUSED"
    with pytest.raises(BackendCapabilityMissing):
        sb.display.screenshot()
    assert client.get(sb.id).info.state == "PAUSED"


def test_the_async_sdk_answers_the_same(
    make_sandbox: Callable[..., Sandbox], container_cluster: LocalCluster
) -> None:
    sid = make_sandbox(image="busybox").id

    async def main() -> None:
        async with AsyncClient(container_cluster.apiserver, token=container_cluster.token) as c:
            sb = await c.get(sid)
            with pytest.raises(BackendCapabilityMissing) as err:
                await sb.display.screenshot()
            _no_display(err.value)
            with pytest.raises(BackendCapabilityMissing):
                await sb.display.press("enter")

    asyncio.run(main())


def test_the_cli_says_a_container_has_no_display(
    make_sandbox: Callable[..., Sandbox], container_cluster: LocalCluster, tmp_path: Path
) -> None:
    sid = make_sandbox(image="busybox").id
    env = cli_env(container_cluster.apiserver, container_cluster.token, tmp_path)
    out = tmp_path / "shot.png"
    for args in (["screenshot", sid, "-o", str(out)], ["view", sid]):
        r = dsec("sandbox", *args, env=env, timeout=60)
        assert r.returncode == 2, r
        assert "BackendCapabilityMissing [BACKEND_CAPABILITY]" in r.stderr
        assert r.stdout == ""
    assert not out.exists()

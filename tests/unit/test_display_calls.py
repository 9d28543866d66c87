"""The edge's display calls (edge/display_calls.py) over a real manager: input checked whole
before the backend gets any of it, and the VNC bridge (bytes both ways over a real socket,
ended by either side or by the sandbox's end, never left hanging). The backend is the null
backend with a screen: a local TCP server stands in for QEMU's VNC server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dsec.types.v1 import types_pb2 as t
from edge import display
from edge.backends import Capability, NullBackend
from edge.display_calls import DisplayCalls
from edge.manager import Capacity, SandboxManager
from edge.model import SandboxRecord, SandboxSpec
from libdsec.errors import InvalidArgument, SandboxTerminated, Unavailable

SID = "sb-e1-aaaaaa01"


class ScreenOnNull(NullBackend):
    """The null backend with a 800x600 screen whose VNC server listens on ``port``."""

    capabilities = frozenset({Capability.DISPLAY})

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port
        self.sent: list[display.Action] = []

    async def display_size(self, rec: SandboxRecord) -> tuple[int, int]:
        return 800, 600

    async def screenshot(self, rec: SandboxRecord) -> tuple[bytes, int, int]:
        return b"\x89PNG\r\n\x1a\n", 800, 600

    async def send_input(self, rec: SandboxRecord, actions: Sequence[Any]) -> int:
        self.sent.extend(actions)
        return len(actions)

    async def open_vnc(self, rec: SandboxRecord) -> tuple[Any, Any]:
        return await asyncio.open_connection("127.0.0.1", self.port)


class VncServer:
    """Greets like RFB, answers each chunk upper-cased, records what it saw and when the
    viewer's side closed; ``close_all()`` drops its connections (the VM stopping)."""

    def __init__(self) -> None:
        self.seen = b""
        self.closed = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        writer.write(b"RFB 003.008\n")
        await writer.drain()
        while chunk := await reader.read(1024):
            self.seen += chunk
            writer.write(chunk.upper())
            await writer.drain()
        self.closed.set()
        writer.close()

    def close_all(self) -> None:
        for w in self.writers:
            w.close()


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[DisplayCalls, ScreenOnNull, VncServer]]:
    vnc = VncServer()
    server = await asyncio.start_server(vnc.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = ScreenOnNull(port)
    m = SandboxManager("e1", tmp_path, Capacity(2000, 1024, 10), [backend])
    await m.create(SID, SandboxSpec(), "root", "p", wait_ready=True)

    async def raise_if_ended(sandbox_id: str) -> None:
        if not m.get(sandbox_id).live:
            m.get_live(sandbox_id)

    yield DisplayCalls(m, raise_if_ended), backend, vnc
    server.close()
    vnc.close_all()


async def test_input_is_checked_whole_before_the_backend_gets_any(
    setup: tuple[DisplayCalls, ScreenOnNull, VncServer],
) -> None:
    calls, backend, _ = setup
    good = t.DisplayAction(click=t.PointerClick(x=10, y=10))
    off = t.DisplayAction(move=t.PointerMove(x=800, y=0))
    with pytest.raises(InvalidArgument) as err:
        await calls.send_input(t.DisplayInputRequest(sandbox_id=SID, actions=[good, off]))
    assert err.value.metadata["field"] == "x" and "800x600" in str(err.value)
    assert backend.sent == []
    resp = await calls.send_input(t.DisplayInputRequest(sandbox_id=SID, actions=[good]))
    assert resp.events == 1 and backend.sent == [display.Click(10, 10, "left", 1)]
    info = await calls.info(t.DisplayInfoRequest(sandbox_id=SID))
    assert (info.width, info.height) == (800, 600)
    shot = await calls.screenshot(t.ScreenshotRequest(sandbox_id=SID))
    assert shot.png.startswith(b"\x89PNG") and shot.taken_ms >= 0


async def _viewer(sends: asyncio.Queue[bytes | None]) -> AsyncIterator[t.VncData]:
    yield t.VncData(open=t.VncOpen(sandbox_id=SID))
    while (data := await sends.get()) is not None:
        yield t.VncData(data=data)


async def test_vnc_bytes_go_both_ways_and_the_viewers_end_closes_the_connection(
    setup: tuple[DisplayCalls, ScreenOnNull, VncServer],
) -> None:
    calls, _, vnc = setup
    sends: asyncio.Queue[bytes | None] = asyncio.Queue()
    stream = calls.vnc(_viewer(sends))
    assert (await anext(stream)).data == b"RFB 003.008\n"
    await sends.put(b"hello")
    assert (await anext(stream)).data == b"HELLO"
    await sends.put(None)  # the viewer closes its side
    assert await asyncio.wait_for(anext(stream, None), 5) is None
    await asyncio.wait_for(vnc.closed.wait(), 5)  # and the VNC connection was closed
    assert vnc.seen == b"hello"


async def test_the_screen_closing_ends_the_stream_with_a_status(
    setup: tuple[DisplayCalls, ScreenOnNull, VncServer],
) -> None:
    calls, _, vnc = setup
    stream = calls.vnc(_viewer(asyncio.Queue()))
    assert (await anext(stream)).data.startswith(b"RFB")
    vnc.close_all()
    with pytest.raises(Unavailable) as err:
        await asyncio.wait_for(anext(stream), 5)
    assert err.value.reason == "VNC_CLOSED"


async def test_the_sandboxs_end_ends_a_stream_whose_connection_stays_open(
    setup: tuple[DisplayCalls, ScreenOnNull, VncServer],
) -> None:
    calls, _, _ = setup
    stream = calls.vnc(_viewer(asyncio.Queue()))
    assert (await anext(stream)).data.startswith(b"RFB")
    await calls.manager.stop(SID)
    with pytest.raises(SandboxTerminated):
        await asyncio.wait_for(anext(stream), 5)


async def test_a_vnc_stream_must_open_first(
    setup: tuple[DisplayCalls, ScreenOnNull, VncServer],
) -> None:
    calls, _, _ = setup

    async def data_first() -> AsyncIterator[t.VncData]:
        yield t.VncData(data=b"RFB")

    with pytest.raises(InvalidArgument, match="`open`"):
        await anext(calls.vnc(data_first()))

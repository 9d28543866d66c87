"""The edge's display calls (computer use): GetDisplayInfo, Screenshot, DisplayInput,
VncStream, answered by the sandbox's backend (the ``Displays`` capability), not by chronus.

A sandbox is found as for any call into it: the capability is checked first (a container or
microVM answers UNIMPLEMENTED ``BACKEND_CAPABILITY`` without being resumed for it), then the
manager's ``touch`` marks activity and resumes a paused one. Input is checked whole by
edge/display.py against the screen's size before the backend sends any of it.

A VNC stream bridges bytes both ways between the caller and the backend's VNC connection; it
ends when either side does. The sandbox's end ends it with the sandbox's termination
(SANDBOX_TERMINATED and its reason), checked every :data:`VNC_LIVENESS_S` as well as when
the VNC connection closes, so a viewer never waits on a dead screen.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import NoReturn

from dsec.types.v1 import types_pb2
from edge import display
from edge.backends.contract import Displays, require
from edge.manager import SandboxManager
from edge.model import SandboxRecord
from libdsec.errors import InvalidArgument, Unavailable

#: Bytes per VncData message from the screen.
VNC_CHUNK = 64 * 1024
#: How often a VNC stream checks that its sandbox is still live (one that ended while its VNC
#: connection stays open must not hold the viewer). A paused sandbox: the stream ends when
#: its VNC connection closes (the VM stops), with UNAVAILABLE VNC_CLOSED; a slow one: nothing
#: is asked of it; a lost node: the API server's stream to this edge breaks.
VNC_LIVENESS_S = 1.0


class DisplayCalls:
    """The four display calls over the manager (the servicer delegates to these)."""

    def __init__(
        self, manager: SandboxManager, raise_if_ended: Callable[[str], Awaitable[None]]
    ) -> None:
        self.manager = manager
        #: EdgeServicer._raise_if_ended: SandboxTerminated once the sandbox is recorded ended.
        self.raise_if_ended = raise_if_ended

    async def _display(self, sandbox_id: str) -> tuple[Displays, SandboxRecord]:
        if not sandbox_id:
            raise InvalidArgument("sandbox_id is required", metadata={"field": "sandbox_id"})
        m = self.manager
        displays = require(m.backend_of(m.get_live(sandbox_id)), Displays)
        return displays, await m.touch(sandbox_id)

    async def info(self, request: types_pb2.DisplayInfoRequest) -> types_pb2.DisplayInfoResponse:
        displays, rec = await self._display(request.sandbox_id)
        width, height = await displays.display_size(rec)
        return types_pb2.DisplayInfoResponse(width=width, height=height)

    async def screenshot(
        self, request: types_pb2.ScreenshotRequest
    ) -> types_pb2.ScreenshotResponse:
        displays, rec = await self._display(request.sandbox_id)
        start = time.perf_counter()
        png, width, height = await displays.screenshot(rec)
        return types_pb2.ScreenshotResponse(
            png=png,
            width=width,
            height=height,
            taken_ms=(time.perf_counter() - start) * 1000,
        )

    async def send_input(
        self, request: types_pb2.DisplayInputRequest
    ) -> types_pb2.DisplayInputResponse:
        displays, rec = await self._display(request.sandbox_id)
        actions = display.parse(request.actions, await displays.display_size(rec))
        events = await displays.send_input(rec, actions)
        return types_pb2.DisplayInputResponse(events=events)

    async def _screen_closed(self, sandbox_id: str) -> NoReturn:
        """The screen's side of a VNC stream closed (the VM stopped or ended): raises why."""
        await self.raise_if_ended(sandbox_id)
        raise Unavailable(
            f"the display of sandbox {sandbox_id} closed its VNC connection", reason="VNC_CLOSED"
        )

    async def vnc(
        self, requests: AsyncIterator[types_pb2.VncData]
    ) -> AsyncGenerator[types_pb2.VncData]:
        first = await anext(requests, None)
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidArgument("the first VncData must carry `open`", metadata={"field": "open"})
        sandbox_id = first.open.sandbox_id
        displays, rec = await self._display(sandbox_id)
        reader, writer = await displays.open_vnc(rec)

        async def viewer_to_screen() -> bool:
            """True when the viewer ended its side; False when the screen's side went."""
            async for msg in requests:
                if msg.WhichOneof("kind") != "data":
                    raise InvalidArgument(
                        "after `open`, a VncData carries `data`", metadata={"field": "data"}
                    )
                rec.last_active_at = time.time()  # a person driving the screen is activity
                try:
                    writer.write(msg.data)
                    await writer.drain()
                except ConnectionError:
                    return False
            return True

        async def screen_read() -> bytes:
            try:
                return await reader.read(VNC_CHUNK)
            except ConnectionError:
                return b""

        upstream = asyncio.create_task(viewer_to_screen())
        read: asyncio.Task[bytes] | None = None
        try:
            while True:
                if read is None:
                    read = asyncio.create_task(screen_read())
                done, _ = await asyncio.wait(
                    {read, upstream}, timeout=VNC_LIVENESS_S, return_when=asyncio.FIRST_COMPLETED
                )
                if read in done:
                    chunk = read.result()
                    read = None
                    if not chunk:
                        await self._screen_closed(sandbox_id)
                    yield types_pb2.VncData(data=chunk)
                elif upstream in done:
                    if not upstream.result():  # raises the viewer's bad message, if that
                        await self._screen_closed(sandbox_id)
                    return  # the viewer closed its side: the stream ends
                elif not self.manager.get(sandbox_id).live:
                    self.manager.get_live(sandbox_id)  # SandboxTerminated with the reason
        finally:
            for task in (read, upstream):
                if task is not None:
                    task.cancel()
            # Their own errors are answered above or moot now; a cancel of ours propagates.
            await asyncio.gather(
                *(t for t in (read, upstream) if t is not None), return_exceptions=True
            )
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

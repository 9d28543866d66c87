"""A sandbox's screen (computer use): :class:`AsyncDisplay` (``sandbox.display``).

Only a sandbox with a display has one (backend "vm", the ``desktop`` image); any other
answers every call with :class:`~libdsec.errors.BackendCapabilityMissing` (UNIMPLEMENTED,
reason ``BACKEND_CAPABILITY``). Screenshots are taken and input is delivered by the host,
as real input events: nothing inside the sandbox has to cooperate.

    png = await sb.display.screenshot()                 # PNG bytes of the whole screen
    width, height = await sb.display.size()
    await sb.display.click(640, 400)                    # left click at a pixel
    await sb.display.type("hello world\\n")
    await sb.display.press("ctrl+l")                    # a chord; X keysym names work too
    print(await sb.display.viewer_url())                # watch or take over in a browser

Coordinates are screen pixels, (0, 0) top left; one outside the screen raises
:class:`~libdsec.errors.InvalidArgument` naming it (``metadata["field"]``: "x" or "y"), and
so does an unknown key name (reason ``UNKNOWN_KEY``). Every input call returns the number of
input events the host delivered.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from dsec.types.v1 import types_pb2
from libdsec._transport import Link
from libdsec.errors import FailedPrecondition, InvalidArgument

#: Deadline of a display call unless ``timeout=`` says otherwise (a paused VM is resumed first).
DISPLAY_TIMEOUT_S = 60.0

_BUTTONS = {
    "left": types_pb2.MOUSE_BUTTON_LEFT,
    "middle": types_pb2.MOUSE_BUTTON_MIDDLE,
    "right": types_pb2.MOUSE_BUTTON_RIGHT,
}


def _button(name: str) -> types_pb2.MouseButton.ValueType:
    try:
        return _BUTTONS[name]
    except KeyError:
        raise InvalidArgument(
            f"button={name!r}: 'left', 'middle' or 'right'",
            reason="UNKNOWN_BUTTON",
            metadata={"field": "button"},
        ) from None


class AsyncDisplay:
    """The screen of a sandbox: screenshots, mouse, keyboard, a live view."""

    def __init__(self, client: Link, sandbox_id: str) -> None:
        self.client = client
        self.sandbox_id = sandbox_id

    async def _call(self, method: str, request: Any, timeout: float | None) -> Any:
        rpc = self.client.transport
        return await rpc.unary(
            getattr(rpc.display, method),
            request,
            timeout=DISPLAY_TIMEOUT_S if timeout is None else timeout,
        )

    async def _info(self, timeout: float | None) -> types_pb2.DisplayInfoResponse:
        resp: types_pb2.DisplayInfoResponse = await self._call(
            "GetDisplayInfo", types_pb2.DisplayInfoRequest(sandbox_id=self.sandbox_id), timeout
        )
        return resp

    async def size(self, *, timeout: float | None = None) -> tuple[int, int]:
        """(width, height) of the screen now, in pixels (a call: the guest may change it)."""
        info = await self._info(timeout)
        return info.width, info.height

    async def screenshot(self, *, timeout: float | None = None) -> bytes:
        """The whole screen as PNG bytes::

        Path("shot.png").write_bytes(await sb.display.screenshot())
        """
        resp = await self._call(
            "Screenshot", types_pb2.ScreenshotRequest(sandbox_id=self.sandbox_id), timeout
        )
        return bytes(resp.png)

    async def viewer_url(self, *, timeout: float | None = None) -> str:
        """The API server's live-view page of this sandbox (noVNC in a browser), with this
        client's token in it: whoever has the URL acts as you on this sandbox's screen.
        :class:`~libdsec.errors.FailedPrecondition` (``NO_VIEWER``) when the API server
        serves no viewer."""
        info = await self._info(timeout)
        if not info.viewer_url:
            raise FailedPrecondition(
                f"the API server at {self.client.transport.target} serves no viewer page",
                reason="NO_VIEWER",
            )
        token = urllib.parse.quote(self.client.transport.token, safe="")
        return f"{info.viewer_url}?token={token}"

    async def _send(self, action: types_pb2.DisplayAction, timeout: float | None) -> int:
        """One DisplayInput call; the input events delivered."""
        resp = await self._call(
            "DisplayInput",
            types_pb2.DisplayInputRequest(sandbox_id=self.sandbox_id, actions=[action]),
            timeout,
        )
        return int(resp.events)

    async def move(self, x: int, y: int, *, timeout: float | None = None) -> int:
        """Moves the pointer to (x, y)."""
        action = types_pb2.DisplayAction(move=types_pb2.PointerMove(x=x, y=y))
        return await self._send(action, timeout)

    async def click(
        self,
        x: int | None = None,
        y: int | None = None,
        *,
        button: str = "left",
        double: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Clicks at (x, y), or where the pointer is when both are None; ``button``: "left",
        "middle" or "right"; ``double=True`` for a double click."""
        click = types_pb2.PointerClick(button=_button(button), count=2 if double else 1)
        if x is not None:
            click.x = x
        if y is not None:
            click.y = y
        return await self._send(types_pb2.DisplayAction(click=click), timeout)

    async def scroll(
        self,
        dy: int = 1,
        *,
        dx: int = 0,
        x: int | None = None,
        y: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Turns the wheel ``dy`` notches (> 0 down, < 0 up) and ``dx`` (> 0 right), at
        (x, y) or where the pointer is."""
        scroll = types_pb2.PointerScroll(dy=dy, dx=dx)
        if x is not None:
            scroll.x = x
        if y is not None:
            scroll.y = y
        return await self._send(types_pb2.DisplayAction(scroll=scroll), timeout)

    async def drag(
        self,
        start: tuple[int, int],
        end: tuple[int, int],
        *,
        button: str = "left",
        timeout: float | None = None,
    ) -> int:
        """Presses ``button`` at ``start``, moves to ``end`` through the points between, and
        releases it there: ``await sb.display.drag((100, 100), (300, 200))``."""
        drag = types_pb2.PointerDrag(
            from_x=start[0], from_y=start[1], to_x=end[0], to_y=end[1], button=_button(button)
        )
        return await self._send(types_pb2.DisplayAction(drag=drag), timeout)

    async def mouse_down(self, button: str = "left", *, timeout: float | None = None) -> int:
        """Presses ``button`` and keeps it down (a drag by hand: then move, then mouse_up)."""
        press = types_pb2.PointerButton(button=_button(button), down=True)
        return await self._send(types_pb2.DisplayAction(button=press), timeout)

    async def mouse_up(self, button: str = "left", *, timeout: float | None = None) -> int:
        """Releases ``button``."""
        release = types_pb2.PointerButton(button=_button(button), down=False)
        return await self._send(types_pb2.DisplayAction(button=release), timeout)

    async def type(self, text: str, *, timeout: float | None = None) -> int:
        """Types ``text`` key by key on a US layout (printable ASCII, "\\n" and "\\t"; at most
        4096 characters a call)."""
        action = types_pb2.DisplayAction(type=types_pb2.KeyType(text=text))
        return await self._send(action, timeout)

    async def press(self, keys: str, *, timeout: float | None = None) -> int:
        """Presses a chord and releases it: "enter", "ctrl+l", "alt+f4", "ctrl+shift+t";
        names are case-insensitive, X keysym names ("Return", "Control_L") work too."""
        action = types_pb2.DisplayAction(press=types_pb2.KeyPress(keys=keys))
        return await self._send(action, timeout)

"""A VM's screen from the host: libvirt's screenshot of its display, input events through
QMP (the steps of input.py), its VNC socket. Nothing inside the guest takes part."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import libvirt
import libvirt_qemu

from edge.backends.vm import input as vm_input
from edge.backends.vm.libvirt_conn import Libvirt
from libdsec.errors import Unavailable

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


async def screenshot(conn: Libvirt, domain: str) -> tuple[bytes, int, int]:
    """The whole screen of `domain` as PNG, with its width and height."""

    def shot(c: libvirt.virConnect) -> tuple[bytes, str]:
        d = c.lookupByName(domain)
        stream = c.newStream(0)
        parts: list[bytes] = []
        try:
            mime = d.screenshot(stream, 0, 0)
            stream.recvAll(lambda _s, data, _o: parts.append(bytes(data)), None)
            stream.finish()
        except BaseException:
            with contextlib.suppress(libvirt.libvirtError):
                stream.abort()
            raise
        return b"".join(parts), str(mime)

    data, mime = await conn.call(shot)
    if mime != "image/png":  # QEMU 7.2 writes PNG; an older one PPM
        data = await asyncio.to_thread(_to_png, data)
    w, h = png_size(data)
    return data, w, h


#: A screen with at most this many colours is not a drawn desktop (a console, a blank screen).
PAINTED_MIN_COLOURS = 64


async def wait_painted(
    conn: Libvirt, domain: str, timeout_s: float, *, poll_s: float = 2.0, still: int = 3
) -> float:
    """Until the screen of `domain` shows a drawn desktop: more than PAINTED_MIN_COLOURS
    colours, and the same picture in `still` screenshots `poll_s` apart (nothing painting).
    Under TCG a session's windows exist tens of seconds before they are painted, and a template
    saved before that hands every clone a black screen that paints itself again. Returns the
    seconds waited; Unavailable (DESKTOP_NOT_DRAWN) after `timeout_s`."""
    t0 = time.monotonic()
    last, same = b"", 0
    while True:
        png, _, _ = await screenshot(conn, domain)
        colours = await asyncio.to_thread(count_colours, png)
        same = same + 1 if colours > PAINTED_MIN_COLOURS and png == last else 1
        if colours > PAINTED_MIN_COLOURS and same >= still:
            return time.monotonic() - t0
        last = png
        if time.monotonic() - t0 + poll_s > timeout_s:
            raise Unavailable(
                f"the desktop of {domain} was not drawn within {timeout_s:.0f} s "
                f"(the screen shows {colours} colours)",
                reason="DESKTOP_NOT_DRAWN",
            )
        await asyncio.sleep(poll_s)


def count_colours(png: bytes) -> int:
    """The number of distinct colours on a screenshot (capped at 65,537)."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as img:
        colours = img.convert("RGB").getcolors(maxcolors=1 << 16)
    return (1 << 16) + 1 if colours is None else len(colours)


async def send_input(
    conn: Libvirt, domain: str, actions: Sequence[Any], size: tuple[int, int]
) -> int:
    """`actions` (edge.display, checked) as input-send-event commands, each step's pause kept;
    returns the number of input events sent."""
    steps = vm_input.to_qmp(actions, size)

    def send(c: libvirt.virConnect) -> None:
        d = c.lookupByName(domain)
        for step in steps:
            cmd = json.dumps({"execute": "input-send-event", "arguments": {"events": step.events}})
            libvirt_qemu.qemuMonitorCommand(d, cmd, 0)
            if step.pause_s:
                time.sleep(step.pause_s)

    await conn.call(send)
    return vm_input.event_count(steps)


async def open_vnc(path: Path) -> tuple[Any, Any]:
    try:
        return await asyncio.open_unix_connection(str(path))
    except OSError as exc:
        raise Unavailable(
            f"the VM's VNC server does not answer: {exc}", reason="VNC_UNREACHABLE"
        ) from exc


def png_size(data: bytes) -> tuple[int, int]:
    if data[:8] != PNG_MAGIC:
        raise ValueError("not a PNG")
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


def _to_png(data: bytes) -> bytes:
    """A PPM (P6) screenshot as PNG."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        out = io.BytesIO()
        img.save(out, format="PNG")
        return out.getvalue()

"""The edge's connect to aether (edge/aether_client.py) on both kinds of channel, against a
peer on a real Unix socket speaking the wire (4-byte length + Frame).

A device channel (a VM's virtio-serial port behind QEMU's socket) has no connection boundary:
a guest paused right after a call has the end of that call's stream still in its port, and the
next host to connect (the resume's) reads it before the Hello. A socket channel has a boundary,
so there anything before the Hello is a protocol error.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.aether.v1 import aether_pb2
from edge.aether_client import AetherConnection
from libdsec.errors import Unavailable

_LEN = struct.Struct(">I")


def _frame(**body: object) -> bytes:
    data = aether_pb2.Frame(**body).SerializeToString()  # type: ignore[arg-type]
    return _LEN.pack(len(data)) + data


async def _peer(path: Path, *, stale: bytes, hello_on_ping: bool) -> asyncio.Server:
    """Sends `stale` at once, then a Hello (at once, or for a Ping of nonce 0: a device)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(stale)
        hello = _frame(hello=aether_pb2.Hello(protocol_version=1, pid=1))
        if not hello_on_ping:
            writer.write(hello)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(4))
                frame = aether_pb2.Frame.FromString(await reader.readexactly(n))
                if frame.WhichOneof("body") == "ping" and frame.ping.nonce == 0:
                    writer.write(hello)

    return await asyncio.start_unix_server(serve, path=str(path))


#: What a guest paused mid-call leaves in its port: a stream's end and another's output.
STALE = _frame(stream_id=7, end=aether_pb2.StreamEnd()) + _frame(
    stream_id=9, response={"read_file": {}}
)


async def test_a_device_channel_skips_what_the_previous_host_left_before_the_hello(
    tmp_path: Path,
) -> None:
    server = await _peer(tmp_path / "agent", stale=STALE, hello_on_ping=True)
    conn = AetherConnection(str(tmp_path / "agent"), "sb-x", ask_hello=True)
    try:
        hello = await conn.connect(timeout_s=5)
        assert hello.pid == 1
    finally:
        await conn.close()
        server.close()


async def test_a_socket_channel_refuses_anything_before_the_hello(tmp_path: Path) -> None:
    server = await _peer(tmp_path / "agent", stale=STALE, hello_on_ping=False)
    conn = AetherConnection(str(tmp_path / "agent"), "sb-x")
    try:
        with pytest.raises(Unavailable) as info:
            await conn.connect(timeout_s=5)
        assert info.value.reason == "AETHER_PROTOCOL"
    finally:
        await conn.close()
        server.close()


class _FrozenPeer:
    """A socket aether that says Hello, then answers Pings only while not `frozen`."""

    def __init__(self) -> None:
        self.thawed = asyncio.Event()
        self.thawed.set()

    @property
    def frozen(self) -> bool:
        return not self.thawed.is_set()

    @frozen.setter
    def frozen(self, value: bool) -> None:
        if value:
            self.thawed.clear()
        else:
            self.thawed.set()

    async def start(self, path: Path) -> asyncio.Server:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(_frame(hello=aether_pb2.Hello(protocol_version=1, pid=1)))
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    (n,) = _LEN.unpack(await reader.readexactly(4))
                    frame = aether_pb2.Frame.FromString(await reader.readexactly(n))
                    await self.thawed.wait()  # a frozen process reads nothing
                    if frame.WhichOneof("body") == "ping":
                        writer.write(_frame(pong=aether_pb2.Pong(nonce=frame.ping.nonce)))

        return await asyncio.start_unix_server(serve, path=str(path))


@contextlib.asynccontextmanager
async def _connected(tmp_path: Path) -> AsyncIterator[tuple[_FrozenPeer, AetherConnection]]:
    """A _FrozenPeer and a connection to it with a fast keepalive (0.2 s, dead after 0.6 s)."""
    peer = _FrozenPeer()
    server = await peer.start(tmp_path / "agent")
    conn = AetherConnection(str(tmp_path / "agent"), "sb-x", ping_interval_s=0.2, dead_after_s=0.6)
    try:
        await conn.connect(timeout_s=5)
        yield peer, conn
    finally:
        await conn.close()
        server.close()


async def test_a_held_channel_outlives_a_silence_past_its_dead_limit(tmp_path: Path) -> None:
    async with _connected(tmp_path) as (peer, conn):
        conn.hold()
        peer.frozen = True
        await asyncio.sleep(2.0)  # > 3x the dead limit
        assert not conn.closed.is_set()
        peer.frozen = False
        await conn.release(timeout_s=2.0)  # answered: a Pong
        await asyncio.sleep(1.0)  # and the keepalive runs again
        assert not conn.closed.is_set()


async def test_an_unheld_silent_channel_closes_and_a_release_unanswered_fails(
    tmp_path: Path,
) -> None:
    async with _connected(tmp_path) as (peer, conn):
        conn.hold()
        peer.frozen = True
        with pytest.raises(Unavailable, match="did not answer a ping"):
            await conn.release(timeout_s=0.5)  # still frozen: no Pong
        await asyncio.wait_for(conn.closed.wait(), timeout=3.0)  # not held: judged dead
        assert conn.close_reason  # why it closed is kept for the calls it fails

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
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.aether.v1 import aether_pb2
from edge.aether_client import AetherConnection
from libdsec.errors import ChannelClosed, Unavailable

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


class _ResetWriter:
    """A writer whose connection was reset by the other end (its process was killed)."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        raise ConnectionResetError("Connection lost")

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


async def test_a_release_on_a_connection_reset_meanwhile_is_a_closed_channel(
    tmp_path: Path,
) -> None:
    """The sandbox was killed while frozen: the resume's Ping meets a reset connection before
    the read loop noticed. That is ChannelClosed (Unavailable: the resume ends the sandbox
    RESUME_FAILED), not an OSError (an INTERNAL error of the call that resumed it)."""
    async with _connected(tmp_path) as (_peer, conn):
        conn.hold()
        writer = conn._writer
        conn._writer = _ResetWriter()  # type: ignore[assignment]
        try:
            with pytest.raises(ChannelClosed, match="channel to sb-x closed: Connection lost"):
                await conn.release(timeout_s=1.0)
        finally:
            conn._writer = writer


# ------------------------------------------------------------------ a command's span


async def _chronus(path: Path, answer: str) -> asyncio.Server:
    """Answers an exec with a result and a CommandSpan: its own (``answer="own"``, times a
    minute off both ways), or one claiming another trace (``"forged"``)."""
    from dsec.chronus.v1 import chronus_pb2

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_frame(hello=aether_pb2.Hello(protocol_version=1, pid=1)))
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(4))
                frame = aether_pb2.Frame.FromString(await reader.readexactly(n))
                if frame.WhichOneof("body") != "request":
                    continue
                _, trace_id, parent_id, _ = frame.request.traceparent.split("-")
                if answer == "forged":
                    trace_id = "ab" * 16
                now = time.time_ns()
                span = chronus_pb2.CommandSpan(
                    trace_id=bytes.fromhex(trace_id),
                    parent_span_id=bytes.fromhex(parent_id),
                    span_id=b"\x01" * 8,
                    start_unix_ns=now - 60 * 10**9,
                    end_unix_ns=now + 60 * 10**9,
                )
                response = chronus_pb2.Response(span=span)
                response.exec_result.exec_id = "ex-1"
                writer.write(_frame(stream_id=frame.stream_id, response=response))
                writer.write(_frame(stream_id=frame.stream_id, end=aether_pb2.StreamEnd()))

    return await asyncio.start_unix_server(serve, path=str(path))


@pytest.mark.parametrize("answer", ["own", "forged"])
async def test_a_commands_span_is_exported_only_in_the_trace_it_was_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common import telemetry
    from dsec.types.v1 import types_pb2

    exported = InMemorySpanExporter()
    monkeypatch.setattr(telemetry, "_exporting", SimpleSpanProcessor(exported))
    server = await _chronus(tmp_path / "agent", answer)
    conn = AetherConnection(str(tmp_path / "agent"), "sb-x")
    try:
        await conn.connect(timeout_s=5)
        with TracerProvider().get_tracer("edge").start_as_current_span("edge.exec") as edge:
            t0 = time.time_ns()
            result = await conn.unary("exec", types_pb2.ExecRequest(command="true"), 5)
            t1 = time.time_ns()
        assert result.exec_id == "ex-1"
    finally:
        await conn.close()
        server.close()
    spans = exported.get_finished_spans()
    if answer == "forged":
        assert spans == ()
        return
    (span,) = spans
    assert span.resource.attributes["service.name"] == "dsec-chronus"
    assert span.context is not None and span.parent is not None
    assert span.context.trace_id == edge.get_span_context().trace_id
    assert span.parent.span_id == edge.get_span_context().span_id
    assert span.context.span_id == int.from_bytes(b"\x01" * 8, "big")
    # The sandbox's times are clamped to the call's.
    assert span.start_time is not None and span.end_time is not None
    assert t0 <= span.start_time <= span.end_time <= t1
    assert span.attributes is not None and span.attributes["dsec.exec_id"] == "ex-1"

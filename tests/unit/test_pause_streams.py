"""Streams out of a sandbox across its pauses (edge/pause_streams.py), over scripted channels:
the edge's keepalives while paused (only then), a stream continued where the caller is after
a pause closed its channel, and one that ends with the sandbox's termination instead.

The end-to-end version (real containers and microVMs paused for minutes) is
tests/backends/test_long_pause.py; the node status a broken ledger cannot encode is here too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dsec.edge.v1 import edge_pb2
from dsec.types.v1 import types_pb2
from edge.backends import NullBackend
from edge.manager import Capacity, SandboxManager
from edge.model import SandboxSpec
from edge.pause_streams import SandboxState, across_pauses
from edge.servicer import EdgeServicer, ExecContinuation
from libdsec.errors import ChannelClosed, Internal, SandboxTerminated


class Channel:
    """Answers each call with a script: items (strings, or ExecEvents), pauses (floats: sleep
    that long), and an exception to end with. Records the calls it got."""

    def __init__(self, scripts: dict[str, list[Any]]) -> None:
        self.scripts = scripts
        self.calls: list[tuple[str, Any]] = []

    async def server_stream(self, call: str, request: Any) -> AsyncIterator[Any]:
        self.calls.append((call, request))
        for step in self.scripts[call]:
            if isinstance(step, float):
                await asyncio.sleep(step)
            elif isinstance(step, BaseException):
                raise step
            else:
                yield step


class Sandbox:
    def __init__(self, channel: Channel) -> None:
        self.paused = False
        self.ended = False
        self.channel = channel

    def state(self) -> SandboxState:
        def check_live() -> None:
            if self.ended:
                raise SandboxTerminated("sandbox sb-x has terminated (TTL: ...)")

        return SandboxState(
            paused=lambda: self.paused, check_live=check_live, channel=lambda: self.channel
        )


def _out(data: str, offset: int) -> types_pb2.ExecEvent:
    return types_pb2.ExecEvent(stdout=types_pb2.OutputChunk(data=data.encode(), offset=offset))


STARTED = types_pb2.ExecEvent(started=types_pb2.ExecStarted(exec_id="ex-1", pid=7))
EXIT = types_pb2.ExecEvent(exit=types_pb2.ExitStatus(exit_code=0))


def _keepalive() -> types_pb2.ExecEvent:
    return types_pb2.ExecEvent(keepalive=types_pb2.Keepalive())


def _exec_stream(sb: Sandbox, *, continued: bool = True) -> AsyncIterator[Any]:
    """An exec stream of `sb` across pauses (keepalives every 0.1 s), continued or not."""
    request = types_pb2.ExecRequest(sandbox_id="sb-x")
    return across_pauses(
        sb.state(),
        "exec_stream",
        request,
        keepalive=_keepalive,
        interval_s=0.1,
        continuation=ExecContinuation(request) if continued else None,
    )


async def _collect(it: AsyncIterator[Any]) -> list[str]:
    out = []
    async for ev in it:
        kind = ev.WhichOneof("event")
        out.append(ev.stdout.data.decode() if kind == "stdout" else kind)
    return out


async def test_a_paused_sandbox_s_quiet_stream_gets_the_edge_s_keepalives_a_running_one_not() -> (
    None
):
    channel = Channel({"exec_stream": [STARTED, 0.35, _out("a", 0), EXIT]})
    sb = Sandbox(channel)
    running = await _collect(_exec_stream(sb))
    assert running == ["started", "a", "exit"]  # chronus's own keepalives are its business
    sb.paused = True
    paused = await _collect(_exec_stream(sb, continued=False))
    assert paused[0] == "started" and paused[-2:] == ["a", "exit"]
    assert paused.count("keepalive") >= 2


async def test_a_stream_cut_by_a_pause_continues_from_the_caller_s_offsets() -> None:
    channel = Channel(
        {
            "exec_stream": [STARTED, _out("one\n", 0), _out("two\n", 4), ChannelClosed("cut")],
            # the attach repeats nothing the caller has: it starts at the offsets asked
            "attach_exec": [_out("three\n", 8), EXIT],
        }
    )
    sb = Sandbox(channel)
    sb.paused = True  # the microVM's pause closed the channel under the stream

    async def resume_later() -> None:
        await asyncio.sleep(0.3)
        sb.paused = False

    resumer = asyncio.create_task(resume_later())
    events = await _collect(_exec_stream(sb))
    await resumer
    assert [e for e in events if e != "keepalive"] == [
        "started",
        "one\n",
        "two\n",
        "three\n",
        "exit",
    ]
    assert "keepalive" in events  # said while it waited for the resume
    call, attach = channel.calls[-1]
    assert call == "attach_exec" and attach.exec_id == "ex-1"
    assert (attach.stdout_offset, attach.stderr_offset) == (8, 0)


async def test_a_cut_stream_of_a_sandbox_that_ends_instead_ends_with_its_termination() -> None:
    channel = Channel({"exec_stream": [STARTED, ChannelClosed("cut")]})
    sb = Sandbox(channel)
    sb.paused = True

    async def end_later() -> None:
        await asyncio.sleep(0.2)
        sb.ended = True

    ender = asyncio.create_task(end_later())
    with pytest.raises(SandboxTerminated, match="TTL"):
        await _collect(_exec_stream(sb))
    await ender


async def test_a_cut_stream_of_a_running_sandbox_is_not_continued() -> None:
    channel = Channel({"exec_stream": [STARTED, ChannelClosed("the sandbox died")]})
    with pytest.raises(ChannelClosed):
        await _collect(_exec_stream(Sandbox(channel)))
    assert [c for c, _ in channel.calls] == ["exec_stream"]


async def test_a_node_status_that_cannot_be_encoded_is_an_error_naming_why(tmp_path: Path) -> None:
    m = SandboxManager("e1", tmp_path, Capacity(1000, 1000, 10), [NullBackend()])
    await m.create("sb-e1-aaaaaa01", SandboxSpec(), "root", "p", wait_ready=True)
    s = EdgeServicer(m, types_pb2.EdgeInfo(edge_id="e1"))
    assert (await s.GetNodeStatus(edge_pb2.GetNodeStatusRequest(), None)).load.sandboxes == 1
    m.admission._live = -1  # what a double release did before one ending per sandbox
    with pytest.raises(Internal) as info:
        await s.GetNodeStatus(edge_pb2.GetNodeStatusRequest(), None)
    assert info.value.reason == "NODE_STATUS_INVALID"
    assert "cannot encode its node status" in info.value.message

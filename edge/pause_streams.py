"""Streams out of a sandbox that outlive its pauses.

A stream open into a sandbox (a command's output, an attach, a directory watch) is fed by
chronus, which also sends its keepalives. While the sandbox is paused nothing in it runs: a
container is frozen, a microVM has no VMM at all (its channel is closed at the pause and
opened again at the resume). The caller's stream must neither stall (the SDK gives up on a
stream silent for 30 s) nor end: a preemption lasts minutes to hours.

`across_pauses` wraps such a stream: while the sandbox is paused (or pausing, resuming) and the
stream is quiet, the edge itself sends the stream's keepalive every ``interval_s``; if the
channel closes under the stream because of the pause, it waits for the sandbox to run again
and continues the stream where the caller is (a command's output from the offsets the caller
has, a watch anew), dropping what the continuation repeats. If the sandbox ends instead, the
stream ends with its termination (SandboxTerminated and the reason). Domain code: no gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from libdsec.errors import ChannelClosed

#: How often the edge polls a paused sandbox's state while a stream waits for its resume.
POLL_S = 0.25


class Continuation(Protocol):
    """How one kind of stream is continued after its channel closed during a pause."""

    def observe(self, item: Any) -> None:
        """Each item as it goes to the caller (what the caller has)."""

    def reopen(self) -> tuple[str, Any] | None:
        """The (chronus call, request) that continues the stream; None: it cannot be."""

    def repeated(self, item: Any) -> bool:
        """An item of the continuation the caller already has (e.g. a second `started`)."""


@dataclass
class SandboxState:
    """What the stream needs to know of its sandbox, from the manager."""

    #: Paused, or being paused or resumed (a transition in progress).
    paused: Callable[[], bool]
    #: Raises SandboxTerminated once the sandbox has ended (with its reason).
    check_live: Callable[[], None]
    #: The sandbox's channel once it runs again (raises while there is none).
    channel: Callable[[], Any]


async def across_pauses(
    state: SandboxState,
    call: str,
    request: Any,
    *,
    keepalive: Callable[[], Any],
    interval_s: float,
    continuation: Continuation | None,
) -> AsyncIterator[Any]:
    """The items of ``call(request)`` on the sandbox's channel, across its pauses (above)."""
    channel = state.channel()
    resumed = False
    while True:
        try:
            async for item in _quiet_while_paused(
                channel.server_stream(call, request), state, keepalive, interval_s
            ):
                if item is _KEEPALIVE:
                    yield keepalive()
                    continue
                if resumed and continuation is not None and continuation.repeated(item):
                    continue
                if continuation is not None:
                    continuation.observe(item)
                yield item
            return
        except ChannelClosed:
            if continuation is None or not state.paused():
                state.check_live()
                raise
            again = continuation.reopen()
            if again is None:
                raise
        # The channel went with the pause: wait for the resume, saying so meanwhile.
        waited = 0.0
        while state.paused():
            state.check_live()
            await asyncio.sleep(POLL_S)
            waited += POLL_S
            if waited >= interval_s:
                waited = 0.0
                yield keepalive()
        state.check_live()
        channel = state.channel()
        call, request = again
        resumed = True


_KEEPALIVE = object()


async def with_keepalives(
    stream: AsyncIterator[Any], state: SandboxState, keepalive: Callable[[], Any], interval_s: float
) -> AsyncIterator[Any]:
    """A stream that cannot be continued (an interactive command: its input is the
    caller's), with the edge's keepalives while the sandbox is paused. A container's stays
    open across the pause; a microVM's ends with its channel (the command runs on: attach to
    it by its exec id)."""
    async for item in _quiet_while_paused(stream, state, keepalive, interval_s):
        yield keepalive() if item is _KEEPALIVE else item


async def _quiet_while_paused(
    stream: AsyncIterator[Any], state: SandboxState, keepalive: Callable[[], Any], interval_s: float
) -> AsyncIterator[Any]:
    """The stream's items; _KEEPALIVE each ``interval_s`` it is quiet while the sandbox is
    paused. A running sandbox's silence is chronus's to fill (its own keepalives): the edge
    does not cover for a sandbox that is stuck."""
    it = stream.__aiter__()
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                if state.paused():
                    yield _KEEPALIVE
                continue
            got, pending = pending, None
            try:
                item = got.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(BaseException):
                await aclose()

"""Watching sandboxes change: :class:`AsyncWatch`, the iterator ``AsyncClient.watch`` returns
(``SandboxService/WatchSandboxes``).

    async with dsec.watch(task_id="swe-123") as changes:   # established on entry
        async for info in changes:                         # SandboxInfo, as get/list return
            print(info.id, info.state, info.termination_reason)

Keepalives are skipped; a stream silent for :data:`STREAM_STALL_MARGIN` keepalive intervals
raises :class:`~libdsec.errors.DeadlineExceeded` (``STREAM_STALLED``). The iteration ends,
without an error, when the watch is closed (``aclose()``, leaving the ``async with``), when
its client closes, after ``timeout`` seconds if one was given, or when the server ends the
stream.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import grpc

from dsec.apiserver.v1 import apiserver_pb2
from libdsec._transport import (
    STREAM_KEEPALIVE_INTERVAL_S,
    STREAM_STALL_MARGIN,
    Transport,
    stalled,
    stream_error,
)
from libdsec.errors import DeadlineExceeded, InvalidArgument
from libdsec.types import SandboxInfo

#: How long closing waits for a read in flight (in another task) to see the close.
_CLOSE_WAIT_S = 1.0


class AsyncWatch:
    """Changes of the caller's sandboxes (its project and subprojects), optionally only of one
    task and/or with all of some labels: each change as the sandbox's :class:`SandboxInfo`
    after it (created, each state change, terminated with its reason). At least once: a change
    may rarely come twice. An async iterator and an async context manager."""

    def __init__(
        self,
        rpc: Transport,
        *,
        task_id: str = "",
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
        keepalive_interval_s: float = STREAM_KEEPALIVE_INTERVAL_S,
        since: datetime | None = None,
    ) -> None:
        if keepalive_interval_s <= 0:
            raise InvalidArgument(
                f"keepalive_interval_s must be > 0, not {keepalive_interval_s}",
                reason="INVALID_KEEPALIVE",
            )
        if timeout is not None and timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0, not {timeout}", reason="INVALID_TIMEOUT")
        self._rpc = rpc
        self._request = apiserver_pb2.WatchSandboxesRequest(
            task_id=task_id,
            label_selector=dict(labels or {}),
            keepalive_interval_ms=round(keepalive_interval_s * 1000),
        )
        if since is not None:
            if since.tzinfo is None:
                raise InvalidArgument(
                    "since must be timezone-aware (e.g. a resume_at)", reason="BAD_CHANGED_SINCE"
                )
            self._request.changed_since.FromDatetime(since)
        #: Where a new watch resumes this one if its stream breaks (``watch(since=...)``):
        #: the server's time in its last keepalive (None before the first).
        self.resume_at: datetime | None = since
        #: A stream silent this long (no change, no keepalive) is dead.
        self.idle_timeout_s = keepalive_interval_s * STREAM_STALL_MARGIN
        self._timeout = timeout
        self._ends_at: float | None = None
        self._call: Any = None
        self._started = False
        self._early: collections.deque[SandboxInfo] = collections.deque()
        self._closed = False
        self._reading = asyncio.Event()  # clear while a read is in flight
        self._reading.set()
        self._on_close: list[Callable[[AsyncWatch], None]] = []

    @property
    def closed(self) -> bool:
        return self._closed

    def __aiter__(self) -> AsyncWatch:
        return self

    async def __aenter__(self) -> AsyncWatch:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> AsyncWatch:
        """Opens the stream and waits for the server's first keepalive, which it sends once it
        follows every edge: from then on, every change is reported. Iterating starts it too."""
        if not self._started and not self._closed:
            self._rpc.check_open()
            self._started = True
            self._call = self._rpc.sandboxes.WatchSandboxes(
                self._request,
                metadata=self._rpc.metadata,
                # a deadline past the caller's own end (which closes the call first)
                timeout=None if self._timeout is None else self._timeout + 30.0,
                # Nothing is sent before the connection is up, so a watch opened while the API
                # server is unreachable (restarting, or its virtual IP's route not yet moved)
                # waits for it rather than failing at once; the first read's stall limit
                # bounds the wait.
                wait_for_ready=True,
            )
            if self._timeout is not None:
                self._ends_at = time.monotonic() + self._timeout
            while True:
                msg = await self._read()
                if msg is None:
                    break  # closed or ended before it was ready: the iteration ends
                if msg.WhichOneof("event") == "keepalive":
                    self._kept_alive(msg)
                    break
                if msg.WhichOneof("event") == "changed":
                    self._early.append(SandboxInfo.from_pb(msg.changed))
        return self

    async def __anext__(self) -> SandboxInfo:
        await self.start()
        if self._early:
            return self._early.popleft()
        while True:
            msg = await self._read()
            if msg is None:
                raise StopAsyncIteration
            if msg.WhichOneof("event") == "changed":
                return SandboxInfo.from_pb(msg.changed)
            self._kept_alive(msg)  # the stream is alive; nothing to yield

    def _kept_alive(self, msg: Any) -> None:
        """Every change before a keepalive's ``at`` has been delivered: a resume point."""
        if msg.keepalive.HasField("at"):
            self.resume_at = msg.keepalive.at.ToDatetime(tzinfo=UTC)

    async def _read(self) -> Any:
        """The next message, or None once the watch is over (closed, timed out, ended)."""
        if self._closed:
            return None
        wait = self.idle_timeout_s
        if self._ends_at is not None:
            left = self._ends_at - time.monotonic()
            if left <= 0:
                await self.aclose()
                return None
            wait = min(wait, left)
        self._reading.clear()
        try:
            try:
                async with asyncio.timeout(wait):
                    msg = await self._call.read()
            except TimeoutError:
                self._finish()
                if self._ends_at is not None and time.monotonic() >= self._ends_at:
                    return None  # the caller's timeout: a clean end
                state = self._rpc.channel.get_state()
                if state != grpc.ChannelConnectivity.READY:
                    raise DeadlineExceeded(  # as a unary call that never got through
                        f"no answer within {wait:g} s: the API server at {self._rpc.target} "
                        f"cannot be reached (connection {state.name}); is it running?"
                    ) from None
                raise stalled(self.idle_timeout_s) from None
            except grpc.aio.AioRpcError as exc:
                if self._closed:
                    return None
                self._finish()
                raise stream_error(exc) from exc
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed and (task is None or task.cancelling() == 0):
                    return None  # the call was cancelled by a close, not this task
                raise
        finally:
            self._reading.set()
        if msg is grpc.aio.EOF or self._closed:
            self._finish()
            return None
        return msg

    def _finish(self) -> None:
        self._closed = True
        if self._call is not None:
            self._call.cancel()
        for callback in self._on_close:
            callback(self)
        self._on_close.clear()

    async def aclose(self) -> None:
        """Ends the watch (idempotent); an iteration in another task ends without an error."""
        if self._closed:
            return
        self._finish()
        try:
            async with asyncio.timeout(_CLOSE_WAIT_S):
                await self._reading.wait()
        except TimeoutError:
            pass  # that reader ends when its task next runs

    close = aclose

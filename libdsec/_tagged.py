"""The caller's side of a tagged job stream (``StreamFunctions``): many concurrent calls
share one bidirectional gRPC stream instead of paying a call each.

Each request gets a tag here; the reader task matches every answer to its waiting caller.
A unary call costs each side a full call set-up (HTTP/2 stream, headers, call objects,
interceptors); a message on an open stream costs a fraction of that (measured on 10 ms jobs
at concurrency 16: ~1.4 ms less CPU per job over the SDK -> API server -> edge chain).

Failure rules, so that no caller ever hangs:

- the stream breaks or ends: every waiting caller gets the stream's error (UNAVAILABLE if it
  simply ended) and the next call opens a new stream;
- the server says nothing (not even a keepalive, tag 0) for ``idle_timeout_s`` while calls
  wait: the stream is declared stalled (DEADLINE_EXCEEDED, ``STREAM_STALLED``) and dropped;
- a caller that times out or is cancelled sends a cancel for its tag and goes away;
- the server ends a new stream before our first request was sent (it refuses the stream at
  once: a bad token): gRPC may then report the failed send (a generic INTERNAL) instead of the
  server's status. Nothing reached the server, so the waiting calls are sent again on a new
  stream (at most ``UNSENT_RESENDS`` times), where the server's own status is seen.

Used by the SDK (to the API server) and by the API server (to each edge).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import grpc

from libdsec.errors import (
    DeadlineExceeded,
    DSecError,
    InvalidArgument,
    Unavailable,
    Unimplemented,
    from_rpc_error,
    item_error,
)

#: The largest job sent: the channels' message limit (64 MiB) minus room for the envelope.
MAX_REQUEST_BYTES = 64 * 1024 * 1024 - 64 * 1024
#: How long a close waits for the server to end an idle stream before cancelling it.
CLOSE_GRACE_S = 1.0
#: How often a call is sent again on a new stream when its stream failed before sending
#: anything (see _unsent). One race in ~500 under CPU load: three in a row do not happen.
UNSENT_RESENDS = 3
#: The status details gRPC gives a call whose own send failed in its core (no server said it).
_CORE_FAILURE = "Internal error from Core"


def stream_failed(err: BaseException) -> bool:
    """Whether ``err`` is the stream's own failure (every waiting call got it), not the error
    one job got from the server (e.g. UNIMPLEMENTED: the server has no such stream at all)."""
    return bool(getattr(err, "stream_failed", False))


class _Open:
    """One open stream: its call, the requests to send, the callers waiting by tag."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.closed = False
        self.sent = 0  # requests the call has sent
        self.call: Any = None
        self.reader: asyncio.Task[None] | None = None
        self.writer: asyncio.Task[None] | None = None
        self.idle: asyncio.Timeout | None = None  # the reader's current wait

    async def write(self) -> None:
        """Sends the queued requests, then half-closes. Our own task rather than gRPC's
        request-iterator task, so that a close can wait for the half-close to complete: a
        client closed while it is in flight leaves gRPC's task to be cancelled by the loop's
        shutdown, and the op's completion then reaches a closed loop ("Event loop is closed"
        from gRPC's poller, in about one of ten closes under CPU load)."""
        try:
            while (item := await self.queue.get()) is not None:
                await self.call.write(item)
                self.sent += 1
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call ended: the reader reports how
        except Exception:
            self.call.cancel()  # the reader reports the cancel to every waiting caller
            raise


class _Unsent(Exception):
    """What a waiting call gets when its stream failed before sending anything: the call
    is sent again on a new stream (``err`` is what to raise once it may not be)."""

    def __init__(self, err: DSecError) -> None:
        super().__init__(str(err))
        self.err = err


class TaggedStream:
    """``await stream.call(request, timeout)``: one request on the shared stream, its answer.

    ``open_call(None)`` starts the bidirectional call (e.g. ``stub.StreamFunctions``) in gRPC's
    reader/writer style: the requests are written here.
    A request is a message with ``tag`` (set here) and ``cancel`` fields. The answer is the
    response message; one that carries an error (``error``, an ItemStatus) is raised as its typed
    :class:`DSecError`. ``unsupported`` turns true once the server answered the stream itself
    with UNIMPLEMENTED (an older server): callers then use their unary call instead.
    """

    def __init__(
        self,
        open_call: Callable[[None], Any],
        *,
        idle_timeout_s: float = 30.0,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ) -> None:
        self._open_call = open_call
        self._idle_timeout_s = idle_timeout_s
        self._max_request_bytes = max_request_bytes
        self._tags = itertools.count(1)
        self._state: _Open | None = None
        self.unsupported = False

    def _ensure(self) -> _Open:
        st = self._state
        if st is None or st.closed:
            st = _Open()
            st.call = self._open_call(None)  # gRPC's reader/writer style: we write
            loop = asyncio.get_running_loop()
            st.writer = loop.create_task(st.write())
            st.reader = loop.create_task(self._read(st))
            self._state = st
        return st

    async def call_if_supported(self, request: Any, timeout: float | None) -> Any | None:
        """As :meth:`call`, or None if the server has no such stream (see ``unsupported``)."""
        if self.unsupported:
            return None
        try:
            return await self.call(request, timeout)
        except Unimplemented:
            if self.unsupported:
                return None
            raise  # that job's own answer

    async def call(self, request: Any, timeout: float | None) -> Any:
        request.tag = next(self._tags)  # kept if it is sent again (on a new stream)
        size = request.ByteSize()
        if size > self._max_request_bytes:
            # Refused here: past the channel's message limit gRPC would fail the whole stream,
            # i.e. every other job on it.
            raise InvalidArgument(
                f"the job is {size} bytes; at most {self._max_request_bytes} per job",
                reason="JOB_TOO_LARGE",
            )
        try:
            async with asyncio.timeout(timeout):
                for attempt in itertools.count():
                    try:
                        msg = await self._send(request)
                        break
                    except _Unsent as unsent:
                        if attempt >= UNSENT_RESENDS:
                            raise unsent.err from None
        except TimeoutError:
            raise DeadlineExceeded(
                f"no answer within {timeout:.1f} s", reason="DEADLINE_EXCEEDED"
            ) from None
        if msg.error.code:
            raise item_error(msg.error)
        return msg

    async def _send(self, request: Any) -> Any:
        """Sends ``request`` (tagged) on the open stream (opened if need be) and
        waits for its answer; a caller that stops waiting cancels it on the stream."""
        tag = request.tag
        st = self._ensure()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        st.pending[tag] = fut
        st.queue.put_nowait(request)
        idle = st.idle
        if idle is not None and len(st.pending) == 1:  # the first waiter: the clock starts now
            idle.reschedule(loop.time() + self._idle_timeout_s)
        try:
            return await fut
        except BaseException:
            self._give_up(st, request)
            raise

    @staticmethod
    def _give_up(st: _Open, request: Any) -> None:
        if st.pending.pop(request.tag, None) is not None and not st.closed:
            st.queue.put_nowait(type(request)(tag=request.tag, cancel=True))

    async def _read(self, st: _Open) -> None:
        err: DSecError = Unavailable("the job stream ended", reason="STREAM_CLOSED")
        unsent = False
        it = st.call.__aiter__()
        try:
            while True:
                deadline = (
                    asyncio.get_running_loop().time() + self._idle_timeout_s if st.pending else None
                )
                try:
                    async with asyncio.timeout_at(deadline) as idle:
                        st.idle = idle
                        msg = await it.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if not st.pending:  # its waiters gave up meanwhile: nobody waits for it
                        continue
                    err = DeadlineExceeded(
                        f"the job stream said nothing (not even a keepalive) for "
                        f"{self._idle_timeout_s:.0f} s",
                        reason="STREAM_STALLED",
                    )
                    break
                finally:
                    st.idle = None
                if msg.tag:
                    fut = st.pending.pop(msg.tag, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            unsent = _unsent(st, exc)
        except asyncio.CancelledError:
            err = Unavailable("the job stream was closed", reason="STREAM_CLOSED")
            raise
        finally:
            self._close(st, err, unsent)

    def _close(self, st: _Open, err: DSecError, unsent: bool = False) -> None:
        """Ends ``st``: every waiting call gets ``err`` (or is sent again, if ``unsent``)."""
        err.stream_failed = True  # type: ignore[attr-defined]  # see stream_failed()
        if isinstance(err, Unimplemented):
            self.unsupported = True
        st.closed = True
        if self._state is st:
            self._state = None
        pending, st.pending = st.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(_Unsent(err) if unsent else err)
        st.queue.put_nowait(None)  # ends the request iterator
        if st.call is not None:
            st.call.cancel()

    async def aclose(self) -> None:
        """Ends the stream. With no call waiting, gracefully: the requests end, the server ends
        the stream, and the reader sees its end (so gRPC has the call's final status before
        the event loop may close: a call merely cancelled gets it a moment later, and if the
        loop is closed by then gRPC logs "Event loop is closed" from another loop of the
        process, e.g. after ``asyncio.run``). Otherwise, or if the server is slow to end it,
        every waiting call gets UNAVAILABLE (STREAM_CLOSED) and the call is cancelled."""
        st, self._state = self._state, None
        if st is None:
            return
        if st.reader is not None:
            if not st.pending and not st.closed:
                st.queue.put_nowait(None)  # half-close: the server ends the stream
                await asyncio.wait({st.reader}, timeout=CLOSE_GRACE_S)
            st.reader.cancel()
            await asyncio.wait({st.reader})  # its own outcome is not ours to raise
        self._close(st, Unavailable("the client was closed", reason="STREAM_CLOSED"))
        if st.writer is not None:  # its last op completes before the caller's loop may close
            await asyncio.wait({st.writer}, timeout=CLOSE_GRACE_S)
            st.writer.cancel()
            await asyncio.wait({st.writer})


def _unsent(st: _Open, exc: grpc.aio.AioRpcError) -> bool:
    """Whether the stream failed in gRPC's core before it sent anything of ours: the server
    ended it at once (a refusal) and the send of our first request failed. gRPC then reports
    that failure (INTERNAL, "Internal error from Core") rather than the server's status, and
    keeps it as the call's status. No request reached the server, so sending them again on a
    new stream is safe, and shows the server's status."""
    return (
        st.sent == 0 and exc.code() == grpc.StatusCode.INTERNAL and exc.details() == _CORE_FAILURE
    )

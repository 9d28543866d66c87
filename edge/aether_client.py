"""The edge's end of the channel to aether inside a sandbox.

One connection per sandbox over a Unix stream socket, carrying
length-delimited ``dsec.aether.v1.Frame`` messages (4-byte big-endian length,
then the encoded frame). Calls are multiplexed by stream id (odd, chosen
here). A call sends a chronus ``Request`` on a new stream and reads
``Response`` frames until a ``StreamEnd``; a non-zero end code becomes the
matching :class:`~libdsec.errors.DSecError`.

Liveness: a Ping goes out when the channel has been quiet for
``ping_interval_s``; no frame at all for ``dead_after_s`` closes the
connection. While the sandbox is paused its aether is frozen and cannot
answer: ``hold()`` suspends the judgment (and the pings) until ``release()``,
which starts the silence count afresh and pings at once. Streams stay open
across a pause. When the connection closes every open call fails with
UNAVAILABLE (reason ``CHANNEL_CLOSED``) and ``on_close`` runs, so the edge can
decide whether the sandbox died.

Traces: the Request of a command (``exec``, ``exec_stream``, ``exec_input``'s start) carries
the W3C context of the edge's current span when it is recorded; chronus answers with the
command's span (``Response.span``), which this side exports on its behalf
(:func:`common.telemetry.record_in_sandbox_span`). The sandbox is not trusted with it: a span
is exported only with the ids this side sent on that stream, and its times are clamped to the
call's (a sandbox cannot plant spans in other traces, nor stretch its own).

Each stream's queue is bounded, so a slow consumer (a client downloading a
large file slowly) applies backpressure to the reader instead of growing the
edge's memory; the cost is that other calls to the same sandbox wait too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from common.telemetry import record_in_sandbox_span, traceparent_for_sandbox
from dsec.aether.v1 import aether_pb2
from dsec.chronus.v1 import chronus_pb2
from libdsec.errors import ChannelClosed, DeadlineExceeded, Unavailable, status_for

log = logging.getLogger(__name__)

MAX_FRAME = 8 * 1024 * 1024
_LEN = struct.Struct(">I")
_END = object()
#: Calls whose Request opens a command: traced into the sandbox (chronus.tracing).
_COMMAND_CALLS = frozenset({"exec", "exec_stream", "exec_input"})


class AetherConnection:
    def __init__(
        self,
        socket_path: str,
        sandbox_id: str,
        *,
        on_close: Callable[[str], Awaitable[None]] | None = None,
        ping_interval_s: float = 5.0,
        dead_after_s: float = 20.0,
        queue_frames: int = 64,
        ask_hello: bool = False,
    ) -> None:
        self.socket_path = socket_path
        # A device channel (a VM's virtio-serial port behind QEMU's socket): aether cannot see
        # the host connect, so the edge asks for the Hello with Pings of nonce 0 until it comes.
        self.ask_hello = ask_hello
        self._claimed: asyncio.Future[str] | None = None
        self.sandbox_id = sandbox_id
        self.on_close = on_close
        self.ping_interval_s = ping_interval_s
        self.dead_after_s = dead_after_s
        self.queue_frames = queue_frames
        self.hello: aether_pb2.Hello | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._ids = itertools.count(1, 2)
        self._tasks: list[asyncio.Task[None]] = []
        self._write_lock = asyncio.Lock()
        self._last_rx = time.monotonic()
        self._last_tx = time.monotonic()
        self.closed = asyncio.Event()
        self.close_reason = ""
        #: The sandbox is paused (frozen): its silence means nothing until release().
        self.held = False
        #: The read loop waits for a slow reader's queue: no frame can be read meanwhile.
        self._backpressure = False
        self._nonce = 0  # of our Pings; the Pongs awaited by ping()
        self._pongs: dict[int, asyncio.Future[None]] = {}
        #: Traced streams: stream id -> (traceparent sent, when, in ns since the epoch).
        self._traced: dict[int, tuple[str, int]] = {}

    # ------------------------------------------------------------ connect

    async def connect(self, timeout_s: float = 10.0) -> aether_pb2.Hello:
        """Connects (retrying while aether starts) and reads its Hello."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    self.socket_path, limit=MAX_FRAME + 16
                )
                asking = asyncio.create_task(self._ask_hello()) if self.ask_hello else None
                try:
                    frame = await asyncio.wait_for(
                        self._read_hello(), timeout=max(0.1, deadline - time.monotonic())
                    )
                finally:
                    if asking is not None:
                        asking.cancel()
                if frame.WhichOneof("body") != "hello":
                    raise Unavailable(
                        f"aether sent {frame.WhichOneof('body')} before hello",
                        reason="AETHER_PROTOCOL",
                    )
                self.hello = frame.hello
                self._last_rx = time.monotonic()
                self._tasks = [
                    asyncio.create_task(self._read_loop(), name=f"aether-read-{self.sandbox_id}"),
                    asyncio.create_task(self._ping_loop(), name=f"aether-ping-{self.sandbox_id}"),
                ]
                return frame.hello
            except (
                ConnectionError,
                FileNotFoundError,
                asyncio.IncompleteReadError,
                TimeoutError,
            ) as exc:
                last = exc
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None
                await asyncio.sleep(0.005)
        raise Unavailable(
            f"aether of {self.sandbox_id} did not answer within {timeout_s} s: {last}",
            reason="AETHER_UNREACHABLE",
        )

    async def _read_hello(self) -> aether_pb2.Frame:
        """The first frame: aether's Hello. A device channel has no connection boundary: what
        the guest wrote to its port for the previous host (e.g. a stream's end, saved with a
        guest paused right after the call) reaches this host first; it is not ours to read."""
        while True:
            frame = await self._read_frame()
            kind = frame.WhichOneof("body")
            if kind == "hello" or not self.ask_hello:
                return frame
            log.debug("%s: dropped a %s frame of a previous connection", self.sandbox_id, kind)

    async def _ask_hello(self) -> None:
        ping = aether_pb2.Frame(ping=aether_pb2.Ping(nonce=0)).SerializeToString()
        while self._writer is not None:
            self._writer.write(_LEN.pack(len(ping)) + ping)
            await asyncio.sleep(0.1)

    async def _read_frame(self) -> aether_pb2.Frame:
        assert self._reader is not None
        head = await self._reader.readexactly(4)
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            raise ConnectionError(f"frame of {n} bytes exceeds the {MAX_FRAME} limit")
        frame = aether_pb2.Frame()
        frame.ParseFromString(await self._reader.readexactly(n))
        return frame

    async def _send(self, frame: aether_pb2.Frame) -> None:
        if self.closed.is_set() or self._writer is None:
            raise ChannelClosed(f"channel to {self.sandbox_id} is closed: {self.close_reason}")
        data = frame.SerializeToString()
        if len(data) > MAX_FRAME:
            from libdsec.errors import InvalidArgument

            raise InvalidArgument(
                f"message of {len(data)} bytes exceeds the {MAX_FRAME}-byte frame limit",
                reason="MESSAGE_TOO_LARGE",
            )
        async with self._write_lock:
            try:
                self._writer.write(_LEN.pack(len(data)) + data)
                await self._writer.drain()
            except OSError as exc:
                # The other end went away (a sandbox killed while frozen dies at its thaw)
                # before the read loop saw it: the channel's end, as the caller knows it.
                raise ChannelClosed(f"channel to {self.sandbox_id} closed: {exc}") from exc
        self._last_tx = time.monotonic()

    # -------------------------------------------------------------- loops

    async def _read_loop(self) -> None:
        reason = "aether closed the channel"
        try:
            while True:
                frame = await self._read_frame()
                self._last_rx = time.monotonic()
                kind = frame.WhichOneof("body")
                if kind == "ping":
                    await self._send(aether_pb2.Frame(pong=aether_pb2.Pong(nonce=frame.ping.nonce)))
                    continue
                if kind == "pong":
                    answered = self._pongs.get(frame.pong.nonce)
                    if answered is not None and not answered.done():
                        answered.set_result(None)
                    continue
                if kind == "hello":
                    continue  # a device channel may repeat its Hello (one per Ping of nonce 0)
                if kind == "claimed":
                    if self._claimed is not None and not self._claimed.done():
                        self._claimed.set_result(frame.claimed.error)
                    continue
                q = self._streams.get(frame.stream_id)
                if q is None:
                    continue  # a stream we abandoned
                # A full queue (a slow reader of one stream) holds the whole channel: that
                # wait is ours, not aether's silence (see _ping_loop).
                self._backpressure = True
                try:
                    if kind == "response":
                        await q.put(frame.response)
                    elif kind == "end":
                        await q.put(frame.end)
                finally:
                    self._backpressure = False
                    self._last_rx = time.monotonic()
        except asyncio.CancelledError:
            reason = "edge closed the channel"
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            reason = f"channel lost: {exc.__class__.__name__}"
        except ChannelClosed as exc:  # a Pong that met the other end's reset (_send)
            reason = f"channel lost: {exc.__cause__.__class__.__name__}"
        except Exception as exc:  # a corrupt frame: the channel cannot be trusted anymore
            reason = f"protocol error: {exc}"
        finally:
            await self._closed(reason)

    def hold(self) -> None:
        """The sandbox is about to be frozen: stop judging its silence (and pinging it)."""
        self.held = True

    async def release(self, timeout_s: float) -> None:
        """The sandbox runs again: its silence counts from now, and it must answer a Ping
        within ``timeout_s`` (a thawed sandbox may first fault its memory back in). Raises
        Unavailable (AETHER_UNREACHABLE) if it does not, ChannelClosed if the channel ends."""
        self.held = False
        self._last_rx = time.monotonic()
        await self.ping(timeout_s)

    async def ping(self, timeout_s: float) -> None:
        """One Ping, answered (Pong) within ``timeout_s``."""
        self._nonce += 1
        nonce = self._nonce
        answered = self._pongs[nonce] = asyncio.get_running_loop().create_future()
        closing = asyncio.ensure_future(self.closed.wait())
        try:
            await self._send(aether_pb2.Frame(ping=aether_pb2.Ping(nonce=nonce)))
            await asyncio.wait(
                {answered, closing}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            closing.cancel()
            self._pongs.pop(nonce, None)
        if answered.done():
            return
        if self.closed.is_set():
            raise ChannelClosed(f"channel to {self.sandbox_id} closed: {self.close_reason}")
        raise Unavailable(
            f"aether of {self.sandbox_id} did not answer a ping within {timeout_s} s",
            reason="AETHER_UNREACHABLE",
        )

    async def _ping_loop(self) -> None:
        while not self.closed.is_set():
            await asyncio.sleep(self.ping_interval_s / 2)
            if self.held or self._backpressure:
                continue
            now = time.monotonic()
            if now - self._last_rx > self.dead_after_s:
                log.warning(
                    "aether of %s silent for %.0f s; closing", self.sandbox_id, now - self._last_rx
                )
                if self._writer is not None:
                    self._writer.close()
                return
            if now - max(self._last_rx, self._last_tx) >= self.ping_interval_s:
                self._nonce += 1
                with contextlib.suppress(Unavailable):
                    await self._send(aether_pb2.Frame(ping=aether_pb2.Ping(nonce=self._nonce)))

    async def _closed(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        for q in list(self._streams.values()):
            q.put_nowait(ChannelClosed(f"channel to sandbox {self.sandbox_id} closed: {reason}"))
        if self._claimed is not None and not self._claimed.done():
            self._claimed.set_exception(ChannelClosed(f"channel closed: {reason}"))
        if self._writer is not None:
            self._writer.close()
        if self.on_close is not None:
            try:
                await self.on_close(reason)
            except Exception:
                log.exception("on_close of %s failed", self.sandbox_id)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._writer is not None:
            self._writer.close()
        self.closed.set()

    # -------------------------------------------------------------- calls

    @property
    def open_calls(self) -> int:
        """Calls into the sandbox under way on this channel (streams not yet ended)."""
        return len(self._streams)

    def _open(self) -> tuple[int, asyncio.Queue[Any]]:
        sid = next(self._ids)
        q: asyncio.Queue[Any] = asyncio.Queue(maxsize=self.queue_frames)
        self._streams[sid] = q
        return sid, q

    async def _request(self, sid: int, call: str, message: Any) -> None:
        req = chronus_pb2.Request()
        getattr(req, call).CopyFrom(message)
        if call in _COMMAND_CALLS and (call != "exec_input" or message.HasField("start")):
            req.traceparent = traceparent_for_sandbox()
            if req.traceparent:
                self._traced[sid] = (req.traceparent, time.time_ns())
        await self._send(aether_pb2.Frame(stream_id=sid, request=req))

    async def _finish(self, sid: int, cancel: bool) -> None:
        self._streams.pop(sid, None)
        self._traced.pop(sid, None)
        if cancel and not self.closed.is_set():
            with contextlib.suppress(Unavailable):
                await self._send(aether_pb2.Frame(stream_id=sid, cancel=aether_pb2.Cancel()))

    @staticmethod
    def _unwrap(item: Any) -> Any:
        if isinstance(item, Exception):
            raise item
        if isinstance(item, aether_pb2.StreamEnd):
            if item.code:
                raise status_for(item.code, item.reason, item.message)
            return _END
        field = item.WhichOneof("result")
        return getattr(item, field) if field else None

    async def _responses(
        self, sid: int, q: asyncio.Queue[Any], timeout_s: float | None
    ) -> AsyncIterator[Any]:
        while True:
            try:
                item = (
                    await asyncio.wait_for(q.get(), timeout=timeout_s)
                    if timeout_s
                    else await q.get()
                )
            except TimeoutError:
                raise DeadlineExceeded(
                    f"sandbox {self.sandbox_id} did not answer in {timeout_s} s"
                ) from None
            if isinstance(item, chronus_pb2.Response) and item.HasField("span"):
                self._export_span(sid, item)
            value = self._unwrap(item)
            if value is _END:
                return
            yield value

    def _export_span(self, sid: int, response: chronus_pb2.Response) -> None:
        """Exports the command's span chronus recorded (under chronus's service name), if it
        belongs to the trace and span this side sent on the stream (once)."""
        sent = self._traced.pop(sid, None)
        span = response.span
        if sent is None:
            return
        traceparent, sent_ns = sent
        _, trace_id, parent_id, _ = traceparent.split("-")
        if span.trace_id.hex() != trace_id or span.parent_span_id.hex() != parent_id:
            log.warning("%s: a command span of another trace, dropped", self.sandbox_id)
            return
        field = response.WhichOneof("result")
        exit = (
            response.exec_result.exit
            if field == "exec_result"
            else response.exec_event.exit
            if field == "exec_event"
            else None
        )
        now_ns = time.time_ns()
        attributes: dict[str, str | int | bool] = {"dsec.sandbox_id": self.sandbox_id}
        if field == "exec_result" and response.exec_result.exec_id:
            attributes["dsec.exec_id"] = response.exec_result.exec_id
        error = ""
        if exit is not None:
            attributes["process.exit.code"] = exit.exit_code
            if exit.signal:
                attributes["dsec.exec.signal"] = exit.signal
            if exit.timed_out:
                attributes["dsec.exec.timed_out"] = True
            error = exit.error or ("timed out" if exit.timed_out else "")
        record_in_sandbox_span(
            "chronus",
            "chronus.exec",
            trace_id=span.trace_id,
            parent_span_id=span.parent_span_id,
            span_id=span.span_id,
            # Within the call: a command cannot start before it was asked for, nor end later
            # than now (a VM guest's clock may also be a little off the host's).
            start_unix_ns=min(max(span.start_unix_ns, sent_ns), now_ns),
            end_unix_ns=min(max(span.end_unix_ns, sent_ns), now_ns),
            attributes=attributes,
            error=error,
        )

    async def unary(self, call: str, request: Any, timeout_s: float | None = None) -> Any:
        sid, q = self._open()
        done = False
        try:
            await self._request(sid, call, request)
            result = None
            async for value in self._responses(sid, q, timeout_s):
                result = value
            done = True
            return result
        finally:
            await self._finish(sid, cancel=not done)

    async def server_stream(self, call: str, request: Any) -> AsyncIterator[Any]:
        sid, q = self._open()
        done = False
        try:
            await self._request(sid, call, request)
            async for value in self._responses(sid, q, None):
                yield value
            done = True
        finally:
            await self._finish(sid, cancel=not done)

    async def _pump(
        self, sid: int, q: asyncio.Queue[Any], call: str, requests: AsyncIterator[Any]
    ) -> None:
        try:
            async for message in requests:
                await self._request(sid, call, message)
            await self._send(aether_pb2.Frame(stream_id=sid, half_close=aether_pb2.HalfClose()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the caller's stream failed: end the call with its error
            await q.put(exc)

    async def client_stream(self, call: str, requests: AsyncIterator[Any]) -> Any:
        result = None
        async for value in self.bidi(call, requests):
            result = value
        return result

    async def bidi(self, call: str, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        sid, q = self._open()
        pump = asyncio.create_task(self._pump(sid, q, call, requests))
        done = False
        try:
            async for value in self._responses(sid, q, None):
                yield value
            done = True
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
            await self._finish(sid, cancel=not done)

    async def claim(
        self,
        env: dict[str, str],
        guest: aether_pb2.GuestIdentity | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        """Hands a warm sandbox to its owner: aether takes `env` as the sandbox's whole
        environment and starts chronus with it (edge/backends/warm.py). With a VM
        guest's identity, waits for aether's answer and raises Unavailable (GUEST_SETUP) on
        what it could not apply."""
        if guest is None:
            await self._send(aether_pb2.Frame(claim=aether_pb2.Claim(env=env)))
            return
        claimed = self._claimed = asyncio.get_running_loop().create_future()
        await self._send(aether_pb2.Frame(claim=aether_pb2.Claim(env=env, guest=guest)))
        done, _ = await asyncio.wait({claimed}, timeout=timeout_s)
        if not done:
            claimed.cancel()
            raise Unavailable(
                f"the guest of {self.sandbox_id} did not answer its claim in {timeout_s} s",
                reason="GUEST_SETUP",
            )
        error = claimed.result()  # ChannelClosed if the channel closed meanwhile
        if error:
            raise Unavailable(f"guest setup failed: {error}", reason="GUEST_SETUP")

    async def sync_guest(self, sync: aether_pb2.GuestSync) -> None:
        """A restored VM guest's clock and entropy (after a resume)."""
        await self._send(aether_pb2.Frame(sync=sync))

    async def shutdown(self, grace_s: float) -> None:
        """Asks aether to end every process and exit."""
        with contextlib.suppress(Unavailable):
            await self._send(aether_pb2.Frame(shutdown=aether_pb2.Shutdown(grace_s=grace_s)))

"""The chronus engine: reads Frames, runs each stream's call, writes Frames.

The main thread reads the channel and dispatches; every stream runs in its
own thread (calls block on disks, children and the peer, and threads cost
tens of KB each, far less than an event-loop library); a single reactor
thread owns every child's file descriptors. Frames from all threads are
written under one lock, so they never interleave mid-frame.
"""

from __future__ import annotations

import _queue  # not `queue`, `threading`, `collections`: see chronus.threads
import _socket
import os
from _collections import deque

from chronus import errors
from chronus.config import ChronusConfig
from chronus.errors import Cancelled, ChronusError, invalid
from chronus.execs import Exec, ExecManager, Runtime, Subscription, timestamp
from chronus.files import Files
from chronus.proc import grow_fd_table, rss_bytes
from chronus.sessions import SessionManager
from chronus.threads import Condition, Event, Lock, start_thread
from chronus.tracing import command_span, parse_traceparent
from chronus.watchers import Watchers, event_dicts
from insandbox import wire
from insandbox.log import get_logger

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any

log = get_logger("chronus")

MAX_QUEUED_INPUT_BYTES = 8 * 1024 * 1024  # client-streamed bytes waiting for a handler
#: A last response up to this size is written in one piece with its call's end.
_COALESCE_BYTES = 64 * 1024

if TYPE_CHECKING:
    Input = dict[str, Any] | None  # a further Request, or None for HalfClose
    Handler = Callable[["Stream", dict[str, Any]], None]

#: The calls chronus serves: the arms of `dsec.chronus.v1.Request`'s oneof `call`, read from the
#: wire schema, so that a new kind of request is declared once (in the proto). Each is handled by
#: the Engine method `_call_<arm>`, which answers in the Response arm of its choice.
CALLS = wire.oneof_fields("dsec.chronus.v1.Request", "call")


def handler_table(engine: object, calls: tuple[str, ...] = CALLS) -> dict[str, Handler]:
    """arm -> `engine._call_<arm>`, for every call; an arm without its method stops chronus at
    start, naming it (rather than answering UNIMPLEMENTED to the first caller)."""
    table: dict[str, Handler] = {}
    missing: list[str] = []
    for arm in calls:
        handler = getattr(engine, f"_call_{arm}", None)
        if callable(handler):
            table[arm] = handler
        else:
            missing.append(arm)
    if missing:
        raise TypeError(
            "chronus has no handler for "
            + ", ".join(f"Request.{arm} (Engine._call_{arm})" for arm in missing)
        )
    return table


class Stream:
    """One call: a Request that opened it, further Requests, responses, an end."""

    def __init__(self, engine: Engine, stream_id: int) -> None:
        self.engine = engine
        self.stream_id = stream_id
        self.cancelled = False
        #: Cancelled because the caller's connection went (aether's Cancel.abandoned), not by
        #: the caller: a foreground command is orphaned for a grace instead of killed.
        self.abandoned = False
        self._cond = Condition()
        self._inputs: deque[tuple[Input, int]] = deque()
        self._queued_bytes = 0
        self._input_handler: Callable[[Input], None] | None = None
        self._cancel_callbacks: list[Callable[[], None]] = []
        #: (trace id, the edge's span id) when the Request carried a sampled traceparent.
        self.trace: tuple[bytes, bytes] | None = None
        #: The last response, packed (`reply`): sent with the end.
        self.last: bytes | None = None

    # ---------------------------------------------------------- reader thread
    def push(self, req: Input, size: int) -> None:
        with self._cond:
            if self._input_handler is not None:
                handler = self._input_handler
            else:
                # Backpressure: a fast uploader waits for the disk here.
                while self._queued_bytes > MAX_QUEUED_INPUT_BYTES and not self.cancelled:
                    self._cond.wait(1.0)
                self._inputs.append((req, size))
                self._queued_bytes += size
                self._cond.notify_all()
                return
        handler(req)

    def cancel(self, abandoned: bool = False) -> None:
        with self._cond:
            self.cancelled = True
            self.abandoned = self.abandoned or abandoned
            callbacks = list(self._cancel_callbacks)
            self._cond.notify_all()
        for cb in callbacks:
            cb()

    # --------------------------------------------------------- handler thread
    def send(self, arm: str, value: dict[str, Any], span: dict[str, Any] | None = None) -> None:
        if self.cancelled:
            raise Cancelled()
        response = {arm: value} if span is None else {arm: value, "span": span}
        self.engine.send({"stream_id": self.stream_id, "response": response})

    def reply(self, arm: str, value: dict[str, Any], span: dict[str, Any] | None = None) -> None:
        """The call's last response: written together with its end (one write, so aether and
        the edge each wake once for both, not twice: a unary call's round trip, issue 43).
        The handler returns after it."""
        if self.cancelled:
            raise Cancelled()
        response = {arm: value} if span is None else {arm: value, "span": span}
        # Packed here: a frame too large fails in the handler, as a sent one would.
        frame = {"stream_id": self.stream_id, "response": response}
        self.last = wire.pack_frame(wire.encode(wire.FRAME, frame))

    def span_of(self, ex: Exec) -> dict[str, Any] | None:
        """The CommandSpan of ``ex`` (exited) if this call is traced."""
        if self.trace is None or ex.exit is None:
            return None
        return command_span(self.trace, ex.started_at, ex.exit)

    def recv(self) -> Input:
        """The next Request on this stream; None after HalfClose."""
        with self._cond:
            while not self._inputs:
                if self.cancelled:
                    raise Cancelled()
                self._cond.wait()
            req, size = self._inputs.popleft()
            self._queued_bytes -= size
            self._cond.notify_all()
            return req

    def on_input(self, handler: Callable[[Input], None]) -> None:
        """Deliver further Requests to `handler` on the reader thread."""
        with self._cond:
            pending = [req for req, _ in self._inputs]
            self._inputs.clear()
            self._queued_bytes = 0
            self._input_handler = handler
        for req in pending:
            handler(req)

    def on_cancel(self, cb: Callable[[], None]) -> None:
        with self._cond:
            if not self.cancelled:
                self._cancel_callbacks.append(cb)
                return
        cb()

    def wait(self, event: Event, timeout: float | None = None) -> bool:
        """Wait for `event`, for `timeout` seconds of running time at most (chronus.clock),
        unless cancelled."""
        deadline = None if timeout is None else self.engine.rt.reactor.deadline(timeout)
        try:
            while not event.wait(0.25):
                if self.cancelled:
                    raise Cancelled()
                if deadline is not None and deadline.passed:
                    return event.is_set()
            return True
        finally:
            if deadline is not None:
                deadline.cancel()


class Engine:
    def __init__(self, config: ChronusConfig) -> None:
        self.config = config
        self.rt = Runtime(config)
        self.sessions = SessionManager(self.rt)
        self.execs = ExecManager(self.rt, self.sessions)
        self.files = Files(config.workdir)
        self.watchers = Watchers(self.files.resolve, self.rt.reactor)
        self._sock: _socket.socket | None = None
        self._send_lock = Lock()
        self._streams: dict[int, Stream] = {}
        self._streams_lock = Lock()
        self._handlers = handler_table(self)  # at start: every call has its handler

    # ------------------------------------------------------------- channel
    def serve(self, sock: _socket.socket) -> None:
        """Serve frames on `sock` until the peer closes it."""
        self._sock = sock
        self.rt.reactor.start()
        if self.config.sudo_users:
            from chronus.sudo import SudoService  # only in sandboxes with sudo users

            try:
                SudoService(self.config.sudo_users, self.rt.sandboxing).start()
            except OSError as exc:  # a read-only /dev: commands' sudo says it is not enabled
                log.warning("no sudo service: %s", exc)
        while True:
            payload = wire.read_frame(sock)
            if payload is None:
                log.info("channel closed; exiting")
                return
            frame = wire.decode(wire.FRAME, payload)
            self.dispatch(frame, len(payload))

    def send(self, frame: dict[str, Any]) -> None:
        payload = wire.encode(wire.FRAME, frame)
        assert self._sock is not None
        with self._send_lock:
            wire.write_frame(self._sock, payload)

    def send_end(self, stream: Stream, end: dict[str, Any]) -> None:
        """A call's end, after its last response if it held one (`Stream.reply`)."""
        payload = wire.pack_frame(
            wire.encode(wire.FRAME, {"stream_id": stream.stream_id, "end": end})
        )
        last, stream.last = stream.last, None
        if last is not None and len(last) <= _COALESCE_BYTES:
            payload, last = last + payload, None
        assert self._sock is not None
        with self._send_lock:
            if last is not None:  # a large body (a file read) is not copied to join its end
                self._sock.sendall(last)
            self._sock.sendall(payload)

    def dispatch(self, frame: dict[str, Any], size: int = 0) -> None:
        stream_id = frame.get("stream_id", 0)
        if "request" in frame:
            with self._streams_lock:
                stream = self._streams.get(stream_id)
                if stream is None:
                    stream = self._streams[stream_id] = Stream(self, stream_id)
                    opened = True
                else:
                    opened = False
            if opened:
                try:
                    start_thread(self._run, stream, frame["request"])
                except RuntimeError:  # "can't start new thread": the sandbox's pids limit
                    # This call fails, typed; chronus and every other call go on (uncaught,
                    # it ended chronus and, with it, every stream: CHRONUS_RESTARTED).
                    with self._streams_lock:
                        self._streams.pop(stream_id, None)
                    end = {
                        "code": errors.RESOURCE_EXHAUSTED,
                        "reason": "PIDS_LIMIT",
                        "message": "the sandbox is at its pids limit: no thread for this call",
                    }
                    try:
                        self.send({"stream_id": stream_id, "end": end})
                    except OSError:
                        pass  # the channel is gone; the reader notices
            else:
                stream.push(frame["request"], size)
        elif "half_close" in frame or "cancel" in frame:
            with self._streams_lock:
                stream = self._streams.get(stream_id)
            if stream is not None:
                if "cancel" in frame:
                    stream.cancel(abandoned=bool((frame["cancel"] or {}).get("abandoned")))
                else:
                    stream.push(None, 0)
        elif "ping" in frame:
            self.send({"pong": {"nonce": frame["ping"].get("nonce", 0)}})

    def _run(self, stream: Stream, request: dict[str, Any]) -> None:
        end: dict[str, Any] = {}
        try:
            traceparent = request.pop("traceparent", "")
            if traceparent:
                stream.trace = parse_traceparent(traceparent)
            if len(request) != 1:
                raise invalid("a Request carries exactly one call")
            ((arm, body),) = request.items()
            handler = self._handlers.get(arm)
            if handler is None:
                raise ChronusError(
                    errors.UNIMPLEMENTED, "UNIMPLEMENTED", f"{arm} is not implemented"
                )
            handler(stream, body)
        except ChronusError as exc:
            end = {"code": exc.code, "reason": exc.reason, "message": exc.message}
        except Cancelled:
            end = {"code": errors.CANCELLED, "reason": "CANCELLED", "message": "cancelled"}
        except Exception:
            log.exception("stream %d failed", stream.stream_id)
            end = {"code": errors.INTERNAL, "reason": "INTERNAL", "message": "internal error"}
        finally:
            with self._streams_lock:
                self._streams.pop(stream.stream_id, None)
        try:
            self.send_end(stream, end)
        except OSError:
            pass  # the channel is gone; the reader thread notices

    # --------------------------------------------------------------- execs
    def _keepalive_s(self, ms: int) -> float:
        return (ms or self.config.keepalive_ms) / 1000.0

    def _pump(
        self, stream: Stream, sub: Subscription, keepalive_s: float, ex: Exec | None = None
    ) -> None:
        """Forward an exec's events until its exit (the last event; with the command's span
        if the call is traced and ``ex`` given)."""
        stream.on_cancel(sub.cancel)
        while True:
            try:
                ev = sub.queue.get(timeout=keepalive_s)
            except _queue.Empty:
                stream.send("exec_event", {"keepalive": {"at": timestamp()}})
                continue
            kind = ev[0]
            if kind == "cancel":
                raise Cancelled()
            if kind == "exit":
                stream.send(
                    "exec_event", {"exit": ev[1]}, None if ex is None else stream.span_of(ex)
                )
                return
            stream.send("exec_event", {kind: {"data": ev[2], "offset": ev[1]}})

    def _started(self, ex: Exec) -> dict[str, Any]:
        return {"started": {"exec_id": ex.exec_id, "pid": ex.pid}}

    def _call_exec(self, stream: Stream, req: dict[str, Any]) -> None:
        ex = self.execs.start(req, mode="sync")
        if ex.background:
            stream.reply("exec_result", {"exec_id": ex.exec_id})
            return
        try:
            stream.wait(ex.done)
        except Cancelled:
            ex.kill()
            raise
        stream.reply("exec_result", ex.result(), stream.span_of(ex))
        self.execs.forget(ex)

    def _run_streaming(self, stream: Stream, ex: Exec, keepalive_ms: int) -> None:
        """Started, output, exit. An abandoned foreground command is killed; a background one
        (ExecRequest.follow) keeps running and stays registered for AttachExec."""
        sub = ex.subscribe()
        try:
            stream.send("exec_event", self._started(ex))
            self._pump(stream, sub, self._keepalive_s(keepalive_ms), ex)
        except Cancelled:
            if ex.background:
                pass
            elif stream.abandoned:
                self.execs.orphan(ex)  # kept for a reattach (orphan_grace_s), then killed
            else:
                ex.kill()
            raise
        finally:
            ex.unsubscribe(sub)
            self.execs.forget(ex)

    def _call_exec_stream(self, stream: Stream, req: dict[str, Any]) -> None:
        ex = self.execs.start(req, mode="stream")
        if ex.background and not req.get("follow"):
            stream.send("exec_event", self._started(ex))
            return
        self._run_streaming(stream, ex, req.get("keepalive_interval_ms", 0))

    def _call_exec_input(self, stream: Stream, req: dict[str, Any]) -> None:
        start = req.get("start")
        if start is None:
            raise invalid("the first ExecInput must carry start")
        ex = self.execs.start(start, mode="interactive")

        def on_input(msg: Input) -> None:
            if msg is None:  # HalfClose: no more input can come
                ex.close_stdin()
                return
            inp = msg.get("exec_input", {})
            if "stdin" in inp:
                ex.write_stdin(inp["stdin"])
            elif "close_stdin" in inp:
                if inp["close_stdin"]:
                    ex.close_stdin()
            elif "resize" in inp:
                ex.resize(inp["resize"].get("rows", 0), inp["resize"].get("cols", 0))
            elif "signal" in inp:
                ex.send_signal(inp["signal"])

        stream.on_input(on_input)
        if ex.background:
            stream.send("exec_event", self._started(ex))
            return
        self._run_streaming(stream, ex, start.get("keepalive_interval_ms", 0))

    def _call_attach_exec(self, stream: Stream, req: dict[str, Any]) -> None:
        ex = self.execs.get(req.get("exec_id", ""))
        sub = ex.subscribe((req.get("stdout_offset", 0), req.get("stderr_offset", 0)))
        try:
            stream.send("exec_event", self._started(ex))
            if req.get("replay_only"):
                self._replay(stream, sub)
            else:
                self._pump(stream, sub, self._keepalive_s(req.get("keepalive_interval_ms", 0)))
        except Cancelled:
            if ex.orphaned and not stream.abandoned:
                # An orphaned foreground command (the edge attached to it again after its
                # stream's connection went): its caller leaving now ends it, as it would have.
                ex.kill()
            raise
        finally:
            ex.unsubscribe(sub)

    def _replay(self, stream: Stream, sub: Subscription) -> None:
        """Forward what the subscription holds now (subscribe() queued the held output, and
        the exit if there was one), then return."""
        while True:
            try:
                ev = sub.queue.get_nowait()
            except _queue.Empty:
                return
            if ev[0] == "cancel":
                raise Cancelled()
            if ev[0] == "exit":
                stream.send("exec_event", {"exit": ev[1]})
                return
            stream.send("exec_event", {ev[0]: {"data": ev[2], "offset": ev[1]}})

    def _call_wait_exec(self, stream: Stream, req: dict[str, Any]) -> None:
        ex = self.execs.get(req.get("exec_id", ""))
        timeout = float(req.get("timeout_s", 0)) or None
        stream.wait(ex.done, timeout)
        with self.rt.lock:
            info = ex.info()
        stream.reply("wait_exec", {"info": info})

    def _call_signal_exec(self, stream: Stream, req: dict[str, Any]) -> None:
        delivered = self.execs.signal(req.get("exec_id", ""), int(req.get("signal", 0)))
        stream.reply("signal_exec", {"delivered": delivered})

    def _call_list_execs(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply("list_execs", {"execs": self.execs.list_infos()})

    def _call_control_exec(self, stream: Stream, req: dict[str, Any]) -> None:
        self.execs.get(req.get("exec_id", "")).control(req)
        stream.reply("control_exec", {})

    # ------------------------------------------------------------ sessions
    def _call_create_session(self, stream: Stream, req: dict[str, Any]) -> None:
        session = self.sessions.create(req)
        stream.reply("create_session", {"session": session.info()})

    def _call_restore_session(self, stream: Stream, req: dict[str, Any]) -> None:
        session = self.sessions.create(req.get("session", {}), req.get("session_id", ""))
        stream.reply("create_session", {"session": session.info()})

    def _call_close_session(self, stream: Stream, req: dict[str, Any]) -> None:
        self.sessions.close(req.get("session_id", ""))
        stream.reply("close_session", {})

    def _call_list_sessions(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply("list_sessions", {"sessions": self.sessions.list_infos()})

    # --------------------------------------------------------------- files
    def _call_read_file(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply("read_file", self.files.read_file(req))

    def _call_write_file(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply("write_file", self.files.write_file(req))

    def _call_list_dir(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply("list_dir", self.files.list_dir(req))

    def _call_stat_path(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply("stat_path", self.files.stat_path(req))

    def _call_make_dir(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply("make_dir", self.files.make_dir(req))

    def _call_remove_path(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply("remove_path", self.files.remove_path(req))

    def _call_move_path(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply("move_path", self.files.move_path(req))

    def _call_chmod_path(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply("chmod_path", self.files.chmod_path(req))

    def _call_upload_file(self, stream: Stream, req: dict[str, Any]) -> None:
        header = req.get("header")
        if header is None:
            raise invalid("the first UploadFileRequest must carry header")

        def chunks() -> Iterator[bytes]:
            while True:
                msg = stream.recv()
                if msg is None:
                    return
                part = msg.get("upload_file")
                if part is None or "header" in part:
                    raise invalid("after the header, an upload carries only chunks")
                yield part.get("chunk", b"")

        stream.reply("upload_file", self.files.upload(header, chunks()))

    def _call_download_file(self, stream: Stream, req: dict[str, Any]) -> None:
        for part in self.files.download(req):
            stream.send("download_chunk", part)

    # ------------------------------------------------------------ watchers
    def _call_create_watcher(self, stream: Stream, req: dict[str, Any]) -> None:
        w = self.watchers.create(req)
        stream.reply("create_watcher", {"watcher_id": w.watcher_id})

    def _call_watcher_events(self, stream: Stream, req: dict[str, Any]) -> None:
        w = self.watchers.get(req.get("watcher_id", ""))
        events, overflowed = w.drain()
        stream.reply(
            "watcher_events",
            {
                "events": event_dicts(w, events),
                "overflowed": overflowed,
            },
        )

    def _call_remove_watcher(self, stream: Stream, req: dict[str, Any]) -> None:
        self.watchers.remove(req.get("watcher_id", ""))
        stream.reply("remove_watcher", {})

    def _call_watch_dir(self, stream: Stream, req: dict[str, Any]) -> None:
        """`started`, then each event as it comes, keepalives when idle; ends (with an
        error) only once the watched directory is gone. Cancelling removes the watcher."""
        w = self.watchers.create(req)
        keepalive_s = self._keepalive_s(req.get("keepalive_interval_ms", 0))

        def wake() -> None:
            with w.cond:
                w.cond.notify_all()

        try:
            stream.on_cancel(wake)
            stream.send("watch_event", {"started": {"path": w.root}})
            reported_dropped = 0
            while True:
                with w.cond:
                    if not (w.events or w.overflowed or w.gone or stream.cancelled):
                        w.cond.wait(keepalive_s)
                    events = list(w.events)
                    w.events.clear()
                    overflowed, w.overflowed = w.overflowed, False
                    dropped, gone = w.dropped, w.gone
                if stream.cancelled:
                    raise Cancelled()
                for event in event_dicts(w, events):
                    stream.send("watch_event", {"event": event})
                if overflowed:
                    stream.send(
                        "watch_event", {"overflow": {"dropped": dropped - reported_dropped}}
                    )
                    reported_dropped = dropped
                if gone:
                    raise ChronusError(
                        errors.NOT_FOUND,
                        "PATH_NOT_FOUND",
                        f"{w.root}: the watched directory was removed",
                    )
                if not events and not overflowed:
                    stream.send("watch_event", {"keepalive": {"at": timestamp()}})
        finally:
            try:
                self.watchers.remove(w.watcher_id)
            except ChronusError:
                pass  # already removed

    # ---------------------------------------------------------------- misc
    def _call_http(self, stream: Stream, req: dict[str, Any]) -> None:
        from chronus.httpcall import http_request

        stream.reply("http", http_request(req, self.rt.reactor))

    def _call_wait_for_port(self, stream: Stream, req: dict[str, Any]) -> None:
        from chronus.httpcall import wait_for_port

        stream.reply("wait_for_port", wait_for_port(req, self.rt.reactor, lambda: stream.cancelled))

    def _call_modified_files(self, stream: Stream, req: dict[str, Any]) -> None:
        """Served by the edge: a walk of the sandbox's writable upper layer, outside it."""
        raise ChronusError(
            errors.UNIMPLEMENTED, "UNIMPLEMENTED", "modified_files is not implemented"
        )

    def _call_status(self, stream: Stream, req: dict[str, Any]) -> None:
        stream.reply(
            "status",
            {
                "running_execs": self.execs.running(),
                "sessions": self.sessions.count(),
                "rss_bytes": rss_bytes(),
            },
        )


def serve_socket(sock: _socket.socket) -> None:
    """Run chronus on a connected channel socket until aether closes it."""
    os.set_inheritable(sock.fileno(), False)
    sock.setblocking(True)
    grow_fd_table()  # while chronus has one thread
    Engine(ChronusConfig.from_env()).serve(sock)

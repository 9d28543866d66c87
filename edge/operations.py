"""Exactly once: the edge's calls into a sandbox that change it, run through its operation log.

Every mutating call (an exec, sync or streamed or in the background; a file write, upload,
remove, move, chmod, mkdir; a session opened or closed) reserves its operation id in the log
(``edge/oplog.py``) before it starts, and records its result when it ends. What a call with an
id already logged gets:

* the operation ended: its logged result (an exec's exit status and output; a file call's
  response; a failure raised again as it was), and nothing runs;
* it is still running on this edge: the same result when it ends (a unary call), or its events
  from the start (a stream: an attach to the command in the sandbox);
* the edge that ran it died while it ran: ``OUTCOME_UNKNOWN`` (:class:`OutcomeUnknown`), with
  what is known (its exec id), never a second run;
* the id names another request: ``OPERATION_ID_REUSED``.

A call that carries an operation id belongs to its operation, not to its caller: when the caller
goes (the API server between them died, the SDK's process was killed), the operation runs on to
its end (an exec to its exit or its own ``timeout_s``), its result is logged, and the caller's
retry gets it. An SDK that means to stop one kills it (SignalExec by operation id). A call
without an id (an operator's ``grpcurl``) is logged under an id the edge makes, and keeps the
old tie to its caller: its command is killed when its call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from google.protobuf.message import Message

from common.steps import step
from dsec.types.v1 import types_pb2
from edge.oplog import (
    FAILED,
    OUTCOME_UNKNOWN,
    RUNNING,
    SUCCEEDED,
    OpLog,
    Reserved,
    digest,
    operation_id_of,
)
from libdsec.errors import (
    Cancelled,
    DSecError,
    NotFound,
    OutcomeUnknown,
    Unavailable,
    Unimplemented,
    code_number,
    status_for,
)

if TYPE_CHECKING:
    from edge.manager import SandboxManager

#: The label an exec's operation id travels as into the sandbox (ExecInfo.labels).
OPERATION_LABEL = "dsec.operation_id"


@dataclass
class Running:
    """An operation this edge process is running: what a repeat of its id waits on."""

    entry: types_pb2.Operation
    #: Its result (a unary call's response, None for a stream) or its failure, once it ended.
    done: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    #: The task running it when it is detached from its caller (held here: asyncio keeps
    #: only weak references to tasks).
    task: asyncio.Task[Any] | None = None
    #: Set when SignalExec by its operation id ended it (a sync run: its call is cancelled).
    killed: bool = False
    #: The first caller's events (a stream), None once it left.
    queue: asyncio.Queue[Any] | None = None
    #: Set once the command's exec id is known (a stream's ``started``) or the run ended.
    started: asyncio.Event = field(default_factory=asyncio.Event)


_END = object()


def _record_error(entry: types_pb2.Operation, err: DSecError) -> None:
    entry.error.reason = err.reason
    entry.error.metadata.update(err.metadata)
    entry.error_code = code_number(err.code)
    entry.error_message = err.message


def _failed_state(err: DSecError) -> int:
    """How a failed operation is logged: a lost connection into the sandbox (UNAVAILABLE,
    e.g. CHANNEL_CLOSED) leaves unknown whether it ran; any other failure is FAILED."""
    return OUTCOME_UNKNOWN if isinstance(err, Unavailable) else FAILED


def _raise_logged(entry: types_pb2.Operation) -> None:
    """Raises the failure a logged FAILED / OUTCOME_UNKNOWN entry ended with."""
    if entry.state == OUTCOME_UNKNOWN:
        raise OutcomeUnknown(entry.error_message, metadata=dict(entry.error.metadata))
    raise status_for(
        entry.error_code, entry.error.reason, entry.error_message, dict(entry.error.metadata)
    )


class StreamRecord:
    """What an exec stream's events leave in its entry: exec id, the output's digests and
    sizes, a copy of its head and tail (``copy_bytes`` in all, per stream; held as it
    streams, so memory stays bounded), the exit status."""

    def __init__(self, entry: types_pb2.Operation, copy_bytes: int) -> None:
        self.entry = entry
        self.half = copy_bytes // 2
        self.head = {"stdout": bytearray(), "stderr": bytearray()}
        self.tail = {"stdout": bytearray(), "stderr": bytearray()}
        self.digests = {"stdout": hashlib.sha256(), "stderr": hashlib.sha256()}

    def observe(self, ev: types_pb2.ExecEvent) -> bool:
        """Takes one event; True when it made the exec id known."""
        kind = ev.WhichOneof("event")
        if kind == "started":
            self.entry.exec_id = ev.started.exec_id
            return True
        if kind in ("stdout", "stderr"):
            data = getattr(ev, kind).data
            self.digests[kind].update(data)
            head, tail = self.head[kind], self.tail[kind]
            room = max(0, self.half - len(head))
            head += data[:room]
            tail += data[room:]
            del tail[: max(0, len(tail) - self.half)]
            setattr(self.entry, f"{kind}_bytes", getattr(self.entry, f"{kind}_bytes") + len(data))
        elif kind == "exit":
            self.entry.exit.CopyFrom(ev.exit)
        return False

    def close(self) -> None:
        for kind in ("stdout", "stderr"):
            head, tail = bytes(self.head[kind]), bytes(self.tail[kind])
            dropped = getattr(self.entry, f"{kind}_bytes") - len(head) - len(tail)
            marker = f"\n[... {dropped} bytes not kept ...]\n".encode() if dropped else b""
            setattr(self.entry, kind, head + marker + tail)
            setattr(self.entry, f"{kind}_digest", self.digests[kind].hexdigest())


def replayed_events(entry: types_pb2.Operation) -> list[types_pb2.ExecEvent]:
    """A logged exec stream's events as a repeat gets them: started, the kept output, exit."""
    events = []
    if entry.exec_id:
        events.append(types_pb2.ExecEvent(started=types_pb2.ExecStarted(exec_id=entry.exec_id)))
    if entry.stdout:
        events.append(types_pb2.ExecEvent(stdout=types_pb2.OutputChunk(data=entry.stdout)))
    if entry.stderr:
        events.append(types_pb2.ExecEvent(stderr=types_pb2.OutputChunk(data=entry.stderr)))
    if entry.HasField("exit"):
        events.append(types_pb2.ExecEvent(exit=entry.exit))
    return events


class Operations:
    """Runs the edge's mutating sandbox calls exactly once, through the log."""

    def __init__(self, log: OpLog, *, enabled: bool = True) -> None:
        self.log = log
        #: Off (DSEC_EDGE_OPLOG=off, for measurements): nothing is logged, and a call carrying
        #: an operation id is refused UNIMPLEMENTED (its exactly-once cannot be kept).
        self.enabled = enabled
        self.running: dict[tuple[str, str], Running] = {}

    def _unlogged(self, request: Message) -> None:
        """With the log off: a call without an id runs as is; one with an id is refused."""
        if operation_id_of(request):
            raise Unimplemented(
                "the operation log is off on this edge (DSEC_EDGE_OPLOG=off): a call with an "
                "operation id cannot be run exactly once here",
                reason="OPERATION_LOG_OFF",
            )

    def _begin(self, sandbox_id: str, entry: types_pb2.Operation) -> Running:
        run = Running(entry)
        run.done.add_done_callback(_consume)
        if not entry.generated_id:  # an id of the edge's own is never repeated: not joinable
            key = (sandbox_id, entry.operation_id)
            self.running[key] = run
            run.done.add_done_callback(lambda _: self.running.pop(key, None))
        return run

    def _end(self, sandbox_id: str, run: Running, state: int, outcome: Any = None) -> None:
        """Logs how ``run`` ended and wakes whoever waits on it (``outcome``: its response, or
        the error it failed with)."""
        self.log.finish(sandbox_id, run.entry, state)
        run.started.set()
        if not run.done.done():
            if isinstance(outcome, BaseException):
                run.done.set_exception(outcome)
            else:
                run.done.set_result(outcome)

    async def _joined(self, sandbox_id: str, entry: types_pb2.Operation) -> Running:
        """The running operation a repeat of ``entry``'s id joins."""
        run = self.running.get((sandbox_id, entry.operation_id))
        if run is None:  # cannot happen on one edge: a RUNNING entry is this process's
            raise OutcomeUnknown(
                f"operation {entry.operation_id!r} is under way and cannot be joined",
                metadata={"operation_id": entry.operation_id},
            )
        return run

    def record(
        self,
        sandbox_id: str,
        kind: str,
        request: Message,
        principal_id: str,
        error: DSecError | None = None,
    ) -> None:
        """Logs, after the fact, a call this runner did not run (a task operation's part on
        one sandbox), under an id of the edge's."""
        if not self.enabled:
            return
        got = self.log.reserve(sandbox_id, kind, request, principal_id=principal_id)
        assert isinstance(got, Reserved)  # an id of the edge's is new
        if error is not None:
            _record_error(got.entry, error)
        self.log.finish(sandbox_id, got.entry, FAILED if error is not None else SUCCEEDED)

    # -------------------------------------------------------------- unary calls

    async def unary(
        self,
        sandbox_id: str,
        kind: str,
        request: Message,
        principal_id: str,
        call: Callable[[], Awaitable[Message]],
        response_type: type[Message],
        *,
        detached: bool = True,
        repeat: Callable[[types_pb2.Operation], Awaitable[None]] | None = None,
        recorded: Callable[[types_pb2.Operation], None] | None = None,
    ) -> Message:
        """``call()`` once for this request's operation id (see the module docstring).

        ``detached``: with an operation id the call runs on when its caller goes (not for an
        upload, whose data comes from the caller). ``repeat(entry)`` runs first for a repeated
        id (an upload reads the repeat's data, to check it is the same); ``recorded(entry)``
        adds to the entry what only the call knows, before it is logged."""
        if not self.enabled:
            self._unlogged(request)
            return await call()
        with step("edge.oplog.reserve"):
            got = self.log.reserve(sandbox_id, kind, request, principal_id=principal_id)
        if not isinstance(got, Reserved):
            if repeat is not None:
                await repeat(got)
            return await self._repeat_unary(sandbox_id, got, response_type)
        run = self._begin(sandbox_id, got.entry)
        detach = detached and not run.entry.generated_id

        async def body() -> Message:
            try:
                result = await call()
            except DSecError as err:
                _record_error(run.entry, err)
                self._end(sandbox_id, run, _failed_state(err), err)
                raise
            except asyncio.CancelledError:
                if run.killed:
                    killed = Cancelled(
                        "killed by a SignalExec on its operation id", reason="KILLED"
                    )
                    _record_error(run.entry, killed)
                    self._end(sandbox_id, run, FAILED, killed)
                    raise
                if detach:  # the edge is going down under it: RUNNING, OUTCOME_UNKNOWN next
                    run.done.set_exception(
                        OutcomeUnknown(
                            "the edge shut down while this operation ran",
                            metadata={"operation_id": run.entry.operation_id},
                        )
                    )
                    raise
                cancelled = Cancelled("its caller cancelled it")
                _record_error(run.entry, cancelled)
                self._end(sandbox_id, run, FAILED, cancelled)
                raise
            with step("edge.oplog.finish"):
                self._record_response(run.entry, result)
                if recorded is not None:
                    recorded(run.entry)
                self._end(sandbox_id, run, SUCCEEDED, result)
            return result

        if not detach:
            return await body()
        run.task = asyncio.create_task(body(), name=f"operation {kind} {run.entry.operation_id}")
        run.task.add_done_callback(_consume)
        result: Message = await asyncio.shield(run.task)
        return result

    @staticmethod
    def _record_response(entry: types_pb2.Operation, result: Message) -> None:
        if isinstance(result, types_pb2.ExecResult):
            entry.exec_id = result.exec_id
            entry.exit.CopyFrom(result.exit)
            entry.stdout, entry.stderr = result.stdout, result.stderr
            entry.stdout_bytes, entry.stderr_bytes = len(result.stdout), len(result.stderr)
            entry.stdout_digest, entry.stderr_digest = digest(result.stdout), digest(result.stderr)
            return
        body = result.SerializeToString(deterministic=True)
        entry.response = body
        entry.response_digest = digest(body)

    async def _repeat_unary(
        self, sandbox_id: str, entry: types_pb2.Operation, response_type: type[Message]
    ) -> Message:
        if entry.state == RUNNING:
            run = await self._joined(sandbox_id, entry)
            result: Message = await asyncio.shield(run.done)
            return result
        if entry.state != SUCCEEDED:
            _raise_logged(entry)
        if response_type is types_pb2.ExecResult:
            out = types_pb2.ExecResult(
                exec_id=entry.exec_id, stdout=entry.stdout, stderr=entry.stderr, exit=entry.exit
            )
            if entry.bodies_dropped:  # the cap took the output: say it is not all there
                out.exit.stdout_truncated = out.exit.stdout_truncated or entry.stdout_bytes > 0
                out.exit.stderr_truncated = out.exit.stderr_truncated or entry.stderr_bytes > 0
            return out
        return response_type.FromString(entry.response)

    # -------------------------------------------------------------- exec streams

    async def stream(
        self,
        sandbox_id: str,
        kind: str,
        request: Message,
        principal_id: str,
        open_events: Callable[[], AsyncIterator[types_pb2.ExecEvent]],
        attach: Callable[[str], AsyncIterator[types_pb2.ExecEvent]],
        *,
        detached: bool = True,
    ) -> AsyncIterator[types_pb2.ExecEvent]:
        """An exec stream once for this request's operation id (see the module docstring).
        ``detached``: with an operation id the command runs on when its caller goes (not for
        an interactive one, whose input comes from the caller)."""
        if not self.enabled:
            self._unlogged(request)
            async for ev in open_events():
                yield ev
            return
        got = self.log.reserve(sandbox_id, kind, request, principal_id=principal_id)
        if not isinstance(got, Reserved):
            async for ev in self._repeat_stream(sandbox_id, got, attach):
                yield ev
            return
        run = self._begin(sandbox_id, got.entry)
        record = StreamRecord(run.entry, self.log.copy_bytes)
        if run.entry.generated_id or not detached:  # tied to its caller
            ended = False
            failed: int = FAILED
            try:
                async for ev in open_events():
                    self._observe(sandbox_id, run, record, ev)
                    yield ev
                ended = True
            except DSecError as err:
                _record_error(run.entry, err)
                failed = _failed_state(err)
                raise
            finally:
                record.close()
                if not ended and not run.entry.error.reason:
                    _record_error(run.entry, Cancelled("its caller left; the command was killed"))
                self._end(sandbox_id, run, SUCCEEDED if ended else failed)
            return
        run.queue = asyncio.Queue()
        run.task = asyncio.create_task(self._pump(sandbox_id, run, record, open_events))
        run.task.add_done_callback(_consume)
        try:
            while True:
                item = await run.queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            run.queue = None  # the caller left: the command runs on, its result is logged

    def _observe(
        self, sandbox_id: str, run: Running, record: StreamRecord, ev: types_pb2.ExecEvent
    ) -> None:
        """One event of a logged stream: into its record; its exec id, once known, into the
        log (what a repeat attaches to, what SignalExec by operation id finds)."""
        if record.observe(ev):
            self.log.update(sandbox_id, run.entry)
            run.started.set()

    async def _pump(
        self,
        sandbox_id: str,
        run: Running,
        record: StreamRecord,
        open_events: Callable[[], AsyncIterator[types_pb2.ExecEvent]],
    ) -> None:
        """Reads the command's events to its end, whoever listens, into the log. (Cancelled
        only when the edge goes down: the entry stays RUNNING, OUTCOME_UNKNOWN at restart.)"""
        state: int = SUCCEEDED
        failure: DSecError | None = None
        try:
            async for ev in open_events():
                self._observe(sandbox_id, run, record, ev)
                if run.queue is not None:
                    run.queue.put_nowait(ev)
        except DSecError as err:
            _record_error(run.entry, err)
            state, failure = _failed_state(err), err
        record.close()
        self._end(sandbox_id, run, state, failure)
        if run.queue is not None:
            run.queue.put_nowait(failure if failure is not None else _END)

    async def _repeat_stream(
        self,
        sandbox_id: str,
        entry: types_pb2.Operation,
        attach: Callable[[str], AsyncIterator[types_pb2.ExecEvent]],
    ) -> AsyncIterator[types_pb2.ExecEvent]:
        if entry.state == RUNNING:
            run = await self._joined(sandbox_id, entry)
            await run.started.wait()
            if run.entry.state == RUNNING and run.entry.exec_id:
                try:
                    async for ev in attach(run.entry.exec_id):
                        yield ev
                    return
                except NotFound:  # it ended and the sandbox forgot it: the log has it
                    pass
            with contextlib.suppress(BaseException):
                await asyncio.shield(run.done)
            entry = run.entry
        if entry.state != SUCCEEDED:
            _raise_logged(entry)
        for ev in replayed_events(entry):
            yield ev

    async def follow_endings(
        self,
        manager: SandboxManager,
        sweep_every_s: float = 60.0,
        checkpoint_every_s: float = 5.0,
    ) -> None:
        """Marks a sandbox's log ended when the sandbox ends (kept ``retention_s`` more, then
        swept), also for those that ended while the edge was down; and folds the log's WAL
        into its database every few seconds, in a thread (a checkpoint fsyncs)."""
        for sandbox_id in self.log.sandboxes():
            rec = manager.records.get(sandbox_id)
            if rec is None or not rec.live:
                self.log.ended(sandbox_id, rec.terminated_at if rec is not None else None)
        q = manager.subscribe(maxsize=1_000_000, terminal_only=True)
        next_sweep = next_checkpoint = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now >= next_sweep:
                    self.log.sweep()
                    next_sweep = now + sweep_every_s
                if now >= next_checkpoint:
                    await asyncio.to_thread(self.log.checkpoint)
                    next_checkpoint = time.monotonic() + checkpoint_every_s
                try:
                    rec = await asyncio.wait_for(q.get(), timeout=checkpoint_every_s)
                except TimeoutError:
                    continue
                if not rec.live:
                    self.log.ended(rec.sandbox_id, rec.terminated_at)
        finally:
            manager.unsubscribe(q)

    def kill(self, sandbox_id: str, operation_id: str) -> bool:
        """Ends a detached unary operation under way (its call into the sandbox is cancelled:
        chronus kills the command). False if it is not running here."""
        run = self.running.get((sandbox_id, operation_id))
        if run is None or run.task is None or run.task.done():
            return False
        run.killed = True
        run.task.cancel()
        return True

    def exec_id_of(self, sandbox_id: str, operation_id: str) -> str:
        """The exec id of a logged exec operation ("" if not known yet)."""
        run = self.running.get((sandbox_id, operation_id))
        if run is not None:
            return run.entry.exec_id
        entry = self.log.get(sandbox_id, operation_id)
        if entry is None:
            raise NotFound(
                f"no operation {operation_id!r} in the log of sandbox {sandbox_id}",
                reason="OPERATION_NOT_FOUND",
                metadata={"operation_id": operation_id},
            )
        return entry.exec_id


def _consume(task: asyncio.Future[Any]) -> None:
    """A detached operation's failure is logged and given to its callers, not left unread."""
    if not task.cancelled():
        with contextlib.suppress(BaseException):
            task.exception()

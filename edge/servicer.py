"""gRPC adapter of the edge: proto in -> manager / sandbox channel -> proto out."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from google.protobuf.message import Message

from common import forwarding
from common.convert import enum_name, grace_s, metrics_window, ts
from common.forwarding import Route
from common.steps import step
from dsec.edge.v1 import edge_pb2
from dsec.types.v1 import types_pb2
from edge.backends.contract import Executes, TrustedExecution, WarmClaims, offers, require
from edge.backends.pausing import PauseReclaim
from edge.controls import Control
from edge.convert import network_from_pb, sandbox_pb, sandbox_pb_fast, spec_from_pb
from edge.display_calls import DisplayCalls
from edge.fncall.adapter import FnCallAdapter
from edge.layers_adapter import LayersAdapter
from edge.manager import SandboxManager
from edge.model import SandboxRecord, SandboxSpec
from edge.operations import OPERATION_LABEL, Operations
from edge.oplog import OpLog, reused
from edge.pause_streams import SandboxState, across_pauses, with_keepalives
from libdsec.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    Unavailable,
    Unimplemented,
    item_status,
)

#: An operator's drain reason is shown in listings: one line, not a document.
MAX_DRAIN_REASON = 512

KEEPALIVE_DEFAULT_MS = 5000
#: Changes a WatchSandboxes stream may lag behind (a burst of 50,000 creates makes 150,000).
WATCH_QUEUE = 200_000
#: Sandboxes per message of a WatchSandboxes replay (a message per sandbox costs far more).
REPLAY_BATCH = 512

#: The forwarded calls that change the sandbox, logged in its operation log (exactly once by
#: operation id: edge/operations.py), with their responses. Execs and uploads are written below.
LOGGED_CALLS: dict[str, type[Message]] = {
    "WriteFile": types_pb2.WriteFileResponse,
    "RemovePath": types_pb2.RemovePathResponse,
    "MovePath": types_pb2.MovePathResponse,
    "ChmodPath": types_pb2.ChmodPathResponse,
    "MakeDir": types_pb2.MakeDirResponse,
    "CreateSession": types_pb2.CreateSessionResponse,
    "CloseSession": types_pb2.CloseSessionResponse,
}


def principal_of(context: Any) -> str:
    """The caller the API server named (\"\" for a call made on the edge directly)."""
    for key, value in context.invocation_metadata() or ():
        if key == forwarding.PRINCIPAL_METADATA:
            return str(value)
    return ""


def _watched(
    rec: SandboxRecord,
    prefix: str,
    task_id: str,
    labels: dict[str, str],
    states: set[str] | None,
) -> bool:
    """Whether ``rec`` passes a WatchSandboxes filter (as ListSandboxes' filters)."""
    if states and rec.state not in states:
        return False
    if prefix and rec.project_id != prefix and not rec.project_id.startswith(prefix + "/"):
        return False
    if task_id and rec.spec.task_id != task_id:
        return False
    return not labels or all(rec.spec.labels.get(k) == v for k, v in labels.items())


_STATE = {n.removeprefix("SANDBOX_STATE_"): v for n, v in types_pb2.SandboxState.items()}
_BACKEND = {n.removeprefix("BACKEND_"): v for n, v in types_pb2.Backend.items()}
_REASON = {n.removeprefix("TERMINATION_REASON_"): v for n, v in types_pb2.TerminationReason.items()}


def _summary_pb(rec: SandboxRecord, out: types_pb2.Sandbox) -> None:
    """The summary a WatchSandboxes replay sends when asked (see ``summary`` in edge.proto)."""
    out.id = rec.sandbox_id
    out.project_id = rec.project_id
    out.principal_id = rec.principal_id
    out.edge_id = rec.edge_id
    out.state = _STATE[rec.state]  # type: ignore[assignment]
    out.created_at.FromNanoseconds(int(rec.created_at * 1e9))
    if rec.started_at:
        out.started_at.FromNanoseconds(int(rec.started_at * 1e9))
    if rec.termination_reason:
        out.termination.reason = _REASON[rec.termination_reason]  # type: ignore[assignment]
        out.termination.message = rec.termination_message
        out.termination.at.FromNanoseconds(int((rec.terminated_at or 0.0) * 1e9))
    spec, s = rec.spec, out.spec
    s.backend = _BACKEND[spec.backend]  # type: ignore[assignment]
    s.image = spec.image
    s.task_id = spec.task_id
    s.labels.update(spec.labels)
    s.resources.cpu_millis = spec.cpu_millis
    s.resources.memory_mb = spec.memory_mb


_ACTION = {
    edge_pb2.SANDBOX_ACTION_PAUSE: "PAUSE",
    edge_pb2.SANDBOX_ACTION_RESUME: "RESUME",
    edge_pb2.SANDBOX_ACTION_STOP: "STOP",
}


def _reason_name(reason: types_pb2.TerminationReason.ValueType) -> str:
    """A stop's termination reason by name (UNSPECIFIED = STOPPED)."""
    if not reason:
        return "STOPPED"
    return enum_name(types_pb2.TerminationReason, reason, "reason", "TERMINATION_REASON_")


def _state_names(states: Any) -> set[str] | None:
    names = {enum_name(types_pb2.SandboxState, s, "states", "SANDBOX_STATE_") for s in states}
    return names or None


class EdgeServicer:
    def __init__(
        self,
        manager: SandboxManager,
        info: types_pb2.EdgeInfo,
        *,
        fncall: FnCallAdapter | None = None,
        layers: LayersAdapter | None = None,
        controls: list[Control] | None = None,
        pause_reclaim: PauseReclaim | None = None,
        operations: Operations | None = None,
    ) -> None:
        self.manager = manager
        #: The sandboxes' operation logs and the exactly-once runner over them.
        self.ops = operations or Operations(OpLog(manager.state_dir / "oplog.db"))
        self.pause_reclaim = pause_reclaim
        self.controls = [
            edge_pb2.HostControl(
                name=c.name, state=c.state, detail=c.detail, status_line=c.status_line
            )
            for c in controls or []
        ]
        self.info = info
        self.fncall = fncall or FnCallAdapter(None)
        self.layers = layers or LayersAdapter(None, manager)
        self.display = DisplayCalls(manager, self._raise_if_ended)

    # ----------------------------------------------------------- lifecycle

    async def CreateSandbox(
        self, request: edge_pb2.CreateSandboxRequest, context: Any
    ) -> edge_pb2.CreateSandboxResponse:
        if not request.sandbox_id:
            raise InvalidArgument("sandbox_id is required")
        spec = spec_from_pb(request.spec)
        rec, existed = await self.manager.create(
            request.sandbox_id,
            spec,
            request.project_id,
            request.principal_id,
            wait_ready=request.wait_ready,
        )
        return edge_pb2.CreateSandboxResponse(sandbox=sandbox_pb(rec), already_existed=existed)

    async def CreateSandboxes(
        self, request: edge_pb2.CreateSandboxesRequest, context: Any
    ) -> edge_pb2.CreateSandboxesResponse:
        items: list[tuple[str, SandboxSpec]] = []
        group_of: list[int] = []
        for g, group in enumerate(request.groups):
            spec = spec_from_pb(group.spec)  # converted once per group
            for sid in group.sandbox_ids:
                if not sid:
                    raise InvalidArgument("every sandbox_id must be set")
                items.append((sid, spec))
                group_of.append(g)
        results = await self.manager.create_many(
            items, request.project_id, request.principal_id, wait_ready=request.wait_ready
        )
        out = edge_pb2.CreateSandboxesResponse()
        templates: dict[int, types_pb2.Sandbox] = {}
        for g, (rec, existed, err) in zip(group_of, results, strict=True):
            r = out.results.add()
            if err is not None:
                item_status(err, r.error)
                continue
            assert rec is not None
            r.already_existed = existed
            if existed:
                r.sandbox.CopyFrom(sandbox_pb(rec))
            else:
                sandbox_pb_fast(rec, g, templates, r.sandbox)
        return out

    async def ForkSandbox(
        self, request: edge_pb2.ForkSandboxRequest, context: Any
    ) -> edge_pb2.ForkSandboxResponse:
        return await self._logged(
            "fork_sandbox",
            request,
            context,
            lambda: self._fork(request),
            edge_pb2.ForkSandboxResponse,
        )

    async def _fork(self, request: edge_pb2.ForkSandboxRequest) -> edge_pb2.ForkSandboxResponse:
        kind, stall_s, children = await self.manager.fork(
            request.sandbox_id,
            list(request.child_ids),
            request.principal_id,
            labels=dict(request.labels),
            task_id=request.task_id,
            ttl_s=request.ttl_s,
            require_memory=request.require_memory,
        )
        out = edge_pb2.ForkSandboxResponse(
            fork_kind=types_pb2.ForkKind.Value("FORK_KIND_" + kind.name),  # type: ignore[arg-type]
            source_stall_s=stall_s,
        )
        for rec, err in children:
            r = out.results.add()
            if err is not None:
                item_status(err, r.error)
            else:
                r.sandbox.CopyFrom(sandbox_pb(rec))
        return out

    async def GetSandbox(
        self, request: edge_pb2.GetSandboxRequest, context: Any
    ) -> edge_pb2.GetSandboxResponse:
        rec = self.manager.get(request.sandbox_id)
        await self.manager.measure_memory(rec)
        return edge_pb2.GetSandboxResponse(sandbox=sandbox_pb(rec))

    async def ListSandboxes(
        self, request: edge_pb2.ListSandboxesRequest, context: Any
    ) -> edge_pb2.ListSandboxesResponse:
        recs = self.manager.list(
            project_prefix=request.project_prefix,
            task_id=request.task_id,
            labels=dict(request.label_selector),
            states=_state_names(request.states),
            include_terminated=request.include_terminated or bool(request.states),
        )
        return edge_pb2.ListSandboxesResponse(sandboxes=[sandbox_pb(r) for r in recs])

    async def StopSandbox(
        self, request: edge_pb2.StopSandboxRequest, context: Any
    ) -> edge_pb2.StopSandboxResponse:
        async def stop() -> edge_pb2.StopSandboxResponse:
            rec = await self.manager.stop(
                request.sandbox_id,
                reason=_reason_name(request.reason),
                grace_s=grace_s(request.grace_s) or 2.0,
            )
            return edge_pb2.StopSandboxResponse(sandbox=sandbox_pb(rec))

        return await self._logged(
            "stop_sandbox", request, context, stop, edge_pb2.StopSandboxResponse
        )

    async def DeleteSandbox(
        self, request: edge_pb2.DeleteSandboxRequest, context: Any
    ) -> edge_pb2.DeleteSandboxResponse:
        await self.manager.delete(request.sandbox_id)
        self.ops.log.forget(request.sandbox_id)
        return edge_pb2.DeleteSandboxResponse()

    async def SetSandboxTimeout(
        self, request: edge_pb2.SetSandboxTimeoutRequest, context: Any
    ) -> edge_pb2.SetSandboxTimeoutResponse:
        rec = await self.manager.set_timeout(request.sandbox_id, request.timeout_s)
        return edge_pb2.SetSandboxTimeoutResponse(sandbox=sandbox_pb(rec))

    async def PauseSandbox(
        self, request: edge_pb2.PauseSandboxRequest, context: Any
    ) -> edge_pb2.PauseSandboxResponse:
        async def pause() -> edge_pb2.PauseSandboxResponse:
            rec = await self.manager.pause(request.sandbox_id, files_only=request.files_only)
            return edge_pb2.PauseSandboxResponse(sandbox=sandbox_pb(rec))

        return await self._logged(
            "pause_sandbox", request, context, pause, edge_pb2.PauseSandboxResponse
        )

    async def ResumeSandbox(
        self, request: edge_pb2.ResumeSandboxRequest, context: Any
    ) -> edge_pb2.ResumeSandboxResponse:
        async def resume() -> edge_pb2.ResumeSandboxResponse:
            rec = await self.manager.resume(request.sandbox_id)
            return edge_pb2.ResumeSandboxResponse(sandbox=sandbox_pb(rec))

        return await self._logged(
            "resume_sandbox", request, context, resume, edge_pb2.ResumeSandboxResponse
        )

    async def _logged(
        self,
        kind: str,
        request: Any,
        context: Any,
        call: Callable[[], Awaitable[Any]],
        response_type: type[Message],
    ) -> Any:
        """A lifecycle call of the sandbox, in its operation log (under an id of the edge's:
        these are idempotent or keyed by the API server, and stay tied to their caller). A
        sandbox this edge does not know is left to the call, which refuses it as it always
        did (its arguments checked first), and nothing is logged."""
        if request.sandbox_id not in self.manager.records:
            return await call()
        return await self.ops.unary(
            request.sandbox_id, kind, request, principal_of(context), call, response_type
        )

    async def ActOnSandboxes(
        self, request: edge_pb2.ActOnSandboxesRequest, context: Any
    ) -> edge_pb2.ActOnSandboxesResponse:
        action = _ACTION.get(request.action)
        if action is None:
            raise InvalidArgument("action must be PAUSE, RESUME or STOP")
        results = await self.manager.act_on(
            action,
            project_prefix=request.project_prefix,
            task_id=request.task_id,
            labels=dict(request.label_selector),
            reason=_reason_name(request.reason),
            message=request.message,
            grace_s=grace_s(request.grace_s) or 2.0,
            skip_terminated=request.skip_terminated,
        )
        out = edge_pb2.ActOnSandboxesResponse()
        kind = f"{action.lower()}_sandbox"
        principal = principal_of(context)
        for sid, rec, err in results:
            r = out.results.add(sandbox_id=sid)
            if err is not None:
                item_status(err, r.error)
            else:
                assert rec is not None
                r.sandbox.CopyFrom(sandbox_pb(rec))
            if err is None or err.reason != "SANDBOX_NOT_FOUND":  # a task operation's part
                self.ops.record(sid, kind, _TASK_REQUEST[action](sandbox_id=sid), principal, err)
        return out

    async def GetNodeStatus(
        self, request: edge_pb2.GetNodeStatusRequest, context: Any
    ) -> edge_pb2.GetNodeStatusResponse:
        try:
            return await self._node_status(request)
        except ValueError as exc:  # a count protobuf cannot carry (below zero): a bug, named
            m = self.manager
            raise Internal(
                f"edge {m.edge_id} cannot encode its node status: {exc} (load {m.load()}, "
                f"accounting errors {m.accounting_errors})",
                reason="NODE_STATUS_INVALID",
            ) from exc

    async def node_status(self) -> edge_pb2.GetNodeStatusResponse:
        """What GetNodeStatus answers (without sandbox ids): the edge's metrics read it."""
        return await self._node_status(edge_pb2.GetNodeStatusRequest())

    async def _node_status(
        self, request: edge_pb2.GetNodeStatusRequest
    ) -> edge_pb2.GetNodeStatusResponse:
        m = self.manager
        load = m.load()
        by_project, by_principal, by_task = m.live_counts()
        return edge_pb2.GetNodeStatusResponse(
            info=self.info,
            load=types_pb2.EdgeLoad(
                sandboxes=load.sandboxes,
                cpu_millis_allocated=load.cpu_millis,
                memory_mb_allocated=load.memory_mb,
                cpu_millis_capacity=m.capacity.cpu_millis,
                memory_mb_capacity=m.capacity.memory_mb,
                gpus_free=m.capacity.gpus - load.gpus,
                sandboxes_by_backend={"BACKEND_" + k: v for k, v in load.by_backend.items()},
                warm_ready={image: st[1] for image, st in self._warm_status().items()},
            ),
            sandboxes_by_project=by_project,
            sandboxes_by_principal=by_principal,
            sandboxes_by_task=by_task,
            live_sandbox_ids=m.live_ids() if request.include_sandbox_ids else [],
            as_of=ts(time.time()),
            draining=m.draining,
            drain_reason=m.drain_state.reason,
            warm={
                image: edge_pb2.WarmPoolStatus(
                    target=target, ready=ready, claimed=claimed, missed=missed
                )
                for image, (target, ready, claimed, missed) in self._warm_status().items()
            },
            fncall=self.fncall.pool_status(),
            controls=self.controls,
            pause=await self._pause_status(),
            accounting_errors=m.accounting_errors,
        )

    async def SetDraining(
        self, request: edge_pb2.SetDrainingRequest, context: Any
    ) -> edge_pb2.SetDrainingResponse:
        m = self.manager
        if len(request.reason) > MAX_DRAIN_REASON:
            raise InvalidArgument(
                f"reason is {len(request.reason)} characters; at most {MAX_DRAIN_REASON}",
                metadata={"field": "reason"},
            )
        try:
            state = await m.set_draining(request.draining, request.reason)
        except OSError as exc:
            raise Unavailable(
                f"edge {m.edge_id} cannot keep its drain state ({exc}); nothing changed",
                reason="DRAIN_STATE_NOT_SAVED",
                metadata={"edge": m.edge_id},
            ) from exc
        load = m.load()
        by_project, _, by_task = m.live_counts()
        return edge_pb2.SetDrainingResponse(
            edge_id=m.edge_id,
            draining=state.draining,
            reason=state.reason,
            since=ts(state.since or None),
            live_sandboxes=load.sandboxes,
            sandboxes_by_backend=load.by_backend,
            sandboxes_by_project=by_project,
            sandboxes_by_task=by_task,
        )

    async def _pause_status(self) -> edge_pb2.PauseStatus:
        paused, released_mb, swapped = self.manager.paused_status()
        out = edge_pb2.PauseStatus(paused=paused, released_mb=released_mb, swapped_bytes=swapped)
        r = self.pause_reclaim
        if r is not None:
            out.swap_size_bytes, out.swap_used_bytes = await asyncio.to_thread(r.status)
            out.swap_path = str(r.swap.path) if r.swap is not None else ""
            out.frozen_only = r.why_not
        return out

    def _warm_status(self) -> dict[str, tuple[int, int, int, int]]:
        """image -> (target, ready, claimed, missed) of the backends' warm pools."""
        out: dict[str, tuple[int, int, int, int]] = {}
        for b in self.manager.backends.values():
            if offers(b, WarmClaims):
                out.update(require(b, WarmClaims).warm_status())
        return out

    async def WatchSandboxes(
        self, request: edge_pb2.WatchSandboxesRequest, context: Any
    ) -> AsyncIterator[edge_pb2.WatchSandboxesResponse]:
        interval = (request.keepalive_interval_ms or KEEPALIVE_DEFAULT_MS) / 1000
        prefix, task_id = request.project_prefix, request.task_id
        labels = dict(request.label_selector)
        states = _state_names(request.states)
        q = None if request.replay_only else self.manager.subscribe(WATCH_QUEUE)
        try:
            # Subscribed before the replay is read, and both without yielding: no change
            # falls between them. Converted at once: the records go on changing.
            at = ts(time.time())
            batches: list[edge_pb2.WatchSandboxesResponse] = []
            if request.HasField("changed_since"):
                since = request.changed_since.seconds + request.changed_since.nanos / 1e9
                changed = [
                    r
                    for r in self.manager.records.values()
                    if max(r.created_at, r.started_at or 0.0, r.terminated_at or 0.0) >= since
                    and _watched(r, prefix, task_id, labels, states)
                ]
                for i, rec in enumerate(changed):
                    if i % REPLAY_BATCH == 0:
                        batches.append(edge_pb2.WatchSandboxesResponse())
                    out = batches[-1].replayed.sandboxes.add()
                    if request.summary:
                        _summary_pb(rec, out)
                    else:
                        out.CopyFrom(sandbox_pb(rec))
            for msg in batches:
                yield msg
            yield edge_pb2.WatchSandboxesResponse(keepalive=types_pb2.Keepalive(at=at))
            if q is None:
                return
            last = time.monotonic()
            while True:
                if q.full():
                    # The manager drops a subscriber it finds full: end the stream rather
                    # than go silent (the caller asks again with changed_since).
                    raise Unavailable(
                        "this watch fell too far behind the edge's changes",
                        reason="WATCH_OVERFLOW",
                    )
                due = interval - (time.monotonic() - last)
                if due <= 0 and q.empty():
                    # Every change until now has been sent: `at` is a safe changed_since.
                    last = time.monotonic()
                    yield edge_pb2.WatchSandboxesResponse(
                        keepalive=types_pb2.Keepalive(at=ts(time.time()))
                    )
                    continue
                try:
                    rec = await asyncio.wait_for(q.get(), timeout=max(due, 0.0))
                except TimeoutError:
                    continue
                if _watched(rec, prefix, task_id, labels, states):
                    yield edge_pb2.WatchSandboxesResponse(changed=sandbox_pb(rec))
        finally:
            if q is not None:
                self.manager.unsubscribe(q)

    # ------------------------------------------------ forwarding into the sandbox

    async def _channel(self, sandbox_id: str) -> Any:
        if not sandbox_id:
            raise InvalidArgument("sandbox_id is required")
        # The capability first: a sandbox whose backend runs no commands is not resumed for it.
        executes = require(self.manager.backend_of(self.manager.get_live(sandbox_id)), Executes)
        rec = await self.manager.touch(sandbox_id)
        return executes.channel(rec)

    async def _exec_channel(self, request: types_pb2.ExecRequest) -> tuple[Any, Any]:
        """The channel for an exec, and the request to send on it. A trusted exec goes to the
        sandbox's trusted sibling (read-only layers + workspace), without the flag."""
        if not request.trusted:
            return await self._channel(request.sandbox_id), request
        if request.session_id or request.background:
            raise InvalidArgument(
                "trusted executions run in the foreground and outside sessions",
                reason="TRUSTED_EXEC_UNSUPPORTED",
            )
        if not request.sandbox_id:
            raise InvalidArgument("sandbox_id is required")
        live = self.manager.get_live(request.sandbox_id)
        trusted = require(self.manager.backend_of(live), TrustedExecution)
        rec = await self.manager.touch(request.sandbox_id)
        channel = await trusted.trusted_channel(rec)
        plain = types_pb2.ExecRequest()
        plain.CopyFrom(request)
        plain.trusted = False
        return channel, plain

    # The hops of common/forwarding.py (EDGE_ROUTES): chronus's call of the same name.

    async def forward_unary(self, route: Route, request: Any, context: Any) -> Message:
        response_type = LOGGED_CALLS.get(route.method)
        if response_type is None:
            if route.method == "SignalExec" and request.operation_id and not request.exec_id:
                request.exec_id = self._exec_of_operation(request)
                if not request.exec_id:  # a sync run under way: its call is ended, chronus kills
                    return types_pb2.SignalExecResponse(
                        delivered=self.ops.kill(request.sandbox_id, request.operation_id)
                    )
            result = await self._forward(route, request)
            if route.method == "ListExecs":
                for info in result.execs:  # type: ignore[attr-defined]
                    _unlabelled(info)
            elif route.method == "WaitExec":
                _unlabelled(result.info)  # type: ignore[attr-defined]
            return result
        self._known(request.sandbox_id)
        return await self.ops.unary(
            request.sandbox_id,
            forwarding.snake_case(route.method),
            request,
            principal_of(context),
            lambda: self._forward(route, request),
            response_type,
        )

    async def _forward(self, route: Route, request: Any) -> Message:
        async with self._ending_says_why(request.sandbox_id):
            channel = await self._channel(request.sandbox_id)
            result: Message = await channel.unary(route.target, request)
        return result

    def _known(self, sandbox_id: str) -> None:
        """Raises unless the sandbox is one of this edge's (before its log takes an entry)."""
        if not sandbox_id:
            raise InvalidArgument("sandbox_id is required")
        self.manager.get(sandbox_id)

    def _exec_of_operation(self, request: types_pb2.SignalExecRequest) -> str:
        """The exec id of the command an exec operation started (a stream's, from its
        ``started``), or "" for a sync run still under way, whose exec id comes with its
        result: that one can only be killed, by ending its call (SIGKILL, else refused)."""
        exec_id = self.ops.exec_id_of(request.sandbox_id, request.operation_id)
        if not exec_id and request.signal != signal.SIGKILL:
            raise FailedPrecondition(
                f"operation {request.operation_id!r} is a sync run: by its operation id it can "
                "only be killed (signal 9); its exec id comes with its result",
                reason="SYNC_RUN_KILL_ONLY",
                metadata={"operation_id": request.operation_id},
            )
        return exec_id

    async def forward_server_stream(
        self, route: Route, request: Any, context: Any
    ) -> AsyncIterator[Message]:
        async with self._ending_says_why(request.sandbox_id):
            channel = await self._channel(request.sandbox_id)
            async for item in channel.server_stream(route.target, request):
                yield item

    async def forward_client_stream(
        self, route: Route, requests: AsyncIterator[Any], context: Any
    ) -> Message:
        sandbox_id, whole = await forwarding.opened(route, requests)
        if route.method == "UploadFile":
            return await self._upload(route, sandbox_id, whole, principal_of(context))
        return await self._forward_client(route, sandbox_id, whole)

    async def _forward_client(
        self, route: Route, sandbox_id: str, whole: AsyncIterator[Any]
    ) -> Message:
        async with self._ending_says_why(sandbox_id):
            channel = await self._channel(sandbox_id)
            result: Message = await channel.client_stream(route.target, whole)
        return result

    async def _upload(
        self, route: Route, sandbox_id: str, whole: AsyncIterator[Any], principal: str
    ) -> Message:
        """An upload through the operation log: its header is the logged request, its bytes'
        digest (and the bytes, when small) are logged with it. A repeat's bytes are read and
        must be the same; nothing is written again."""
        first = await anext(whole)
        header = types_pb2.UploadFileRequest(header=first.header)
        content = hashlib.sha256()
        kept: list[bytes] = []
        size = 0
        limit = self.ops.log.copy_bytes

        async def teed() -> AsyncIterator[Any]:
            nonlocal size
            yield first
            async for item in whole:
                size += len(item.chunk)
                content.update(item.chunk)
                if size <= limit:
                    kept.append(item.chunk)
                yield item

        def recorded(entry: types_pb2.Operation) -> None:
            entry.content_digest = content.hexdigest()
            if size <= limit:
                entry.content = b"".join(kept)

        async def repeat(entry: types_pb2.Operation) -> None:
            async for _ in teed():
                pass
            if entry.content_digest and entry.content_digest != content.hexdigest():
                raise reused(sandbox_id, entry, "an upload of other bytes")

        self._known(sandbox_id)
        return await self.ops.unary(
            sandbox_id,
            "upload_file",
            header,
            principal,
            lambda: self._forward_client(route, sandbox_id, teed()),
            types_pb2.UploadFileResponse,
            detached=False,  # its bytes come from its caller
            repeat=repeat,
            recorded=recorded,
        )

    @contextlib.asynccontextmanager
    async def _ending_says_why(self, sandbox_id: str) -> AsyncIterator[None]:
        """A call into the sandbox cut by the sandbox's ending (its channel closes before its
        teardown is recorded: a stop, its TTL, a full disk) raises the ending,
        SandboxTerminated with the reason, rather than the closed channel."""
        try:
            yield
        except Unavailable:
            await self._raise_if_ended(sandbox_id)
            raise

    def _sandbox_state(self, sandbox_id: str) -> SandboxState:
        m = self.manager

        def channel() -> Any:
            rec = m.get_live(sandbox_id)
            return require(m.backend_of(rec), Executes).channel(rec)

        def check_live() -> None:
            m.get_live(sandbox_id)

        return SandboxState(
            paused=lambda: m.quiesced(sandbox_id), check_live=check_live, channel=channel
        )

    async def _across_pauses(
        self, call: str, request: Any, keepalive: Any, continuation: Any
    ) -> AsyncIterator[Any]:
        """A stream out of the sandbox that outlives its pauses (edge/pause_streams.py)."""
        await self._channel(request.sandbox_id)  # resumes a paused sandbox, as any call does
        interval_s = (request.keepalive_interval_ms or KEEPALIVE_DEFAULT_MS) / 1000
        async for item in across_pauses(
            self._sandbox_state(request.sandbox_id),
            call,
            request,
            keepalive=lambda: keepalive(keepalive=types_pb2.Keepalive(at=ts(time.time()))),
            interval_s=interval_s,
            continuation=continuation,
        ):
            yield item

    def _count_truncation(self, sandbox_id: str, status: types_pb2.ExitStatus) -> None:
        if status.stdout_truncated or status.stderr_truncated:
            self.manager.note_violation(sandbox_id, "output_truncations")

    async def Exec(self, request: types_pb2.ExecRequest, context: Any) -> types_pb2.ExecResult:
        self._known(request.sandbox_id)

        async def call() -> types_pb2.ExecResult:
            async with self._ending_says_why(request.sandbox_id):
                with step("edge.exec.channel"):
                    channel, sent = await self._exec_channel(request)
                with step("edge.aether.exec"):
                    result: types_pb2.ExecResult = await channel.unary("exec", sent)
            self._count_truncation(request.sandbox_id, result.exit)
            return result

        done = await self.ops.unary(
            request.sandbox_id, "exec", request, principal_of(context), call, types_pb2.ExecResult
        )
        assert isinstance(done, types_pb2.ExecResult)
        return done

    async def ExecStream(
        self, request: types_pb2.ExecRequest, context: Any
    ) -> AsyncIterator[types_pb2.ExecEvent]:
        self._known(request.sandbox_id)

        async def events() -> AsyncIterator[types_pb2.ExecEvent]:
            sent = _labelled(request)
            if sent.trusted:
                channel, sent = await self._exec_channel(sent)
                items = channel.server_stream("exec_stream", sent)
            else:
                items = self._across_pauses(
                    "exec_stream", sent, types_pb2.ExecEvent, ExecContinuation(sent)
                )
            async for item in items:
                if item.HasField("exit"):
                    self._count_truncation(request.sandbox_id, item.exit)
                yield item

        async for item in self.ops.stream(
            request.sandbox_id,
            "exec_stream",
            request,
            principal_of(context),
            events,
            lambda exec_id: self._attach(request, exec_id),
        ):
            yield item

    def _attach(
        self, request: types_pb2.ExecRequest, exec_id: str
    ) -> AsyncIterator[types_pb2.ExecEvent]:
        """A repeat of an exec stream's operation: the command's events from its start."""
        attach = types_pb2.AttachExecRequest(
            sandbox_id=request.sandbox_id,
            exec_id=exec_id,
            keepalive_interval_ms=request.keepalive_interval_ms,
        )
        return self._across_pauses(
            "attach_exec", attach, types_pb2.ExecEvent, ExecContinuation(attach)
        )

    async def ExecInteractive(
        self, request_iterator: AsyncIterator[types_pb2.ExecInput], context: Any
    ) -> AsyncIterator[types_pb2.ExecEvent]:
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("input") != "start":
            raise InvalidArgument("the first ExecInput must carry `start`")
        request = first.start
        self._known(request.sandbox_id)
        logged = request.operation_id and self.ops.log.get(request.sandbox_id, request.operation_id)
        if logged:
            raise FailedPrecondition(
                f"operation {request.operation_id!r} is an interactive command already started "
                f"(exec {logged.exec_id or 'not started'}): a retry cannot take its input over; "
                "attach to it (AttachExec) and send input by its exec id (ControlExec)",
                reason="OPERATION_NOT_REATTACHABLE",
                metadata={"operation_id": request.operation_id, "exec_id": logged.exec_id},
            )

        async def events() -> AsyncIterator[types_pb2.ExecEvent]:
            channel, start = await self._exec_channel(_labelled(request))

            async def inputs() -> AsyncIterator[types_pb2.ExecInput]:
                yield types_pb2.ExecInput(start=start)
                async for item in request_iterator:
                    yield item

            items = channel.bidi("exec_input", inputs())
            if not request.trusted:
                items = with_keepalives(
                    items,
                    self._sandbox_state(start.sandbox_id),
                    lambda: types_pb2.ExecEvent(keepalive=types_pb2.Keepalive(at=ts(time.time()))),
                    (start.keepalive_interval_ms or KEEPALIVE_DEFAULT_MS) / 1000,
                )
            async for item in items:
                yield item

        async for item in self.ops.stream(
            request.sandbox_id,
            "exec_interactive",
            request,
            principal_of(context),
            events,
            lambda exec_id: self._attach(request, exec_id),
            detached=False,  # its input comes from its caller
        ):
            yield item

    async def AttachExec(
        self, request: types_pb2.AttachExecRequest, context: Any
    ) -> AsyncIterator[types_pb2.ExecEvent]:
        async for item in self._across_pauses(
            "attach_exec", request, types_pb2.ExecEvent, ExecContinuation(request)
        ):
            yield item

    async def ListOperations(
        self, request: types_pb2.ListOperationsRequest, context: Any
    ) -> types_pb2.ListOperationsResponse:
        """The sandbox's operation log, a page at a time; kept after its end (for
        ``oplog_retention_s``), so an ended sandbox's log is still read here."""
        if not request.sandbox_id:
            raise InvalidArgument("sandbox_id is required")
        if not self.ops.enabled:
            raise Unimplemented(
                "the operation log is off on this edge (DSEC_EDGE_OPLOG=off)",
                reason="OPERATION_LOG_OFF",
            )
        log = self.ops.log
        rec = self.manager.records.get(request.sandbox_id)
        if not log.has_log(request.sandbox_id):
            if rec is None:
                raise NotFound(
                    f"sandbox {request.sandbox_id} has no operation log here: deleted, ended "
                    "longer ago than its edge keeps logs, or never created",
                    reason="OPERATION_LOG_NOT_FOUND",
                    metadata={"sandbox_id": request.sandbox_id},
                )
            return types_pb2.ListOperationsResponse(sandbox_ended=not rec.live)
        entries, more = log.page(
            request.sandbox_id, request.after_seq, request.limit, with_bodies=request.with_bodies
        )
        out = types_pb2.ListOperationsResponse(operations=entries, more=more)
        out.next_seq = entries[-1].seq if entries else request.after_seq
        out.sandbox_ended = rec is None or not rec.live
        return out

    async def WatchDir(
        self, request: types_pb2.WatchDirRequest, context: Any
    ) -> AsyncIterator[types_pb2.WatchDirResponse]:
        """chronus's stream as is; when the channel goes (the sandbox ending: TTL, stop, OOM),
        the stream ends with the sandbox's termination (SANDBOX_TERMINATED and its reason)."""
        try:
            async for item in self._across_pauses(
                "watch_dir", request, types_pb2.WatchDirResponse, WatchContinuation(request)
            ):
                yield item
        except Unavailable as exc:
            await self._raise_if_ended(request.sandbox_id)
            raise exc
        await self._raise_if_ended(request.sandbox_id)
        raise Unavailable("the watch ended without a reason", reason="STREAM_ENDED_EARLY")

    async def _raise_if_ended(self, sandbox_id: str, wait_s: float = 10.0) -> None:
        """Raises SandboxTerminated once the sandbox is recorded as ended (its channel closes
        before its teardown completes); returns if it is still RUNNING after a moment (the
        channel dropped, the sandbox lives) or not ended after ``wait_s``."""
        start = time.monotonic()
        while True:
            rec = self.manager.get(sandbox_id)
            if not rec.live:
                self.manager.get_live(sandbox_id)  # SandboxTerminated with the reason
            waited = time.monotonic() - start
            if waited >= wait_s or (rec.state == "RUNNING" and waited >= 2.0):
                return
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------ display

    async def GetDisplayInfo(
        self, request: types_pb2.DisplayInfoRequest, context: Any
    ) -> types_pb2.DisplayInfoResponse:
        return await self.display.info(request)

    async def Screenshot(
        self, request: types_pb2.ScreenshotRequest, context: Any
    ) -> types_pb2.ScreenshotResponse:
        return await self.display.screenshot(request)

    async def DisplayInput(
        self, request: types_pb2.DisplayInputRequest, context: Any
    ) -> types_pb2.DisplayInputResponse:
        return await self.display.send_input(request)

    async def VncStream(
        self, request_iterator: AsyncIterator[types_pb2.VncData], context: Any
    ) -> AsyncIterator[types_pb2.VncData]:
        stream = self.display.vnc(request_iterator)
        async with contextlib.aclosing(stream):  # its VNC connection closes with the call
            async for item in stream:
                yield item

    # ------------------------------------------------------------- fncall

    async def RunFunction(
        self, request: edge_pb2.RunFunctionRequest, context: Any
    ) -> edge_pb2.RunFunctionResponse:
        return await self.fncall.run_function(request)

    async def RunFunctions(
        self, request: edge_pb2.RunFunctionsRequest, context: Any
    ) -> AsyncIterator[edge_pb2.RunFunctionsResponse]:
        async for item in self.fncall.run_functions(request):
            yield item

    async def StreamFunctions(
        self, requests: AsyncIterator[edge_pb2.StreamFunctionsRequest], context: Any
    ) -> AsyncIterator[edge_pb2.StreamFunctionsResponse]:
        jobs = self.fncall.stream_functions(requests)
        async with contextlib.aclosing(jobs):  # its jobs are cancelled when we are closed
            async for item in jobs:
                yield item

    # --------------------------------------------------------- containment

    async def UpdateNetworkPolicy(
        self, request: edge_pb2.UpdateNetworkPolicyRequest, context: Any
    ) -> edge_pb2.UpdateNetworkPolicyResponse:
        async def update() -> edge_pb2.UpdateNetworkPolicyResponse:
            policy = network_from_pb(request.policy)
            rec = await self.manager.update_network_policy(request.sandbox_id, policy)
            return edge_pb2.UpdateNetworkPolicyResponse(sandbox=sandbox_pb(rec))

        return await self._logged(
            "update_network_policy", request, context, update, edge_pb2.UpdateNetworkPolicyResponse
        )

    async def GetSandboxMetrics(
        self, request: types_pb2.GetSandboxMetricsRequest, context: Any
    ) -> types_pb2.GetSandboxMetricsResponse:
        start, end = metrics_window(request)
        got = self.manager.usage_samples(request.sandbox_id, start, end)
        resp = types_pb2.GetSandboxMetricsResponse(interval_s=got.interval_s, kept_s=got.kept_s)
        for s in got.samples:
            m = resp.metrics.add(
                cpu_count=got.cpu_count,
                cpu_used_pct=s.cpu_used_pct,
                mem_used_bytes=s.mem_used_bytes,
                mem_cache_bytes=s.mem_cache_bytes,
                mem_total_bytes=got.mem_total_bytes,
                disk_used_bytes=s.disk_used_bytes,
                disk_total_bytes=s.disk_total_bytes,
            )
            m.at.FromNanoseconds(int(s.at * 1e9))
        return resp

    async def GetModifiedFiles(
        self, request: edge_pb2.GetModifiedFilesRequest, context: Any
    ) -> edge_pb2.GetModifiedFilesResponse:
        files = await self.manager.modified_files(request.sandbox_id)
        return edge_pb2.GetModifiedFilesResponse(
            files=[edge_pb2.ModifiedFile(path=p, deleted=d) for p, d in files]
        )

    # ------------------------------------------------------- environments

    async def PackDiff(
        self, request: edge_pb2.PackDiffRequest, context: Any
    ) -> edge_pb2.PackDiffResponse:
        return await self._logged(  # type: ignore[no-any-return]
            "pack_diff",
            request,
            context,
            lambda: self.layers.pack_diff(request),
            edge_pb2.PackDiffResponse,
        )

    async def ImportImage(
        self, request: edge_pb2.ImportImageRequest, context: Any
    ) -> edge_pb2.ImportImageResponse:
        return await self.layers.import_image(request)

    async def ListEnvironments(
        self, request: edge_pb2.ListEnvironmentsRequest, context: Any
    ) -> edge_pb2.ListEnvironmentsResponse:
        return await self.layers.list_environments(request)

    async def GetEnvironment(
        self, request: edge_pb2.GetEnvironmentRequest, context: Any
    ) -> edge_pb2.GetEnvironmentResponse:
        return await self.layers.get_environment(request)

    async def ListLayers(
        self, request: edge_pb2.ListLayersRequest, context: Any
    ) -> edge_pb2.ListLayersResponse:
        return await self.layers.list_layers(request)

    async def ComposeEnvironment(
        self, request: edge_pb2.ComposeEnvironmentRequest, context: Any
    ) -> edge_pb2.ComposeEnvironmentResponse:
        return await self.layers.compose(request)

    async def DeleteEnvironment(
        self, request: edge_pb2.DeleteEnvironmentRequest, context: Any
    ) -> edge_pb2.DeleteEnvironmentResponse:
        return await self.layers.delete(request)


#: chronus's names for the calls it does not name as the contract does.
_CHRONUS_NAMES = {"SendHttp": "http", "GetWatcherEvents": "watcher_events"}
#: The sandbox calls the edge passes to chronus unchanged (the others, written above, also
#: choose a trusted channel, count truncations or outlive pauses).
EDGE_ROUTES = forwarding.routes(
    edge_pb2.DESCRIPTOR.services_by_name["EdgeService"],
    skip={
        "Exec",
        "ExecStream",
        "ExecInteractive",
        "AttachExec",
        "WatchDir",
        "ListOperations",
        # the backend's, not chronus's (edge/display_calls.py)
        "GetDisplayInfo",
        "Screenshot",
        "DisplayInput",
        "VncStream",
        # the backend's samples (edge/usage.py)
        "GetSandboxMetrics",
    },
    target=lambda name: _CHRONUS_NAMES.get(name) or forwarding.snake_case(name),
)
forwarding.install(EdgeServicer, EDGE_ROUTES)


#: The request a task operation's part is logged as, per action (ActOnSandboxes).
_TASK_REQUEST: dict[str, Callable[..., Message]] = {
    "PAUSE": edge_pb2.PauseSandboxRequest,
    "RESUME": edge_pb2.ResumeSandboxRequest,
    "STOP": edge_pb2.StopSandboxRequest,
}


def _labelled(request: types_pb2.ExecRequest) -> types_pb2.ExecRequest:
    """A streamed or background command as sent into the sandbox: its operation id as a
    label, given back as ExecInfo.operation_id (a sync run, gone when it answers, has none)."""
    if request.operation_id and len(request.labels) < 16:
        request.labels[OPERATION_LABEL] = request.operation_id
    return request


def _unlabelled(info: types_pb2.ExecInfo) -> None:
    """An ExecInfo as the caller sees it: its operation id in its own field, not a label."""
    if OPERATION_LABEL in info.labels:
        info.operation_id = info.labels.pop(OPERATION_LABEL)


class ExecContinuation:
    """A command's output stream continued after a pause closed its channel: an attach to
    the command from the offsets the caller has (chronus keeps its output; the command ran
    on in the guest's restored memory)."""

    def __init__(self, request: types_pb2.ExecRequest | types_pb2.AttachExecRequest) -> None:
        self.sandbox_id = request.sandbox_id
        self.interval_ms = request.keepalive_interval_ms
        self.exec_id = getattr(request, "exec_id", "")
        self.stdout = getattr(request, "stdout_offset", 0)
        self.stderr = getattr(request, "stderr_offset", 0)

    def observe(self, item: types_pb2.ExecEvent) -> None:
        kind = item.WhichOneof("event")
        if kind == "started":
            self.exec_id = item.started.exec_id
        elif kind == "stdout":
            self.stdout = item.stdout.offset + len(item.stdout.data)
        elif kind == "stderr":
            self.stderr = item.stderr.offset + len(item.stderr.data)

    def reopen(self) -> tuple[str, types_pb2.AttachExecRequest] | None:
        if not self.exec_id:
            return None
        return "attach_exec", types_pb2.AttachExecRequest(
            sandbox_id=self.sandbox_id,
            exec_id=self.exec_id,
            stdout_offset=self.stdout,
            stderr_offset=self.stderr,
            keepalive_interval_ms=self.interval_ms,
        )

    def repeated(self, item: types_pb2.ExecEvent) -> bool:
        return item.HasField("started")


class WatchContinuation:
    """A directory watch continued after a pause closed its channel: the same watch anew
    (its `started` not repeated to the caller)."""

    def __init__(self, request: types_pb2.WatchDirRequest) -> None:
        self.request = request

    def observe(self, item: types_pb2.WatchDirResponse) -> None:
        pass

    def reopen(self) -> tuple[str, types_pb2.WatchDirRequest]:
        return "watch_dir", self.request

    def repeated(self, item: types_pb2.WatchDirResponse) -> bool:
        return item.HasField("started")

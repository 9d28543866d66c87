"""gRPC adapters of the public API: authenticate, then a gateway call or a forward."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import Message

from apiserver import forking, snapshots
from apiserver.creation import Caller
from apiserver.environments import OWNER_KEY
from apiserver.functions import FunctionRouter
from apiserver.gateway import Gateway
from apiserver.routing import downstream
from apiserver.tasks import TaskOperations
from apiserver.viewer import viewer_url
from apiserver.watch import SandboxWatch
from common import forwarding
from common.auth import auth_metadata, bearer_token
from common.channels import DEFAULT_DEADLINE_S
from common.convert import grace_s, metrics_window
from common.forwarding import Route
from common.grpc_server import internal_error
from common.ids import is_queue_id
from common.tagged import serve_tagged
from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2
from dsec.iam.v1 import iam_pb2_grpc
from dsec.types.v1 import types_pb2
from libdsec.errors import (
    DSecError,
    InvalidArgument,
    SandboxNotFound,
    SandboxTerminated,
    Unavailable,
    from_rpc_error,
    item_error,
    item_status,
)

log = logging.getLogger(__name__)

#: pack_diff copies the writable layer and builds a layer from it (minutes for GBs).
PACK_DIFF_DEADLINE_S = 1800.0

#: Sync exec: the call may take the command's timeout plus this margin.
EXEC_MARGIN_S = 30.0
EXEC_DEFAULT_TIMEOUT_S = 600.0

#: Screenshots and display input (see DISPLAY_ROUTES).
DISPLAY_DEADLINE_S = 60.0


class _Forwarder:
    """Calls to the sandbox's owning edge: the caller's token, the owner check, the edge's stub
    and its errors in our vocabulary, in one place. The execution and file calls forward the
    same message unchanged; the sandbox calls map to the edge's own messages."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def _to_edge(
        self,
        who: Caller,
        sandbox_id: str,
        method: str,
        request: Any,
        *,
        timeout: float = DEFAULT_DEADLINE_S,
    ) -> Any:
        try:
            stub = await self.gw.edge_for(who, sandbox_id)
            call = getattr(stub, method)(request, timeout=timeout, metadata=_named(who))
            return await downstream(call, "edge")
        except (SandboxNotFound, Unavailable) as err:
            await self._raise_explained(who, sandbox_id, err)
            raise

    async def _raise_explained(self, who: Caller, sandbox_id: str, err: DSecError) -> None:
        """Raises why the edge could not answer if it is known (the sandbox ended with
        EDGE_LOST: see Gateway.explain); returns if ``err`` stands."""
        explained = await self.gw.explain(who, sandbox_id, err)
        if explained is not err:
            raise explained from err

    async def _call(
        self,
        context: Any,
        sandbox_id: str,
        method: str,
        request: Any,
        *,
        timeout: float = DEFAULT_DEADLINE_S,
    ) -> Any:
        who = await self.gw.caller(bearer_token(context))
        return await self._to_edge(who, sandbox_id, method, request, timeout=timeout)

    # The hops of common/forwarding.py, one per call shape.

    async def forward_unary(self, route: Route, request: Any, context: Any) -> Message:
        timeout = DEFAULT_DEADLINE_S if route.deadline is None else route.deadline(request)
        result: Message = await self._call(
            context, request.sandbox_id, route.target, request, timeout=timeout
        )
        return result

    async def forward_server_stream(
        self, route: Route, request: Any, context: Any
    ) -> AsyncIterator[Message]:
        who = await self.gw.caller(bearer_token(context))
        try:
            stub = await self.gw.edge_for(who, request.sandbox_id)
        except (SandboxNotFound, Unavailable) as err:
            await self._raise_explained(who, request.sandbox_id, err)
            raise
        call = getattr(stub, route.target)(request, metadata=_named(who))
        try:
            async for item in call:
                yield item
        except grpc.aio.AioRpcError as exc:
            failure = from_rpc_error(exc)
            await self._raise_explained(who, request.sandbox_id, failure)
            raise failure from exc
        finally:
            call.cancel()

    async def forward_client_stream(
        self, route: Route, requests: AsyncIterator[Any], context: Any
    ) -> Message:
        call = await self._open_client_stream(route, requests, context)
        try:
            result: Message = await call
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        return result

    async def forward_bidi_stream(
        self, route: Route, requests: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Message]:
        call = await self._open_client_stream(route, requests, context)
        try:
            async for item in call:
                yield item
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        finally:
            call.cancel()

    async def _open_client_stream(
        self, route: Route, requests: AsyncIterator[Any], context: Any
    ) -> Any:
        """The edge's call for a client stream, its first message (which must name the
        sandbox, in ``route.opener``) put back in front."""
        who = await self.gw.caller(bearer_token(context))
        sandbox_id, whole = await forwarding.opened(route, requests)
        try:
            stub = await self.gw.edge_for(who, sandbox_id)
        except (SandboxNotFound, Unavailable) as err:
            await self._raise_explained(who, sandbox_id, err)
            raise
        return getattr(stub, route.target)(whole, metadata=_named(who))


def _named(who: Caller) -> tuple[tuple[str, str], ...]:
    """The metadata naming the caller to the edge (its operation log records who called)."""
    return ((forwarding.PRINCIPAL_METADATA, who.principal_id),)


class SandboxServicer(_Forwarder):
    def __init__(self, gw: Gateway) -> None:
        super().__init__(gw)
        self.tasks = TaskOperations(gw)

    async def CreateSandbox(
        self, request: apiserver_pb2.CreateSandboxRequest, context: Any
    ) -> apiserver_pb2.CreateSandboxResponse:
        who = await self.gw.caller(bearer_token(context))
        return apiserver_pb2.CreateSandboxResponse(sandbox=await self.gw.create(who, request))

    async def CreateSandboxes(
        self, request: apiserver_pb2.CreateSandboxesRequest, context: Any
    ) -> apiserver_pb2.CreateSandboxesResponse:
        who = await self.gw.caller(bearer_token(context))
        results = await self.gw.create_many(who, list(request.items))
        out = apiserver_pb2.CreateSandboxesResponse()
        created = failed = 0
        add = out.results.add
        for i, (sb, err) in enumerate(results):
            r = add(index=i)
            if sb is not None:
                r.sandbox.CopyFrom(sb)
                created += 1
            elif err is not None:
                item_status(err, r.error)
                failed += 1
        out.created, out.failed = created, failed
        return out

    async def GetSandbox(
        self, request: apiserver_pb2.GetSandboxRequest, context: Any
    ) -> apiserver_pb2.GetSandboxResponse:
        who = await self.gw.caller(bearer_token(context))
        if is_queue_id(request.sandbox_id):
            sb = await self.gw.queue.get(who, request.sandbox_id)
            return apiserver_pb2.GetSandboxResponse(sandbox=sb)
        return apiserver_pb2.GetSandboxResponse(sandbox=await self.gw.get(who, request.sandbox_id))

    async def ListSandboxes(
        self, request: apiserver_pb2.ListSandboxesRequest, context: Any
    ) -> apiserver_pb2.ListSandboxesResponse:
        who = await self.gw.caller(bearer_token(context))
        page_size = request.page_size or 1000
        if page_size > 10_000:
            raise InvalidArgument("page_size must be <= 10000")
        try:
            offset = int(request.page_token or "0")
        except ValueError:
            raise InvalidArgument("malformed page_token") from None
        sandboxes = await self.gw.list_sandboxes(
            who,
            task_id=request.task_id,
            labels=dict(request.label_selector),
            states=list(request.states),
            include_subprojects=request.include_subprojects,
        )
        page = sandboxes[offset : offset + page_size]
        nxt = str(offset + page_size) if offset + page_size < len(sandboxes) else ""
        return apiserver_pb2.ListSandboxesResponse(sandboxes=page, next_page_token=nxt)

    async def StopSandbox(
        self, request: apiserver_pb2.StopSandboxRequest, context: Any
    ) -> apiserver_pb2.StopSandboxResponse:
        grace = grace_s(request.grace_s)
        if is_queue_id(request.sandbox_id):
            who = await self.gw.caller(bearer_token(context))
            view, placed = await self.gw.queue.stop(who, request.sandbox_id)
            if view is not None:
                return apiserver_pb2.StopSandboxResponse(sandbox=view)
            request = apiserver_pb2.StopSandboxRequest(sandbox_id=placed, grace_s=request.grace_s)
        try:
            resp = await self._call(
                context,
                request.sandbox_id,
                "StopSandbox",
                edge_pb2.StopSandboxRequest(sandbox_id=request.sandbox_id, grace_s=grace),
                timeout=DEFAULT_DEADLINE_S + grace,
            )
        except SandboxTerminated as err:
            if err.metadata.get("termination_reason") != "EDGE_LOST":
                raise
            # Ended already, as a stop of a terminated sandbox answers on a live edge.
            who = await self.gw.caller(bearer_token(context))
            return apiserver_pb2.StopSandboxResponse(
                sandbox=await self.gw.get(who, request.sandbox_id)
            )
        return apiserver_pb2.StopSandboxResponse(sandbox=resp.sandbox)

    async def StopSandboxes(
        self, request: apiserver_pb2.StopSandboxesRequest, context: Any
    ) -> apiserver_pb2.StopSandboxesResponse:
        """StopTask's path, answered as before: the ids of the live sandboxes stopped (an edge
        that does not answer is skipped; a sandbox that fails to stop fails the call)."""
        who = await self.gw.caller(bearer_token(context))
        results, _ = await self.tasks.act(
            who,
            edge_pb2.SANDBOX_ACTION_STOP,
            request.task_id,
            request.label_selector,
            grace_s=request.grace_s,
            skip_terminated=True,
        )
        for r in results:
            if r.error.code:
                raise item_error(r.error)
        ids = [r.sandbox_id for r in results]
        return apiserver_pb2.StopSandboxesResponse(stopped=len(ids), sandbox_ids=ids)

    async def PauseTask(
        self, request: apiserver_pb2.PauseTaskRequest, context: Any
    ) -> apiserver_pb2.PauseTaskResponse:
        who = await self.gw.caller(bearer_token(context))
        results, edge_errors = await self.tasks.act(
            who, edge_pb2.SANDBOX_ACTION_PAUSE, request.task_id, request.label_selector
        )
        return apiserver_pb2.PauseTaskResponse(results=results, edge_errors=edge_errors)

    async def ResumeTask(
        self, request: apiserver_pb2.ResumeTaskRequest, context: Any
    ) -> apiserver_pb2.ResumeTaskResponse:
        who = await self.gw.caller(bearer_token(context))
        results, edge_errors = await self.tasks.act(
            who, edge_pb2.SANDBOX_ACTION_RESUME, request.task_id, request.label_selector
        )
        return apiserver_pb2.ResumeTaskResponse(results=results, edge_errors=edge_errors)

    async def StopTask(
        self, request: apiserver_pb2.StopTaskRequest, context: Any
    ) -> apiserver_pb2.StopTaskResponse:
        who = await self.gw.caller(bearer_token(context))
        results, edge_errors = await self.tasks.act(
            who,
            edge_pb2.SANDBOX_ACTION_STOP,
            request.task_id,
            request.label_selector,
            reason=(
                types_pb2.TERMINATION_REASON_PREEMPTED
                if request.preempted
                else types_pb2.TERMINATION_REASON_STOPPED
            ),
            message=request.message,
            grace_s=request.grace_s,
        )
        return apiserver_pb2.StopTaskResponse(results=results, edge_errors=edge_errors)

    async def DeleteSandbox(
        self, request: apiserver_pb2.DeleteSandboxRequest, context: Any
    ) -> apiserver_pb2.DeleteSandboxResponse:
        await self._call(
            context,
            request.sandbox_id,
            "DeleteSandbox",
            edge_pb2.DeleteSandboxRequest(sandbox_id=request.sandbox_id),
        )
        self.gw.owners.drop(request.sandbox_id)
        return apiserver_pb2.DeleteSandboxResponse()

    async def PauseSandbox(
        self, request: apiserver_pb2.PauseSandboxRequest, context: Any
    ) -> apiserver_pb2.PauseSandboxResponse:
        resp = await self._call(
            context,
            request.sandbox_id,
            "PauseSandbox",
            edge_pb2.PauseSandboxRequest(
                sandbox_id=request.sandbox_id, files_only=request.files_only
            ),
            timeout=DEFAULT_DEADLINE_S * 6,
        )
        return apiserver_pb2.PauseSandboxResponse(sandbox=resp.sandbox)

    async def SetSandboxTimeout(
        self, request: apiserver_pb2.SetSandboxTimeoutRequest, context: Any
    ) -> apiserver_pb2.SetSandboxTimeoutResponse:
        max_ttl_s = self.gw.cfg.max_ttl_s
        if not 0 < request.timeout_s <= max_ttl_s:  # NaN fails both
            raise InvalidArgument(
                f"timeout_s={request.timeout_s} must be in (0, {max_ttl_s}] seconds "
                "(the maximum ttl_s)",
                reason="INVALID_TTL",
                metadata={"field": "timeout_s"},
            )
        resp = await self._call(
            context,
            request.sandbox_id,
            "SetSandboxTimeout",
            edge_pb2.SetSandboxTimeoutRequest(
                sandbox_id=request.sandbox_id, timeout_s=request.timeout_s
            ),
        )
        return apiserver_pb2.SetSandboxTimeoutResponse(sandbox=resp.sandbox)

    async def ResumeSandbox(
        self, request: apiserver_pb2.ResumeSandboxRequest, context: Any
    ) -> apiserver_pb2.ResumeSandboxResponse:
        resp = await self._call(
            context,
            request.sandbox_id,
            "ResumeSandbox",
            edge_pb2.ResumeSandboxRequest(sandbox_id=request.sandbox_id),
            timeout=DEFAULT_DEADLINE_S * 6,
        )
        return apiserver_pb2.ResumeSandboxResponse(sandbox=resp.sandbox)

    async def ForkSandbox(
        self, request: apiserver_pb2.ForkSandboxRequest, context: Any
    ) -> apiserver_pb2.ForkSandboxResponse:
        """On the source's edge, after reserving quota for every child (apiserver/forking.py)."""
        who = await self.gw.caller(bearer_token(context))
        try:
            return await forking.fork(self.gw, who, request)
        except (SandboxNotFound, Unavailable) as err:
            await self._raise_explained(who, request.sandbox_id, err)
            raise

    async def PackDiff(
        self, request: apiserver_pb2.PackDiffRequest, context: Any
    ) -> apiserver_pb2.PackDiffResponse:
        """On the owning edge: its writable layer is on that node's disk. A name in the
        snapshot namespace must be the caller's project's (apiserver/snapshots.py); the
        environment's config records the caller's project (``dsec.project``: its owner, who
        may delete it)."""
        who = await self.gw.caller(bearer_token(context))
        snapshots.check_packable(who.project_id, request.name)
        config = {k: v for k, v in request.config.items() if not k.startswith("dsec.")}
        config[OWNER_KEY] = who.project_id
        resp = await self._to_edge(
            who,
            request.sandbox_id,
            "PackDiff",
            edge_pb2.PackDiffRequest(
                sandbox_id=request.sandbox_id,
                name=request.name,
                exclude=request.exclude,
                no_default_excludes=request.no_default_excludes,
                config=config,
            ),
            timeout=PACK_DIFF_DEADLINE_S,
        )
        return apiserver_pb2.PackDiffResponse(environment=resp.environment)

    async def UpdateNetworkPolicy(
        self, request: apiserver_pb2.UpdateNetworkPolicyRequest, context: Any
    ) -> apiserver_pb2.UpdateNetworkPolicyResponse:
        """On the owning edge, which validates the policy (and resolves its names)."""
        resp = await self._call(
            context,
            request.sandbox_id,
            "UpdateNetworkPolicy",
            edge_pb2.UpdateNetworkPolicyRequest(
                sandbox_id=request.sandbox_id, policy=request.policy
            ),
        )
        return apiserver_pb2.UpdateNetworkPolicyResponse(sandbox=resp.sandbox)

    async def GetSandboxMetrics(
        self, request: types_pb2.GetSandboxMetricsRequest, context: Any
    ) -> types_pb2.GetSandboxMetricsResponse:
        metrics_window(request)  # a bad window is the caller's error, before any hop
        resp: types_pb2.GetSandboxMetricsResponse = await self._call(
            context, request.sandbox_id, "GetSandboxMetrics", request
        )
        return resp

    async def GetModifiedFiles(
        self, request: apiserver_pb2.GetModifiedFilesRequest, context: Any
    ) -> apiserver_pb2.GetModifiedFilesResponse:
        resp = await self._call(
            context,
            request.sandbox_id,
            "GetModifiedFiles",
            edge_pb2.GetModifiedFilesRequest(sandbox_id=request.sandbox_id),
            timeout=DEFAULT_DEADLINE_S * 4,
        )
        return apiserver_pb2.GetModifiedFilesResponse(
            files=[apiserver_pb2.ModifiedFile(path=f.path, deleted=f.deleted) for f in resp.files]
        )

    async def ListQueue(
        self, request: apiserver_pb2.ListQueueRequest, context: Any
    ) -> apiserver_pb2.ListQueueResponse:
        who = await self.gw.caller(bearer_token(context))
        return await self.gw.queue.summary(who, request.include_entries)

    async def WatchSandboxes(
        self, request: apiserver_pb2.WatchSandboxesRequest, context: Any
    ) -> AsyncIterator[apiserver_pb2.WatchSandboxesResponse]:
        who = await self.gw.caller(bearer_token(context))
        events = SandboxWatch(self.gw, who, request).events()
        async with contextlib.aclosing(events):  # its edge streams end with the caller's
            async for item in events:
                yield item


class ExecServicer(_Forwarder):
    """ExecService: every call forwarded to the sandbox's owning edge (EXEC_ROUTES)."""


class FileServicer(_Forwarder):
    """FileService: every call forwarded to the sandbox's owning edge (FILE_ROUTES)."""


class DisplayServicer(_Forwarder):
    """DisplayService (computer use): every call forwarded to the sandbox's owning edge
    (DISPLAY_ROUTES), whose backend answers it (edge/display_calls.py). GetDisplayInfo is
    the edge's answer plus this API server's live-view page (apiserver/viewer.py)."""

    async def GetDisplayInfo(
        self, request: types_pb2.DisplayInfoRequest, context: Any
    ) -> types_pb2.DisplayInfoResponse:
        resp = await self.forward_unary(_DISPLAY_INFO, request, context)
        assert isinstance(resp, types_pb2.DisplayInfoResponse)
        resp.viewer_url = viewer_url(self.gw.cfg, request.sandbox_id)
        return resp


def _exec_deadline(request: types_pb2.ExecRequest | types_pb2.WaitExecRequest) -> float:
    """A command's call may take its timeout plus a margin."""
    return (request.timeout_s or EXEC_DEFAULT_TIMEOUT_S) + EXEC_MARGIN_S


def _port_deadline(request: types_pb2.HttpRequest | types_pb2.WaitForPortRequest) -> float:
    return (request.timeout_s or 30.0) + EXEC_MARGIN_S


_SERVICES = apiserver_pb2.DESCRIPTOR.services_by_name
#: The sandbox calls, as the edge names them (the same methods there), with their deadlines.
EXEC_ROUTES = forwarding.routes(
    _SERVICES["ExecService"],
    deadlines={
        "Exec": _exec_deadline,
        "WaitExec": _exec_deadline,
        "SendHttp": _port_deadline,
        "WaitForPort": _port_deadline,
    },
)
FILE_ROUTES = forwarding.routes(_SERVICES["FileService"])
#: A display call may resume a paused VM first (its memory read back from disk) and then
#: take and encode a screenshot, or type a long text key by key: a minute. A VNC stream has
#: no deadline (a person watching); it ends with the viewer or the sandbox.
_DISPLAY_ALL = forwarding.routes(
    _SERVICES["DisplayService"],
    deadlines={
        "GetDisplayInfo": lambda request: DISPLAY_DEADLINE_S,
        "Screenshot": lambda request: DISPLAY_DEADLINE_S,
        "DisplayInput": lambda request: DISPLAY_DEADLINE_S,
    },
)
_DISPLAY_INFO = _DISPLAY_ALL["GetDisplayInfo"]  # written by hand (adds the viewer's URL)
DISPLAY_ROUTES = {name: r for name, r in _DISPLAY_ALL.items() if name != "GetDisplayInfo"}
forwarding.install(ExecServicer, EXEC_ROUTES)
forwarding.install(FileServicer, FILE_ROUTES)
forwarding.install(DisplayServicer, DISPLAY_ROUTES)


class ProjectServicer:
    """Project/token management, forwarded to IAM with the caller's own token."""

    def __init__(self, gw: Gateway, iam: iam_pb2_grpc.IamServiceStub, instance: str) -> None:
        self.gw = gw
        self.iam = iam
        self.instance = instance

    async def WhoAmI(
        self, request: apiserver_pb2.WhoAmIRequest, context: Any
    ) -> apiserver_pb2.WhoAmIResponse:
        principal = await self.gw.auth.principal(bearer_token(context))
        return apiserver_pb2.WhoAmIResponse(principal=principal, apiserver_instance=self.instance)

    async def _iam(self, method: str, request: Any, context: Any) -> Any:
        token = bearer_token(context)
        await self.gw.auth.principal(token)  # UNAUTHENTICATED here rather than deeper
        return await downstream(
            getattr(self.iam, method)(
                request, metadata=auth_metadata(token), timeout=DEFAULT_DEADLINE_S
            ),
            "iam",
        )

    async def CreateProject(self, request: Any, context: Any) -> Any:
        return await self._iam("CreateProject", request, context)

    async def GetProject(self, request: Any, context: Any) -> Any:
        return await self._iam("GetProject", request, context)

    async def ListProjects(self, request: Any, context: Any) -> Any:
        return await self._iam("ListProjects", request, context)

    async def SetQuota(self, request: Any, context: Any) -> Any:
        return await self._iam("SetQuota", request, context)

    async def DeleteProject(self, request: Any, context: Any) -> Any:
        return await self._iam("DeleteProject", request, context)

    async def CreateToken(self, request: Any, context: Any) -> Any:
        return await self._iam("CreateToken", request, context)

    async def ListTokens(self, request: Any, context: Any) -> Any:
        return await self._iam("ListTokens", request, context)

    async def RevokeToken(self, request: Any, context: Any) -> Any:
        return await self._iam("RevokeToken", request, context)


class FunctionServicer:
    """FnCall: authenticate, then route to an edge offering BACKEND_FNCALL (see functions.py)."""

    def __init__(self, gw: Gateway) -> None:
        self.router = FunctionRouter(gw)
        self.gw = gw

    async def RunFunction(
        self, request: apiserver_pb2.RunFunctionRequest, context: Any
    ) -> apiserver_pb2.RunFunctionResponse:
        who = await self.gw.caller(bearer_token(context))
        return apiserver_pb2.RunFunctionResponse(result=await self.router.run(who, request.job))

    async def RunFunctions(
        self, request: apiserver_pb2.RunFunctionsRequest, context: Any
    ) -> AsyncIterator[apiserver_pb2.RunFunctionsResponse]:
        who = await self.gw.caller(bearer_token(context))
        async for item in self.router.run_many(who, request):
            yield item

    async def StreamFunctions(
        self, requests: AsyncIterator[apiserver_pb2.StreamFunctionsRequest], context: Any
    ) -> AsyncIterator[apiserver_pb2.StreamFunctionsResponse]:
        token = bearer_token(context)
        await self.gw.caller(token)  # a bad token ends the stream at once

        async def run(request: apiserver_pb2.StreamFunctionsRequest) -> Any:
            # Per job, not once per stream: a stream lives long, a token may be revoked or
            # expire meanwhile (the lookup is cached: no IAM call per job).
            who = await self.gw.caller(token)
            return await self.router.run(who, request.job)

        jobs = serve_tagged(
            requests,
            run,
            apiserver_pb2.StreamFunctionsResponse,
            internal=lambda exc: internal_error("StreamFunctions job", exc),
        )
        async with contextlib.aclosing(jobs):
            async for item in jobs:
                yield item

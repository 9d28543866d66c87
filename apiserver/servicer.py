"""gRPC adapters of the public API: authenticate, then a gateway call or a forward."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from apiserver.creation import Caller
from apiserver.functions import FunctionRouter
from apiserver.gateway import Gateway
from apiserver.routing import downstream
from apiserver.tasks import TaskOperations
from apiserver.watch import SandboxWatch
from common.auth import auth_metadata, bearer_token
from common.channels import DEFAULT_DEADLINE_S
from common.grpc_server import internal_error
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
    code_number,
    from_rpc_error,
    status_for,
)

log = logging.getLogger(__name__)

#: pack_diff copies the writable layer and builds a layer from it (minutes for GBs).
PACK_DIFF_DEADLINE_S = 1800.0

#: Sync exec: the call may take the command's timeout plus this margin.
EXEC_MARGIN_S = 30.0
EXEC_DEFAULT_TIMEOUT_S = 600.0


def _exec_deadline(request: types_pb2.ExecRequest) -> float:
    return (request.timeout_s or EXEC_DEFAULT_TIMEOUT_S) + EXEC_MARGIN_S


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
            return await downstream(getattr(stub, method)(request, timeout=timeout), "edge")
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

    async def _unary(
        self, method: str, request: Any, context: Any, timeout: float = DEFAULT_DEADLINE_S
    ) -> Any:
        return await self._call(context, request.sandbox_id, method, request, timeout=timeout)

    async def _stream(self, method: str, request: Any, context: Any) -> AsyncIterator[Any]:
        who = await self.gw.caller(bearer_token(context))
        try:
            stub = await self.gw.edge_for(who, request.sandbox_id)
        except (SandboxNotFound, Unavailable) as err:
            await self._raise_explained(who, request.sandbox_id, err)
            raise
        call = getattr(stub, method)(request)
        try:
            async for item in call:
                yield item
        except grpc.aio.AioRpcError as exc:
            failure = from_rpc_error(exc)
            await self._raise_explained(who, request.sandbox_id, failure)
            raise failure from exc
        finally:
            call.cancel()

    async def _client_stream(
        self, method: str, requests: AsyncIterator[Any], context: Any, key: str
    ) -> Any:
        who = await self.gw.caller(bearer_token(context))
        first = await anext(requests, None)
        if first is None or first.WhichOneof(first.DESCRIPTOR.oneofs[0].name) != key:
            raise InvalidArgument(f"the first message must carry `{key}`")
        sandbox_id = getattr(first, key).sandbox_id
        try:
            stub = await self.gw.edge_for(who, sandbox_id)
        except (SandboxNotFound, Unavailable) as err:
            await self._raise_explained(who, sandbox_id, err)
            raise

        async def all_requests() -> AsyncIterator[Any]:
            yield first
            async for item in requests:
                yield item

        return stub, getattr(stub, method)(all_requests())


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
                r.error_code = code_number(err.code)
                r.error_reason = err.reason
                r.error_message = err.message
                r.error_metadata.update(err.metadata)
                failed += 1
        out.created, out.failed = created, failed
        return out

    async def GetSandbox(
        self, request: apiserver_pb2.GetSandboxRequest, context: Any
    ) -> apiserver_pb2.GetSandboxResponse:
        who = await self.gw.caller(bearer_token(context))
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
        req = edge_pb2.ListSandboxesRequest(
            project_prefix=who.project_id,
            task_id=request.task_id,
            label_selector=request.label_selector,
            states=request.states,
            include_terminated=True,
        )
        answers = await self.gw.fan_out(lambda s: s.ListSandboxes(req, timeout=DEFAULT_DEADLINE_S))
        sandboxes = [sb for a in answers for sb in a.sandboxes]
        if not request.states or types_pb2.SANDBOX_STATE_TERMINATED in request.states:
            sandboxes += await self._lost(who, request, {sb.id for sb in sandboxes})
        if not request.include_subprojects:
            sandboxes = [sb for sb in sandboxes if sb.project_id == who.project_id]
        sandboxes.sort(key=lambda sb: (sb.created_at.seconds, sb.created_at.nanos, sb.id))
        page = sandboxes[offset : offset + page_size]
        nxt = str(offset + page_size) if offset + page_size < len(sandboxes) else ""
        return apiserver_pb2.ListSandboxesResponse(sandboxes=page, next_page_token=nxt)

    async def _lost(
        self, who: Caller, request: apiserver_pb2.ListSandboxesRequest, listed: set[str]
    ) -> list[types_pb2.Sandbox]:
        """The caller's sandboxes of edges declared lost (an edge that answers again wins)."""
        try:
            resp = await self.gw.edges.lost(
                project_prefix=who.project_id,
                task_id=request.task_id,
                label_selector=dict(request.label_selector),
            )
        except DSecError as exc:  # the watcher is down: the edges' answers stand
            log.warning("lost-sandbox listing failed: %s", exc)
            return []
        return [sb for sb in resp.sandboxes if sb.id not in listed]

    async def StopSandbox(
        self, request: apiserver_pb2.StopSandboxRequest, context: Any
    ) -> apiserver_pb2.StopSandboxResponse:
        try:
            resp = await self._call(
                context,
                request.sandbox_id,
                "StopSandbox",
                edge_pb2.StopSandboxRequest(sandbox_id=request.sandbox_id, grace_s=request.grace_s),
                timeout=DEFAULT_DEADLINE_S + request.grace_s,
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
            if r.error_code:
                info = r.error_info
                raise status_for(r.error_code, info.reason, r.error_message, info.metadata)
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
            edge_pb2.PauseSandboxRequest(sandbox_id=request.sandbox_id),
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

    async def PackDiff(
        self, request: apiserver_pb2.PackDiffRequest, context: Any
    ) -> apiserver_pb2.PackDiffResponse:
        """On the owning edge: its writable layer is on that node's disk."""
        resp = await self._call(
            context,
            request.sandbox_id,
            "PackDiff",
            edge_pb2.PackDiffRequest(
                sandbox_id=request.sandbox_id,
                name=request.name,
                exclude=request.exclude,
                no_default_excludes=request.no_default_excludes,
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

    async def WatchSandboxes(
        self, request: apiserver_pb2.WatchSandboxesRequest, context: Any
    ) -> AsyncIterator[apiserver_pb2.WatchSandboxesResponse]:
        who = await self.gw.caller(bearer_token(context))
        events = SandboxWatch(self.gw, who, request).events()
        async with contextlib.aclosing(events):  # its edge streams end with the caller's
            async for item in events:
                yield item


class ExecServicer(_Forwarder):
    async def Exec(self, request: types_pb2.ExecRequest, context: Any) -> types_pb2.ExecResult:
        return await self._unary("Exec", request, context, timeout=_exec_deadline(request))  # type: ignore[no-any-return]

    async def ExecStream(
        self, request: types_pb2.ExecRequest, context: Any
    ) -> AsyncIterator[types_pb2.ExecEvent]:
        async for item in self._stream("ExecStream", request, context):
            yield item

    async def ExecInteractive(
        self, request_iterator: AsyncIterator[types_pb2.ExecInput], context: Any
    ) -> AsyncIterator[types_pb2.ExecEvent]:
        _, call = await self._client_stream("ExecInteractive", request_iterator, context, "start")
        try:
            async for item in call:
                yield item
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc
        finally:
            call.cancel()

    async def AttachExec(
        self, request: types_pb2.AttachExecRequest, context: Any
    ) -> AsyncIterator[types_pb2.ExecEvent]:
        async for item in self._stream("AttachExec", request, context):
            yield item

    async def WaitExec(
        self, request: types_pb2.WaitExecRequest, context: Any
    ) -> types_pb2.WaitExecResponse:
        timeout = (request.timeout_s or EXEC_DEFAULT_TIMEOUT_S) + EXEC_MARGIN_S
        return await self._unary("WaitExec", request, context, timeout=timeout)  # type: ignore[no-any-return]

    async def SignalExec(
        self, request: types_pb2.SignalExecRequest, context: Any
    ) -> types_pb2.SignalExecResponse:
        return await self._unary("SignalExec", request, context)  # type: ignore[no-any-return]

    async def ControlExec(
        self, request: types_pb2.ControlExecRequest, context: Any
    ) -> types_pb2.ControlExecResponse:
        return await self._unary("ControlExec", request, context)  # type: ignore[no-any-return]

    async def ListExecs(
        self, request: types_pb2.ListExecsRequest, context: Any
    ) -> types_pb2.ListExecsResponse:
        return await self._unary("ListExecs", request, context)  # type: ignore[no-any-return]

    async def CreateSession(
        self, request: types_pb2.CreateSessionRequest, context: Any
    ) -> types_pb2.CreateSessionResponse:
        return await self._unary("CreateSession", request, context)  # type: ignore[no-any-return]

    async def CloseSession(
        self, request: types_pb2.CloseSessionRequest, context: Any
    ) -> types_pb2.CloseSessionResponse:
        return await self._unary("CloseSession", request, context)  # type: ignore[no-any-return]

    async def ListSessions(
        self, request: types_pb2.ListSessionsRequest, context: Any
    ) -> types_pb2.ListSessionsResponse:
        return await self._unary("ListSessions", request, context)  # type: ignore[no-any-return]

    async def SendHttp(
        self, request: types_pb2.HttpRequest, context: Any
    ) -> types_pb2.HttpResponse:
        timeout = (request.timeout_s or 30.0) + EXEC_MARGIN_S
        return await self._unary("SendHttp", request, context, timeout=timeout)  # type: ignore[no-any-return]

    async def WaitForPort(
        self, request: types_pb2.WaitForPortRequest, context: Any
    ) -> types_pb2.WaitForPortResponse:
        timeout = (request.timeout_s or 30.0) + EXEC_MARGIN_S
        return await self._unary("WaitForPort", request, context, timeout=timeout)  # type: ignore[no-any-return]


class FileServicer(_Forwarder):
    async def ReadFile(
        self, request: types_pb2.ReadFileRequest, context: Any
    ) -> types_pb2.ReadFileResponse:
        return await self._unary("ReadFile", request, context)  # type: ignore[no-any-return]

    async def WriteFile(
        self, request: types_pb2.WriteFileRequest, context: Any
    ) -> types_pb2.WriteFileResponse:
        return await self._unary("WriteFile", request, context)  # type: ignore[no-any-return]

    async def ListDir(
        self, request: types_pb2.ListDirRequest, context: Any
    ) -> types_pb2.ListDirResponse:
        return await self._unary("ListDir", request, context)  # type: ignore[no-any-return]

    async def StatPath(
        self, request: types_pb2.StatPathRequest, context: Any
    ) -> types_pb2.StatPathResponse:
        return await self._unary("StatPath", request, context)  # type: ignore[no-any-return]

    async def MakeDir(
        self, request: types_pb2.MakeDirRequest, context: Any
    ) -> types_pb2.MakeDirResponse:
        return await self._unary("MakeDir", request, context)  # type: ignore[no-any-return]

    async def RemovePath(
        self, request: types_pb2.RemovePathRequest, context: Any
    ) -> types_pb2.RemovePathResponse:
        return await self._unary("RemovePath", request, context)  # type: ignore[no-any-return]

    async def MovePath(
        self, request: types_pb2.MovePathRequest, context: Any
    ) -> types_pb2.MovePathResponse:
        return await self._unary("MovePath", request, context)  # type: ignore[no-any-return]

    async def ChmodPath(
        self, request: types_pb2.ChmodPathRequest, context: Any
    ) -> types_pb2.ChmodPathResponse:
        return await self._unary("ChmodPath", request, context)  # type: ignore[no-any-return]

    async def UploadFile(
        self, request_iterator: AsyncIterator[types_pb2.UploadFileRequest], context: Any
    ) -> types_pb2.UploadFileResponse:
        _, call = await self._client_stream("UploadFile", request_iterator, context, "header")
        try:
            return await call  # type: ignore[no-any-return]
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc

    async def DownloadFile(
        self, request: types_pb2.DownloadFileRequest, context: Any
    ) -> AsyncIterator[types_pb2.DownloadFileResponse]:
        async for item in self._stream("DownloadFile", request, context):
            yield item

    async def CreateWatcher(
        self, request: types_pb2.CreateWatcherRequest, context: Any
    ) -> types_pb2.CreateWatcherResponse:
        return await self._unary("CreateWatcher", request, context)  # type: ignore[no-any-return]

    async def GetWatcherEvents(
        self, request: types_pb2.GetWatcherEventsRequest, context: Any
    ) -> types_pb2.GetWatcherEventsResponse:
        return await self._unary("GetWatcherEvents", request, context)  # type: ignore[no-any-return]

    async def RemoveWatcher(
        self, request: types_pb2.RemoveWatcherRequest, context: Any
    ) -> types_pb2.RemoveWatcherResponse:
        return await self._unary("RemoveWatcher", request, context)  # type: ignore[no-any-return]

    async def WatchDir(
        self, request: types_pb2.WatchDirRequest, context: Any
    ) -> AsyncIterator[types_pb2.WatchDirResponse]:
        async for item in self._stream("WatchDir", request, context):
            yield item


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

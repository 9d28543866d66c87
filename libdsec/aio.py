"""The asynchronous SDK: :class:`AsyncClient` and :class:`AsyncSandbox`.

    import asyncio
    from libdsec import AsyncClient

    async def main():
        async with AsyncClient() as dsec:              # the local cluster by default
            async with await dsec.create(image="bookworm") as sb:
                r = await sb.run("python3 -c 'print(6*7)'")
                print(r.exit_code, r.text)

    asyncio.run(main())

The synchronous :class:`libdsec.Client` wraps this one, so both behave the same.
"""

from __future__ import annotations

import asyncio
import builtins
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import grpc

from dsec.apiserver.v1 import apiserver_pb2, apiserver_pb2_grpc
from dsec.iam.v1 import iam_pb2
from dsec.types.v1 import types_pb2
from libdsec._config import resolve
from libdsec._tagged import TaggedStream
from libdsec._transport import (
    CHANNEL_OPTIONS,
    DEFAULT_TIMEOUT_S,
    STREAM_IDLE_TIMEOUT_S,
)
from libdsec._transport import stream as _stream
from libdsec._transport import unary as _unary
from libdsec.errors import (
    DSecError,
    InvalidArgument,
    Unavailable,
    status_for,
)
from libdsec.types import (
    Environment,
    ExecEvent,
    ExecInfo,
    ExecResult,
    Exited,
    ExitStatus,
    FileInfo,
    FunctionJob,
    FunctionResult,
    HttpResponse,
    Layer,
    ModifiedFile,
    NetworkPolicy,
    NewToken,
    Principal,
    Project,
    Quota,
    SandboxInfo,
    TokenInfo,
    event_from_pb,
)

_BACKENDS = {
    "fncall": types_pb2.BACKEND_FNCALL,
    "container": types_pb2.BACKEND_CONTAINER,
    "microvm": types_pb2.BACKEND_MICROVM,
    "vm": types_pb2.BACKEND_VM,
}

CHUNK = 1024 * 1024


def _resources(
    cpu: float | None,
    memory_mb: int | None,
    pids_max: int | None,
    disk_mb: int | None,
    gpus: int | None,
) -> types_pb2.Resources:
    return types_pb2.Resources(
        cpu_millis=round((cpu or 0) * 1000),
        memory_mb=memory_mb or 0,
        pids_max=pids_max or 0,
        disk_mb=disk_mb or 0,
        gpu_count=gpus or 0,
    )


def make_spec(
    *,
    backend: str = "container",
    image: str = "",
    cpu: float | None = None,
    memory_mb: int | None = None,
    pids_max: int | None = None,
    disk_mb: int | None = None,
    gpus: int | None = None,
    ttl_s: int | None = None,
    idle_timeout_s: int | None = None,
    labels: Mapping[str, str] | None = None,
    task_id: str = "",
    env: Mapping[str, str] | None = None,
    network: NetworkPolicy | None = None,
    workdir: str = "",
    best_effort: bool = False,
    node_selector: Mapping[str, str] | None = None,
    toolkits: Iterable[str] = (),
) -> types_pb2.SandboxSpec:
    """The protobuf spec for keyword options (shared by create and create_many)."""
    if backend not in _BACKENDS:
        raise InvalidArgument(
            f"backend must be one of {sorted(_BACKENDS)}, not {backend!r}", reason="INVALID_BACKEND"
        )
    if cpu is not None and cpu <= 0:
        raise InvalidArgument(f"cpu must be > 0, not {cpu}", reason="INVALID_RESOURCES")
    spec = types_pb2.SandboxSpec(
        backend=_BACKENDS[backend],
        image=image,
        resources=_resources(cpu, memory_mb, pids_max, disk_mb, gpus),
        ttl_s=ttl_s or 0,
        idle_timeout_s=idle_timeout_s or 0,
        labels=dict(labels or {}),
        task_id=task_id,
        env=dict(env or {}),
        workdir=workdir,
        qos=types_pb2.QOS_CLASS_BEST_EFFORT
        if best_effort
        else types_pb2.QOS_CLASS_LATENCY_SENSITIVE,
        node_selector=dict(node_selector or {}),
        toolkits=list(toolkits),
    )
    if network is not None:
        spec.network.CopyFrom(network.to_pb())
    return spec


class AsyncClient:
    """Connection to a dsec cluster (its API servers).

    Args:
        target: API server address (``host:port`` or ``unix:/path``); default
            ``DSEC_TARGET`` or the local cluster from ``dsec up``.
        token: bearer token; default ``DSEC_TOKEN`` or ``$DSEC_HOME/token``.
        timeout: default deadline of unary calls in seconds.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        conn = resolve(target, token)
        self.target = conn.target
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {conn.token}"),)
        self._channel = grpc.aio.insecure_channel(conn.target, options=CHANNEL_OPTIONS)
        self._sandboxes = apiserver_pb2_grpc.SandboxServiceStub(self._channel)
        self._exec = apiserver_pb2_grpc.ExecServiceStub(self._channel)
        self._files = apiserver_pb2_grpc.FileServiceStub(self._channel)
        self._projects = apiserver_pb2_grpc.ProjectServiceStub(self._channel)
        self._environments = apiserver_pb2_grpc.EnvironmentServiceStub(self._channel)
        self._functions = apiserver_pb2_grpc.FunctionServiceStub(self._channel)
        # fncall's jobs share one tagged stream (opened at the first job, reopened after a
        # failure); an API server without StreamFunctions gets unary calls instead.
        self._job_stream = TaggedStream(
            lambda requests: self._functions.StreamFunctions(requests, metadata=self._metadata),
            idle_timeout_s=STREAM_IDLE_TIMEOUT_S,
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._job_stream.aclose()
        await self._channel.close()

    def _t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    # -------------------------------------------------------------- fncall

    async def fncall(
        self,
        *,
        language: str = "",
        code: str = "",
        stdin: bytes | str = b"",
        time_limit_s: float = 0.0,
        cpu_limit_s: float = 0.0,
        memory_mb: int = 0,
        max_output_bytes: int = 0,
        files: Mapping[str, bytes | str] | None = None,
        command: Iterable[str] = (),
        environment: str = "",
        job_id: str = "",
        timeout: float | None = None,
    ) -> FunctionResult:
        """Runs one short job in a warm pool (backend ``fncall``) and returns its verdict.

        No sandbox is created: the job runs in a pre-created container of the
        environment's pool (Python jobs fork from an interpreter with numpy already
        imported), then the container is cleaned for the next job. A program that
        fails is a result (``verdict`` RUNTIME_ERROR, TIME_LIMIT, ...), not an exception;
        a bad job raises :class:`~libdsec.errors.InvalidArgument`::

            r = await dsec.fncall(language="python", code="print(input()[::-1])", stdin="abc")
            assert r.verdict == "OK" and r.text == "cba\n"
        """
        job = FunctionJob(
            language=language,
            code=code,
            stdin=stdin,
            time_limit_s=time_limit_s,
            cpu_limit_s=cpu_limit_s,
            memory_mb=memory_mb,
            max_output_bytes=max_output_bytes,
            files=dict(files or {}),
            command=list(command),
            environment=environment,
            job_id=job_id,
        )
        deadline = timeout if timeout is not None else (time_limit_s or 10.0) + 180.0
        pb = job.to_pb()
        msg = await self._job_stream.call_if_supported(
            apiserver_pb2.StreamFunctionsRequest(job=pb), timeout=deadline
        )
        if msg is not None:
            return FunctionResult.from_pb(msg.result)
        # an older API server: one call per job
        resp = await _unary(
            self._functions.RunFunction(
                apiserver_pb2.RunFunctionRequest(job=pb),
                metadata=self._metadata,
                timeout=deadline,
            )
        )
        return FunctionResult.from_pb(resp.result)

    async def fncall_many(
        self,
        jobs: Iterable[FunctionJob | Mapping[str, Any]],
        *,
        parallelism: int = 0,
    ) -> AsyncIterator[FunctionResult]:
        """Runs many jobs in one call; yields each result as it finishes (``index`` gives
        the job's position). Jobs with the same compiled program (e.g. one C++ solution
        against many test cases) compile it once::

            jobs = [FunctionJob(language="cpp", code=src, stdin=t) for t in tests]
            async for r in dsec.fncall_many(jobs):
                print(r.index, r.verdict)
        """
        req = apiserver_pb2.RunFunctionsRequest(parallelism=parallelism)
        for j in jobs:
            job = j if isinstance(j, FunctionJob) else FunctionJob(**j)
            req.jobs.append(job.to_pb())
        call = self._functions.RunFunctions(req, metadata=self._metadata)
        async for msg in _stream(call):
            if msg.WhichOneof("event") == "result":
                yield FunctionResult.from_pb(msg.result)

    # ------------------------------------------------------------ identity

    async def whoami(self, *, timeout: float | None = None) -> Principal:
        """Who this client's token is (and which project it acts in)."""
        resp = await _unary(
            self._projects.WhoAmI(
                apiserver_pb2.WhoAmIRequest(), metadata=self._metadata, timeout=self._t(timeout)
            )
        )
        return Principal.from_pb(resp.principal)

    # ----------------------------------------------------------- sandboxes

    async def create(
        self,
        *,
        idempotency_key: str = "",
        wait: bool = True,
        timeout: float | None = 180.0,
        **options: Any,
    ) -> AsyncSandbox:
        """Creates a sandbox and (by default) waits until it accepts commands.

        Options: ``backend`` ("container", "fncall", "microvm", "vm"),
        ``image`` (environment name, e.g. "bookworm", "busybox",
        "docker:python:3.11"), ``cpu`` (cores), ``memory_mb``, ``pids_max``,
        ``disk_mb``, ``gpus``, ``ttl_s``, ``idle_timeout_s``, ``labels``,
        ``task_id``, ``env``, ``network`` (:class:`NetworkPolicy`),
        ``workdir``, ``best_effort``, ``node_selector``, ``toolkits``.

        ``idempotency_key``: a retried create with the same key returns the
        first attempt's sandbox instead of making another.
        """
        spec = make_spec(**options)
        req = apiserver_pb2.CreateSandboxRequest(
            spec=spec, idempotency_key=idempotency_key, wait_ready=wait
        )
        resp = await _unary(
            self._sandboxes.CreateSandbox(req, metadata=self._metadata, timeout=timeout)
        )
        info = SandboxInfo.from_pb(resp.sandbox)
        if info.terminated:
            from libdsec.errors import SandboxTerminated

            raise SandboxTerminated(
                f"sandbox {info.id} failed to start: {info.termination_reason}: {info.termination_message}",
                metadata={
                    "sandbox_id": info.id,
                    "termination_reason": info.termination_reason or "",
                },
            )
        return AsyncSandbox(self, info)

    async def create_many(
        self,
        count: int | None = None,
        *,
        specs: list[dict[str, Any]] | None = None,
        wait: bool = True,
        timeout: float | None = 600.0,
        **options: Any,
    ) -> list[AsyncSandbox | DSecError]:
        """Creates many sandboxes in one call: ``count`` alike, or one per dict in ``specs``.

        Returns, in order, a sandbox or the error that item got (nothing is
        raised for per-item failures).
        """
        req = apiserver_pb2.CreateSandboxesRequest()
        if specs is None:
            if not count or count < 1:
                raise InvalidArgument("give count >= 1 or specs")
            key = options.pop("idempotency_key", "")
            if key:
                raise InvalidArgument("idempotency keys go in specs=[...], one per item")
            template = apiserver_pb2.CreateSandboxRequest(
                spec=make_spec(**options), wait_ready=wait
            )
            add = req.items.add
            for _ in range(count):
                add().CopyFrom(template)
        else:
            for s in specs:
                s = dict(s)
                key = s.pop("idempotency_key", "")
                req.items.add(spec=make_spec(**s), idempotency_key=key, wait_ready=wait)
        resp = await _unary(
            self._sandboxes.CreateSandboxes(req, metadata=self._metadata, timeout=timeout)
        )
        out: list[AsyncSandbox | DSecError] = []
        for r in resp.results:
            if r.error_code:
                out.append(
                    status_for(r.error_code, r.error_reason, r.error_message, r.error_metadata)
                )
            else:
                out.append(AsyncSandbox(self, SandboxInfo.from_pb(r.sandbox)))
        return out

    async def get(self, sandbox_id: str, *, timeout: float | None = None) -> AsyncSandbox:
        """Reattaches to an existing sandbox (e.g. from another process)."""
        return AsyncSandbox(self, await self._info(sandbox_id, timeout))

    async def _info(self, sandbox_id: str, timeout: float | None = None) -> SandboxInfo:
        resp = await _unary(
            self._sandboxes.GetSandbox(
                apiserver_pb2.GetSandboxRequest(sandbox_id=sandbox_id),
                metadata=self._metadata,
                timeout=self._t(timeout),
            )
        )
        return SandboxInfo.from_pb(resp.sandbox)

    async def list(
        self,
        *,
        task_id: str = "",
        labels: Mapping[str, str] | None = None,
        states: Iterable[str] = (),
        include_subprojects: bool = False,
        timeout: float | None = None,
    ) -> list[SandboxInfo]:
        """Sandboxes of this project (all pages), filtered by task id, labels and states."""
        out: list[SandboxInfo] = []
        token = ""
        state_values = [types_pb2.SandboxState.Value("SANDBOX_STATE_" + s.upper()) for s in states]
        while True:
            req = apiserver_pb2.ListSandboxesRequest(
                task_id=task_id,
                label_selector=dict(labels or {}),
                states=state_values,
                page_token=token,
                include_subprojects=include_subprojects,
            )
            resp = await _unary(
                self._sandboxes.ListSandboxes(
                    req, metadata=self._metadata, timeout=self._t(timeout)
                )
            )
            out.extend(SandboxInfo.from_pb(s) for s in resp.sandboxes)
            token = resp.next_page_token
            if not token:
                return out

    async def stop_all(
        self,
        *,
        task_id: str = "",
        labels: Mapping[str, str] | None = None,
        timeout: float | None = 120.0,
    ) -> builtins.list[str]:
        """Stops every sandbox of a task and/or with labels, across all edges; returns their ids."""
        resp = await _unary(
            self._sandboxes.StopSandboxes(
                apiserver_pb2.StopSandboxesRequest(
                    task_id=task_id, label_selector=dict(labels or {})
                ),
                metadata=self._metadata,
                timeout=timeout,
            )
        )
        return list(resp.sandbox_ids)

    # -------------------------------------------------------- environments

    async def _env_call(self, method: str, request: Any, timeout: float | None) -> Any:
        return await _unary(
            getattr(self._environments, method)(
                request, metadata=self._metadata, timeout=self._t(timeout)
            )
        )

    async def list_environments(
        self, prefix: str = "", *, timeout: float | None = None
    ) -> builtins.list[Environment]:
        """Environments of the layer store (cluster-wide), optionally by name prefix."""
        resp = await self._env_call(
            "ListEnvironments", apiserver_pb2.ListEnvironmentsRequest(prefix=prefix), timeout
        )
        return [Environment.from_pb(e) for e in resp.environments]

    async def get_environment(self, name: str, *, timeout: float | None = None) -> Environment:
        """One environment with its layers (raises ImageNotFound)."""
        resp = await self._env_call(
            "GetEnvironment", apiserver_pb2.GetEnvironmentRequest(name=name), timeout
        )
        return Environment.from_pb(resp.environment)

    async def list_layers(self, *, timeout: float | None = None) -> builtins.list[Layer]:
        resp = await self._env_call("ListLayers", apiserver_pb2.ListLayersRequest(), timeout)
        return [Layer.from_pb(x) for x in resp.layers]

    async def import_image(
        self,
        source: str,
        name: str = "",
        *,
        kind: str = "",
        base: str = "",
        all_root: bool = False,
        timeout: float | None = 3600.0,
    ) -> Environment:
        """Imports into the layer store and registers an environment (idempotent).

        ``source``: ``"docker:<repo>:<tag>"`` (an image of a node's Docker engine, every layer;
        ``name`` defaults to ``docker/<repo>:<tag>``), ``"dir:/path"`` or ``"tar:/path.tar"``
        (one layer of ``kind``: base, workspace or toolkit; with ``base``, on top of that
        environment)::

            env = await dsec.import_image("docker:python:3.11")
            ws = await dsec.import_image("dir:/data/swe-123", "swe-123:v1", base=env.name)
            sb = await dsec.create(image=ws.name)
        """
        req = apiserver_pb2.ImportImageRequest(
            source=source,
            name=name,
            kind=types_pb2.LayerKind.Value("LAYER_KIND_" + kind.upper()) if kind else 0,  # type: ignore[arg-type]
            base=base,
            all_root=all_root,
        )
        resp = await self._env_call("ImportImage", req, timeout)
        return Environment.from_pb(resp.environment)

    async def compose_environment(
        self,
        name: str,
        *,
        base: str,
        workspace: str = "",
        toolkits: Iterable[str] = (),
        timeout: float | None = None,
    ) -> Environment:
        """Registers base + workspace + toolkits (existing environments) as ``name``; no layer
        is rebuilt, so upgrading one toolkit is composing again with the new one."""
        req = apiserver_pb2.ComposeEnvironmentRequest(
            name=name, base=base, workspace=workspace, toolkits=list(toolkits)
        )
        resp = await self._env_call("ComposeEnvironment", req, timeout)
        return Environment.from_pb(resp.environment)

    async def delete_environment(self, name: str, *, timeout: float | None = None) -> bool:
        """Forgets a name (ADMIN); unreferenced layers are garbage-collected later."""
        resp = await self._env_call(
            "DeleteEnvironment", apiserver_pb2.DeleteEnvironmentRequest(name=name), timeout
        )
        return bool(resp.deleted)

    # ---------------------------------------------------- projects & tokens

    async def _project_call(self, method: str, request: Any, timeout: float | None) -> Any:
        return await _unary(
            getattr(self._projects, method)(
                request, metadata=self._metadata, timeout=self._t(timeout)
            )
        )

    async def create_project(
        self,
        name: str,
        *,
        parent: str = "",
        quota: Quota | None = None,
        timeout: float | None = None,
    ) -> Project:
        """Creates a subproject (of ``parent``, default this token's project) with a delegated quota."""
        resp = await self._project_call(
            "CreateProject",
            iam_pb2.CreateProjectRequest(
                parent_id=parent, name=name, quota=(quota or Quota()).to_pb()
            ),
            timeout,
        )
        return Project.from_pb(resp.project)

    async def get_project(self, project_id: str = "", *, timeout: float | None = None) -> Project:
        resp = await self._project_call(
            "GetProject", iam_pb2.GetProjectRequest(project_id=project_id), timeout
        )
        return Project.from_pb(resp.project)

    async def list_projects(
        self, parent: str = "", *, recursive: bool = False, timeout: float | None = None
    ) -> builtins.list[Project]:
        resp = await self._project_call(
            "ListProjects",
            iam_pb2.ListProjectsRequest(parent_id=parent, recursive=recursive),
            timeout,
        )
        return [Project.from_pb(p) for p in resp.projects]

    async def set_quota(
        self, project_id: str, quota: Quota, *, timeout: float | None = None
    ) -> Project:
        resp = await self._project_call(
            "SetQuota", iam_pb2.SetQuotaRequest(project_id=project_id, quota=quota.to_pb()), timeout
        )
        return Project.from_pb(resp.project)

    async def delete_project(self, project_id: str, *, timeout: float | None = None) -> None:
        await self._project_call(
            "DeleteProject", iam_pb2.DeleteProjectRequest(project_id=project_id), timeout
        )

    async def create_token(
        self,
        name: str,
        *,
        project: str = "",
        agent: bool = False,
        admin: bool = False,
        ttl_s: int = 0,
        timeout: float | None = None,
    ) -> NewToken:
        """A token for a human or an agent (same API); the secret is returned once."""
        req = iam_pb2.CreateTokenRequest(
            project_id=project,
            name=name,
            kind=iam_pb2.PRINCIPAL_KIND_AGENT if agent else iam_pb2.PRINCIPAL_KIND_HUMAN,
            role=iam_pb2.ROLE_ADMIN if admin else iam_pb2.ROLE_MEMBER,
            ttl_s=ttl_s,
        )
        resp = await self._project_call("CreateToken", req, timeout)
        return NewToken(TokenInfo.from_pb(resp.info), resp.token)

    async def list_tokens(
        self, project: str = "", *, include_revoked: bool = False, timeout: float | None = None
    ) -> builtins.list[TokenInfo]:
        resp = await self._project_call(
            "ListTokens",
            iam_pb2.ListTokensRequest(project_id=project, include_revoked=include_revoked),
            timeout,
        )
        return [TokenInfo.from_pb(t) for t in resp.tokens]

    async def revoke_token(self, token_id: str, *, timeout: float | None = None) -> None:
        await self._project_call(
            "RevokeToken", iam_pb2.RevokeTokenRequest(token_id=token_id), timeout
        )


def _exec_request(
    sandbox_id: str,
    cmd: str | list[str],
    *,
    timeout_s: float | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    stdin: bytes | str | None,
    pty: bool,
    max_output_bytes: int | None,
    session_id: str = "",
    background: bool = False,
    stdin_open: bool = False,
    trusted: bool = False,
) -> types_pb2.ExecRequest:
    req = types_pb2.ExecRequest(
        sandbox_id=sandbox_id,
        cwd=cwd or "",
        env=dict(env or {}),
        timeout_s=timeout_s or 0.0,
        stdin=stdin.encode() if isinstance(stdin, str) else (stdin or b""),
        stdin_open=stdin_open,
        pty=pty,
        max_output_bytes=max_output_bytes or 0,
        session_id=session_id,
        background=background,
        trusted=trusted,
    )
    if isinstance(cmd, str):
        req.command = cmd
    else:
        req.argv.extend(cmd)
    return req


class AsyncProcess:
    """A background command: reattach, wait, signal at any later time."""

    def __init__(self, sandbox: AsyncSandbox, exec_id: str, pid: int) -> None:
        self.sandbox = sandbox
        self.exec_id = exec_id
        self.pid = pid

    async def wait(self, timeout_s: float | None = None) -> ExecInfo:
        """Waits for exit (or ``timeout_s``; then ``.running`` is still True)."""
        c = self.sandbox.client
        resp = await _unary(
            c._exec.WaitExec(
                types_pb2.WaitExecRequest(
                    sandbox_id=self.sandbox.id, exec_id=self.exec_id, timeout_s=timeout_s or 0
                ),
                metadata=c._metadata,
                timeout=(timeout_s or 86400) + 30,
            )
        )
        return ExecInfo.from_pb(resp.info)

    async def kill(self, signal: int = 9) -> bool:
        """Signals the command's whole process group; False if it had already exited."""
        c = self.sandbox.client
        resp = await _unary(
            c._exec.SignalExec(
                types_pb2.SignalExecRequest(
                    sandbox_id=self.sandbox.id, exec_id=self.exec_id, signal=signal
                ),
                metadata=c._metadata,
                timeout=c.timeout,
            )
        )
        return bool(resp.delivered)

    async def attach(
        self, *, stdout_offset: int = 0, stderr_offset: int = 0
    ) -> AsyncIterator[ExecEvent]:
        """Output from the given offsets (what is still held), then live, then the exit."""
        c = self.sandbox.client
        call = c._exec.AttachExec(
            types_pb2.AttachExecRequest(
                sandbox_id=self.sandbox.id,
                exec_id=self.exec_id,
                stdout_offset=stdout_offset,
                stderr_offset=stderr_offset,
            ),
            metadata=c._metadata,
        )
        async for ev in _stream(call):
            e = event_from_pb(ev)
            if e is not None:
                yield e


class AsyncSession:
    """A persistent shell: cwd, exported env and started services survive between runs."""

    def __init__(self, sandbox: AsyncSandbox, session_id: str) -> None:
        self.sandbox = sandbox
        self.session_id = session_id

    async def run(self, cmd: str, **kw: Any) -> ExecResult:
        return await self.sandbox.run(cmd, session=self.session_id, **kw)

    def stream(self, cmd: str, **kw: Any) -> AsyncIterator[ExecEvent]:
        return self.sandbox.stream(cmd, session=self.session_id, **kw)

    async def close(self) -> None:
        c = self.sandbox.client
        await _unary(
            c._exec.CloseSession(
                types_pb2.CloseSessionRequest(
                    sandbox_id=self.sandbox.id, session_id=self.session_id
                ),
                metadata=c._metadata,
                timeout=c.timeout,
            )
        )

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncFiles:
    """Filesystem operations inside a sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self.sandbox = sandbox

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        c = self.sandbox.client
        return _unary(
            getattr(c._files, method)(request, metadata=c._metadata, timeout=c._t(timeout))
        )

    async def read(self, path: str, *, offset: int = 0, length: int = 0) -> bytes:
        """A whole small file (or a slice); use :meth:`download` for big ones."""
        if length == 0 and offset == 0:
            chunks = [chunk async for chunk in self.iter_download(path)]
            return b"".join(chunks)
        resp = await self._call(
            "ReadFile",
            types_pb2.ReadFileRequest(
                sandbox_id=self.sandbox.id, path=path, offset=offset, length=length
            ),
        )
        return bytes(resp.data)

    async def write(
        self,
        path: str,
        data: bytes | str,
        *,
        mode: int = 0,
        append: bool = False,
        make_parents: bool = True,
    ) -> FileInfo:
        raw = data.encode() if isinstance(data, str) else data
        if len(raw) > 4 * 1024 * 1024:
            return await self.upload(raw, path, mode=mode, make_parents=make_parents)
        resp = await self._call(
            "WriteFile",
            types_pb2.WriteFileRequest(
                sandbox_id=self.sandbox.id,
                path=path,
                data=raw,
                mode=mode,
                append=append,
                make_parents=make_parents,
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def list(self, path: str, *, max_entries: int = 0) -> list[FileInfo]:
        resp = await self._call(
            "ListDir",
            types_pb2.ListDirRequest(
                sandbox_id=self.sandbox.id, path=path, max_entries=max_entries
            ),
        )
        return [FileInfo.from_pb(e) for e in resp.entries]

    async def stat(self, path: str, *, follow_symlinks: bool = True) -> FileInfo:
        resp = await self._call(
            "StatPath",
            types_pb2.StatPathRequest(
                sandbox_id=self.sandbox.id, path=path, follow_symlinks=follow_symlinks
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def exists(self, path: str) -> bool:
        from libdsec.errors import NotFound

        try:
            await self.stat(path, follow_symlinks=False)
            return True
        except NotFound:
            return False

    async def mkdir(self, path: str, *, mode: int = 0, parents: bool = True) -> FileInfo:
        resp = await self._call(
            "MakeDir",
            types_pb2.MakeDirRequest(
                sandbox_id=self.sandbox.id, path=path, mode=mode, parents=parents
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._call(
            "RemovePath",
            types_pb2.RemovePathRequest(sandbox_id=self.sandbox.id, path=path, recursive=recursive),
        )

    async def move(self, source: str, destination: str, *, overwrite: bool = False) -> FileInfo:
        resp = await self._call(
            "MovePath",
            types_pb2.MovePathRequest(
                sandbox_id=self.sandbox.id,
                source=source,
                destination=destination,
                overwrite=overwrite,
            ),
        )
        return FileInfo.from_pb(resp.info)

    async def chmod(self, path: str, mode: int) -> FileInfo:
        resp = await self._call(
            "ChmodPath",
            types_pb2.ChmodPathRequest(sandbox_id=self.sandbox.id, path=path, mode=mode),
        )
        return FileInfo.from_pb(resp.info)

    async def upload(
        self,
        source: bytes | str | os.PathLike[str] | IO[bytes],
        path: str,
        *,
        mode: int = 0,
        make_parents: bool = True,
        chunk_bytes: int = CHUNK,
    ) -> FileInfo:
        """Streams ``source`` (bytes, a local path, or a binary file object) into ``path``.

        The file appears atomically when the whole stream has arrived; a
        failed upload leaves nothing behind. Memory use is one chunk.
        """
        size = 0
        fh: IO[bytes] | None = None
        data: bytes | None = None
        if isinstance(source, bytes):
            data, size = source, len(source)
        elif isinstance(source, (str, os.PathLike)):
            fh = open(source, "rb")
            size = os.fstat(fh.fileno()).st_size
        else:
            fh = source

        async def parts() -> AsyncIterator[types_pb2.UploadFileRequest]:
            yield types_pb2.UploadFileRequest(
                header=types_pb2.UploadHeader(
                    sandbox_id=self.sandbox.id,
                    path=path,
                    mode=mode,
                    make_parents=make_parents,
                    size_bytes=size,
                )
            )
            if data is not None:
                for i in range(0, len(data), chunk_bytes):
                    yield types_pb2.UploadFileRequest(chunk=data[i : i + chunk_bytes])
            else:
                assert fh is not None
                while True:
                    block = await asyncio.to_thread(fh.read, chunk_bytes)
                    if not block:
                        break
                    yield types_pb2.UploadFileRequest(chunk=block)

        c = self.sandbox.client
        try:
            resp = await _unary(c._files.UploadFile(parts(), metadata=c._metadata, timeout=3600))
        finally:
            if (
                fh is not None
                and not isinstance(source, (bytes,))
                and isinstance(source, (str, os.PathLike))
            ):
                fh.close()
        return FileInfo.from_pb(resp.info)

    async def iter_download(
        self, path: str, *, offset: int = 0, chunk_bytes: int = CHUNK
    ) -> AsyncIterator[bytes]:
        """The file's bytes in chunks, streamed (never whole in memory)."""
        c = self.sandbox.client
        call = c._files.DownloadFile(
            types_pb2.DownloadFileRequest(
                sandbox_id=self.sandbox.id, path=path, offset=offset, chunk_bytes=chunk_bytes
            ),
            metadata=c._metadata,
        )
        async for msg in _stream(call):
            if msg.chunk:
                yield bytes(msg.chunk)

    async def download(self, path: str, destination: str | os.PathLike[str] | IO[bytes]) -> int:
        """Streams ``path`` into a local file (path or binary file object); returns bytes written."""
        total = 0
        if isinstance(destination, (str, os.PathLike)):
            dest = Path(destination)
            tmp = dest.with_name(dest.name + ".part")
            with open(tmp, "wb") as fh:
                async for chunk in self.iter_download(path):
                    await asyncio.to_thread(fh.write, chunk)
                    total += len(chunk)
            os.replace(tmp, dest)
            return total
        async for chunk in self.iter_download(path):
            destination.write(chunk)
            total += len(chunk)
        return total


class AsyncSandbox:
    """A sandbox: run commands, use files, stop it. An async context manager that stops on exit."""

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self.client = client
        self.info = info
        self.files = AsyncFiles(self)

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.state}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.stop()
        except DSecError:
            pass  # already gone: nothing to clean up

    async def refresh(self) -> SandboxInfo:
        self.info = await self.client._info(self.id)
        return self.info

    async def run(
        self,
        cmd: str | list[str],
        *,
        timeout_s: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        pty: bool = False,
        max_output_bytes: int | None = None,
        session: str = "",
        trusted: bool = False,
    ) -> ExecResult:
        """Runs a command to completion. A string runs under ``/bin/sh -c``; a list is an argv.

        On timeout the command's whole process group is killed and the
        result has ``timed_out=True`` (no exception). Output beyond
        ``max_output_bytes`` per stream keeps its head and tail
        (``truncated=True``).

        ``trusted=True`` is for the evaluation step: the command runs from the
        image's read-only layers plus the sandbox's workspace (its workdir, or
        ``/work``), in a sibling container the agent's processes cannot see, so a
        ``/bin/bash`` or test runner the agent replaced is not used::

            r = await sb.run("cd /work && python3 -m pytest -q", trusted=True)
        """
        c = self.client
        req = _exec_request(
            self.id,
            cmd,
            timeout_s=timeout_s,
            cwd=cwd,
            env=env,
            stdin=stdin,
            pty=pty,
            max_output_bytes=max_output_bytes,
            session_id=session,
            trusted=trusted,
        )
        deadline = (timeout_s or 600.0) + 60.0
        return ExecResult.from_pb(
            await _unary(c._exec.Exec(req, metadata=c._metadata, timeout=deadline))
        )

    async def stream(
        self,
        cmd: str | list[str],
        *,
        timeout_s: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        pty: bool = False,
        max_output_bytes: int | None = None,
        session: str = "",
        trusted: bool = False,
    ) -> AsyncIterator[ExecEvent]:
        """Yields :class:`Started`, then :class:`Output` events as produced, then one :class:`Exited`.

        Keepalives flow underneath; if the stream stalls or the sandbox dies
        an error is raised (never a hang).
        """
        c = self.client
        req = _exec_request(
            self.id,
            cmd,
            timeout_s=timeout_s,
            cwd=cwd,
            env=env,
            stdin=stdin,
            pty=pty,
            max_output_bytes=max_output_bytes,
            session_id=session,
            trusted=trusted,
        )
        req.keepalive_interval_ms = 5000
        exited = False
        async for ev in _stream(c._exec.ExecStream(req, metadata=c._metadata)):
            e = event_from_pb(ev)
            if e is not None:
                exited = exited or isinstance(e, Exited)
                yield e
        if not exited:
            raise Unavailable(
                "the stream ended without an exit status", reason="STREAM_ENDED_EARLY"
            )

    async def start(
        self,
        cmd: str | list[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout_s: float | None = None,
        max_output_bytes: int | None = None,
        session: str = "",
    ) -> AsyncProcess:
        """Starts a background command; returns at once with a handle to wait on, kill or reattach."""
        c = self.client
        req = _exec_request(
            self.id,
            cmd,
            timeout_s=timeout_s,
            cwd=cwd,
            env=env,
            stdin=stdin,
            pty=False,
            max_output_bytes=max_output_bytes,
            session_id=session,
            background=True,
        )
        async for ev in _stream(c._exec.ExecStream(req, metadata=c._metadata)):
            if ev.WhichOneof("event") == "started":
                return AsyncProcess(self, ev.started.exec_id, ev.started.pid)
        raise Unavailable("background start returned no exec id", reason="STREAM_ENDED_EARLY")

    async def process(self, exec_id: str) -> AsyncProcess:
        """A handle to a background command started earlier (e.g. by another process)."""
        return AsyncProcess(self, exec_id, 0)

    async def processes(self) -> list[ExecInfo]:
        c = self.client
        resp = await _unary(
            c._exec.ListExecs(
                types_pb2.ListExecsRequest(sandbox_id=self.id),
                metadata=c._metadata,
                timeout=c.timeout,
            )
        )
        return [ExecInfo.from_pb(i) for i in resp.execs]

    async def session(
        self, *, shell: str = "", cwd: str = "", env: Mapping[str, str] | None = None
    ) -> AsyncSession:
        """Opens a persistent shell session (several may be open at once)."""
        c = self.client
        resp = await _unary(
            c._exec.CreateSession(
                types_pb2.CreateSessionRequest(
                    sandbox_id=self.id, shell=shell, cwd=cwd, env=dict(env or {})
                ),
                metadata=c._metadata,
                timeout=c.timeout,
            )
        )
        return AsyncSession(self, resp.session.session_id)

    async def http(
        self,
        port: int,
        path: str = "/",
        *,
        method: str = "GET",
        headers: Mapping[str, str] | None = None,
        body: bytes | str = b"",
        timeout_s: float = 30.0,
    ) -> HttpResponse:
        """An HTTP request to a service listening on ``port`` inside the sandbox."""
        c = self.client
        req = types_pb2.HttpRequest(
            sandbox_id=self.id,
            port=port,
            method=method,
            path=path,
            headers=[types_pb2.HttpHeader(name=k, value=v) for k, v in (headers or {}).items()],
            body=body.encode() if isinstance(body, str) else body,
            timeout_s=timeout_s,
        )
        return HttpResponse.from_pb(
            await _unary(c._exec.SendHttp(req, metadata=c._metadata, timeout=timeout_s + 30))
        )

    async def _lifecycle(self, method: str, request: Any, timeout: float) -> SandboxInfo:
        c = self.client
        resp = await _unary(
            getattr(c._sandboxes, method)(request, metadata=c._metadata, timeout=timeout)
        )
        self.info = SandboxInfo.from_pb(resp.sandbox)
        return self.info

    async def stop(self, *, grace_s: float = 2.0) -> SandboxInfo:
        """Stops the sandbox (terminal state STOPPED); idempotent."""
        return await self._lifecycle(
            "StopSandbox",
            apiserver_pb2.StopSandboxRequest(sandbox_id=self.id, grace_s=grace_s),
            60 + grace_s,
        )

    async def pause(self) -> SandboxInfo:
        return await self._lifecycle(
            "PauseSandbox", apiserver_pb2.PauseSandboxRequest(sandbox_id=self.id), 120
        )

    async def resume(self) -> SandboxInfo:
        return await self._lifecycle(
            "ResumeSandbox", apiserver_pb2.ResumeSandboxRequest(sandbox_id=self.id), 120
        )

    async def pack_diff(
        self,
        name: str,
        *,
        exclude: Iterable[str] = (),
        default_excludes: bool = True,
        timeout: float = 1800.0,
    ) -> Environment:
        """Checkpoints this sandbox's writable layer as environment ``name``: its layers plus
        the diff. New sandboxes start from it (``create(image=name)``), and packing one of
        those again chains diffs. Build residue is left out (``/tmp``, ``/var/tmp``, caches,
        shell history, ...; ``exclude`` adds absolute path globs, ``default_excludes=False``
        keeps everything). A running sandbox is frozen only while its changes are copied::

            env = await sb.pack_diff("my-env:v2")
        """
        c = self.client
        resp = await _unary(
            c._sandboxes.PackDiff(
                apiserver_pb2.PackDiffRequest(
                    sandbox_id=self.id,
                    name=name,
                    exclude=list(exclude),
                    no_default_excludes=not default_excludes,
                ),
                metadata=c._metadata,
                timeout=timeout,
            )
        )
        return Environment.from_pb(resp.environment)

    async def update_network_policy(
        self, policy: NetworkPolicy, *, timeout: float | None = None
    ) -> SandboxInfo:
        """Replaces the egress policy while the sandbox runs (e.g. per task stage); the next
        connection sees it. A malformed rule raises :class:`InvalidArgument` naming it::

            await sb.update_network_policy(NetworkPolicy(allow=["pypi.org:443"]))
        """
        c = self.client
        resp = await _unary(
            c._sandboxes.UpdateNetworkPolicy(
                apiserver_pb2.UpdateNetworkPolicyRequest(sandbox_id=self.id, policy=policy.to_pb()),
                metadata=c._metadata,
                timeout=timeout or 30.0,
            )
        )
        self.info = SandboxInfo.from_pb(resp.sandbox)
        return self.info

    async def modified_files(self, *, timeout: float | None = None) -> list[ModifiedFile]:
        """Files of the image's read-only layers this sandbox modified or deleted (from its
        writable layer); new files are not listed. For checking an agent's trajectory."""
        c = self.client
        resp = await _unary(
            c._sandboxes.GetModifiedFiles(
                apiserver_pb2.GetModifiedFilesRequest(sandbox_id=self.id),
                metadata=c._metadata,
                timeout=timeout or 60.0,
            )
        )
        return [ModifiedFile(f.path, f.deleted) for f in resp.files]

    async def delete(self) -> None:
        c = self.client
        await _unary(
            c._sandboxes.DeleteSandbox(
                apiserver_pb2.DeleteSandboxRequest(sandbox_id=self.id),
                metadata=c._metadata,
                timeout=60,
            )
        )


__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSession",
    "ExitStatus",
    "make_spec",
]

"""The asynchronous SDK: :class:`AsyncClient` (and, from here too, :class:`AsyncSandbox`).

    import asyncio
    from libdsec import AsyncClient

    async def main():
        async with AsyncClient() as dsec:              # the local cluster by default
            async with await dsec.create(image="bookworm") as sb:
                r = await sb.run("python3 -c 'print(6*7)'")
                print(r.exit_code, r.text)

    asyncio.run(main())

The synchronous :class:`libdsec.Client` wraps this one, so both behave the same.

The SDK by role: ``_transport.py`` (channel, token, call wrappers, stream stall timeouts),
this module (the client: sandboxes, environments, projects, tokens, fncall),
``_sandbox.py`` (:class:`AsyncSandbox`, :class:`AsyncProcess`, :class:`AsyncSession`),
``_files.py`` (:class:`AsyncFiles`), ``_display.py`` (:class:`AsyncDisplay`, a sandbox's screen).
"""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Unpack

from dsec.apiserver.v1 import apiserver_pb2
from dsec.iam.v1 import iam_pb2
from dsec.types.v1 import types_pb2
from libdsec._config import resolve
from libdsec._display import AsyncDisplay
from libdsec._files import CHUNK, AsyncDirWatch, AsyncFiles
from libdsec._oplog import ReplayReport, operation_log, replay
from libdsec._sandbox import AsyncProcess, AsyncSandbox, AsyncSession, sandbox_info
from libdsec._tagged import TaggedStream
from libdsec._transport import (
    CHANNEL_OPTIONS,
    DEFAULT_TIMEOUT_S,
    STREAM_IDLE_TIMEOUT_S,
    STREAM_KEEPALIVE_INTERVAL_S,
    Transport,
    retry_pauses,
)
from libdsec._watch import AsyncWatch
from libdsec.errors import (
    DSecError,
    InvalidArgument,
    SandboxTerminated,
    item_error,
)
from libdsec.options import (
    CreateOptions,
    SandboxOptions,
    make_spec,
    new_idempotency_key,
    split_key,
)
from libdsec.types import (
    Environment,
    ExitStatus,
    FunctionJob,
    FunctionResult,
    Layer,
    NewToken,
    Principal,
    Project,
    QueueSummary,
    Quota,
    SandboxInfo,
    TaskResult,
    TokenInfo,
)

#: The default deadline of a task-level operation: the API server gives each edge 600 s for
#: its share (thousands of sandboxes, a few at a time), and answers per edge before this.
TASK_TIMEOUT_S = 660.0


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
        self._rpc = rpc = Transport(conn.target, conn.token)
        # fncall's jobs share one tagged stream (opened at the first job, reopened after a
        # failure); an API server without StreamFunctions gets unary calls instead.
        self._job_stream = TaggedStream(
            lambda requests: rpc.functions.StreamFunctions(requests, metadata=rpc.metadata),
            idle_timeout_s=STREAM_IDLE_TIMEOUT_S,
        )
        self._watches: set[AsyncWatch] = set()

    @property
    def transport(self) -> Transport:
        """The channel, token and stubs this client calls through (what its sandboxes' handles
        use: :class:`~libdsec._transport.Link`)."""
        return self._rpc

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel; open watches end first (their iterations stop, no error)."""
        for w in list(self._watches):
            await w.aclose()
        await self._job_stream.aclose()
        await self._rpc.close()

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
        compile_time_limit_s: float = 0.0,
        fetch_files: Iterable[str] = (),
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

        ``compile_time_limit_s``: the compile step's wall clock (C, C++; 0 = 30 s; running
        out of it is a COMPILE_ERROR with ``r.compile.verdict == "TIME_LIMIT"``).
        ``fetch_files``: paths relative to the job directory to return after the run, in
        ``r.files`` (path -> bytes; regular files only, 32 MiB in all, whatever the verdict);
        the others in ``r.fetch_errors`` (path -> why)::

            r = await dsec.fncall(language="bash", code="echo 1 > out.txt", fetch_files=["out.txt"])
            assert r.files == {"out.txt": b"1\n"}
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
            compile_time_limit_s=compile_time_limit_s,
            fetch_files=list(fetch_files),
        )
        compile_s = compile_time_limit_s or 30.0  # the edge's default
        deadline = timeout if timeout is not None else (time_limit_s or 10.0) + compile_s + 180.0
        pb = job.to_pb()
        self._rpc.check_open()
        msg = await self._job_stream.call_if_supported(
            apiserver_pb2.StreamFunctionsRequest(job=pb), timeout=deadline
        )
        if msg is not None:
            return FunctionResult.from_pb(msg.result)
        # an older API server: one call per job
        resp = await self._rpc.unary(
            self._rpc.functions.RunFunction,
            apiserver_pb2.RunFunctionRequest(job=pb),
            timeout=deadline,
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
        async for msg in self._rpc.stream(self._rpc.functions.RunFunctions, req):
            if msg.WhichOneof("event") == "result":
                yield FunctionResult.from_pb(msg.result)

    # ------------------------------------------------------------ identity

    async def whoami(self, *, timeout: float | None = None) -> Principal:
        """Who this client's token is (and which project it acts in)."""
        resp = await self._rpc.unary(
            self._rpc.projects.WhoAmI, apiserver_pb2.WhoAmIRequest(), timeout=self._t(timeout)
        )
        return Principal.from_pb(resp.principal)

    # ----------------------------------------------------------- sandboxes

    async def create(
        self,
        *,
        wait: bool = True,
        timeout: float | None = 180.0,
        wait_s: float = 0.0,
        priority: int = 0,
        **options: Unpack[CreateOptions],
    ) -> AsyncSandbox:
        """Creates a sandbox and (by default) waits until it accepts commands.

        The options (:class:`~libdsec.options.CreateOptions`, typed keywords): ``backend``,
        ``image``, ``cpu``, ``memory_mb``, ``pids_max``, ``disk_mb``, ``gpus``, ``ttl_s``,
        ``idle_timeout_s``, ``labels``, ``task_id``, ``env``, ``network``, ``workdir``,
        ``best_effort``, ``node_selector``, ``toolkits``, and ``idempotency_key`` (a retried
        create with the same key returns the first attempt's sandbox instead of making
        another). ``wait=False`` returns once the sandbox is admitted (PENDING/STARTING)::

            async with await dsec.create(
                image="bookworm", cpu=1, memory_mb=1024, ttl_s=3600, task_id="swe-123"
            ) as sb:
                print(sb.id, sb.info.state)     # sb-edge0-..., RUNNING

        A sandbox that ended while starting raises
        :class:`~libdsec.errors.SandboxTerminated` with its reason.

        Without an ``idempotency_key`` the SDK makes one up for this call, so the create is
        retried like any idempotent call while the API server (or a service behind it) is
        unavailable, until ``timeout``: one sandbox, even if the first attempt's answer was
        lost.

        ``wait_s`` > 0: when the cluster (or the project's quota) has no room now, the create
        waits in the queue, in fair share with other projects and tasks, up to ``wait_s``
        seconds, and raises :class:`~libdsec.errors.QueueTimeout` if it was never placed
        (``timeout`` then counts from the end of that wait). ``priority`` orders the queued
        creates of one project (higher first). A create no edge could ever hold is refused at
        once (:class:`~libdsec.errors.ExceedsEveryEdge`)::

            sb = await dsec.create(image="busybox", cpu=1, wait_s=600, task_id="swe-123")
        """
        key, sandbox_options = split_key(options)
        req = apiserver_pb2.CreateSandboxRequest(
            spec=make_spec(**sandbox_options),
            idempotency_key=key,
            wait_ready=wait,
            wait_s=wait_s,
            priority=priority,
        )
        resp = await self._rpc.unary(
            self._rpc.sandboxes.CreateSandbox, req, timeout=_queue_timeout(timeout, wait_s)
        )
        info = SandboxInfo.from_pb(resp.sandbox)
        if info.terminated:
            raise SandboxTerminated(
                f"sandbox {info.id} failed to start: {info.termination_reason}: {info.termination_message}",
                metadata={
                    "sandbox_id": info.id,
                    "termination_reason": info.termination_reason or "",
                },
            )
        return AsyncSandbox(self, info)

    async def queue(
        self, *, include_entries: bool = False, timeout: float | None = None
    ) -> QueueSummary:
        """The create queue of this project subtree: creates waiting (``wait_s``) per project
        and task, the oldest wait, and (``include_entries``) each waiting create in serving
        order::

            q = await dsec.queue()
            print(q.waiting, [(g.task_id, g.waiting) for g in q.groups])
        """
        resp = await self._rpc.unary(
            self._rpc.sandboxes.ListQueue,
            apiserver_pb2.ListQueueRequest(include_entries=include_entries),
            timeout=timeout,
        )
        return QueueSummary.from_pb(resp)

    async def create_many(
        self,
        count: int | None = None,
        *,
        specs: Sequence[CreateOptions] | None = None,
        wait: bool = True,
        timeout: float | None = 600.0,
        wait_s: float = 0.0,
        priority: int = 0,
        **options: Unpack[SandboxOptions],
    ) -> list[AsyncSandbox | DSecError]:
        """Creates many sandboxes in one call: ``count`` alike (the options as for
        :meth:`create`, without an idempotency key), or one per item of ``specs`` (each a
        :class:`~libdsec.options.CreateOptions`, with its own key if wanted)::

            same = await dsec.create_many(40, image="busybox", cpu=0.25, task_id="swe-123")
            each = await dsec.create_many(
                specs=[{"image": "busybox", "idempotency_key": f"swe-123/{i}"} for i in range(8)]
            )

        Every item without a key gets a fresh one from the SDK, so the call is retried while
        the API server is unavailable (as :meth:`create` is) without doubling any sandbox.
        Returns, in order, a sandbox or the error that item got (nothing is
        raised for per-item failures). ``wait_s`` and ``priority`` as for :meth:`create`:
        the items the cluster has no room for wait in the queue (the call answers when every
        item is placed or has failed).
        """
        req = apiserver_pb2.CreateSandboxesRequest()
        if specs is None:
            if not count or count < 1:
                raise InvalidArgument("give count >= 1 or specs")
            if "idempotency_key" in options:
                raise InvalidArgument("idempotency keys go in specs=[...], one per item")
            template = apiserver_pb2.CreateSandboxRequest(
                spec=make_spec(**options), wait_ready=wait, wait_s=wait_s, priority=priority
            )
            add = req.items.add
            for _ in range(count):
                entry = add()
                entry.CopyFrom(template)
                entry.idempotency_key = new_idempotency_key()
        else:
            if options or count is not None:
                raise InvalidArgument("give count and options, or specs, not both")
            for item in specs:
                key, sandbox_options = split_key(item)
                req.items.add(
                    spec=make_spec(**sandbox_options),
                    idempotency_key=key,
                    wait_ready=wait,
                    wait_s=wait_s,
                    priority=priority,
                )
        results = await self._create_items(req, _queue_timeout(timeout, wait_s))
        return [
            item_error(r.error) if r.error.code else AsyncSandbox(self, r.sandbox) for r in results
        ]

    async def _create_items(
        self, req: apiserver_pb2.CreateSandboxesRequest, timeout: float | None
    ) -> list[apiserver_pb2.CreateSandboxResult]:
        """``CreateSandboxes``, with its items that came back ``CREATE_IN_PROGRESS`` (their key
        is being created through another API server, e.g. after the first attempt's server
        died) sent again, with their keys, until ``timeout``: as :meth:`create` retries."""
        deadline = time.monotonic() + (DEFAULT_TIMEOUT_S if timeout is None else timeout)
        first = await self._rpc.unary(self._rpc.sandboxes.CreateSandboxes, req, timeout=timeout)
        results = list(first.results)
        pauses = retry_pauses()
        while True:
            again = [i for i, r in enumerate(results) if r.error.reason == "CREATE_IN_PROGRESS"]
            pause = next(pauses)
            if not again or time.monotonic() + pause >= deadline:
                return results
            await asyncio.sleep(pause)
            retry = apiserver_pb2.CreateSandboxesRequest(items=[req.items[i] for i in again])
            resp = await self._rpc.unary(
                self._rpc.sandboxes.CreateSandboxes, retry, timeout=deadline - time.monotonic()
            )
            for r in resp.results:
                results[again[r.index]] = r

    async def replay(
        self,
        source_id: str,
        *,
        upto: int | None = None,
        **options: Unpack[SandboxOptions],
    ) -> ReplayReport:
        """Re-runs the logged operations of sandbox ``source_id`` in order, up to and
        including entry ``upto``, in a fresh sandbox (the create options as for
        :meth:`create`; ``image`` defaults to the source's), comparing each result with the log's
        digests: for debugging a reward, reproducing an episode::

            report = await dsec.replay(sb.id)
            if not report.reproduced:
                print("diverges at", report.first_divergence)

        The replay sandbox is left running (``report.sandbox_id``) for inspection: stop it.
        A source whose log is gone raises NotFound (``OPERATION_LOG_NOT_FOUND``).
        """
        ops, _ = await operation_log(self._rpc, source_id, with_bodies=True, timeout=self.timeout)
        if "image" not in options:
            options["image"] = (await self._info(source_id)).image
        sandbox = await self.create(**options)
        return await replay(self, sandbox.id, source_id, ops, upto=upto)

    async def get(self, sandbox_id: str, *, timeout: float | None = None) -> AsyncSandbox:
        """Reattaches to an existing sandbox (e.g. from another process)."""
        return AsyncSandbox(self, await self._info(sandbox_id, timeout))

    async def _info(self, sandbox_id: str, timeout: float | None = None) -> SandboxInfo:
        return await sandbox_info(self._rpc, sandbox_id, self._t(timeout))

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
            resp = await self._rpc.unary(
                self._rpc.sandboxes.ListSandboxes, req, timeout=self._t(timeout)
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
        """Stops every live sandbox of a task and/or with labels, across all edges; returns their
        ids. :meth:`stop_task` does the same with a result per sandbox (and PREEMPTED)."""
        resp = await self._rpc.unary(
            self._rpc.sandboxes.StopSandboxes,
            apiserver_pb2.StopSandboxesRequest(task_id=task_id, label_selector=dict(labels or {})),
            timeout=timeout,
        )
        return list(resp.sandbox_ids)

    # ------------------------------------------------- task-level operations

    async def pause_task(
        self,
        task_id: str,
        *,
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> TaskResult:
        """Pauses every sandbox of the task (this project's and its subprojects', on every
        edge, in one call), narrowed by ``labels`` if given: what a trainer calls when its job
        is preempted. Files and processes are kept; any later call into a sandbox resumes it
        (or :meth:`resume_task` resumes them all). One result per sandbox, never an exception
        for one sandbox: a PAUSED one stays PAUSED, one that is not running fails with
        FAILED_PRECONDITION naming its state (``metadata["state"]``)::

            r = await dsec.pause_task("job-42")
            print(len(r), "sandboxes,", len(r.failed), "failed")   # r.ok: all of them paused

        A task without sandboxes gives an empty result; ``task_id=""`` without ``labels``
        raises :class:`~libdsec.errors.InvalidArgument` (nothing acts on everything).
        """
        resp = await self._rpc.unary(
            self._rpc.sandboxes.PauseTask,
            apiserver_pb2.PauseTaskRequest(task_id=task_id, label_selector=dict(labels or {})),
            timeout=TASK_TIMEOUT_S if timeout is None else timeout,
        )
        return TaskResult.from_pb(resp)

    async def resume_task(
        self,
        task_id: str,
        *,
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> TaskResult:
        """Resumes every paused sandbox of the task (a RUNNING one stays RUNNING, an ended one
        fails with :class:`~libdsec.errors.SandboxTerminated`, one whose memory does not fit
        its node again with :class:`~libdsec.errors.NodeMemoryFull` and stays PAUSED); see
        :meth:`pause_task`::

            r = await dsec.resume_task("job-42")
            episodes = {info.labels["episode"]: info.id for info in r.sandboxes}
        """
        resp = await self._rpc.unary(
            self._rpc.sandboxes.ResumeTask,
            apiserver_pb2.ResumeTaskRequest(task_id=task_id, label_selector=dict(labels or {})),
            timeout=TASK_TIMEOUT_S if timeout is None else timeout,
        )
        return TaskResult.from_pb(resp)

    async def stop_task(
        self,
        task_id: str,
        *,
        preempted: bool = False,
        grace_s: float = 2.0,
        message: str = "",
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> TaskResult:
        """Stops every sandbox of the task (see :meth:`pause_task` for the selection and the
        results): each ends with termination reason STOPPED, or PREEMPTED with
        ``preempted=True`` (its job was preempted: what :meth:`get` and :meth:`watch` then
        report, with ``message`` or a default one); SIGTERM, then SIGKILL after ``grace_s``.
        A sandbox that had ended already is answered as it is (its first reason stands)::

            r = await dsec.stop_task("job-42", preempted=True)
            print([(i.id, i.termination_reason) for i in r.sandboxes])  # [("sb-...", "PREEMPTED")]
        """
        resp = await self._rpc.unary(
            self._rpc.sandboxes.StopTask,
            apiserver_pb2.StopTaskRequest(
                task_id=task_id,
                label_selector=dict(labels or {}),
                preempted=preempted,
                grace_s=grace_s,
                message=message,
            ),
            timeout=(TASK_TIMEOUT_S + grace_s) if timeout is None else timeout,
        )
        return TaskResult.from_pb(resp)

    def watch(
        self,
        *,
        task_id: str = "",
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
        keepalive_interval_s: float = STREAM_KEEPALIVE_INTERVAL_S,
        since: datetime | None = None,
    ) -> AsyncWatch:
        """Changes of this project's sandboxes (and its subprojects'), as they happen: an async
        iterator of :class:`SandboxInfo` (the same as :meth:`get` and :meth:`list` give), one
        per change (created, each state change, terminated with its reason), filtered by task
        id and/or labels (all must match)::

            async with dsec.watch(task_id="swe-123") as changes:   # established on entry
                sb = await dsec.create(image="busybox", task_id="swe-123")
                async for info in changes:
                    print(info.id, info.state, info.termination_reason)
                    if info.terminated:
                        break

        ``async for info in dsec.watch(...)`` works too (the stream opens at the first
        step). Keepalives (every ``keepalive_interval_s``) are skipped; a stream silent for
        six of them raises :class:`~libdsec.errors.DeadlineExceeded` (``STREAM_STALLED``).
        The iteration ends without an error when the watch is closed (``await
        changes.aclose()``, or leaving the ``async with``), when this client closes, or after
        ``timeout`` seconds if given (None: until closed).

        A stream that breaks (the API server behind a virtual IP died) raises
        :class:`~libdsec.errors.Unavailable`; ``dsec.watch(..., since=changes.resume_at)``
        resumes it: what changed since the last keepalive of the broken one is replayed
        first, so no change is lost (one near the break may come twice).
        """
        w = AsyncWatch(
            self._rpc,
            task_id=task_id,
            labels=labels,
            timeout=timeout,
            keepalive_interval_s=keepalive_interval_s,
            since=since,
        )
        self._watches.add(w)
        w._on_close.append(self._watches.discard)
        return w

    # -------------------------------------------------------- environments

    async def _env_call(self, method: str, request: Any, timeout: float | None) -> Any:
        return await self._rpc.unary(
            getattr(self._rpc.environments, method), request, timeout=self._t(timeout)
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
            kind=types_pb2.LayerKind.Value("LAYER_KIND_" + kind.upper())
            if kind
            else types_pb2.LAYER_KIND_UNSPECIFIED,
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
        return await self._rpc.unary(
            getattr(self._rpc.projects, method), request, timeout=self._t(timeout)
        )

    async def create_project(
        self,
        name: str,
        *,
        parent: str = "",
        quota: Quota | None = None,
        exist_ok: bool = False,
        timeout: float | None = None,
    ) -> Project:
        """Creates a subproject (of ``parent``, default this token's project) with a delegated
        quota. ``exist_ok``: a project of that name that exists already is returned as it is
        (its quota unchanged) instead of raising ``AlreadyExists``."""
        resp = await self._project_call(
            "CreateProject",
            iam_pb2.CreateProjectRequest(
                parent_id=parent, name=name, quota=(quota or Quota()).to_pb(), exist_ok=exist_ok
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
        e2b: bool = False,
        timeout: float | None = None,
    ) -> NewToken:
        """A token for a human or an agent (same API); the secret is returned once.
        ``e2b``: shaped as an E2B API key (``e2b_<hex>``), which E2B's SDKs check before
        sending a key; it works everywhere a dsec token does."""
        req = iam_pb2.CreateTokenRequest(
            project_id=project,
            name=name,
            kind=iam_pb2.PRINCIPAL_KIND_AGENT if agent else iam_pb2.PRINCIPAL_KIND_HUMAN,
            role=iam_pb2.ROLE_ADMIN if admin else iam_pb2.ROLE_MEMBER,
            ttl_s=ttl_s,
            e2b_format=e2b,
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


__all__ = [
    "CHANNEL_OPTIONS",
    "CHUNK",
    "DEFAULT_TIMEOUT_S",
    "STREAM_IDLE_TIMEOUT_S",
    "AsyncClient",
    "AsyncDirWatch",
    "AsyncDisplay",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncWatch",
    "ExitStatus",
    "make_spec",
]


def _queue_timeout(timeout: float | None, wait_s: float) -> float | None:
    """A create's deadline: its ``timeout`` after the longest it may wait in the queue."""
    return None if timeout is None else timeout + max(0.0, wait_s)

"""The synchronous SDK: :class:`Client` and :class:`Sandbox`.

It runs an :class:`~libdsec.aio.AsyncClient` on a private event loop thread,
so the two clients share one implementation (timeouts, keepalives, retries,
error mapping) and cannot drift apart.

    from libdsec import Client

    with Client() as dsec:                         # the local cluster by default
        with dsec.create(image="bookworm", cpu=1, memory_mb=512) as sb:
            r = sb.run("python3 -c 'print(6*7)'")
            assert r.exit_code == 0 and r.text == "42\\n"
            sb.files.write("/work/a.txt", "hello")
            for ev in sb.stream("for i in 1 2 3; do echo $i; sleep 0.1; done"):
                print(ev)
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from datetime import datetime
from functools import cached_property
from typing import IO, Any, Generic, Self, TypeVar, Unpack, cast

from libdsec._display import AsyncDisplay
from libdsec._files import AsyncDirWatch
from libdsec._oplog import Operation, ReplayReport
from libdsec._transport import STREAM_KEEPALIVE_INTERVAL_S
from libdsec.aio import (
    AsyncClient,
    AsyncFiles,
    AsyncProcess,
    AsyncSandbox,
    AsyncSession,
    AsyncWatch,
)
from libdsec.errors import ClientClosed, DSecError
from libdsec.options import (
    AttachOptions,
    ComposeOptions,
    CreateOptions,
    DownloadOptions,
    ForkOptions,
    FunctionBatchOptions,
    FunctionOptions,
    HttpOptions,
    ImportOptions,
    ListDirOptions,
    ListOptions,
    ListProjectsOptions,
    ListTokensOptions,
    MkdirOptions,
    MoveOptions,
    PackDiffOptions,
    ProjectOptions,
    ReadOptions,
    RemoveOptions,
    RunOptions,
    SandboxOptions,
    SessionOptions,
    SessionRunOptions,
    SessionStreamOptions,
    StartOptions,
    StatOptions,
    StopAllOptions,
    StopOptions,
    StreamOptions,
    TokenOptions,
    UploadOptions,
    WaitForPortOptions,
    WriteOptions,
)
from libdsec.types import (
    Environment,
    ExecEvent,
    ExecInfo,
    ExecResult,
    FileEvent,
    FileInfo,
    ForkResult,
    FunctionJob,
    FunctionResult,
    HttpResponse,
    Layer,
    ModifiedFile,
    NetworkPolicy,
    NewToken,
    Principal,
    Project,
    QueueSummary,
    Quota,
    SandboxInfo,
    SandboxMetric,
    TaskResult,
    TokenInfo,
)

T = TypeVar("T")


class _Loop:
    """An event loop on a daemon thread; sync calls submit coroutines to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="libdsec-loop", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.loop.is_closed():  # a handle kept past its Client's close
            coro.close()  # never to run: no "coroutine was never awaited" warning
            raise ClientClosed(
                "the Client this handle belongs to was closed; open a new Client (the "
                "sandboxes live on: client.get(sandbox_id))"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """Steps the async generator ``agen`` on the loop; closes it however the loop ends."""
        try:
            while True:
                try:
                    yield self.run(_next(agen))
                except StopAsyncIteration:
                    return
        finally:
            if isinstance(agen, AsyncGenerator):
                self.run(agen.aclose())

    def close(self) -> None:
        # As asyncio.run ends: what is still pending (gRPC's own per-call tasks, after the
        # channel closed) is cancelled and given a moment to finish, not destroyed pending
        # ("Task was destroyed but it is pending!" at exit).
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_finish_tasks(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


async def _next(it: AsyncIterator[T]) -> T:
    """``it``'s next item, as a coroutine (what ``run_coroutine_threadsafe`` takes)."""
    return await it.__anext__()


async def _finish_tasks(grace_s: float = 1.0) -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=grace_s)


class Client:
    """Synchronous connection to a dsec cluster. Same arguments as :class:`AsyncClient`."""

    def __init__(
        self, target: str | None = None, *, token: str | None = None, timeout: float = 30.0
    ) -> None:
        self._loop = _Loop()
        try:
            self._async = self._loop.run(self._make(target, token, timeout))
        except BaseException:
            self._loop.close()
            raise

    @staticmethod
    async def _make(target: str | None, token: str | None, timeout: float) -> AsyncClient:
        return AsyncClient(target, token=token, timeout=timeout)  # the channel binds to this loop

    @property
    def target(self) -> str:
        return self._async.target

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.loop.is_running():
            self._loop.run(self._async.close())
            self._loop.close()

    def whoami(self, *, timeout: float | None = None) -> Principal:
        return self._loop.run(self._async.whoami(timeout=timeout))

    def create(
        self,
        *,
        wait: bool = True,
        timeout: float | None = 180.0,
        wait_s: float = 0.0,
        priority: int = 0,
        **options: Unpack[CreateOptions],
    ) -> Sandbox:
        """Creates a sandbox and (by default) waits until it accepts commands; the options are
        :class:`~libdsec.options.CreateOptions` (typed keywords), as for
        :meth:`AsyncClient.create`. The sandbox is a context manager that stops on exit::

            with dsec.create(image="busybox", cpu=0.5, memory_mb=256, task_id="swe-123") as sb:
                print(sb.run("echo hi").text)

        ``wait_s`` > 0 waits that long in the create queue when the cluster is full (fair
        share; :class:`~libdsec.errors.QueueTimeout` if never placed), ``priority`` orders a
        project's queued creates.
        """
        return Sandbox(
            self,
            self._loop.run(
                self._async.create(
                    wait=wait, timeout=timeout, wait_s=wait_s, priority=priority, **options
                )
            ),
        )

    def queue(self, *, include_entries: bool = False, timeout: float | None = None) -> QueueSummary:
        """The create queue of this project subtree (see :meth:`AsyncClient.queue`)."""
        return self._loop.run(self._async.queue(include_entries=include_entries, timeout=timeout))

    def create_many(
        self,
        count: int | None = None,
        *,
        specs: Sequence[CreateOptions] | None = None,
        wait: bool = True,
        timeout: float | None = 600.0,
        wait_s: float = 0.0,
        priority: int = 0,
        **options: Unpack[SandboxOptions],
    ) -> list[Sandbox | DSecError]:
        """Many sandboxes in one call, ``count`` alike or one per item of ``specs``; in order,
        a sandbox or the error that item got (see :meth:`AsyncClient.create_many`)::

            for r in dsec.create_many(40, image="busybox", cpu=0.25, task_id="swe-123"):
                print(r.id if isinstance(r, Sandbox) else f"failed: {r.reason}")
        """
        out = self._loop.run(
            self._async.create_many(
                count,
                specs=specs,
                wait=wait,
                timeout=timeout,
                wait_s=wait_s,
                priority=priority,
                **options,
            )
        )
        return [Sandbox(self, s) if isinstance(s, AsyncSandbox) else s for s in out]

    def replay(
        self,
        source_id: str,
        *,
        upto: int | None = None,
        **options: Unpack[SandboxOptions],
    ) -> ReplayReport:
        """Re-runs a sandbox's logged operations in a fresh one (see
        :meth:`AsyncClient.replay`)."""
        return self._loop.run(self._async.replay(source_id, upto=upto, **options))

    def get(self, sandbox_id: str, *, timeout: float | None = None) -> Sandbox:
        """Reattaches to an existing sandbox (e.g. one created by another process)."""
        return Sandbox(self, self._loop.run(self._async.get(sandbox_id, timeout=timeout)))

    def list(self, **options: Unpack[ListOptions]) -> list[SandboxInfo]:
        """Sandboxes of this project, filtered (see :meth:`AsyncClient.list`)::

        running = dsec.list(task_id="swe-123", states=["running"])
        """
        return self._loop.run(self._async.list(**options))

    def stop_all(self, **options: Unpack[StopAllOptions]) -> builtins.list[str]:
        """See :meth:`AsyncClient.stop_all`: ``dsec.stop_all(task_id="swe-123")``."""
        return self._loop.run(self._async.stop_all(**options))

    def pause_task(
        self,
        task_id: str,
        *,
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> TaskResult:
        """Pauses every sandbox of the task, on every edge, in one call; one result per
        sandbox (see :meth:`AsyncClient.pause_task`)::

            r = dsec.pause_task("job-42")            # the trainer's preemption handler
            for f in r.failed:
                print(f.sandbox_id, f.error.reason, f.error.metadata.get("state"))
        """
        return self._loop.run(self._async.pause_task(task_id, labels=labels, timeout=timeout))

    def resume_task(
        self,
        task_id: str,
        *,
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> TaskResult:
        """Resumes every paused sandbox of the task (see :meth:`AsyncClient.resume_task`)."""
        return self._loop.run(self._async.resume_task(task_id, labels=labels, timeout=timeout))

    def stop_task(
        self,
        task_id: str,
        *,
        preempted: bool = False,
        grace_s: float = 2.0,
        message: str = "",
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> TaskResult:
        """Stops every sandbox of the task, with reason PREEMPTED if ``preempted`` (see
        :meth:`AsyncClient.stop_task`): ``dsec.stop_task("job-42", preempted=True)``."""
        return self._loop.run(
            self._async.stop_task(
                task_id,
                preempted=preempted,
                grace_s=grace_s,
                message=message,
                labels=labels,
                timeout=timeout,
            )
        )

    def watch(
        self,
        *,
        task_id: str = "",
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
        keepalive_interval_s: float = STREAM_KEEPALIVE_INTERVAL_S,
        since: datetime | None = None,
    ) -> Watch:
        """Changes of this project's sandboxes as they happen: an iterator of
        :class:`SandboxInfo` (as :meth:`get` and :meth:`list` give), one per change (created,
        each state change, terminated with its reason), filtered by task id and/or labels.
        The watch is established when this returns (every change after it is reported); it
        is a context manager, ends without an error on ``close()``, when this client closes,
        or after ``timeout`` seconds if given, and raises
        :class:`~libdsec.errors.DeadlineExceeded` (``STREAM_STALLED``) if the stream goes
        silent (see :meth:`AsyncClient.watch`)::

            with dsec.watch(task_id="swe-123") as changes:
                sb = dsec.create(image="busybox", task_id="swe-123")
                for info in changes:
                    print(info.id, info.state, info.termination_reason)
                    if info.terminated:
                        break
        """
        w = self._async.watch(
            task_id=task_id,
            labels=labels,
            timeout=timeout,
            keepalive_interval_s=keepalive_interval_s,
            since=since,
        )
        try:
            self._loop.run(w.start())
        except BaseException:
            self._loop.run(w.aclose())
            raise
        return Watch(self, w)

    def fncall(self, **options: Unpack[FunctionOptions]) -> FunctionResult:
        """Runs one short job in a warm pool (see :meth:`AsyncClient.fncall`).

        Example: ``dsec.fncall(language="python", code="print(input()[::-1])", stdin="abc")``
        returns a :class:`FunctionResult` with ``verdict == "OK"`` and ``text == "cba\\n"``.
        The same keywords as the async client's, ``compile_time_limit_s=`` (the compile step's
        wall clock, C/C++; 0 = 30 s) and ``fetch_files=[...]`` (files returned after the run in
        ``r.files``, the others with a reason in ``r.fetch_errors``) included.
        """
        return self._loop.run(self._async.fncall(**options))

    def fncall_many(
        self,
        jobs: Iterable[FunctionJob | Mapping[str, Any]],
        **options: Unpack[FunctionBatchOptions],
    ) -> Iterator[FunctionResult]:
        """Many jobs in one call, results as they finish; see :meth:`AsyncClient.fncall_many`."""
        return self._loop.iterate(self._async.fncall_many(jobs, **options))

    def list_environments(
        self, prefix: str = "", *, timeout: float | None = None
    ) -> builtins.list[Environment]:
        """See :meth:`AsyncClient.list_environments`."""
        return self._loop.run(self._async.list_environments(prefix, timeout=timeout))

    def get_environment(self, name: str, *, timeout: float | None = None) -> Environment:
        return self._loop.run(self._async.get_environment(name, timeout=timeout))

    def list_layers(self, *, timeout: float | None = None) -> builtins.list[Layer]:
        return self._loop.run(self._async.list_layers(timeout=timeout))

    def import_image(
        self, source: str, name: str = "", **options: Unpack[ImportOptions]
    ) -> Environment:
        """See :meth:`AsyncClient.import_image`: ``dsec.import_image("docker:python:3.11")``."""
        return self._loop.run(self._async.import_image(source, name, **options))

    def compose_environment(self, name: str, **options: Unpack[ComposeOptions]) -> Environment:
        """See :meth:`AsyncClient.compose_environment`:
        ``dsec.compose_environment("swe-123:py", base="bookworm", toolkits=["py-tools"])``."""
        return self._loop.run(self._async.compose_environment(name, **options))

    def delete_environment(self, name: str, *, timeout: float | None = None) -> bool:
        return self._loop.run(self._async.delete_environment(name, timeout=timeout))

    def create_project(self, name: str, **options: Unpack[ProjectOptions]) -> Project:
        """See :meth:`AsyncClient.create_project`."""
        return self._loop.run(self._async.create_project(name, **options))

    def get_project(self, project_id: str = "", *, timeout: float | None = None) -> Project:
        return self._loop.run(self._async.get_project(project_id, timeout=timeout))

    def list_projects(
        self, parent: str = "", **options: Unpack[ListProjectsOptions]
    ) -> builtins.list[Project]:
        return self._loop.run(self._async.list_projects(parent, **options))

    def set_quota(self, project_id: str, quota: Quota, *, timeout: float | None = None) -> Project:
        return self._loop.run(self._async.set_quota(project_id, quota, timeout=timeout))

    def delete_project(self, project_id: str, *, timeout: float | None = None) -> None:
        self._loop.run(self._async.delete_project(project_id, timeout=timeout))

    def create_token(self, name: str, **options: Unpack[TokenOptions]) -> NewToken:
        """See :meth:`AsyncClient.create_token`."""
        return self._loop.run(self._async.create_token(name, **options))

    def list_tokens(
        self, project: str = "", **options: Unpack[ListTokensOptions]
    ) -> builtins.list[TokenInfo]:
        return self._loop.run(self._async.list_tokens(project, **options))

    def revoke_token(self, token_id: str, *, timeout: float | None = None) -> None:
        self._loop.run(self._async.revoke_token(token_id, timeout=timeout))


class _SyncStream(Generic[T]):
    """A long-lived async iterator (a watch) driven from the client's loop: an iterator, a
    context manager, closable from any thread."""

    def __init__(self, client: Client, stream: AsyncWatch | AsyncDirWatch) -> None:
        self._c = client
        self._w = stream

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> T:
        if self._w.closed:
            raise StopIteration
        try:
            return cast(T, self._c._loop.run(self._w.__anext__()))
        except StopAsyncIteration:
            raise StopIteration from None
        except concurrent.futures.CancelledError:
            if self._w.closed:  # the client closed while this thread waited
                raise StopIteration from None
            raise

    def close(self) -> None:
        """Ends the stream (idempotent); an iteration in another thread ends without an error."""
        if not self._w.closed and self._c._loop.loop.is_running():
            self._c._loop.run(self._w.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Watch(_SyncStream[SandboxInfo]):
    """Changes of sandboxes (see :meth:`Client.watch`): an iterator of :class:`SandboxInfo`,
    a context manager, closable."""

    @property
    def resume_at(self) -> datetime | None:
        """Where ``watch(since=...)`` resumes this watch if its stream breaks."""
        assert isinstance(self._w, AsyncWatch)
        return self._w.resume_at


class Process:
    """A background command (see :meth:`Sandbox.start`)."""

    def __init__(self, client: Client, proc: AsyncProcess) -> None:
        self._c = client
        self._p = proc

    @property
    def exec_id(self) -> str:
        return self._p.exec_id

    @property
    def pid(self) -> int:
        return self._p.pid

    def wait(self, timeout_s: float | None = None) -> ExecInfo:
        return self._c._loop.run(self._p.wait(timeout_s))

    def kill(self, signal: int = 9) -> bool:
        return self._c._loop.run(self._p.kill(signal))

    def attach(self, **options: Unpack[AttachOptions]) -> Iterator[ExecEvent]:
        """See :meth:`AsyncProcess.attach`."""
        return self._c._loop.iterate(self._p.attach(**options))

    def send_stdin(self, data: bytes | str) -> None:
        """See :meth:`AsyncProcess.send_stdin`."""
        self._c._loop.run(self._p.send_stdin(data))

    def close_stdin(self) -> None:
        self._c._loop.run(self._p.close_stdin())

    def resize(self, rows: int, cols: int) -> None:
        self._c._loop.run(self._p.resize(rows, cols))


class Session:
    """A persistent shell session (see :meth:`Sandbox.session`)."""

    def __init__(self, client: Client, session: AsyncSession) -> None:
        self._c = client
        self._s = session

    @property
    def session_id(self) -> str:
        return self._s.session_id

    def run(self, cmd: str, **options: Unpack[SessionRunOptions]) -> ExecResult:
        """Runs ``cmd`` in this session (the options of :meth:`Sandbox.run` but ``session``)."""
        return self._c._loop.run(self._s.run(cmd, **options))

    def stream(self, cmd: str, **options: Unpack[SessionStreamOptions]) -> Iterator[ExecEvent]:
        """Streams ``cmd`` in this session (see :meth:`Sandbox.stream`)."""
        return self._c._loop.iterate(self._s.stream(cmd, **options))

    def close(self) -> None:
        self._c._loop.run(self._s.close())

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Files:
    """Filesystem operations inside a sandbox (see :class:`AsyncFiles`)."""

    def __init__(self, client: Client, files: AsyncFiles) -> None:
        self._c = client
        self._f = files

    def read(self, path: str, **options: Unpack[ReadOptions]) -> bytes:
        return self._c._loop.run(self._f.read(path, **options))

    def write(self, path: str, data: bytes | str, **options: Unpack[WriteOptions]) -> FileInfo:
        """See :meth:`AsyncFiles.write`: ``sb.files.write("/work/run.sh", "ls", mode=0o755)``."""
        return self._c._loop.run(self._f.write(path, data, **options))

    def list(self, path: str, **options: Unpack[ListDirOptions]) -> list[FileInfo]:
        return self._c._loop.run(self._f.list(path, **options))

    def stat(self, path: str, **options: Unpack[StatOptions]) -> FileInfo:
        return self._c._loop.run(self._f.stat(path, **options))

    def exists(self, path: str) -> bool:
        return self._c._loop.run(self._f.exists(path))

    def mkdir(self, path: str, **options: Unpack[MkdirOptions]) -> FileInfo:
        return self._c._loop.run(self._f.mkdir(path, **options))

    def remove(self, path: str, **options: Unpack[RemoveOptions]) -> None:
        self._c._loop.run(self._f.remove(path, **options))

    def move(self, source: str, destination: str, **options: Unpack[MoveOptions]) -> FileInfo:
        return self._c._loop.run(self._f.move(source, destination, **options))

    def chmod(self, path: str, mode: int, *, operation_id: str | None = None) -> FileInfo:
        return self._c._loop.run(self._f.chmod(path, mode, operation_id=operation_id))

    def upload(
        self,
        source: bytes | str | os.PathLike[str] | IO[bytes],
        path: str,
        **options: Unpack[UploadOptions],
    ) -> FileInfo:
        """See :meth:`AsyncFiles.upload`: ``sb.files.upload("data.tar", "/work/data.tar")``."""
        return self._c._loop.run(self._f.upload(source, path, **options))

    def download(self, path: str, destination: str | os.PathLike[str] | IO[bytes]) -> int:
        return self._c._loop.run(self._f.download(path, destination))

    def iter_download(self, path: str, **options: Unpack[DownloadOptions]) -> Iterator[bytes]:
        return self._c._loop.iterate(self._f.iter_download(path, **options))

    def create_watcher(
        self,
        path: str,
        recursive: bool = False,
        *,
        include_entry: bool = False,
        allow_network_mounts: bool = False,
        timeout: float | None = None,
    ) -> str:
        """See :meth:`AsyncFiles.create_watcher`."""
        return self._c._loop.run(
            self._f.create_watcher(
                path,
                recursive,
                include_entry=include_entry,
                allow_network_mounts=allow_network_mounts,
                timeout=timeout,
            )
        )

    def watcher_events(
        self, watcher_id: str, *, timeout: float | None = None
    ) -> builtins.list[FileEvent]:
        """See :meth:`AsyncFiles.watcher_events`."""
        return self._c._loop.run(self._f.watcher_events(watcher_id, timeout=timeout))

    def remove_watcher(self, watcher_id: str, *, timeout: float | None = None) -> None:
        """See :meth:`AsyncFiles.remove_watcher`."""
        self._c._loop.run(self._f.remove_watcher(watcher_id, timeout=timeout))

    def watch(
        self,
        path: str,
        recursive: bool = False,
        *,
        include_entry: bool = False,
        allow_network_mounts: bool = False,
    ) -> DirWatch:
        """Changes of the directory ``path`` as they happen (see :meth:`AsyncFiles.watch`):
        established when this returns; an iterator of :class:`FileEvent`, a context manager,
        ended with ``close()``::

            with sb.files.watch("/work") as changes:
                for ev in changes:
                    print(ev.type, ev.name)
        """
        watch = self._f.watch(
            path, recursive, include_entry=include_entry, allow_network_mounts=allow_network_mounts
        )
        return DirWatch(self._c, self._c._loop.run(watch))


class Display:
    """The screen of a sandbox (see :class:`~libdsec.aio.AsyncDisplay`)::

    png = sb.display.screenshot()
    width, height = sb.display.size()
    sb.display.click(640, 400)
    sb.display.type("hello\\n")
    sb.display.press("ctrl+l")
    """

    def __init__(self, client: Client, display: AsyncDisplay) -> None:
        self._c = client
        self._d = display

    def size(self, *, timeout: float | None = None) -> tuple[int, int]:
        """(width, height) of the screen now, in pixels."""
        return self._c._loop.run(self._d.size(timeout=timeout))

    def screenshot(self, *, timeout: float | None = None) -> bytes:
        """The whole screen as PNG bytes."""
        return self._c._loop.run(self._d.screenshot(timeout=timeout))

    def viewer_url(self, *, timeout: float | None = None) -> str:
        """See :meth:`AsyncDisplay.viewer_url`: the live view's URL, with this client's token."""
        return self._c._loop.run(self._d.viewer_url(timeout=timeout))

    def move(self, x: int, y: int, *, timeout: float | None = None) -> int:
        return self._c._loop.run(self._d.move(x, y, timeout=timeout))

    def click(
        self,
        x: int | None = None,
        y: int | None = None,
        *,
        button: str = "left",
        double: bool = False,
        timeout: float | None = None,
    ) -> int:
        """See :meth:`AsyncDisplay.click`: ``sb.display.click(10, 20, double=True)``."""
        return self._c._loop.run(self._d.click(x, y, button=button, double=double, timeout=timeout))

    def scroll(
        self,
        dy: int = 1,
        *,
        dx: int = 0,
        x: int | None = None,
        y: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """See :meth:`AsyncDisplay.scroll`: ``sb.display.scroll(3)`` turns 3 notches down."""
        return self._c._loop.run(self._d.scroll(dy, dx=dx, x=x, y=y, timeout=timeout))

    def drag(
        self,
        start: tuple[int, int],
        end: tuple[int, int],
        *,
        button: str = "left",
        timeout: float | None = None,
    ) -> int:
        return self._c._loop.run(self._d.drag(start, end, button=button, timeout=timeout))

    def mouse_down(self, button: str = "left", *, timeout: float | None = None) -> int:
        return self._c._loop.run(self._d.mouse_down(button, timeout=timeout))

    def mouse_up(self, button: str = "left", *, timeout: float | None = None) -> int:
        return self._c._loop.run(self._d.mouse_up(button, timeout=timeout))

    def type(self, text: str, *, timeout: float | None = None) -> int:
        return self._c._loop.run(self._d.type(text, timeout=timeout))

    def press(self, keys: str, *, timeout: float | None = None) -> int:
        """See :meth:`AsyncDisplay.press`: ``sb.display.press("ctrl+l")``."""
        return self._c._loop.run(self._d.press(keys, timeout=timeout))


class DirWatch(_SyncStream[FileEvent]):
    """A directory watch (see :meth:`Files.watch`): an iterator of :class:`FileEvent`."""

    def __init__(self, client: Client, watch: AsyncDirWatch) -> None:
        super().__init__(client, watch)
        self._dir = watch

    @property
    def dropped(self) -> int:
        return self._dir.dropped


class Sandbox:
    """A sandbox (see :class:`AsyncSandbox` for every method's contract)."""

    def __init__(self, client: Client, sandbox: AsyncSandbox) -> None:
        self._c = client
        self._s = sandbox

    @cached_property
    def files(self) -> Files:
        """The sandbox's files (made on first use, as :attr:`AsyncSandbox.files`)."""
        return Files(self._c, self._s.files)

    @cached_property
    def display(self) -> Display:
        """The screen, for a sandbox with a display (see :attr:`AsyncSandbox.display`)."""
        return Display(self._c, self._s.display)

    @property
    def id(self) -> str:
        return self._s.id

    @property
    def info(self) -> SandboxInfo:
        return self._s.info

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.state}>"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self._c._loop.run(self._s.__aexit__(None, None, None))

    def refresh(self) -> SandboxInfo:
        return self._c._loop.run(self._s.refresh())

    def run(self, cmd: str | list[str], **options: Unpack[RunOptions]) -> ExecResult:
        """Runs a command to completion (see :meth:`AsyncSandbox.run`)::

        r = sb.run("pytest -q", cwd="/work", timeout_s=600)
        """
        return self._c._loop.run(self._s.run(cmd, **options))

    def stream(self, cmd: str | list[str], **options: Unpack[StreamOptions]) -> Iterator[ExecEvent]:
        """Started, Output... then Exited, as produced (see :meth:`AsyncSandbox.stream`)."""
        return self._c._loop.iterate(self._s.stream(cmd, **options))

    def start(self, cmd: str | list[str], **options: Unpack[StartOptions]) -> Process:
        """A background command (see :meth:`AsyncSandbox.start`)::

        server = sb.start("python3 -m http.server 8000", labels={"role": "server"})
        """
        return Process(self._c, self._c._loop.run(self._s.start(cmd, **options)))

    def process(self, exec_id: str) -> Process:
        return Process(self._c, self._c._loop.run(self._s.process(exec_id)))

    def processes(self) -> list[ExecInfo]:
        return self._c._loop.run(self._s.processes())

    def session(self, **options: Unpack[SessionOptions]) -> Session:
        """A persistent shell (see :meth:`AsyncSandbox.session`)."""
        return Session(self._c, self._c._loop.run(self._s.session(**options)))

    def http(self, port: int, path: str = "/", **options: Unpack[HttpOptions]) -> HttpResponse:
        """See :meth:`AsyncSandbox.http`: ``sb.http(8000, "/health", wait_s=10)``."""
        return self._c._loop.run(self._s.http(port, path, **options))

    def wait_for_port(self, port: int, **options: Unpack[WaitForPortOptions]) -> float:
        """See :meth:`AsyncSandbox.wait_for_port`: ``sb.wait_for_port(8000, timeout_s=10)``."""
        return self._c._loop.run(self._s.wait_for_port(port, **options))

    def stop(self, **options: Unpack[StopOptions]) -> SandboxInfo:
        """Stops the sandbox (see :meth:`AsyncSandbox.stop`): ``sb.stop(grace_s=0.5)``."""
        return self._c._loop.run(self._s.stop(**options))

    def pause(self, *, memory: bool = True) -> SandboxInfo:
        """See :meth:`AsyncSandbox.pause`: ``sb.pause(memory=False)`` keeps the files only."""
        return self._c._loop.run(self._s.pause(memory=memory))

    def resume(self) -> SandboxInfo:
        return self._c._loop.run(self._s.resume())

    def set_timeout(self, seconds: float) -> SandboxInfo:
        """See :meth:`AsyncSandbox.set_timeout`: ``sb.set_timeout(3600)``."""
        return self._c._loop.run(self._s.set_timeout(seconds))

    def fork(self, n: int, **options: Unpack[ForkOptions]) -> ForkResult[Sandbox]:
        """See :meth:`AsyncSandbox.fork`: ``group = sb.fork(16, task_id="grpo-step-7")``;
        ``group.sandboxes`` are the children that run, ``group.errors`` why the others do not."""
        r = self._c._loop.run(self._s.fork(n, **options))
        children: list[Sandbox | DSecError] = [
            c if isinstance(c, DSecError) else Sandbox(self._c, c) for c in r.children
        ]
        return ForkResult(children, r.kind, r.stall_s)

    def pack_diff(self, name: str, **options: Unpack[PackDiffOptions]) -> Environment:
        """See :meth:`AsyncSandbox.pack_diff`: ``env = sb.pack_diff("my-env:v2")``."""
        return self._c._loop.run(self._s.pack_diff(name, **options))

    def update_network_policy(
        self, policy: NetworkPolicy, *, timeout: float | None = None
    ) -> SandboxInfo:
        """See :meth:`AsyncSandbox.update_network_policy`."""
        return self._c._loop.run(self._s.update_network_policy(policy, timeout=timeout))

    def metrics(
        self,
        *,
        start: datetime | None = None,
        end: datetime | None = None,
        timeout: float | None = None,
    ) -> list[SandboxMetric]:
        """See :meth:`AsyncSandbox.metrics`."""
        return self._c._loop.run(self._s.metrics(start=start, end=end, timeout=timeout))

    def modified_files(self, *, timeout: float | None = None) -> list[ModifiedFile]:
        """See :meth:`AsyncSandbox.modified_files`."""
        return self._c._loop.run(self._s.modified_files(timeout=timeout))

    def log(
        self, *, after_seq: int = 0, with_bodies: bool = False, timeout: float | None = None
    ) -> list[Operation]:
        """The sandbox's operation log (see :meth:`AsyncSandbox.log`)."""
        return self._c._loop.run(
            self._s.log(after_seq=after_seq, with_bodies=with_bodies, timeout=timeout)
        )

    def follow_log(self, *, after_seq: int = 0, interval_s: float = 0.5) -> Iterator[Operation]:
        """The log's entries as they end, until the sandbox ends (see
        :meth:`AsyncSandbox.follow_log`)."""
        return self._c._loop.iterate(self._s.follow_log(after_seq=after_seq, interval_s=interval_s))

    def export_log(self, destination: str | os.PathLike[str] | IO[str]) -> int:
        """The trajectory export, JSON Lines (see :meth:`AsyncSandbox.export_log`)."""
        return self._c._loop.run(self._s.export_log(destination))

    def delete(self) -> None:
        self._c._loop.run(self._s.delete())


__all__ = ["Client", "DirWatch", "Display", "Files", "Process", "Sandbox", "Session", "Watch"]

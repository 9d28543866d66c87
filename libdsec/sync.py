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
import threading
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import IO, Any, Generic, Self, TypeVar, Unpack, cast

from libdsec._files import AsyncDirWatch
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
from libdsec.options import CreateOptions, SandboxOptions
from libdsec.types import (
    Environment,
    ExecEvent,
    ExecInfo,
    ExecResult,
    FileEvent,
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

    def run(self, coro: Awaitable[T]) -> T:
        if self.loop.is_closed():  # a handle kept past its Client's close
            if isinstance(coro, Coroutine):
                coro.close()  # never to run: no "coroutine was never awaited" warning
            raise ClientClosed(
                "the Client this handle belongs to was closed; open a new Client (the "
                "sandboxes live on: client.get(sandbox_id))"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.run(agen.aclose())  # type: ignore[attr-defined]

    def close(self) -> None:
        # As asyncio.run ends: what is still pending (gRPC's own per-call tasks, after the
        # channel closed) is cancelled and given a moment to finish, not destroyed pending
        # ("Task was destroyed but it is pending!" at exit).
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_finish_tasks(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


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

    def whoami(self, **kw: Any) -> Principal:
        return self._loop.run(self._async.whoami(**kw))

    def create(
        self,
        *,
        wait: bool = True,
        timeout: float | None = 180.0,
        **options: Unpack[CreateOptions],
    ) -> Sandbox:
        """Creates a sandbox and (by default) waits until it accepts commands; the options are
        :class:`~libdsec.options.CreateOptions` (typed keywords), as for
        :meth:`AsyncClient.create`. The sandbox is a context manager that stops on exit::

            with dsec.create(image="busybox", cpu=0.5, memory_mb=256, task_id="swe-123") as sb:
                print(sb.run("echo hi").text)
        """
        return Sandbox(
            self, self._loop.run(self._async.create(wait=wait, timeout=timeout, **options))
        )

    def create_many(
        self,
        count: int | None = None,
        *,
        specs: Sequence[CreateOptions] | None = None,
        wait: bool = True,
        timeout: float | None = 600.0,
        **options: Unpack[SandboxOptions],
    ) -> list[Sandbox | DSecError]:
        """Many sandboxes in one call, ``count`` alike or one per item of ``specs``; in order,
        a sandbox or the error that item got (see :meth:`AsyncClient.create_many`)::

            for r in dsec.create_many(40, image="busybox", cpu=0.25, task_id="swe-123"):
                print(r.id if isinstance(r, Sandbox) else f"failed: {r.reason}")
        """
        out = self._loop.run(
            self._async.create_many(count, specs=specs, wait=wait, timeout=timeout, **options)
        )
        return [Sandbox(self, s) if isinstance(s, AsyncSandbox) else s for s in out]

    def get(self, sandbox_id: str, **kw: Any) -> Sandbox:
        """Reattaches to an existing sandbox (e.g. one created by another process)."""
        return Sandbox(self, self._loop.run(self._async.get(sandbox_id, **kw)))

    def list(self, **kw: Any) -> list[SandboxInfo]:
        return self._loop.run(self._async.list(**kw))

    def stop_all(self, **kw: Any) -> builtins.list[str]:
        return self._loop.run(self._async.stop_all(**kw))

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
        )
        try:
            self._loop.run(w.start())
        except BaseException:
            self._loop.run(w.aclose())
            raise
        return Watch(self, w)

    def fncall(self, **kw: Any) -> FunctionResult:
        """Runs one short job in a warm pool (see :meth:`AsyncClient.fncall`).

        Example: ``dsec.fncall(language="python", code="print(input()[::-1])", stdin="abc")``
        returns a :class:`FunctionResult` with ``verdict == "OK"`` and ``text == "cba\\n"``.
        The same keywords as the async client's, ``compile_time_limit_s=`` (the compile step's
        wall clock, C/C++; 0 = 30 s) and ``fetch_files=[...]`` (files returned after the run in
        ``r.files``, the others with a reason in ``r.fetch_errors``) included.
        """
        return self._loop.run(self._async.fncall(**kw))

    def fncall_many(
        self, jobs: Iterable[FunctionJob | Mapping[str, Any]], **kw: Any
    ) -> Iterator[FunctionResult]:
        """Many jobs in one call, results as they finish; see :meth:`AsyncClient.fncall_many`."""
        return self._loop.iterate(self._async.fncall_many(jobs, **kw))

    def list_environments(self, prefix: str = "", **kw: Any) -> builtins.list[Environment]:
        """See :meth:`AsyncClient.list_environments`."""
        return self._loop.run(self._async.list_environments(prefix, **kw))

    def get_environment(self, name: str, **kw: Any) -> Environment:
        return self._loop.run(self._async.get_environment(name, **kw))

    def list_layers(self, **kw: Any) -> builtins.list[Layer]:
        return self._loop.run(self._async.list_layers(**kw))

    def import_image(self, source: str, name: str = "", **kw: Any) -> Environment:
        """See :meth:`AsyncClient.import_image`: ``dsec.import_image("docker:python:3.11")``."""
        return self._loop.run(self._async.import_image(source, name, **kw))

    def compose_environment(self, name: str, **kw: Any) -> Environment:
        return self._loop.run(self._async.compose_environment(name, **kw))

    def delete_environment(self, name: str, **kw: Any) -> bool:
        return self._loop.run(self._async.delete_environment(name, **kw))

    def create_project(self, name: str, **kw: Any) -> Project:
        return self._loop.run(self._async.create_project(name, **kw))

    def get_project(self, project_id: str = "", **kw: Any) -> Project:
        return self._loop.run(self._async.get_project(project_id, **kw))

    def list_projects(self, parent: str = "", **kw: Any) -> builtins.list[Project]:
        return self._loop.run(self._async.list_projects(parent, **kw))

    def set_quota(self, project_id: str, quota: Quota, **kw: Any) -> Project:
        return self._loop.run(self._async.set_quota(project_id, quota, **kw))

    def delete_project(self, project_id: str, **kw: Any) -> None:
        self._loop.run(self._async.delete_project(project_id, **kw))

    def create_token(self, name: str, **kw: Any) -> NewToken:
        return self._loop.run(self._async.create_token(name, **kw))

    def list_tokens(self, project: str = "", **kw: Any) -> builtins.list[TokenInfo]:
        return self._loop.run(self._async.list_tokens(project, **kw))

    def revoke_token(self, token_id: str, **kw: Any) -> None:
        self._loop.run(self._async.revoke_token(token_id, **kw))


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

    def attach(self, **kw: Any) -> Iterator[ExecEvent]:
        return self._c._loop.iterate(self._p.attach(**kw))

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

    def run(self, cmd: str, **kw: Any) -> ExecResult:
        return self._c._loop.run(self._s.run(cmd, **kw))

    def stream(self, cmd: str, **kw: Any) -> Iterator[ExecEvent]:
        return self._c._loop.iterate(self._s.stream(cmd, **kw))

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

    def read(self, path: str, **kw: Any) -> bytes:
        return self._c._loop.run(self._f.read(path, **kw))

    def write(self, path: str, data: bytes | str, **kw: Any) -> FileInfo:
        return self._c._loop.run(self._f.write(path, data, **kw))

    def list(self, path: str, **kw: Any) -> list[FileInfo]:
        return self._c._loop.run(self._f.list(path, **kw))

    def stat(self, path: str, **kw: Any) -> FileInfo:
        return self._c._loop.run(self._f.stat(path, **kw))

    def exists(self, path: str) -> bool:
        return self._c._loop.run(self._f.exists(path))

    def mkdir(self, path: str, **kw: Any) -> FileInfo:
        return self._c._loop.run(self._f.mkdir(path, **kw))

    def remove(self, path: str, **kw: Any) -> None:
        self._c._loop.run(self._f.remove(path, **kw))

    def move(self, source: str, destination: str, **kw: Any) -> FileInfo:
        return self._c._loop.run(self._f.move(source, destination, **kw))

    def chmod(self, path: str, mode: int) -> FileInfo:
        return self._c._loop.run(self._f.chmod(path, mode))

    def upload(self, source: Any, path: str, **kw: Any) -> FileInfo:
        return self._c._loop.run(self._f.upload(source, path, **kw))

    def download(self, path: str, destination: str | IO[bytes] | Any) -> int:
        return self._c._loop.run(self._f.download(path, destination))

    def iter_download(self, path: str, **kw: Any) -> Iterator[bytes]:
        return self._c._loop.iterate(self._f.iter_download(path, **kw))

    def create_watcher(self, path: str, recursive: bool = False, **kw: Any) -> str:
        """See :meth:`AsyncFiles.create_watcher`."""
        return self._c._loop.run(self._f.create_watcher(path, recursive, **kw))

    def watcher_events(self, watcher_id: str, **kw: Any) -> builtins.list[FileEvent]:
        """See :meth:`AsyncFiles.watcher_events`."""
        return self._c._loop.run(self._f.watcher_events(watcher_id, **kw))

    def remove_watcher(self, watcher_id: str, **kw: Any) -> None:
        """See :meth:`AsyncFiles.remove_watcher`."""
        self._c._loop.run(self._f.remove_watcher(watcher_id, **kw))

    def watch(self, path: str, recursive: bool = False) -> DirWatch:
        """Changes of the directory ``path`` as they happen (see :meth:`AsyncFiles.watch`):
        established when this returns; an iterator of :class:`FileEvent`, a context manager,
        ended with ``close()``::

            with sb.files.watch("/work") as changes:
                for ev in changes:
                    print(ev.type, ev.name)
        """
        return DirWatch(self._c, self._c._loop.run(self._f.watch(path, recursive)))


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
        self.files = Files(client, sandbox.files)

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

    def run(self, cmd: str | list[str], **kw: Any) -> ExecResult:
        return self._c._loop.run(self._s.run(cmd, **kw))

    def stream(self, cmd: str | list[str], **kw: Any) -> Iterator[ExecEvent]:
        return self._c._loop.iterate(self._s.stream(cmd, **kw))

    def start(self, cmd: str | list[str], **kw: Any) -> Process:
        return Process(self._c, self._c._loop.run(self._s.start(cmd, **kw)))

    def process(self, exec_id: str) -> Process:
        return Process(self._c, self._c._loop.run(self._s.process(exec_id)))

    def processes(self) -> list[ExecInfo]:
        return self._c._loop.run(self._s.processes())

    def session(self, **kw: Any) -> Session:
        return Session(self._c, self._c._loop.run(self._s.session(**kw)))

    def http(self, port: int, path: str = "/", **kw: Any) -> HttpResponse:
        return self._c._loop.run(self._s.http(port, path, **kw))

    def wait_for_port(self, port: int, **kw: Any) -> float:
        """See :meth:`AsyncSandbox.wait_for_port`: ``sb.wait_for_port(8000, timeout_s=10)``."""
        return self._c._loop.run(self._s.wait_for_port(port, **kw))

    def stop(self, **kw: Any) -> SandboxInfo:
        return self._c._loop.run(self._s.stop(**kw))

    def pause(self) -> SandboxInfo:
        return self._c._loop.run(self._s.pause())

    def resume(self) -> SandboxInfo:
        return self._c._loop.run(self._s.resume())

    def set_timeout(self, seconds: float) -> SandboxInfo:
        """See :meth:`AsyncSandbox.set_timeout`: ``sb.set_timeout(3600)``."""
        return self._c._loop.run(self._s.set_timeout(seconds))

    def pack_diff(self, name: str, **kw: Any) -> Environment:
        """See :meth:`AsyncSandbox.pack_diff`: ``env = sb.pack_diff("my-env:v2")``."""
        return self._c._loop.run(self._s.pack_diff(name, **kw))

    def update_network_policy(self, policy: NetworkPolicy, **kw: Any) -> SandboxInfo:
        """See :meth:`AsyncSandbox.update_network_policy`."""
        return self._c._loop.run(self._s.update_network_policy(policy, **kw))

    def modified_files(self, **kw: Any) -> list[ModifiedFile]:
        """See :meth:`AsyncSandbox.modified_files`."""
        return self._c._loop.run(self._s.modified_files(**kw))

    def delete(self) -> None:
        self._c._loop.run(self._s.delete())


__all__ = ["Client", "DirWatch", "Files", "Process", "Sandbox", "Session", "Watch"]

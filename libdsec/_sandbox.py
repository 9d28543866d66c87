"""A sandbox and what runs in it: :class:`AsyncSandbox`, :class:`AsyncProcess` (a
background command), :class:`AsyncSession` (a persistent shell).

    async with await dsec.create(image="bookworm") as sb:     # stopped on exit
        r = await sb.run("python3 -c 'print(6*7)'")
        async for ev in sb.stream("make test"):                # Started, Output..., Exited
            print(ev)
        proc = await sb.start("python3 -m http.server 8000")   # background, reattachable
        print((await sb.http(8000, "/")).status)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import datetime
from functools import cached_property
from typing import IO, Any, Unpack

from dsec.apiserver.v1 import apiserver_pb2
from dsec.types.v1 import types_pb2
from libdsec._display import AsyncDisplay
from libdsec._files import AsyncFiles
from libdsec._oplog import Operation, operation_log
from libdsec._transport import STREAM_KEEPALIVE_INTERVAL_S, Link, Transport, new_operation_id
from libdsec.errors import DSecError, Unavailable, item_error
from libdsec.options import SessionRunOptions, SessionStreamOptions
from libdsec.types import (
    Environment,
    ExecEvent,
    ExecInfo,
    ExecResult,
    Exited,
    ForkResult,
    HttpResponse,
    ModifiedFile,
    NetworkPolicy,
    SandboxInfo,
    SandboxMetric,
    event_from_pb,
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
    labels: Mapping[str, str] | None = None,
    user: str = "",
    follow: bool = False,
    pty_size: tuple[int, int] | None = None,
    operation_id: str | None = None,
) -> types_pb2.ExecRequest:
    req = types_pb2.ExecRequest(
        sandbox_id=sandbox_id,
        operation_id=operation_id or new_operation_id(),
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
        labels=dict(labels or {}),
        user=user,
        follow=follow,
    )
    if pty_size is not None:
        req.pty_size.rows, req.pty_size.cols = pty_size
    if isinstance(cmd, str):
        req.command = cmd
    else:
        req.argv.extend(cmd)
    return req


#: The kills of abandoned operations under way (a task must be referenced until it ends).
_KILLS: set[asyncio.Task[None]] = set()


class AsyncProcess:
    """A background command: reattach, wait, signal, send input at any later time."""

    def __init__(self, sandbox: AsyncSandbox, exec_id: str, pid: int) -> None:
        self.sandbox = sandbox
        self.exec_id = exec_id
        self.pid = pid

    async def wait(self, timeout_s: float | None = None) -> ExecInfo:
        """Waits for exit (or ``timeout_s``; then ``.running`` is still True)."""
        rpc = self.sandbox.client.transport
        resp = await rpc.unary(
            rpc.exec.WaitExec,
            types_pb2.WaitExecRequest(
                sandbox_id=self.sandbox.id, exec_id=self.exec_id, timeout_s=timeout_s or 0
            ),
            timeout=(timeout_s or 86400) + 30,
        )
        return ExecInfo.from_pb(resp.info)

    async def kill(self, signal: int = 9) -> bool:
        """Signals the command's whole process group; False if it had already exited."""
        c = self.sandbox.client
        resp = await c.transport.unary(
            c.transport.exec.SignalExec,
            types_pb2.SignalExecRequest(
                sandbox_id=self.sandbox.id, exec_id=self.exec_id, signal=signal
            ),
            timeout=c.timeout,
        )
        return bool(resp.delivered)

    async def _control(self, **action: Any) -> None:
        """Sends one ``ControlExecRequest`` action (``stdin=``, ``close_stdin=`` or ``resize=``,
        the request's own fields: private, its three callers below are the typed surface)."""
        c = self.sandbox.client
        await c.transport.unary(
            c.transport.exec.ControlExec,
            types_pb2.ControlExecRequest(
                sandbox_id=self.sandbox.id, exec_id=self.exec_id, **action
            ),
            timeout=c.timeout,
        )

    async def send_stdin(self, data: bytes | str) -> None:
        """Writes ``data`` (a str is UTF-8) to the command's stdin; calls arrive in order. The
        command must have been started with ``stdin_open=True`` or ``pty``. Closed stdin:
        :class:`FailedPrecondition` ``STDIN_CLOSED``; exited: ``EXEC_EXITED``::

            proc = await sb.start("cat", stdin_open=True)
            await proc.send_stdin("hello\n")
            await proc.close_stdin()
        """
        await self._control(stdin=data.encode() if isinstance(data, str) else data)

    async def close_stdin(self) -> None:
        """Ends the command's input (EOF; on a PTY the EOF character ^D)."""
        await self._control(close_stdin=True)

    async def resize(self, rows: int, cols: int) -> None:
        """Resizes the command's terminal (it gets SIGWINCH). Not a PTY: ``NOT_A_PTY``."""
        await self._control(resize=types_pb2.PtySize(rows=rows, cols=cols))

    async def attach(
        self, *, stdout_offset: int = 0, stderr_offset: int = 0, follow: bool = True
    ) -> AsyncIterator[ExecEvent]:
        """Output from the given offsets (what is still held), then live, then the exit.
        ``follow=False``: only what is held now (a log read); it ends with the exit if the
        command has ended, without one if it still runs."""
        rpc = self.sandbox.client.transport
        request = types_pb2.AttachExecRequest(
            sandbox_id=self.sandbox.id,
            exec_id=self.exec_id,
            stdout_offset=stdout_offset,
            stderr_offset=stderr_offset,
            replay_only=not follow,
        )
        async for ev in rpc.stream(rpc.exec.AttachExec, request):
            e = event_from_pb(ev)
            if e is not None:
                yield e


class AsyncSession:
    """A persistent shell: cwd, exported env and started services survive between runs."""

    def __init__(self, sandbox: AsyncSandbox, session_id: str) -> None:
        self.sandbox = sandbox
        self.session_id = session_id

    async def run(self, cmd: str, **options: Unpack[SessionRunOptions]) -> ExecResult:
        """Runs ``cmd`` in this session (see :meth:`AsyncSandbox.run` for the options)."""
        return await self.sandbox.run(cmd, session=self.session_id, **options)

    def stream(self, cmd: str, **options: Unpack[SessionStreamOptions]) -> AsyncIterator[ExecEvent]:
        """Streams ``cmd`` in this session (see :meth:`AsyncSandbox.stream`)."""
        return self.sandbox.stream(cmd, session=self.session_id, **options)

    async def close(self) -> None:
        c = self.sandbox.client
        await c.transport.unary(
            c.transport.exec.CloseSession,
            types_pb2.CloseSessionRequest(
                sandbox_id=self.sandbox.id,
                session_id=self.session_id,
                operation_id=new_operation_id(),
            ),
            timeout=c.timeout,
        )

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def sandbox_info(rpc: Transport, sandbox_id: str, timeout: float) -> SandboxInfo:
    """A sandbox's state now (GetSandbox): what ``AsyncClient.get`` and ``refresh`` read."""
    resp = await rpc.unary(
        rpc.sandboxes.GetSandbox,
        apiserver_pb2.GetSandboxRequest(sandbox_id=sandbox_id),
        timeout=timeout,
    )
    return SandboxInfo.from_pb(resp.sandbox)


class AsyncSandbox:
    """A sandbox: run commands, use files, stop it. An async context manager that stops on exit."""

    def __init__(self, client: Link, info: SandboxInfo | types_pb2.Sandbox) -> None:
        """``info``: the sandbox as converted, or as the API server described it (then
        converted on the first read of :attr:`info`: a burst's ``create_many`` returns tens
        of thousands of handles, and converting all 32,768 descriptions of a burst took 1 s
        of its 2.6 s)."""
        #: The client that made this handle (an :class:`~libdsec.aio.AsyncClient`).
        self.client = client
        self._id = info.id
        self._info: SandboxInfo | None = None
        self._described: types_pb2.Sandbox | None = None
        if isinstance(info, SandboxInfo):
            self._info = info
        else:
            self._described = info

    @property
    def info(self) -> SandboxInfo:
        """The sandbox as the last call that returned it left it (:meth:`refresh` asks)."""
        info = self._info
        if info is None:
            described = self._described
            assert described is not None
            info = SandboxInfo.from_pb(described)
            if self._described is described:  # not replaced meanwhile (another thread)
                self._info, self._described = info, None
        return info

    @info.setter
    def info(self, info: SandboxInfo) -> None:
        self._info, self._described = info, None

    # Made on first use: a burst's create_many returns tens of thousands of handles, most
    # of which never touch their files or screen.
    @cached_property
    def files(self) -> AsyncFiles:
        """The sandbox's files."""
        return AsyncFiles(self.client, self._id)

    @cached_property
    def display(self) -> AsyncDisplay:
        """The screen, for a sandbox with a display (backend "vm", the ``desktop`` image)."""
        return AsyncDisplay(self.client, self._id)

    @property
    def id(self) -> str:
        return self._id

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
        self.info = await sandbox_info(self.client.transport, self.id, self.client.timeout)
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
        user: str = "",
        labels: Mapping[str, str] | None = None,
        operation_id: str | None = None,
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

        ``user`` runs it as that user of the sandbox's ``/etc/passwd`` (name or uid; HOME,
        USER and LOGNAME from there, cwd its home unless given); unknown:
        :class:`InvalidArgument` ``USER_NOT_FOUND``. ``labels`` tag the command
        (:attr:`ExecInfo.labels`).

        Exactly once: ``operation_id`` names this step in the sandbox's operation log. A run
        with an id already logged returns the logged result (or waits for the command still
        running) and never runs it again, through any API server, after an SDK restart; an id
        whose command was under way when its edge died raises ``OutcomeUnknown``. Without one,
        the SDK makes one, and its own retries (an API server restart) reuse it. The command
        belongs to its operation: it runs on when the caller's connection goes, and a run
        cancelled by its caller (``asyncio`` cancellation) kills it::

            r = await sb.run("git commit -am step", operation_id=f"{task}-{episode}-{turn}")
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
            user=user,
            labels=labels,
            operation_id=operation_id,
        )
        deadline = (timeout_s or 600.0) + 60.0
        try:
            result = await c.transport.unary(c.transport.exec.Exec, req, timeout=deadline)
        except asyncio.CancelledError:
            self._kill_operation(req.operation_id)
            raise
        return ExecResult.from_pb(result)

    def _kill_operation(self, operation_id: str) -> None:
        """Kills the command of an operation its caller gave up on (a cancelled run, a stream
        left early), in the background: its edge would otherwise run it to its end."""
        c = self.client
        request = types_pb2.SignalExecRequest(
            sandbox_id=self.id, operation_id=operation_id, signal=9
        )

        async def kill() -> None:
            with contextlib.suppress(DSecError):
                await c.transport.unary(c.transport.exec.SignalExec, request, timeout=10.0)

        task = asyncio.get_running_loop().create_task(kill())
        _KILLS.add(task)
        task.add_done_callback(_KILLS.discard)

    async def stream(
        self,
        cmd: str | list[str],
        *,
        timeout_s: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        pty: bool | tuple[int, int] = False,
        max_output_bytes: int | None = None,
        session: str = "",
        trusted: bool = False,
        user: str = "",
        labels: Mapping[str, str] | None = None,
        background: bool = False,
        stdin_open: bool = False,
        operation_id: str | None = None,
    ) -> AsyncIterator[ExecEvent]:
        """Yields :class:`Started`, then :class:`Output` events as produced, then one :class:`Exited`.

        Keepalives flow underneath; if the stream stalls or the sandbox dies
        an error is raised (never a hang). Leaving the loop early kills the command, unless
        ``background=True``: then it keeps running, and ``sb.process(started.exec_id)``
        reattaches, waits, signals or sends input later::

            async for ev in sb.stream("python3 -m http.server 8000", background=True):
                if isinstance(ev, Started):
                    server = await sb.process(ev.exec_id)
                    break                               # the server stays up

        ``stdin_open`` (and a ``pty``, ``(rows, cols)`` or True) keep the command's input open
        for :meth:`AsyncProcess.send_stdin` / ``resize`` by its exec id, as with :meth:`start`.

        ``operation_id``: as :meth:`run`'s; a stream opened again with a logged id gets the
        command's events from its start (a live command's from the sandbox, an ended one's
        as logged: its head and tail) and never runs it again.
        """
        c = self.client
        req = _exec_request(
            self.id,
            cmd,
            timeout_s=timeout_s,
            cwd=cwd,
            env=env,
            stdin=stdin,
            pty=bool(pty),
            pty_size=pty if isinstance(pty, tuple) else None,
            max_output_bytes=max_output_bytes,
            session_id=session,
            trusted=trusted,
            user=user,
            labels=labels,
            background=background,
            follow=background,
            stdin_open=stdin_open or (background and bool(pty)),
            operation_id=operation_id,
        )
        req.keepalive_interval_ms = round(STREAM_KEEPALIVE_INTERVAL_S * 1000)
        exited = False
        try:
            async for ev in c.transport.stream(c.transport.exec.ExecStream, req):
                e = event_from_pb(ev)
                if e is not None:
                    exited = exited or isinstance(e, Exited)
                    yield e
        finally:
            if not exited and not background:  # left early: the command dies with the stream
                self._kill_operation(req.operation_id)
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
        labels: Mapping[str, str] | None = None,
        user: str = "",
        stdin_open: bool = False,
        pty: bool | tuple[int, int] = False,
        operation_id: str | None = None,
    ) -> AsyncProcess:
        """Starts a background command; returns at once with a handle to wait on, kill, reattach
        or send input to. ``stdin_open=True`` keeps its stdin (a pipe) open for
        :meth:`AsyncProcess.send_stdin`; ``pty`` runs it under a terminal (``(rows, cols)``, or
        True for 24x80) whose input stays open, with :meth:`AsyncProcess.resize`::

            shell = await sb.start("bash -i", pty=(40, 120), labels={"role": "terminal"})
            await shell.send_stdin("ls\n")
            await shell.resize(50, 160)
        """
        c = self.client
        req = _exec_request(
            self.id,
            cmd,
            timeout_s=timeout_s,
            cwd=cwd,
            env=env,
            stdin=stdin,
            pty=bool(pty),
            pty_size=pty if isinstance(pty, tuple) else None,
            max_output_bytes=max_output_bytes,
            session_id=session,
            background=True,
            stdin_open=stdin_open or bool(pty),
            labels=labels,
            user=user,
            operation_id=operation_id,
        )
        async for ev in c.transport.stream(c.transport.exec.ExecStream, req):
            if ev.WhichOneof("event") == "started":
                return AsyncProcess(self, ev.started.exec_id, ev.started.pid)
        raise Unavailable("background start returned no exec id", reason="STREAM_ENDED_EARLY")

    async def process(self, exec_id: str) -> AsyncProcess:
        """A handle to a background command started earlier (e.g. by another process)."""
        return AsyncProcess(self, exec_id, 0)

    async def processes(self) -> list[ExecInfo]:
        c = self.client
        resp = await c.transport.unary(
            c.transport.exec.ListExecs,
            types_pb2.ListExecsRequest(sandbox_id=self.id),
            timeout=c.timeout,
        )
        return [ExecInfo.from_pb(i) for i in resp.execs]

    async def session(
        self, *, shell: str = "", cwd: str = "", env: Mapping[str, str] | None = None
    ) -> AsyncSession:
        """Opens a persistent shell session (several may be open at once)."""
        c = self.client
        resp = await c.transport.unary(
            c.transport.exec.CreateSession,
            types_pb2.CreateSessionRequest(
                sandbox_id=self.id,
                shell=shell,
                cwd=cwd,
                env=dict(env or {}),
                operation_id=new_operation_id(),
            ),
            timeout=c.timeout,
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
        wait_s: float = 0.0,
    ) -> HttpResponse:
        """An HTTP request to a service listening on ``port`` inside the sandbox.

        ``wait_s``: first wait up to this long for the server to listen
        (:meth:`wait_for_port`), e.g. right after starting it; 0 (the default) sends at once,
        and nothing listening is ``Unavailable`` (reason ``CONNECTION_REFUSED``)."""
        if wait_s:
            await self.wait_for_port(port, timeout_s=wait_s)
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
            await c.transport.unary(c.transport.exec.SendHttp, req, timeout=timeout_s + 30)
        )

    async def wait_for_port(self, port: int, *, timeout_s: float = 30.0) -> float:
        """Waits until a server inside the sandbox accepts connections on ``port`` (on its
        loopback: a server bound to 0.0.0.0 or 127.0.0.1), e.g. one just started with
        :meth:`start`; returns the seconds waited. The sandbox itself tries every 20 ms, so
        this is one call. Nothing listening within ``timeout_s``: ``DeadlineExceeded``
        (reason ``PORT_NOT_LISTENING``)::

            sb.start("python3 -m http.server 8000")
            sb.wait_for_port(8000, timeout_s=10)
        """
        req = types_pb2.WaitForPortRequest(sandbox_id=self.id, port=port, timeout_s=timeout_s)
        rpc = self.client.transport
        resp = await rpc.unary(rpc.exec.WaitForPort, req, timeout=timeout_s + 30)
        return float(resp.waited_s)

    async def _lifecycle(self, method: str, request: Any, timeout: float) -> SandboxInfo:
        rpc = self.client.transport
        resp = await rpc.unary(getattr(rpc.sandboxes, method), request, timeout=timeout)
        self.info = SandboxInfo.from_pb(resp.sandbox)
        return self.info

    async def stop(self, *, grace_s: float = 2.0) -> SandboxInfo:
        """Stops the sandbox (terminal state STOPPED); idempotent."""
        return await self._lifecycle(
            "StopSandbox",
            apiserver_pb2.StopSandboxRequest(sandbox_id=self.id, grace_s=grace_s),
            60 + grace_s,
        )

    async def pause(self, *, memory: bool = True) -> SandboxInfo:
        """Stops everything in the sandbox and gives its memory back to the node, keeping files,
        processes and their memory contents: a container's pages go to the edge's swap area, a
        microVM is saved to local disk. ``refresh().memory`` says how much was freed. Any later
        call (exec, files, HTTP, sessions) resumes it first (unless it was created with
        ``manual_resume``); the TTL keeps counting while paused, the idle timeout does not.
        Not RUNNING: ``FailedPrecondition``.

        ``memory=False`` keeps the files only (a cold pause, containers): every process is
        stopped and all of its memory given back; the resume boots it afresh on its files
        (a new init and agents, no processes, same id). ``info.paused_files_only`` says so.
        Another backend: ``BackendCapabilityMissing`` (``files_only_pause``)."""
        return await self._lifecycle(
            "PauseSandbox",
            apiserver_pb2.PauseSandboxRequest(sandbox_id=self.id, files_only=not memory),
            120,
        )

    async def set_timeout(self, seconds: float) -> SandboxInfo:
        """Changes the sandbox's lifetime: it ends (termination reason ``TTL``) ``seconds``
        from now, sooner or later than its ``ttl_s`` said; ``info.expires_at`` is the new
        end. ``0 < seconds <=`` the maximum ``ttl_s`` a create accepts, else
        ``InvalidArgument``; an ended sandbox: ``SandboxTerminated``::

            await sb.set_timeout(3600)   # one more hour from now
        """
        return await self._lifecycle(
            "SetSandboxTimeout",
            apiserver_pb2.SetSandboxTimeoutRequest(sandbox_id=self.id, timeout_s=seconds),
            60,
        )

    async def resume(self) -> SandboxInfo:
        """Thaws a paused sandbox (memory is read back as it runs). If the memory its pause gave
        back does not fit on its node now: ``NodeMemoryFull`` and it stays PAUSED."""
        return await self._lifecycle(
            "ResumeSandbox", apiserver_pb2.ResumeSandboxRequest(sandbox_id=self.id), 120
        )

    async def fork(
        self,
        n: int,
        *,
        labels: Mapping[str, str] | None = None,
        task_id: str = "",
        ttl_s: int = 0,
        require_memory: bool = False,
        timeout: float = 900.0,
    ) -> ForkResult[AsyncSandbox]:
        """``n`` independent copies of this sandbox at one instant (1..64), on its node:
        GRPO groups, tree search, best-of-N from a mid-episode state. The source keeps
        running (it stands still while its state is captured: ``result.stall_s``); a paused
        source stays paused. A microVM's children continue every process from the fork point
        (``result.kind == "memory"``); a container's get its files and each session's cwd and
        environment, not its processes (``"files"``; ``require_memory=True`` refuses that
        with ``FailedPrecondition`` ``FORK_MEMORY_UNAVAILABLE``). Children take the source's
        spec; ``labels`` are set over its labels, ``task_id`` and ``ttl_s`` replace its own.
        Quota for all ``n`` is reserved first (``QuotaExceeded``, nothing made); a node that
        cannot hold them all: ``EdgeCapacity`` with ``metadata["fits"]``. Per child, in order,
        a sandbox or the error it got::

            group = await sb.fork(16, task_id="grpo-step-7")
            outs = await asyncio.gather(*(c.run("python rollout.py") for c in group.sandboxes))
        """
        rpc = self.client.transport
        resp = await rpc.unary(
            rpc.sandboxes.ForkSandbox,
            apiserver_pb2.ForkSandboxRequest(
                sandbox_id=self.id,
                count=n,
                labels=dict(labels or {}),
                task_id=task_id,
                ttl_s=ttl_s,
                require_memory=require_memory,
            ),
            timeout=timeout,
        )
        children: list[AsyncSandbox | DSecError] = [
            item_error(r.error) if r.error.code else AsyncSandbox(self.client, r.sandbox)
            for r in resp.results
        ]
        kind = types_pb2.ForkKind.Name(resp.fork_kind).removeprefix("FORK_KIND_").lower()
        return ForkResult(children, kind, resp.source_stall_s)

    async def pack_diff(
        self,
        name: str,
        *,
        exclude: Iterable[str] = (),
        default_excludes: bool = True,
        config: Mapping[str, str] | None = None,
        timeout: float = 1800.0,
    ) -> Environment:
        """Checkpoints this sandbox's writable layer as environment ``name``: its layers plus
        the diff. New sandboxes start from it (``create(image=name)``), and packing one of
        those again chains diffs. Build residue is left out (``/tmp``, ``/var/tmp``, caches,
        shell history, ...; ``exclude`` adds absolute path globs, ``default_excludes=False``
        keeps everything). ``config`` adds entries to the environment's config (``env.NAME``
        variables and ``workdir`` apply to sandboxes made from it); the API server records
        this project as its owner (``dsec.project``), which may then delete it. A running
        sandbox is frozen only while its changes are copied::

            env = await sb.pack_diff("my-env:v2")
        """
        rpc = self.client.transport
        resp = await rpc.unary(
            rpc.sandboxes.PackDiff,
            apiserver_pb2.PackDiffRequest(
                sandbox_id=self.id,
                name=name,
                exclude=list(exclude),
                no_default_excludes=not default_excludes,
                config=dict(config or {}),
            ),
            timeout=timeout,
        )
        return Environment.from_pb(resp.environment)

    async def update_network_policy(
        self, policy: NetworkPolicy, *, timeout: float | None = None
    ) -> SandboxInfo:
        """Replaces the egress policy while the sandbox runs (e.g. per task stage); the next
        connection sees it. A malformed rule raises :class:`InvalidArgument` naming it::

            await sb.update_network_policy(NetworkPolicy(allow=["pypi.org:443"]))
        """
        rpc = self.client.transport
        resp = await rpc.unary(
            rpc.sandboxes.UpdateNetworkPolicy,
            apiserver_pb2.UpdateNetworkPolicyRequest(sandbox_id=self.id, policy=policy.to_pb()),
            timeout=timeout or 30.0,
        )
        self.info = SandboxInfo.from_pb(resp.sandbox)
        return self.info

    async def metrics(
        self,
        *,
        start: datetime | None = None,
        end: datetime | None = None,
        timeout: float | None = None,
    ) -> list[SandboxMetric]:
        """Samples of the sandbox's CPU, memory and disk use, oldest first: its edge takes one
        every few seconds while it runs and keeps the last ten minutes (by default). ``start``
        and ``end`` narrow the window (default: all that is kept, up to now). Container
        sandboxes; another backend raises BackendCapabilityMissing."""
        req = types_pb2.GetSandboxMetricsRequest(sandbox_id=self.id)
        if start is not None:
            req.start.FromDatetime(start)
        if end is not None:
            req.end.FromDatetime(end)
        rpc = self.client.transport
        resp = await rpc.unary(rpc.sandboxes.GetSandboxMetrics, req, timeout=timeout or 30.0)
        return [SandboxMetric.from_pb(m) for m in resp.metrics]

    async def modified_files(self, *, timeout: float | None = None) -> list[ModifiedFile]:
        """Files of the image's read-only layers this sandbox modified or deleted (from its
        writable layer); new files are not listed. For checking an agent's trajectory."""
        rpc = self.client.transport
        resp = await rpc.unary(
            rpc.sandboxes.GetModifiedFiles,
            apiserver_pb2.GetModifiedFilesRequest(sandbox_id=self.id),
            timeout=timeout or 60.0,
        )
        return [ModifiedFile(f.path, f.deleted) for f in resp.files]

    async def log(
        self, *, after_seq: int = 0, with_bodies: bool = False, timeout: float | None = None
    ) -> list[Operation]:
        """The sandbox's operation log: every call that changed it, in order (an exec with
        its exit status and output digests, a file write, an upload, ...), also after it
        ended while its edge keeps it. ``with_bodies`` adds the requests and the kept output::

            for op in await sb.log():
                print(op.seq, op.kind, op.state, op.exit_code, op.summary())
        """
        ops, _ = await operation_log(
            self.client.transport,
            self.id,
            after_seq=after_seq,
            with_bodies=with_bodies,
            timeout=self.client.timeout if timeout is None else timeout,
        )
        return ops

    async def follow_log(
        self, *, after_seq: int = 0, interval_s: float = 0.5
    ) -> AsyncIterator[Operation]:
        """The log's entries as each operation ends (every entry after ``after_seq``, in
        order), until the sandbox has ended and its last operation is written."""
        rpc, timeout = self.client.transport, self.client.timeout
        while True:
            ops, ended = await operation_log(rpc, self.id, after_seq=after_seq, timeout=timeout)
            for op in ops:
                if op.state == "RUNNING":
                    break  # in order: this one and what follows come again next time
                yield op
                after_seq = op.seq
            else:
                if ended:
                    return
            await asyncio.sleep(interval_s)

    async def export_log(self, destination: str | os.PathLike[str] | IO[str]) -> int:
        """Writes the trajectory export (JSON Lines, one object per operation, schema
        ``dsec.operation/v1``, see the README) to a path or a text file; returns the count."""
        ops = await self.log(with_bodies=True)
        lines = [json.dumps(op.to_json(self.id), sort_keys=True) + "\n" for op in ops]
        if isinstance(destination, (str, os.PathLike)):
            with open(destination, "w") as fh:
                fh.writelines(lines)
        else:
            destination.writelines(lines)
        return len(ops)

    async def delete(self) -> None:
        rpc = self.client.transport
        await rpc.unary(
            rpc.sandboxes.DeleteSandbox,
            apiserver_pb2.DeleteSandboxRequest(sandbox_id=self.id),
            timeout=60,
        )

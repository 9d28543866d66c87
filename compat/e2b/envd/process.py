"""envd's ``process.Process`` service on chronus background commands.

Every E2B process is a dsec background exec (``stream(..., background=True)``): its Start
stream is the exec's live output, a client that goes away leaves it running, and Connect
(by pid or tag) reattaches with ``AsyncProcess.attach``. Nothing is kept here: the pid is
the one chronus reports (stable across reconnects and front-end instances), and the E2B tag
and the config the process was started with are exec labels, so List and Connect-by-tag
answer from dsec alone.

Differences from envd (README): Connect replays the output dsec still holds for the
process (head and tail, ``DSEC_COMPAT_MAX_OUTPUT_BYTES`` per stream) before following it
live, where envd sends only what comes after the Connect; output past that cap is cut.
"""

from __future__ import annotations

import json
import signal as signals
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from compat.e2b import dsec
from compat.e2b.envd.call import current, invalid, mapped
from compat.e2b.envd.gen.process import process_pb as pb
from compat.e2b.envd.gen.process.process_connect import Process
from compat.e2b.envd.streams import KEEPALIVE, with_keepalives
from libdsec import ExecInfo, Exited, ExitStatus, Output, Started
from libdsec.errors import DSecError
from libdsec.types import ExecEvent

LABEL_TAG = "e2b.tag"
LABEL_CMD = "e2b.cmd"
#: The config label is kept only while it fits a label value.
MAX_LABEL = 1024  # chronus's limit for a label value

_GO_SIGNAL_NAMES: dict[int, str] = {
    signals.SIGKILL: "killed",
    signals.SIGTERM: "terminated",
    signals.SIGINT: "interrupt",
    signals.SIGHUP: "hangup",
    signals.SIGQUIT: "quit",
    signals.SIGPIPE: "broken pipe",
    signals.SIGSEGV: "segmentation fault",
    signals.SIGABRT: "aborted",
}


def _event(**kw: Any) -> pb.ProcessEvent:
    ((name, value),) = kw.items()
    arm: Any = Oneof(name, value)
    return pb.ProcessEvent(event=arm)


def start_event(pid: int) -> pb.ProcessEvent:
    return _event(start=pb.ProcessEvent.StartEvent(pid=pid))


def keepalive_event() -> pb.ProcessEvent:
    return _event(keepalive=pb.ProcessEvent.KeepAlive())


def data_event(out: Output, pty: bool) -> pb.ProcessEvent:
    arm: Any = Oneof("pty" if pty else out.stream, out.data)
    return _event(data=pb.ProcessEvent.DataEvent(output=arm))


def end_event(status: ExitStatus) -> pb.ProcessEvent:
    """envd's end event: Go's ``ProcessState`` wording ("exit status 1", "signal: killed")."""
    sig = status.signal or (signals.SIGKILL if status.timed_out else 0)
    if sig:
        text = "signal: " + _GO_SIGNAL_NAMES.get(sig, f"signal {sig}")
        end = pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=text)
    else:
        end = pb.ProcessEvent.EndEvent(
            exit_code=status.exit_code, exited=True, status=f"exit status {status.exit_code}"
        )
    if status.error:
        end.error = status.error
    return _event(end=end)


#: What envd's stream ends with when the request's deadline passes (Go's ``ctx.Err()``).
DEADLINE_MESSAGE = "context deadline exceeded"


def ended(status: ExitStatus, *, deadline: bool) -> pb.ProcessEvent:
    """The end event of a Start stream, or, for a process killed because the request's
    deadline (``Connect-Timeout-Ms``) passed, envd's answer then: the stream's own
    ``deadline_exceeded`` (envd kills the process with the request's context, so the stream
    ends with that context's error and sends no end event)."""
    if deadline and status.timed_out:
        raise ConnectError(Code.DEADLINE_EXCEEDED, DEADLINE_MESSAGE)
    return end_event(status)


def _config_of(info: ExecInfo) -> pb.ProcessConfig:
    raw = info.labels.get(LABEL_CMD)
    if raw:
        try:
            c = json.loads(raw)
            cfg = pb.ProcessConfig(cmd=c["cmd"], args=c.get("args", []), envs=c.get("envs", {}))
            if c.get("cwd") is not None:
                cfg.cwd = c["cwd"]
            return cfg
        except (ValueError, KeyError, TypeError):
            pass
    argv = info.argv or [info.command]
    cfg = pb.ProcessConfig(cmd=argv[0], args=argv[1:], envs=dict(info.env))
    if info.cwd:
        cfg.cwd = info.cwd
    return cfg


async def find(selector: pb.ProcessSelector | None) -> ExecInfo:
    """The exec a selector names: by pid (chronus's), or by E2B tag; a running one first."""
    if selector is None or selector.selector is None:
        raise invalid("process selector (pid or tag) is required")
    field, value = selector.selector.field, selector.selector.value
    infos = await current().sandbox.processes()
    if field == "pid":
        matches = [i for i in infos if i.pid == value]
    else:
        matches = [i for i in infos if i.labels.get(LABEL_TAG) == value]
    running = [i for i in matches if i.running]
    if running:
        return running[-1]
    if matches:
        return matches[-1]
    raise ConnectError(Code.NOT_FOUND, f"process with {field} {value} not found")


async def _running(selector: pb.ProcessSelector | None) -> ExecInfo:
    info = await find(selector)
    if not info.running:
        raise ConnectError(Code.NOT_FOUND, f"process with pid {info.pid} has exited")
    return info


class ProcessService(Process):
    """The Connect handlers; each maps to one or two libdsec calls (see module doc)."""

    def __init__(self, max_output_bytes: int) -> None:
        self.max_output_bytes = max_output_bytes

    async def _follow(
        self, events: AsyncIterator[ExecEvent], pty: bool, *, deadline: bool = False
    ) -> AsyncIterator[pb.ProcessEvent]:
        async for ev in with_keepalives(events, current().keepalive_s):
            if ev is KEEPALIVE:
                yield keepalive_event()
            elif isinstance(ev, Started):
                yield start_event(ev.pid)
            elif isinstance(ev, Output):
                yield data_event(ev, pty)
            elif isinstance(ev, Exited):
                yield ended(ev.status, deadline=deadline)
                return

    def start(
        self, request: pb.StartRequest, ctx: RequestContext[pb.StartRequest, pb.StartResponse]
    ) -> AsyncIterator[pb.StartResponse]:
        async def run() -> AsyncIterator[pb.StartResponse]:
            call = current()
            cfg = request.process
            if cfg is None or not cfg.cmd:
                raise invalid("process.cmd is required")
            # envd: the user's home unless asked (dsec already starts a named user there)
            cwd = call.resolve(cfg.cwd) if cfg.has_field("cwd") and cfg.cwd else None
            if cwd is None and call.default_workdir:
                cwd = call.default_workdir  # a built template's WORKDIR
            if cwd is None and not call.run_as:
                cwd = call.home
            labels = {}
            config = json.dumps(
                {
                    "cmd": cfg.cmd,
                    "args": list(cfg.args),
                    "envs": dict(cfg.envs),
                    "cwd": cfg.cwd if cfg.has_field("cwd") else None,
                },
                separators=(",", ":"),
            )
            if len(config) <= MAX_LABEL:
                labels[LABEL_CMD] = config
            if request.has_field("tag"):
                labels[LABEL_TAG] = request.tag
            pty = None
            if request.pty is not None:
                size = request.pty.size or pb.PTY.Size(cols=80, rows=24)
                pty = (size.rows or 24, size.cols or 80)
            remaining_ms = ctx.timeout_ms
            # envd: the request's deadline is the process's timeout (killed when it passes);
            # a client that disconnects leaves the process running.
            timeout_s = remaining_ms / 1000 if remaining_ms and remaining_ms > 0 else None
            events = dsec.start_process(
                call.sandbox,
                [cfg.cmd, *cfg.args],
                labels=labels,
                user=call.run_as,
                stdin_open=request.stdin if request.has_field("stdin") else True,
                pty=pty,
                cwd=cwd,
                env=dict(cfg.envs),
                timeout_s=timeout_s,
                max_output_bytes=self.max_output_bytes,
            )
            follow = self._follow(events, pty is not None, deadline=timeout_s is not None)
            async for ev in follow:
                yield pb.StartResponse(event=ev)

        return mapped(run)

    def connect(
        self,
        request: pb.ConnectRequest,
        ctx: RequestContext[pb.ConnectRequest, pb.ConnectResponse],
    ) -> AsyncIterator[pb.ConnectResponse]:
        async def run() -> AsyncIterator[pb.ConnectResponse]:
            info = await find(request.process)
            proc = await current().sandbox.process(info.exec_id)
            yield pb.ConnectResponse(event=start_event(info.pid))
            async for ev in self._follow(proc.attach(), info.pty):
                yield pb.ConnectResponse(event=ev)

        return mapped(run)

    async def list(
        self, request: pb.ListRequest, ctx: RequestContext[pb.ListRequest, pb.ListResponse]
    ) -> pb.ListResponse:
        call = current()
        try:
            infos = await call.sandbox.processes()
        except DSecError as exc:
            raise call.error(exc) from None
        out = []
        for info in infos:
            if not info.running:
                continue
            p = pb.ProcessInfo(config=_config_of(info), pid=info.pid)
            tag = info.labels.get(LABEL_TAG)
            if tag is not None:
                p.tag = tag
            out.append(p)
        return pb.ListResponse(processes=out)

    async def send_signal(
        self,
        request: pb.SendSignalRequest,
        ctx: RequestContext[pb.SendSignalRequest, pb.SendSignalResponse],
    ) -> pb.SendSignalResponse:
        call = current()
        if int(request.signal) == 0:
            raise invalid("signal is required (SIGNAL_SIGTERM or SIGNAL_SIGKILL)")
        try:
            info = await _running(request.process)
            proc = await call.sandbox.process(info.exec_id)
            if not await proc.kill(int(request.signal)):
                raise ConnectError(Code.NOT_FOUND, f"process with pid {info.pid} has exited")
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.SendSignalResponse()

    async def _input(
        self, selector: pb.ProcessSelector | None, data: pb.ProcessInput | None
    ) -> None:
        call = current()
        if data is None or data.input is None:
            raise invalid("input (stdin or pty bytes) is required")
        try:
            info = await _running(selector)
            proc = await call.sandbox.process(info.exec_id)
            await proc.send_stdin(data.input.value)
        except DSecError as exc:
            raise call.error(exc) from None

    async def send_input(
        self,
        request: pb.SendInputRequest,
        ctx: RequestContext[pb.SendInputRequest, pb.SendInputResponse],
    ) -> pb.SendInputResponse:
        await self._input(request.process, request.input)
        return pb.SendInputResponse()

    async def stream_input(
        self,
        request: AsyncIterator[pb.StreamInputRequest],
        ctx: RequestContext[pb.StreamInputRequest, pb.StreamInputResponse],
    ) -> pb.StreamInputResponse:
        selector: pb.ProcessSelector | None = None
        async for msg in request:
            event = msg.event
            if event is None or event.field == "keepalive":
                continue
            if event.field == "start":
                selector = event.value.process
                await _running(selector)
            elif selector is None:
                raise invalid("the first StreamInput message must name the process (start)")
            else:
                await self._input(selector, event.value.input)
        return pb.StreamInputResponse()

    async def close_stdin(
        self,
        request: pb.CloseStdinRequest,
        ctx: RequestContext[pb.CloseStdinRequest, pb.CloseStdinResponse],
    ) -> pb.CloseStdinResponse:
        call = current()
        try:
            info = await _running(request.process)
            if info.pty:
                raise invalid("a PTY has no stdin to close: send Ctrl-D (0x04) instead")
            proc = await call.sandbox.process(info.exec_id)
            await proc.close_stdin()
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.CloseStdinResponse()

    async def update(
        self, request: pb.UpdateRequest, ctx: RequestContext[pb.UpdateRequest, pb.UpdateResponse]
    ) -> pb.UpdateResponse:
        call = current()
        if request.pty is None or request.pty.size is None:
            return pb.UpdateResponse()  # envd: nothing to change
        size = request.pty.size
        try:
            info = await _running(request.process)
            proc = await call.sandbox.process(info.exec_id)
            await proc.resize(size.rows, size.cols)
        except DSecError as exc:
            raise call.error(exc) from None
        return pb.UpdateResponse()

"""The libdsec calls the E2B front end makes into a sandbox, in one place.

Most are plain libdsec. Two need care: a handle on a sandbox without a GetSandbox round
trip (an envd call's own RPC answers NOT_FOUND for a sandbox that is missing or another
project's, exactly like a missing one), and starting an E2B process: a background exec
whose stream is its live output (``stream(..., background=True)``: cancelling the stream
leaves the process running), with its E2B tag and config as exec labels.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Mapping
from typing import Any

from libdsec import AsyncClient, AsyncSandbox, ExecInfo, SandboxInfo, Started
from libdsec.errors import Unimplemented
from libdsec.types import ExecEvent


def sandbox(client: AsyncClient, sandbox_id: str) -> AsyncSandbox:
    """A handle for calls into ``sandbox_id`` (no lookup: the calls themselves check)."""
    info = SandboxInfo(
        id=sandbox_id,
        project_id="",
        state="RUNNING",
        backend="",
        image="",
        edge_id="",
        labels={},
        task_id="",
        created_at=None,
        expires_at=None,
        termination_reason=None,
        termination_message="",
        violations={},
        memory=None,
    )
    return AsyncSandbox(client, info)


def _accepts(fn: object, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


#: Whether this libdsec starts followed background execs with labels, users, stdin and PTYs.
FOLLOWED_EXECS = _accepts(AsyncSandbox.stream, "labels")


async def start_process(
    sb: AsyncSandbox,
    argv: list[str],
    *,
    labels: Mapping[str, str],
    user: str,
    stdin_open: bool,
    pty: tuple[int, int] | None,
    cwd: str | None,
    env: Mapping[str, str],
    timeout_s: float | None,
    max_output_bytes: int,
) -> AsyncIterator[ExecEvent]:
    """Started(exec_id, pid), then Output as produced, then Exited; the process outlives
    the iteration (closing it early only stops following)."""
    if FOLLOWED_EXECS:
        options: dict[str, Any] = {
            "background": True,
            "labels": dict(labels),
            "user": user,
            "stdin_open": stdin_open,
            "pty": pty if pty is not None else False,
            "cwd": cwd,
            "env": env,
            "timeout_s": timeout_s,
            "max_output_bytes": max_output_bytes,
        }
        async for ev in sb.stream(argv, **options):
            yield ev
        return
    # A libdsec without followed execs: start in the background, then attach from the start.
    # Tags, users, stdin and PTYs need the newer one (dsec answers UNIMPLEMENTED for them).
    if user or pty is not None or stdin_open:
        what = "a PTY" if pty is not None else "a user" if user else "open stdin"
        raise Unimplemented(f"this dsec cannot start a process with {what} yet")
    proc = await sb.start(
        argv, cwd=cwd, env=env, timeout_s=timeout_s, max_output_bytes=max_output_bytes
    )
    yield Started(proc.exec_id, proc.pid)
    async for ev in proc.attach():
        if not isinstance(ev, Started):
            yield ev


def labels_of(info: ExecInfo) -> dict[str, str]:
    return dict(getattr(info, "labels", None) or {})


def process_method(proc: object, name: str) -> object:
    """A control method of a process handle (send_stdin, close_stdin, resize) or
    UNIMPLEMENTED when this libdsec has none."""
    fn = getattr(proc, name, None)
    if fn is None:
        raise Unimplemented(f"this dsec cannot {name.replace('_', ' ')} of a process yet")
    return fn

"""The libdsec calls the E2B front end makes into a sandbox that need a word of why.

A handle on a sandbox without a GetSandbox round trip: an envd call's own RPC answers
NOT_FOUND for a sandbox that is missing or another project's, exactly like a missing one,
so looking it up first would only add a round trip. And starting an E2B process: a
background exec whose stream is its live output (``stream(..., background=True)`` follows
it; leaving the stream leaves the process running), with its E2B tag and config as exec
labels, so List and Connect answer from dsec alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from libdsec import AsyncClient, AsyncSandbox, SandboxInfo, Violations
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
        violations=Violations({}),
        memory=None,
    )
    return AsyncSandbox(client, info)


def start_process(
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
    return sb.stream(
        argv,
        background=True,
        labels=dict(labels),
        user=user,
        stdin_open=stdin_open,
        pty=pty if pty is not None else False,
        cwd=cwd,
        env=env,
        timeout_s=timeout_s,
        max_output_bytes=max_output_bytes,
    )

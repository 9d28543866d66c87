"""What a container fork copies besides the files: the state dsec knows of its shell sessions.

A container's processes cannot be copied on this kernel (CRIU fails on the vDSO: README,
"Fork"), so a child gets the source's files and, for each of the source's chronus sessions, a
new session under the same id (chronus's RestoreSession, an edge-only call), in the same working
directory, with the same exported environment. Unexported variables, functions, aliases and
jobs live only inside the source's shell and are not copied; neither is the removal of a
variable the sandbox's environment has (the child's new shell starts with it again).

The state is read from the running source through its chronus: ListSessions gives each
session's shell and cwd (chronus reads /proc/<shell>/cwd); `env -0` run in the session gives
what the shell exports. The read is a command in the source's session: its `$?` and `$_`
afterwards are those of `env -0`. A session busy with a command at that moment cannot be asked:
its cwd is still known, its environment is then the one the child's new session starts with.
A frozen source answers nothing, so a pause lists the sessions just before the freeze and keeps
them in the record (`rec.runtime["sessions"]`) for a fork of the paused source: ids, shells and
cwds only. A pause runs no command in a session (it must leave `$?` as it was), so the children
of a paused source get each session's cwd, not the variables it exported.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsec.chronus.v1 import chronus_pb2
from dsec.types.v1 import types_pb2
from libdsec.errors import DSecError

log = logging.getLogger(__name__)

#: Where the state read at a pause is kept in the sandbox's runtime record.
RECORD_KEY = "sessions"
#: Set by the shell or by chronus in every session: copying them would be wrong (PWD follows the
#: cwd, SHLVL and _ belong to the new shell) or pointless.
_SHELL_OWN = frozenset({"_", "PWD", "OLDPWD", "SHLVL", "PS1", "PS2"})
#: One call into the sandbox for the copy (a session's `env -0`, a session's creation).
CALL_TIMEOUT_S = 10.0
#: What a pause waits for the sessions' state before it freezes without it. A paused sandbox
#: is not asked (it is frozen); a slow one (0.01 cpu, swapping) may not answer in time: its
#: pause is then late by this much and a fork of it gets no sessions; on a lost node there is
#: no pause.
PAUSE_READ_S = 2.0


@dataclass(frozen=True)
class SessionState:
    session_id: str
    shell: str
    cwd: str
    #: What the session's shell exports; None when it could not be asked (busy).
    env: dict[str, str] | None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.session_id, "shell": self.shell, "cwd": self.cwd, "env": self.env}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionState:
        env = d.get("env")
        return cls(str(d["id"]), str(d.get("shell", "")), str(d.get("cwd", "")), env)


def parse_env(output: bytes) -> dict[str, str]:
    """`env -0` output -> the variables a copy of the session must export."""
    env: dict[str, str] = {}
    for item in output.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if not sep or not name:
            continue
        key = name.decode(errors="replace")
        if key not in _SHELL_OWN:
            env[key] = value.decode(errors="replace")  # a proto string is UTF-8
    return env


async def capture(channel: Any, sandbox_id: str, *, with_env: bool = True) -> list[SessionState]:
    """The sessions of a running sandbox, each with its cwd and (`with_env`) its exported
    environment, read by a command in the session."""
    listed = await channel.unary(
        "list_sessions",
        types_pb2.ListSessionsRequest(sandbox_id=sandbox_id),
        timeout_s=CALL_TIMEOUT_S,
    )
    out = []
    for s in listed.sessions:
        env: dict[str, str] | None = None
        if not with_env:
            out.append(SessionState(s.session_id, s.shell, s.cwd, None))
            continue
        try:
            result = await channel.unary(
                "exec",
                types_pb2.ExecRequest(
                    sandbox_id=sandbox_id,
                    session_id=s.session_id,
                    command="env -0",
                    timeout_s=CALL_TIMEOUT_S,
                ),
                timeout_s=CALL_TIMEOUT_S + 5,
            )
            if result.exit.exit_code == 0:
                env = parse_env(result.stdout)
        except DSecError as exc:  # SESSION_BUSY: a command runs in it
            log.info("session %s of %s: environment not read: %s", s.session_id, sandbox_id, exc)
        out.append(SessionState(s.session_id, s.shell, s.cwd, env))
    return out


async def restore(channel: Any, sandbox_id: str, sessions: list[SessionState]) -> None:
    """Start, in a new sandbox, a session per captured one: same id, shell, cwd and
    environment (chronus's RestoreSession)."""
    for s in sessions:
        await channel.unary(
            "restore_session",
            chronus_pb2.RestoreSessionRequest(
                session=types_pb2.CreateSessionRequest(
                    sandbox_id=sandbox_id, shell=s.shell, cwd=s.cwd, env=s.env or {}
                ),
                session_id=s.session_id,
            ),
            timeout_s=CALL_TIMEOUT_S,
        )


async def capture_quietly(
    channel_of: Callable[[], Any], sandbox_id: str
) -> list[SessionState] | None:
    """`capture` for a pause (ids, shells and cwds: no command runs in a session), or None
    (logged) when the sandbox cannot answer within PAUSE_READ_S or has no channel (re-adopted
    after an edge restart, not yet reconnected): the pause goes on without it."""
    try:
        return await asyncio.wait_for(
            capture(channel_of(), sandbox_id, with_env=False), PAUSE_READ_S
        )
    except (DSecError, TimeoutError) as exc:
        log.warning("sessions of %s not recorded: %s", sandbox_id, exc)
        return None

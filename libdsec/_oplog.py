"""A sandbox's operation log, read through the SDK: listing, the trajectory export, and replay.

The edge keeps the log (``edge/oplog.py``): every mutating call into the sandbox in order, with
its caller, times, request, and result (exit status, output digests and a bounded copy of the
output). Here:

* :func:`operation_log` pages through it (:class:`Operation` entries);
* :meth:`Operation.to_json` is the trajectory export, one JSON object per operation (the schema
  is documented in the README, "Exactly once, provenance and replay", and is stable:
  ``schema`` names its version);
* :func:`replay` re-runs a sandbox's logged operations, in order, in a fresh sandbox and
  compares each result with the logged digests (:class:`ReplayReport`, the first divergence).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from dsec.types.v1 import types_pb2
from libdsec._transport import Link, Transport
from libdsec.errors import DSecError

#: The export's schema version (the ``schema`` key of every line).
EXPORT_SCHEMA = "dsec.operation/v1"

_STATE = {
    types_pb2.OPERATION_STATE_RUNNING: "RUNNING",
    types_pb2.OPERATION_STATE_SUCCEEDED: "SUCCEEDED",
    types_pb2.OPERATION_STATE_FAILED: "FAILED",
    types_pb2.OPERATION_STATE_OUTCOME_UNKNOWN: "OUTCOME_UNKNOWN",
}

#: The request message of each kind of logged call (what replay parses the logged request as).
REQUESTS: dict[str, type[Message]] = {
    "exec": types_pb2.ExecRequest,
    "exec_stream": types_pb2.ExecRequest,
    "exec_interactive": types_pb2.ExecRequest,
    "write_file": types_pb2.WriteFileRequest,
    "upload_file": types_pb2.UploadFileRequest,
    "remove_path": types_pb2.RemovePathRequest,
    "move_path": types_pb2.MovePathRequest,
    "chmod_path": types_pb2.ChmodPathRequest,
    "make_dir": types_pb2.MakeDirRequest,
    "create_session": types_pb2.CreateSessionRequest,
    "close_session": types_pb2.CloseSessionRequest,
}


def _ts(t: Any) -> float | None:
    return t.ToNanoseconds() / 1e9 if t.seconds or t.nanos else None


@dataclass(frozen=True)
class Operation:
    """One entry of a sandbox's operation log (see the module docstring)."""

    seq: int
    operation_id: str
    kind: str
    state: str  # RUNNING, SUCCEEDED, FAILED, OUTCOME_UNKNOWN
    principal_id: str
    started_at: float | None
    ended_at: float | None
    request_digest: str
    #: What it was, in a line: the command, the path.
    summary: str = ""
    exec_id: str = ""
    exit_code: int | None = None
    signal: int = 0
    timed_out: bool = False
    stdout_digest: str = ""
    stderr_digest: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    response_digest: str = ""
    content_digest: str = ""
    error_reason: str = ""
    error_message: str = ""
    bodies_dropped: bool = False
    generated_id: bool = False
    #: The request and a bounded copy of the output, when read ``with_bodies``.
    request: bytes = b""
    stdout: bytes = b""
    stderr: bytes = b""
    response: bytes = b""
    content: bytes = b""

    @classmethod
    def from_pb(cls, e: types_pb2.Operation) -> Operation:
        return cls(
            seq=e.seq,
            operation_id=e.operation_id,
            kind=e.kind,
            state=_STATE.get(e.state, "UNSPECIFIED"),
            principal_id=e.principal_id,
            started_at=_ts(e.started_at),
            ended_at=_ts(e.ended_at),
            request_digest=e.request_digest,
            summary=e.summary,
            exec_id=e.exec_id,
            exit_code=e.exit.exit_code if e.HasField("exit") else None,
            signal=e.exit.signal,
            timed_out=e.exit.timed_out,
            stdout_digest=e.stdout_digest,
            stderr_digest=e.stderr_digest,
            stdout_bytes=e.stdout_bytes,
            stderr_bytes=e.stderr_bytes,
            response_digest=e.response_digest,
            content_digest=e.content_digest,
            error_reason=e.error.reason,
            error_message=e.error_message,
            bodies_dropped=e.bodies_dropped,
            generated_id=e.generated_id,
            request=e.request,
            stdout=e.stdout,
            stderr=e.stderr,
            response=e.response,
            content=e.content,
        )

    def request_message(self) -> Message | None:
        """The logged request, parsed (None when it was not kept)."""
        kind = REQUESTS.get(self.kind)
        if kind is None or not self.request:
            return None
        return kind.FromString(self.request)

    def to_json(self, sandbox_id: str) -> dict[str, Any]:
        """The trajectory export's object for this entry (schema :data:`EXPORT_SCHEMA`)."""
        out: dict[str, Any] = {
            "schema": EXPORT_SCHEMA,
            "sandbox_id": sandbox_id,
            "seq": self.seq,
            "operation_id": self.operation_id,
            "kind": self.kind,
            "state": self.state,
            "principal_id": self.principal_id,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "request_digest": self.request_digest,
            "summary": self.summary,
            "exec_id": self.exec_id,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "timed_out": self.timed_out,
            "stdout_digest": self.stdout_digest,
            "stderr_digest": self.stderr_digest,
            "stdout_bytes": self.stdout_bytes,
            "stderr_bytes": self.stderr_bytes,
            "response_digest": self.response_digest,
            "content_digest": self.content_digest,
            "error_reason": self.error_reason,
            "error_message": self.error_message,
            "bodies_dropped": self.bodies_dropped,
        }
        for name in ("request", "stdout", "stderr", "content"):
            data = getattr(self, name)
            out[f"{name}_b64"] = base64.b64encode(data).decode() if data else ""
        return out


async def operation_log(
    rpc: Transport,
    sandbox_id: str,
    *,
    after_seq: int = 0,
    with_bodies: bool = False,
    timeout: float = 30.0,
) -> tuple[list[Operation], bool]:
    """Every entry of the log after ``after_seq`` (all pages), and whether the sandbox ended.
    A sandbox whose log is gone raises NotFound (``OPERATION_LOG_NOT_FOUND``)."""
    out: list[Operation] = []
    while True:
        resp = await rpc.unary(
            rpc.exec.ListOperations,
            types_pb2.ListOperationsRequest(
                sandbox_id=sandbox_id, after_seq=after_seq, with_bodies=with_bodies
            ),
            timeout=timeout,
        )
        out.extend(Operation.from_pb(e) for e in resp.operations)
        after_seq = resp.next_seq
        if not resp.more:
            return out, resp.sandbox_ended


# ------------------------------------------------------------------------------ replay


@dataclass
class ReplayStep:
    """One logged operation, replayed: what was logged, what the replay got, and whether
    they match (``diff`` says how they differ; ``skipped`` why it was not replayed)."""

    seq: int
    kind: str
    summary: str
    matched: bool
    diff: str = ""
    skipped: str = ""


@dataclass
class ReplayReport:
    """The replay of ``source_id``'s log in the sandbox ``sandbox_id`` (left running for the
    caller to inspect; stop it when done)."""

    source_id: str
    sandbox_id: str
    steps: list[ReplayStep] = field(default_factory=list)

    @property
    def first_divergence(self) -> ReplayStep | None:
        """The first replayed operation whose result differs from the log's, if any."""
        return next((s for s in self.steps if not s.matched and not s.skipped), None)

    @property
    def reproduced(self) -> bool:
        """Every replayed operation matched (skipped ones aside)."""
        return self.first_divergence is None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Replayer:
    """Sends one logged request at a time to the replay sandbox and compares the results."""

    def __init__(self, client: Link, sandbox_id: str, source_id: str) -> None:
        self.client = client
        self.sandbox_id = sandbox_id
        self.source_id = source_id
        self.sessions: dict[str, str] = {}  # the source's session ids -> the replay's

    def _request(self, op: Operation) -> Message:
        req = op.request_message()
        assert req is not None
        holder: Any = req.header if isinstance(req, types_pb2.UploadFileRequest) else req
        holder.sandbox_id = self.sandbox_id
        holder.operation_id = f"replay-{op.seq}-{op.operation_id}"[:128]
        if getattr(holder, "session_id", ""):
            holder.session_id = self.sessions.get(holder.session_id, holder.session_id)
        return req

    async def step(self, op: Operation) -> ReplayStep:
        summary = op.summary
        if op.state not in ("SUCCEEDED", "FAILED"):
            why = f"its outcome was {op.state}"
            return ReplayStep(op.seq, op.kind, summary, False, skipped=why)
        if op.kind == "exec_interactive":
            why = "an interactive command is not replayed (its input came live)"
            return ReplayStep(op.seq, op.kind, summary, False, skipped=why)
        if op.kind not in REQUESTS:
            why = f"{op.kind}: the sandbox's lifecycle, not its contents: not replayed"
            return ReplayStep(op.seq, op.kind, summary, False, skipped=why)
        if not op.request or (op.kind == "upload_file" and not op.content):
            why = "its request (or uploaded bytes) was not kept in the log"
            return ReplayStep(op.seq, op.kind, summary, False, skipped=why)
        req = self._request(op)
        failed: DSecError | None = None
        got: dict[str, Any] = {}
        try:
            got = await self._send(op, req)
        except DSecError as err:
            failed = err
        diff = self._compare(op, got, failed)
        return ReplayStep(op.seq, op.kind, summary, not diff, diff=diff)

    async def _send(self, op: Operation, req: Any) -> dict[str, Any]:
        rpc = self.client.transport
        timeout = self.client.timeout
        if op.kind == "exec":
            r = await rpc.unary(rpc.exec.Exec, req, timeout=(req.timeout_s or 600.0) + 60.0)
            return {"exit": r.exit, "stdout": r.stdout, "stderr": r.stderr}
        if op.kind == "exec_stream":
            out = {"stdout": b"", "stderr": b""}
            got: dict[str, Any] = {}
            async for ev in rpc.stream(rpc.exec.ExecStream, req):
                kind = ev.WhichOneof("event")
                if kind in ("stdout", "stderr"):
                    out[kind] += getattr(ev, kind).data
                elif kind == "exit":
                    got["exit"] = ev.exit
            return {**got, **out}
        if op.kind == "upload_file":

            async def parts() -> AsyncIterator[types_pb2.UploadFileRequest]:
                yield req
                yield types_pb2.UploadFileRequest(chunk=op.content)

            await rpc.unary(rpc.files.UploadFile, parts(), timeout=timeout)
            return {}
        method = {
            "write_file": rpc.files.WriteFile,
            "remove_path": rpc.files.RemovePath,
            "move_path": rpc.files.MovePath,
            "chmod_path": rpc.files.ChmodPath,
            "make_dir": rpc.files.MakeDir,
            "create_session": rpc.exec.CreateSession,
            "close_session": rpc.exec.CloseSession,
        }[op.kind]
        resp = await rpc.unary(method, req, timeout=timeout)
        if op.kind == "create_session" and op.response:
            logged = types_pb2.CreateSessionResponse.FromString(op.response)
            self.sessions[logged.session.session_id] = resp.session.session_id
        return {}

    @staticmethod
    def _compare(op: Operation, got: dict[str, Any], failed: DSecError | None) -> str:
        """How the replay's result differs from the logged one ("" = it matches). A file call
        matches when it succeeds or fails alike (its response holds times); a command when
        its exit status and the digests of its output are the same."""
        if op.state == "FAILED" or failed is not None:
            was = op.error_reason if op.state == "FAILED" else "success"
            now = failed.reason if failed is not None else "success"
            return "" if was == now else f"logged {was}, replayed {now}"
        if op.kind not in ("exec", "exec_stream") or "exit" not in got:
            return ""
        diffs = []
        code = got["exit"].exit_code
        if op.exit_code is not None and code != op.exit_code:
            diffs.append(f"exit code {op.exit_code} -> {code}")
        for name in ("stdout", "stderr"):
            logged, now = getattr(op, f"{name}_digest"), _digest(got[name])
            if logged and logged != now:
                diffs.append(
                    f"{name} differs ({getattr(op, f'{name}_bytes')} -> {len(got[name])} bytes)"
                )
        return "; ".join(diffs)


async def replay(
    client: Link,
    sandbox_id: str,
    source_id: str,
    operations: list[Operation],
    *,
    upto: int | None = None,
    on_step: Callable[[ReplayStep], None] | None = None,
) -> ReplayReport:
    """Re-runs ``operations`` (the source's log, with bodies) in order in the sandbox
    ``sandbox_id``, up to and including ``upto``, comparing each result with the log's."""
    report = ReplayReport(source_id=source_id, sandbox_id=sandbox_id)
    replayer = _Replayer(client, sandbox_id, source_id)
    for op in operations:
        if upto is not None and op.seq > upto:
            break
        step = await replayer.step(op)
        report.steps.append(step)
        if on_step is not None:
            on_step(step)
    return report

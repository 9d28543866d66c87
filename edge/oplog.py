"""The operation log: every mutating call into a sandbox, in order, with its result.

What it is for:

* **Exactly once.** An operation id is reserved here before its call starts (a unique row per
  sandbox and id); a call carrying an id already logged gets the logged result, or attaches
  to the running operation, and never runs again (``edge/operations.py`` does that part).
* **Provenance and replay.** Each entry keeps the caller, times, the request (and a digest of
  it), and the result: exit status, digests of the output and a bounded copy of it (head and
  tail), or the response of a file call. ``dsec sandbox log`` lists it; ``libdsec``'s replay
  re-runs the requests in a fresh sandbox and compares the digests.

Kept by the edge in one SQLite database, ``<state_dir>/oplog.db`` (WAL, ``synchronous=NORMAL``:
a commit survives the edge process being killed; a power loss may lose the last ones), so it
outlives edge restarts. An entry found RUNNING when the edge starts belonged to the edge that
died: its outcome cannot be known (:meth:`OpLog.recover` marks it ``OUTCOME_UNKNOWN``).

Bounds: per sandbox, the bodies (request payloads, output copies, responses) take at most
``max_bytes``; past it the oldest entries lose their bodies (``bodies_dropped``) but every
entry, with its digests and exit status, stays. A sandbox's log is removed with it
(DeleteSandbox) or ``retention_s`` after it ended (:meth:`OpLog.sweep`).

The store is synchronous (one write is tens of microseconds); the edge calls it from its
event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.message import Message

from dsec.types.v1 import types_pb2
from libdsec.errors import InvalidArgument, OperationIdReused

#: What an operation id may be: a caller's own name for a step (``ep17-turn3``, a UUID, a
#: ``task/episode:turn`` path).
OPERATION_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")
MAX_OPERATION_ID = 128
#: How long an entry's progress and end wait to be written with others (one commit per batch).
BATCH_S = 0.01
INSERT = (
    "INSERT INTO ops (sandbox_id, seq, op_id, state, body_bytes, entry) VALUES (?, ?, ?, ?, ?, ?)"
)
UPDATE = "UPDATE ops SET state=?, body_bytes=?, entry=? WHERE sandbox_id=? AND seq=?"
#: The fields of an entry the log's cap may drop (its bodies).
BODIES = ("request", "stdout", "stderr", "response", "content")
#: Entries per ListOperations page at most.
MAX_PAGE = 1000

RUNNING = types_pb2.OPERATION_STATE_RUNNING
SUCCEEDED = types_pb2.OPERATION_STATE_SUCCEEDED
FAILED = types_pb2.OPERATION_STATE_FAILED
OUTCOME_UNKNOWN = types_pb2.OPERATION_STATE_OUTCOME_UNKNOWN


def check_operation_id(op_id: str) -> None:
    """Raises InvalidArgument (``INVALID_OPERATION_ID``) unless ``op_id`` is a valid id."""
    if len(op_id) > MAX_OPERATION_ID:
        raise InvalidArgument(
            f"operation_id is {len(op_id)} characters; at most {MAX_OPERATION_ID}",
            reason="INVALID_OPERATION_ID",
            metadata={"field": "operation_id"},
        )
    if not OPERATION_ID.fullmatch(op_id):
        raise InvalidArgument(
            f"operation_id {op_id!r} may hold only letters, digits and . _ : @ / -",
            reason="INVALID_OPERATION_ID",
            metadata={"field": "operation_id"},
        )


def request_digest(kind: str, request: Message) -> str:
    """sha256 (hex) of the call's kind and its request without the operation id: what tells a
    retry (the same request) from another request reusing the id."""
    field = _id_holder(request)
    saved = getattr(field, "operation_id", "")  # a lifecycle request has none
    if saved:
        field.operation_id = ""
    try:
        body = request.SerializeToString(deterministic=True)
    finally:
        if saved:
            field.operation_id = saved
    return hashlib.sha256(kind.encode() + b"\0" + body).hexdigest()


def _id_holder(request: Message) -> Any:
    """The message carrying a request's ``operation_id`` (an upload's header, else itself)."""
    if isinstance(request, types_pb2.UploadFileRequest):
        return request.header
    return request


def operation_id_of(request: Message) -> str:
    holder = _id_holder(request)
    return str(holder.operation_id) if hasattr(holder, "operation_id") else ""


def reused(sandbox_id: str, entry: types_pb2.Operation, what: str) -> OperationIdReused:
    """The error of a request reusing the id of ``entry`` (which was ``what``)."""
    return OperationIdReused(
        f"operation {entry.operation_id!r} of sandbox {sandbox_id} is entry {entry.seq}, "
        f"{what}; a new request needs a new id",
        metadata={"operation_id": entry.operation_id, "seq": str(entry.seq)},
    )


def summary(request: Message) -> str:
    """What a request was, in one line: the command, the path (cut at 200 characters)."""
    r: Any = request
    if isinstance(r, types_pb2.ExecRequest):
        text = r.command or " ".join(r.argv)
    elif isinstance(r, types_pb2.UploadFileRequest):
        text = r.header.path
    elif isinstance(r, types_pb2.MovePathRequest):
        text = f"{r.source} -> {r.destination}"
    elif hasattr(r, "child_ids"):  # a fork: its children
        text = " ".join(r.child_ids)
    elif hasattr(r, "name"):  # a pack_diff: the environment it makes
        text = str(r.name)
    else:
        text = str(
            getattr(r, "path", "") or getattr(r, "session_id", "") or getattr(r, "shell", "")
        )
    return text if len(text) <= 200 else text[:199] + "…"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bodies(entry: types_pb2.Operation) -> int:
    return sum(len(getattr(entry, name)) for name in BODIES)


@dataclass
class Reserved:
    """A new entry: the call runs, then :meth:`OpLog.finish` records how it went."""

    entry: types_pb2.Operation


class OpLog:
    """The operation log of one edge's sandboxes (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = 64 << 20,
        copy_bytes: int = 64 << 10,
        retention_s: float = 3600.0,
    ) -> None:
        self.max_bytes = max_bytes
        #: Per output stream of an entry: what is kept of it (head and tail).
        self.copy_bytes = copy_bytes
        self.retention_s = retention_s
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.path = path
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        # Checkpoints (which fsync) run from a thread: see checkpoint().
        self.db.execute("PRAGMA wal_autocheckpoint=0")
        self.db.executescript(
            """
            CREATE TABLE IF NOT EXISTS logs (
                sandbox_id TEXT PRIMARY KEY,
                ended_at REAL
            );
            CREATE TABLE IF NOT EXISTS ops (
                sandbox_id TEXT NOT NULL,
                seq INTEGER NOT NULL,
                op_id TEXT NOT NULL,
                state INTEGER NOT NULL,
                body_bytes INTEGER NOT NULL,
                entry BLOB NOT NULL,
                PRIMARY KEY (sandbox_id, seq),
                UNIQUE (sandbox_id, op_id)
            );
            """
        )
        #: sandbox id -> [last seq, body bytes]: the counters, read once per sandbox.
        self._logs: dict[str, list[int]] = {}
        #: (sandbox id, seq) -> body bytes of the entries under way (what their end replaces).
        self._sizes: dict[tuple[str, int], int] = {}
        #: Writes waiting for the batch (see _defer), and the batch's timer.
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._flush: asyncio.TimerHandle | None = None
        self.closed = False

    def close(self) -> None:
        """At edge shutdown (the batch written first). An operation still under way stays
        RUNNING (OUTCOME_UNKNOWN for the next edge): its end is not written once the log is
        closed."""
        self.flush()
        self.closed = True
        self.db.close()

    # ---------------------------------------------------------------- writing

    def _counters(self, sandbox_id: str) -> list[int]:
        """[last seq, body bytes] of a sandbox's log: read once, then kept in memory (so an
        operation costs one INSERT and one UPDATE, nothing else)."""
        c = self._logs.get(sandbox_id)
        if c is None:
            self.flush()
            row = self.db.execute(
                "SELECT MAX(seq), SUM(body_bytes) FROM ops WHERE sandbox_id=?", (sandbox_id,)
            ).fetchone()
            self.db.execute("INSERT OR IGNORE INTO logs (sandbox_id) VALUES (?)", (sandbox_id,))
            c = self._logs[sandbox_id] = [int(row[0] or 0), int(row[1] or 0)]
        return c

    def reserve(
        self,
        sandbox_id: str,
        kind: str,
        request: Message,
        *,
        principal_id: str = "",
    ) -> Reserved | types_pb2.Operation:
        """Reserves the request's operation id (one is made when it has none): a new entry
        (RUNNING) as :class:`Reserved`, or the entry already logged under that id.

        Raises InvalidArgument for a malformed id and :class:`OperationIdReused` when the id
        names another request (another kind, or other fields) in this sandbox's log."""
        op_id = operation_id_of(request)
        generated = not op_id
        if op_id:
            check_operation_id(op_id)
        counters = self._counters(sandbox_id)
        seq = counters[0] + 1
        if generated:
            op_id = f"edge-{seq}-{time.time_ns():x}"
        entry = types_pb2.Operation(
            seq=seq,
            operation_id=op_id,
            kind=kind,
            principal_id=principal_id,
            state=RUNNING,
            request_digest=request_digest(kind, request),
            generated_id=generated,
            summary=summary(request),
        )
        entry.started_at.FromNanoseconds(time.time_ns())
        entry.request = request.SerializeToString(deterministic=True)
        size = _bodies(entry)
        row = (sandbox_id, seq, op_id, RUNNING, size, entry.SerializeToString())
        try:
            if generated:  # nobody can repeat it: written with the next batch
                self._defer(INSERT, row)
            else:  # the reservation: on disk before the call starts
                self.db.execute(INSERT, row)
        except sqlite3.IntegrityError:  # the id is taken: a repeat, or another request
            found = self.get(sandbox_id, op_id)
            assert found is not None
            if found.request_digest != entry.request_digest or found.kind != kind:
                raise reused(sandbox_id, found, f"a different {found.kind} request") from None
            return found
        self._sizes[(sandbox_id, seq)] = size
        self._grown(sandbox_id, counters, seq, size)
        return Reserved(entry)

    def _grown(self, sandbox_id: str, counters: list[int], seq: int, added: int) -> None:
        counters[0] = max(counters[0], seq)
        counters[1] += added
        if counters[1] > self.max_bytes:
            self._drop_bodies(sandbox_id, counters)

    def update(self, sandbox_id: str, entry: types_pb2.Operation) -> None:
        """Writes ``entry`` (its result, its exec id) over its row."""
        if self.closed:
            return
        size = _bodies(entry)
        key = (sandbox_id, entry.seq)
        before = self._sizes.get(key, 0)
        if entry.state == RUNNING:
            self._sizes[key] = size
        else:
            self._sizes.pop(key, None)
        self._defer(UPDATE, (entry.state, size, entry.SerializeToString(), sandbox_id, entry.seq))
        self._grown(sandbox_id, self._counters(sandbox_id), entry.seq, size - before)

    def finish(self, sandbox_id: str, entry: types_pb2.Operation, state: int) -> None:
        """Records the end of an operation (its result already set on ``entry``)."""
        entry.state = state  # type: ignore[assignment]
        entry.ended_at.FromNanoseconds(time.time_ns())
        self.update(sandbox_id, entry)

    def _defer(self, sql: str, args: tuple[Any, ...]) -> None:
        """A write that may wait for the next batch (:data:`BATCH_S`): an entry's progress and
        end, an edge-made entry. Lost only if the edge dies within the batch: a reserved entry
        then reads OUTCOME_UNKNOWN (never run again), an edge-made one is missing."""
        self._pending.append((sql, args))
        if self._flush is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a tool, a test): at once
            self.flush()
            return
        self._flush = loop.call_later(BATCH_S, self.flush)

    def flush(self) -> None:
        """Writes the batched writes, in order, in one transaction (one WAL commit)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if not self._pending or self.closed:
            return
        pending, self._pending = self._pending, []
        self.db.execute("BEGIN")
        for sql, args in pending:
            self.db.execute(sql, args)
        self.db.execute("COMMIT")

    def checkpoint(self) -> None:
        """Folds the WAL into the database, from a connection of its own: called from a
        thread (Operations.follow_endings), so the event loop never waits for the fsyncs a
        checkpoint makes (the edge's connection has automatic checkpoints off)."""
        db = sqlite3.connect(str(self.path), timeout=1.0)
        try:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            db.close()

    def _drop_bodies(self, sandbox_id: str, counters: list[int]) -> None:
        """Oldest first, entries that ended lose their bodies until the log fits its cap."""
        self.flush()
        self.db.execute("BEGIN")
        rows = self.db.execute(
            "SELECT seq, entry FROM ops WHERE sandbox_id=? AND body_bytes>0 AND state!=? "
            "ORDER BY seq",
            (sandbox_id, RUNNING),
        )
        for seq, blob in rows.fetchall():
            if counters[1] <= self.max_bytes:
                break
            if (sandbox_id, seq) in self._sizes:  # still under way: its end rewrites it
                continue
            entry = types_pb2.Operation.FromString(blob)
            freed = _bodies(entry)
            for name in BODIES:
                entry.ClearField(name)  # type: ignore[arg-type]
            entry.bodies_dropped = True
            self.db.execute(
                "UPDATE ops SET body_bytes=0, entry=? WHERE sandbox_id=? AND seq=?",
                (entry.SerializeToString(), sandbox_id, seq),
            )
            counters[1] -= freed
        self.db.execute("COMMIT")

    # ---------------------------------------------------------------- reading

    def get(self, sandbox_id: str, op_id: str) -> types_pb2.Operation | None:
        self.flush()
        row = self.db.execute(
            "SELECT entry FROM ops WHERE sandbox_id=? AND op_id=?", (sandbox_id, op_id)
        ).fetchone()
        return types_pb2.Operation.FromString(row[0]) if row else None

    def has_log(self, sandbox_id: str) -> bool:
        if sandbox_id in self._logs:
            return True
        row = self.db.execute("SELECT 1 FROM logs WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        return row is not None

    def page(
        self, sandbox_id: str, after_seq: int = 0, limit: int = 0, *, with_bodies: bool = False
    ) -> tuple[list[types_pb2.Operation], bool]:
        """Entries after ``after_seq`` in order, at most ``limit`` (0: :data:`MAX_PAGE`), and
        whether more follow."""
        self.flush()
        limit = min(limit or MAX_PAGE, MAX_PAGE)
        rows = self.db.execute(
            "SELECT entry FROM ops WHERE sandbox_id=? AND seq>? ORDER BY seq LIMIT ?",
            (sandbox_id, after_seq, limit + 1),
        ).fetchall()
        out = []
        for (blob,) in rows[:limit]:
            entry = types_pb2.Operation.FromString(blob)
            if not with_bodies:
                for name in BODIES:
                    entry.ClearField(name)  # type: ignore[arg-type]
            out.append(entry)
        return out, len(rows) > limit

    # ---------------------------------------------------------------- lifetime

    def ended(self, sandbox_id: str, at: float | None = None) -> None:
        """The sandbox ended: its log is kept ``retention_s`` more (removed now if 0)."""
        if self.retention_s <= 0:
            self.forget(sandbox_id)
            return
        self.db.execute(
            "UPDATE logs SET ended_at=? WHERE sandbox_id=? AND ended_at IS NULL",
            (at or time.time(), sandbox_id),
        )

    def forget(self, sandbox_id: str) -> None:
        self.flush()
        with self.db:
            self.db.execute("DELETE FROM ops WHERE sandbox_id=?", (sandbox_id,))
            self.db.execute("DELETE FROM logs WHERE sandbox_id=?", (sandbox_id,))
        self._logs.pop(sandbox_id, None)
        for key in [k for k in self._sizes if k[0] == sandbox_id]:
            del self._sizes[key]

    def sweep(self, now: float | None = None) -> list[str]:
        """Removes the logs of sandboxes that ended more than ``retention_s`` ago."""
        self.flush()
        cutoff = (now or time.time()) - self.retention_s
        gone = [
            str(r[0])
            for r in self.db.execute(
                "SELECT sandbox_id FROM logs WHERE ended_at IS NOT NULL AND ended_at<?", (cutoff,)
            ).fetchall()
        ]
        for sandbox_id in gone:
            self.forget(sandbox_id)
        return gone

    def sandboxes(self) -> list[str]:
        """The sandboxes with a log still open (not ended)."""
        rows = self.db.execute("SELECT sandbox_id FROM logs WHERE ended_at IS NULL").fetchall()
        return [str(r[0]) for r in rows]

    def recover(self) -> int:
        """At edge start: entries still RUNNING belonged to the edge process that died, which
        ran them; whether they finished cannot be known. They become OUTCOME_UNKNOWN (a
        retry is answered so, never run again). Returns how many."""
        self.flush()
        rows = self.db.execute(
            "SELECT sandbox_id, entry FROM ops WHERE state=?", (RUNNING,)
        ).fetchall()
        for sandbox_id, blob in rows:
            entry = types_pb2.Operation.FromString(blob)
            entry.error.reason = "OUTCOME_UNKNOWN"
            entry.error_code = 9  # FAILED_PRECONDITION
            entry.error_message = (
                "the edge restarted while this operation ran: it may have run, in full or in "
                "part" + (f" (exec {entry.exec_id})" if entry.exec_id else "")
            )
            entry.error.metadata["operation_id"] = entry.operation_id
            if entry.exec_id:
                entry.error.metadata["exec_id"] = entry.exec_id
            self.finish(str(sandbox_id), entry, OUTCOME_UNKNOWN)
        return len(rows)

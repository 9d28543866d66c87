"""Command executions: spawning, capture, timeouts, subscribers, reattach.

An `Exec` owns the read ends of a command's output and its capture buffers.
All of its I/O runs on the reactor thread; handler threads see it through
`Subscription` queues (events in order: output chunks with stream offsets,
then the exit status) and through the shared lock.
"""

from __future__ import annotations

import _queue  # not `queue`, `threading`, `collections`: see chronus.threads
import _signal
import errno
import itertools
import os
import time
from _collections import deque

from chronus import threads
from chronus.config import ChronusConfig
from chronus.errors import (
    FAILED_PRECONDITION,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    ChronusError,
    invalid,
)
from chronus.landlock import Sandboxing
from chronus.output import OutputBuffer
from chronus.proc import SpawnError, decode_status, set_winsize, spawn
from chronus.reactor import Drain, Reactor, Timer
from chronus.threads import RLock
from chronus.users import resolve_user
from insandbox.log import get_logger
from insandbox.proc import kill_session, killpg_quietly

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from chronus.proc import Credentials

log = get_logger("chronus.execs")

STDOUT, STDERR = 0, 1
STREAM_NAMES = ("stdout", "stderr")
EXEC_STATUS_RUNNING, EXEC_STATUS_EXITED = 1, 2
READ_CHUNK = 65536
MAX_LABELS, MAX_LABEL_KEY, MAX_LABEL_VALUE_BYTES = 16, 63, 1024
_LABEL_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._/-")
# ControlExec input not yet taken by the command: past this, the caller must wait.
MAX_PENDING_STDIN_BYTES = 8 * 1024 * 1024

if TYPE_CHECKING:
    # ("stdout"|"stderr", offset, data) | ("exit", status) | ("cancel",)
    Event = tuple[Any, ...]


def timestamp(t: float | None = None) -> dict[str, int]:
    """google.protobuf.Timestamp in dict form."""
    t = time.time() if t is None else t
    seconds = int(t)
    return {"seconds": seconds, "nanos": int((t - seconds) * 1e9)}


class Runtime:
    """What every part of the engine shares: config, loop, lock."""

    def __init__(self, config: ChronusConfig) -> None:
        self.config = config
        self.reactor = Reactor()
        self.drain = Drain(self.reactor)
        # One lock for all exec and session state: the reactor thread and the
        # handler threads both touch it, and contention is negligible.
        self.lock = RLock()
        self._ids = itertools.count(1)
        self.on_session_gone: Callable[[Any], None] = lambda session: None
        self.sandboxing = Sandboxing(config.landlock)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids):x}{os.urandom(3).hex()}"


class Subscription:
    """One reader of an exec's events, with a forwarding budget per stream.

    The budget (the exec's output cap) bounds what one subscription can
    queue, so a slow edge and a flooding command cannot grow chronus: past
    it, chunks stop being forwarded (the exit still says how much there was).
    """

    def __init__(self, offsets: tuple[int, int], budget: int) -> None:
        self.queue: _queue.SimpleQueue[Event] = _queue.SimpleQueue()
        self.pos = list(offsets)
        self.budget = [budget, budget]

    def offer(self, idx: int, offset: int, data: bytes) -> None:
        pos = self.pos[idx]
        if offset + len(data) <= pos:
            return
        if offset < pos:
            data = data[pos - offset :]
            offset = pos
        left = self.budget[idx]
        if left <= 0:
            return
        if len(data) > left:
            data = data[:left]
        self.budget[idx] = left - len(data)
        self.pos[idx] = offset + len(data)
        self.queue.put((STREAM_NAMES[idx], offset, data))

    def finish(self, status: dict[str, Any]) -> None:
        self.queue.put(("exit", status))

    def cancel(self) -> None:
        self.queue.put(("cancel",))


class Exec:
    """A running or finished command: capture, subscribers, stdin, exit."""

    def __init__(
        self,
        rt: Runtime,
        req: dict[str, Any],
        *,
        cap: int,
        background: bool,
        timeout_s: float,
    ) -> None:
        self.rt = rt
        self.exec_id = rt.new_id("ex")
        argv = req.get("argv")
        self.command: str = req.get("command") or " ".join(argv or ())
        self.argv: list[str] = (
            ["/bin/sh", "-c", req["command"]] if req.get("command") else list(argv or ())
        )
        self.cwd: str = req.get("cwd", "")  # the effective one once launched
        self.env: dict[str, str] = dict(req.get("env", {}))
        self.labels: dict[str, str] = dict(req.get("labels", {}))
        self.user: str = req.get("user", "")
        self.session_id: str = req.get("session_id", "")
        self.background = background
        #: A foreground exec whose stream was abandoned: kept for a reattach (Execs.orphan).
        self.orphaned = False
        self.timeout_s = timeout_s
        self.cap = cap
        self.buffers = (OutputBuffer(cap), OutputBuffer(cap))
        self.pid = 0
        self.status = EXEC_STATUS_RUNNING
        self.exit: dict[str, Any] | None = None
        self.done = threads.Event()
        self.started_at = time.time()
        self._t0 = time.monotonic()  # duration_s: wall time, pauses included (see finish)
        self._run0 = rt.reactor.clock.now()  # the timeout: running time (chronus.clock)
        self.subs: list[Subscription] = []
        self.done_callbacks: list[Callable[[], None]] = []
        self.timed_out = False
        self.is_pty = bool(req.get("pty"))
        self.fds: dict[int, int] = {}  # read end -> STDOUT/STDERR
        self.stdin_fd = -1
        self._stdin_pending: deque[bytes] = deque()
        self._stdin_close = False
        self._timer: Timer | None = None

    # ------------------------------------------------------------- queries
    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "exec_id": self.exec_id,
            "command": self.command,
            "status": self.status,
            "pid": self.pid,
            "started_at": timestamp(self.started_at),
            "session_id": self.session_id,
            "labels": self.labels,
            "argv": self.argv,
            "cwd": self.cwd,
            "env": self.env,
            "pty": self.is_pty,
            "user": self.user,
        }
        if self.exit is not None:
            info["exit"] = self.exit
        return info

    def subscribe(self, offsets: tuple[int, int] = (0, 0), budget: int = 0) -> Subscription:
        """Replay what is held from `offsets`, then follow live (any thread)."""
        sub = Subscription(offsets, budget or self.cap)
        with self.rt.lock:
            for idx, buf in enumerate(self.buffers):
                for offset, data in buf.held_from(offsets[idx]):
                    sub.offer(idx, offset, data)
            if self.exit is not None:
                sub.finish(self.exit)
            else:
                self.subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self.rt.lock:
            if sub in self.subs:
                self.subs.remove(sub)

    def result(self) -> dict[str, Any]:
        """ExecResult of a finished exec."""
        with self.rt.lock:
            return {
                "exec_id": self.exec_id,
                "stdout": self.buffers[STDOUT].result(),
                "stderr": self.buffers[STDERR].result(),
                "exit": self.exit or {},
            }

    # ------------------------------------------------------- control (any thread)
    def write_stdin(self, data: bytes) -> None:
        with self.rt.lock:
            if self.stdin_fd < 0 or self._stdin_close:
                return
            self._stdin_pending.append(data)
        self.rt.reactor.call_soon(self._pump_stdin)

    def close_stdin(self) -> None:
        with self.rt.lock:
            self._stdin_close = True
        self.rt.reactor.call_soon(self._pump_stdin)

    def control(self, action: dict[str, Any]) -> None:
        """One ControlExec action (stdin, close_stdin or resize), or a typed error. Input is
        queued under the lock before the call answers, so successive calls arrive in order."""
        with self.rt.lock:
            if self.exit is not None:
                raise ChronusError(
                    FAILED_PRECONDITION, "EXEC_EXITED", f"execution {self.exec_id} has exited"
                )
            if "resize" in action:
                fd = self._pty_fd()
                if fd < 0:
                    raise ChronusError(
                        FAILED_PRECONDITION,
                        "NOT_A_PTY",
                        f"execution {self.exec_id} does not run under a pseudo-terminal",
                    )
                size = action["resize"]
                set_winsize(fd, size.get("rows", 0), size.get("cols", 0))
                return
            if "stdin" not in action and not action.get("close_stdin"):
                raise invalid("ControlExec needs one of stdin, close_stdin (true) and resize")
            if self.stdin_fd < 0 or self._stdin_close:
                raise ChronusError(
                    FAILED_PRECONDITION,
                    "STDIN_CLOSED",
                    f"execution {self.exec_id} has no open stdin (start it with stdin_open or pty)",
                )
            if "stdin" in action:
                data = action["stdin"]
                if sum(map(len, self._stdin_pending)) + len(data) > MAX_PENDING_STDIN_BYTES:
                    raise ChronusError(
                        RESOURCE_EXHAUSTED,
                        "STDIN_BACKLOG",
                        f"execution {self.exec_id} has not read the input sent so far",
                    )
                self._stdin_pending.append(data)
            else:
                self._stdin_close = True
        self.rt.reactor.call_soon(self._pump_stdin)

    def resize(self, rows: int, cols: int) -> None:
        with self.rt.lock:
            fd = self._pty_fd()
            if fd >= 0:
                set_winsize(fd, rows, cols)

    def send_signal(self, sig: int) -> bool:
        raise NotImplementedError

    def kill(self) -> None:
        """Abandoned by its caller: end it now (whole group)."""
        raise NotImplementedError

    def _pty_fd(self) -> int:
        return self.stdin_fd if self.is_pty else -1

    # ------------------------------------------------------- reactor thread
    def _watch(self, fd: int, idx: int) -> None:
        os.set_blocking(fd, False)
        self.fds[fd] = idx
        self.rt.reactor.add_reader(fd, lambda: self._on_readable(fd))

    def _on_readable(self, fd: int) -> None:
        with self.rt.lock:
            if fd not in self.fds:
                return
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                data = b""  # EIO: a pty master whose slave side is gone
            if data:
                self.on_output(self.fds[fd], data)
            else:
                self._close_output(fd)
                self._on_output_closed()

    def on_output(self, idx: int, data: bytes) -> None:
        buf = self.buffers[idx]
        offset = buf.total
        buf.append(data)
        for sub in self.subs:
            sub.offer(idx, offset, data)

    def _close_output(self, fd: int) -> None:
        del self.fds[fd]
        self.rt.reactor.forget(fd)
        if fd == self.stdin_fd:
            self.stdin_fd = -1  # a pty master is both
        os.close(fd)

    def _on_output_closed(self) -> None:
        pass

    def _drain_available(self) -> None:
        """Read what is already in the pipes, then hand them to the drain."""
        for fd in list(self.fds):
            idx = self.fds[fd]
            for _ in range(256):  # bounded: a writer may still be producing
                try:
                    data = os.read(fd, READ_CHUNK)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:
                    break
                self.on_output(idx, data)
            del self.fds[fd]
            if fd == self.stdin_fd:
                self.stdin_fd = -1
            self.rt.reactor.forget(fd)
            self.rt.drain.adopt(fd)

    def _pump_stdin(self) -> None:
        with self.rt.lock:
            fd = self.stdin_fd
            if fd < 0:
                self._stdin_pending.clear()
                return
            while self._stdin_pending:
                data = self._stdin_pending[0]
                try:
                    n = os.write(fd, data)
                except BlockingIOError:
                    self.rt.reactor.add_writer(fd, self._pump_stdin)
                    return
                except OSError:  # EPIPE: the command closed its stdin
                    self._stdin_pending.clear()
                    break
                if n < len(data):
                    self._stdin_pending[0] = data[n:]
                else:
                    self._stdin_pending.popleft()
            self.rt.reactor.remove_writer(fd)
            if self._stdin_close:
                self._close_stdin_fd()

    def _close_stdin_fd(self) -> None:
        fd = self.stdin_fd
        if fd < 0:
            return
        if self.is_pty:
            # The master is also the output: closing it would hang up the
            # terminal. End of input on a terminal is the EOF character.
            try:
                os.write(fd, b"\x04")
            except OSError:
                pass
            return
        self.rt.reactor.forget(fd)
        self.stdin_fd = -1
        os.close(fd)

    def _arm_timeout(self) -> None:
        """The timeout counts running time from the start: a pause does not count."""
        if self.timeout_s > 0:
            reactor = self.rt.reactor
            # From the start, unless that read of the clock is ahead of this turn's: taken at a
            # thaw, before the reactor took the stall off. Then from now.
            start = min(self._run0, reactor.now)
            self._timer = reactor.call_at(start + self.timeout_s, self._on_timeout)

    def _on_timeout(self) -> None:
        raise NotImplementedError

    def finish(self, exit_code: int, sig: int, error: str = "") -> None:
        """Record the exit and tell every subscriber (reactor thread, locked)."""
        if self.exit is not None:
            return
        self._drain_available()
        if self.stdin_fd >= 0 and not self.is_pty:
            self.rt.reactor.forget(self.stdin_fd)
            os.close(self.stdin_fd)
        self.stdin_fd = -1
        if self._timer is not None:
            self._timer.cancel()
        out, err = self.buffers
        if self.timed_out:
            exit_code = -1
        self.exit = {
            "exit_code": exit_code,
            "signal": sig,
            "timed_out": self.timed_out,
            # Wall time from start to exit: a container's pause is in it, a microVM's is not
            # (its guest clock stops). The running clock knows pauses only while a timer is
            # pending, so it could not say this of every command.
            "duration_s": time.monotonic() - self._t0,
            "stdout_truncated": out.truncated,
            "stderr_truncated": err.truncated,
            "stdout_bytes": out.total,
            "stderr_bytes": err.total,
            "error": error,
        }
        self.status = EXEC_STATUS_EXITED
        for sub in self.subs:
            sub.finish(self.exit)
        self.subs.clear()
        self.done.set()
        for cb in self.done_callbacks:
            cb()


class ProcessExec(Exec):
    """A command forked by chronus in its own session."""

    def __init__(self, rt: Runtime, req: dict[str, Any], **kw: Any) -> None:
        super().__init__(rt, req, **kw)
        self._exit_status: int | None = None
        self._pidfd = -1

    def launch(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        req: dict[str, Any],
        creds: Credentials | None = None,
    ) -> None:
        """Spawn (calling thread), then hand the I/O to the reactor; as `creds` if given."""
        stdin_data: bytes = req.get("stdin", b"")
        keep_stdin = bool(req.get("stdin_open"))
        child_fds: list[int] = []
        try:
            if self.is_pty:
                master, slave = os.openpty()
                child_fds.append(slave)
                size = req.get("pty_size") or {}
                set_winsize(master, size.get("rows", 24), size.get("cols", 80))
                env.setdefault("TERM", "xterm")
                if creds is not None:
                    try:  # the terminal is the user's, as login(1) leaves it
                        os.fchown(slave, creds[0], -1)
                    except OSError:
                        pass
                self.stdin_fd = master  # closed by the SpawnError handler below if spawn fails
                self.pid = spawn(
                    argv,
                    env,
                    cwd,
                    ctty=slave,
                    ruleset_fd=self.rt.sandboxing.for_exec(),
                    syscall_filter=self.rt.sandboxing.filter,
                    creds=creds,
                )
                self.stdin_fd = master
                out_fds = [(master, STDOUT)]
            else:
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                child_fds += [out_w, err_w]
                if stdin_data or keep_stdin:
                    in_r, in_w = os.pipe()
                    child_fds.append(in_r)
                    self.stdin_fd = in_w
                else:
                    in_r = os.open(os.devnull, os.O_RDONLY)
                    child_fds.append(in_r)
                if creds is not None:
                    # A pipe is its creator's, mode 0600: a command run as a user could not
                    # reopen /dev/stdout (/proc/self/fd/1) without owning its ends.
                    _chown_quietly(
                        [out_w, err_w] + ([in_r] if stdin_data or keep_stdin else []), creds[0]
                    )
                out_fds = [(out_r, STDOUT), (err_r, STDERR)]
                try:
                    self.pid = spawn(
                        argv,
                        env,
                        cwd,
                        stdin=in_r,
                        stdout=out_w,
                        stderr=err_w,
                        ruleset_fd=self.rt.sandboxing.for_exec(),
                        syscall_filter=self.rt.sandboxing.filter,
                        creds=creds,
                    )
                except BaseException:
                    for fd, _ in out_fds:
                        os.close(fd)
                    raise
        except BlockingIOError:  # EAGAIN from fork/posix_spawn: the sandbox's pids limit
            if self.stdin_fd >= 0:
                os.close(self.stdin_fd)
                self.stdin_fd = -1
            raise
        except SpawnError as exc:
            if self.stdin_fd >= 0:
                os.close(self.stdin_fd)
                self.stdin_fd = -1
            # Like a shell: 127 when the program or directory is missing, 126
            # when it exists but cannot be executed.
            code = 127 if exc.errno == errno.ENOENT else 126
            with self.rt.lock:
                self.finish(code, 0, str(exc))
            return
        finally:
            for fd in child_fds:
                os.close(fd)
        if self.stdin_fd >= 0:
            os.set_blocking(self.stdin_fd, False)
            if stdin_data:
                self._stdin_pending.append(stdin_data)
            if not keep_stdin:
                self._stdin_close = True
        self.rt.reactor.call_soon(lambda: self._setup(out_fds))

    def _setup(self, out_fds: list[tuple[int, int]]) -> None:
        with self.rt.lock:
            for fd, idx in out_fds:
                self._watch(fd, idx)
            try:
                pidfd = os.pidfd_open(self.pid)
            except OSError:  # kernels before 5.3: poll instead
                self._poll_exit()
            else:
                self._pidfd = pidfd
                self.rt.reactor.add_reader(pidfd, self._on_pidfd)
            self._arm_timeout()
            if self._stdin_pending or self._stdin_close:
                self._pump_stdin()

    def _poll_exit(self) -> None:
        with self.rt.lock:
            if self._reap():
                self._after_exit()
            elif self.exit is None:
                self.rt.reactor.call_later(0.05, self._poll_exit)

    def _on_pidfd(self) -> None:
        with self.rt.lock:
            if not self._reap():
                return
            self.rt.reactor.forget(self._pidfd)
            os.close(self._pidfd)
            self._after_exit()

    def _reap(self) -> bool:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 255 << 8  # reaped elsewhere: status unknown
        if pid == 0:
            return False
        self._exit_status = status
        return True

    def _after_exit(self) -> None:
        if not self.fds:
            self._finish_exited()
        else:
            # Output still open: a grandchild holds the pipe. Give it a moment
            # to flush, then stop waiting (the pipe goes to the drain).
            self.rt.reactor.call_later(self.rt.config.linger_s, self._finish_locked)

    def _on_output_closed(self) -> None:
        if self._exit_status is not None and not self.fds:
            self._finish_exited()

    def _finish_locked(self) -> None:
        with self.rt.lock:
            self._finish_exited()

    def _finish_exited(self) -> None:
        assert self._exit_status is not None
        code, sig = decode_status(self._exit_status)
        self.finish(code, sig)

    def _on_timeout(self) -> None:
        with self.rt.lock:
            if self.exit is not None:
                return
            self.timed_out = True
            n = kill_session(self.pid, self.pid)
            log.info(
                "exec %s timed out after %.3fs; killed %d processes",
                self.exec_id,
                self.timeout_s,
                n,
            )

    def send_signal(self, sig: int) -> bool:
        with self.rt.lock:
            if self.exit is not None or self.pid <= 0:
                return False
            return killpg_quietly(self.pid, sig)

    def kill(self) -> None:
        with self.rt.lock:
            if self.exit is None and self.pid > 0:
                kill_session(self.pid, self.pid)


def _chown_quietly(fds: list[int], uid: int) -> None:
    for fd in fds:
        try:
            os.fchown(fd, uid, -1)
        except OSError:
            pass


def shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


class ExecManager:
    """The table of executions of this sandbox."""

    def __init__(self, rt: Runtime, sessions: Any) -> None:
        self.rt = rt
        self.sessions = sessions
        self.execs: dict[str, Exec] = {}

    def start(self, req: dict[str, Any], *, mode: str) -> Exec:
        """Validate and start `req`. mode: "sync", "stream", "interactive",
        or "background" (also chosen by req.background)."""
        cfg = self.rt.config
        command = req.get("command", "")
        argv = req.get("argv") or []
        if bool(command) == bool(argv):
            raise invalid("exactly one of command and argv must be set")
        if req.get("trusted"):
            raise ChronusError(
                UNIMPLEMENTED,
                "TRUSTED_EXEC_UNSUPPORTED",
                "trusted execution must be arranged by the edge (read-only layers)",
            )
        labels = req.get("labels", {})
        if len(labels) > MAX_LABELS:
            raise invalid(f"at most {MAX_LABELS} labels, got {len(labels)}", "INVALID_LABEL")
        for key, value in labels.items():
            if not 0 < len(key) <= MAX_LABEL_KEY or not _LABEL_KEY_CHARS.issuperset(key):
                raise invalid(
                    f"label key {key!r}: 1-{MAX_LABEL_KEY} characters of [a-zA-Z0-9._/-]",
                    "INVALID_LABEL",
                )
            if len(value.encode()) > MAX_LABEL_VALUE_BYTES:
                raise invalid(
                    f"label {key!r}: the value exceeds {MAX_LABEL_VALUE_BYTES} bytes",
                    "INVALID_LABEL",
                )
        for key in req.get("env", {}):
            if not key or "=" in key or "\0" in key:
                raise invalid(f"invalid environment variable name {key!r}")
        user = req.get("user", "")
        for part in (
            command or "", *argv, req.get("cwd") or "", user, *req.get("env", {}).values()
        ):  # fmt: skip
            if "\0" in part:  # exec cannot carry it: refuse rather than cut the string
                raise invalid("a NUL byte in the command, argv, cwd or an environment value")
        timeout_s = float(req.get("timeout_s", 0.0))
        if timeout_s < 0:
            raise invalid("timeout_s must not be negative")
        if req.get("background"):
            mode = "background"
        if mode == "sync" and timeout_s == 0:
            timeout_s = cfg.sync_timeout_s
        cap = int(req.get("max_output_bytes", 0)) or cfg.max_output_bytes
        cap = min(
            cap, cfg.sync_output_bytes_limit if mode == "sync" else cfg.max_output_bytes_limit
        )
        if mode == "interactive":
            req = dict(req, stdin_open=True)  # an interactive stream feeds stdin
        background = mode == "background"
        session_id = req.get("session_id", "")
        if session_id and user:
            raise invalid(
                "user is not supported in a session (its shell runs as it was created)",
                "USER_IN_SESSION",
            )
        if session_id:
            ex = self.sessions.start_exec(req, cap=cap, background=background, timeout_s=timeout_s)
            ex.cwd = ex.cwd or ex.session.info()["cwd"]
            self._register(ex)
            return ex
        cwd = req.get("cwd", "")
        env = dict(cfg.env)
        creds: Credentials | None = None
        if user:
            account = resolve_user(user)
            env.update(account.env())
            creds = (account.uid, account.gid, account.groups)
            # A home that does not exist (nobody's /nonexistent) falls back, like su(1) does.
            if not cwd and os.path.isdir(account.home):
                cwd = account.home
        cwd = cwd or cfg.workdir
        env.update(req.get("env", {}))
        pex = ProcessExec(self.rt, req, cap=cap, background=background, timeout_s=timeout_s)
        pex.cwd = cwd
        self._register(pex)
        try:
            pex.launch(list(pex.argv), env, cwd, req, creds)
        except BlockingIOError:
            # Typed like a call that got no thread (engine.py): this command fails, chronus
            # and every other call go on.
            with self.rt.lock:
                self.execs.pop(pex.exec_id, None)
            raise ChronusError(
                RESOURCE_EXHAUSTED,
                "PIDS_LIMIT",
                "the sandbox is at its pids limit: no process for this command",
            ) from None
        return pex

    def _register(self, ex: Exec) -> None:
        with self.rt.lock:
            self.execs[ex.exec_id] = ex
            ex.done_callbacks.append(lambda: self._evict(ex))

    def _evict(self, finished: Exec) -> None:
        """Keep at most keep_exited finished background execs (oldest go)."""
        exited = [e for e in self.execs.values() if e.exit is not None and e.background]
        for old in exited[: max(0, len(exited) - self.rt.config.keep_exited)]:
            del self.execs[old.exec_id]

    def orphan(self, ex: Exec) -> None:
        """A foreground exec whose stream was abandoned (its connection went: an edge restart,
        a microVM's restore), not cancelled by its caller: kept orphan_grace_s of running time
        for an AttachExec by its id, and killed if nobody is attached then (checked again
        each grace while someone is). Any thread."""
        with self.rt.lock:
            ex.orphaned = True
        reactor, grace = self.rt.reactor, self.rt.config.orphan_grace_s

        def arm() -> None:
            reactor.call_later(grace, lambda: self._orphan_due(ex))

        reactor.call_soon(arm)

    def _orphan_due(self, ex: Exec) -> None:
        """Reactor thread: an orphan's grace is over."""
        with self.rt.lock:
            if ex.exit is not None:
                return
            attached = bool(ex.subs)
        if attached:
            self.rt.reactor.call_later(self.rt.config.orphan_grace_s, lambda: self._orphan_due(ex))
            return
        ex.kill()

    def forget(self, ex: Exec) -> None:
        """A foreground exec whose caller has its result (or went away): nobody can ask
        again. One still running (its stream was cancelled, the kill not yet reaped) goes
        when it exits, so abandoned streams do not grow the table. An orphan stays until it
        exits (it may be attached to meanwhile)."""
        with self.rt.lock:
            if ex.background:
                return
            if ex.orphaned and ex.exit is None:
                ex.done_callbacks.append(lambda: self._drop(ex.exec_id))
                return
            if ex.exit is not None:
                self.execs.pop(ex.exec_id, None)
            else:
                ex.done_callbacks.append(lambda: self._drop(ex.exec_id))

    def _drop(self, exec_id: str) -> None:
        self.execs.pop(exec_id, None)  # called by Exec.finish, under the lock

    def get(self, exec_id: str) -> Exec:
        with self.rt.lock:
            ex = self.execs.get(exec_id)
        if ex is None:
            raise ChronusError(NOT_FOUND, "EXEC_NOT_FOUND", f"no execution {exec_id!r}")
        return ex

    def list_infos(self) -> list[dict[str, Any]]:
        with self.rt.lock:
            return [ex.info() for ex in self.execs.values()]

    def running(self) -> int:
        with self.rt.lock:
            return sum(1 for ex in self.execs.values() if ex.exit is None)

    def signal(self, exec_id: str, sig: int) -> bool:
        if sig <= 0 or sig >= _signal.NSIG:
            raise invalid(f"invalid signal {sig}")
        return self.get(exec_id).send_signal(sig)

    def busy_error(self, what: str) -> ChronusError:
        return ChronusError(FAILED_PRECONDITION, "SESSION_BUSY", what)

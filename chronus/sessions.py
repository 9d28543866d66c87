"""Persistent shell sessions and the marker protocol that drives them.

A session is one interactive shell (bash if present, else sh) started by
chronus on its own pseudo-terminal, in its own session, with job control.
State (cwd, variables, functions, background services) lives in that shell.

One call at a time, chronus:
  1. writes the command verbatim to a file `cmd-N` and a wrapper `call-N`
     (`cd -- CWD && VAR='v' . cmd-N`): the command never passes through the
     terminal, so quotes, heredocs and multi-line scripts need no escaping
     and the tty's 4 KiB line limit does not apply;
  2. makes per-call FIFOs `out-N`, `err-N` (and `in-N` for interactive
     stdin) and opens their read ends, so the shell's opens never block;
  3. types one short line on the terminal:
        __dsec_c=ID; { . call-N; } <in >out-N 2>err-N; printf 'ID %s\n' "$?" >ctl
     The group runs in the shell itself (`cd`, `export`, functions persist);
  4. reads `ID STATUS` from the session's control FIFO. If the line was
     aborted (Ctrl-C semantics after a timeout), bash's PROMPT_COMMAND, set
     read-only at start, reports `ID 130` instead: a marker always comes.

Timeouts: with job control each pipeline is its own process group, so the
foreground job is `tcgetpgrp(master)`. chronus SIGKILLs it and every process
group of the shell's session created during the call, and sends SIGINT to
the shell, which aborts the rest of the line (or a builtin loop) and returns
to its prompt: the session stays usable. If no marker comes within a grace
period, the whole session is killed and reported.

Pipes that a background job keeps open after its call go to the drain, so
`server &` keeps running without dying of SIGPIPE.

Where the files live: each session has a directory of its own in chronus's
runtime directory, which in a container is a detached tmpfs (no path leads
to it; see `chronus.landlock`). The shell holds its session directory as
descriptor SESSION_DIR_FD and names every file through it
(`/proc/self/fd/63/cmd-N`); chronus works relative to the same descriptor.
The shell's Landlock domain grants that directory and no other part of the
runtime directory, so no other command or session can read the commands,
write markers or steal output, even as root.
"""

from __future__ import annotations

import _signal
import errno
import os
import termios
import time

from chronus.errors import (
    ALREADY_EXISTS,
    FAILED_PRECONDITION,
    NOT_FOUND,
    ChronusError,
    invalid,
)
from chronus.execs import STDERR, STDOUT, Exec, Runtime, shell_quote, timestamp
from chronus.proc import SpawnError, decode_status, set_winsize, spawn
from chronus.reactor import Timer
from insandbox.log import get_logger
from insandbox.proc import kill_quietly, kill_session, killpg_quietly, proc_table

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
    from typing import Any

log = get_logger("chronus.sessions")

SESSION_DIR_FD = 63  # in the shell: its session directory
INTERRUPT_GRACE_S = 5.0  # after a timeout, how long the shell gets to return to its prompt
INTERRUPT_EVERY_S = 0.25


def _is_session_id(value: str) -> bool:
    """The form Runtime.new_id("se") gives: "se-" and 1 to 40 lowercase hex digits (it names a
    directory of the runtime directory, so nothing else gets through)."""
    digits = value[3:]
    return (
        value.startswith("se-")
        and 0 < len(digits) <= 40
        and all(c in "0123456789abcdef" for c in digits)
    )


def shell_path(name: str) -> str:
    """How the session's shell names a file of its session directory."""
    return f"/proc/self/fd/{SESSION_DIR_FD}/{name}"


class Session:
    def __init__(self, rt: Runtime, session_id: str, shell: str, dir_fd: int, base_fd: int) -> None:
        self.rt = rt
        self.session_id = session_id
        self.shell = shell
        self.dir_fd = dir_fd  # the session directory (O_DIRECTORY, close-on-exec)
        self.base_fd = base_fd  # the runtime directory it is in
        self.is_bash = os.path.basename(shell).startswith("bash")
        self.created_at = time.time()
        self.pid = 0
        self.master = -1
        self.ctl_path = shell_path("ctl")
        self.ctl_r = -1
        self.ctl_w = -1
        self.pidfd = -1
        self.current: SessionExec | None = None
        self.seq = 0
        self.closed = False
        self._ctl_buf = b""

    def info(self) -> dict[str, Any]:
        try:
            cwd = os.readlink(f"/proc/{self.pid}/cwd")
        except OSError:
            cwd = ""
        return {
            "session_id": self.session_id,
            "shell": self.shell,
            "cwd": cwd,
            "created_at": timestamp(self.created_at),
        }

    # --------------------------------------------------------------- start
    def start(self, cwd: str, env: dict[str, str]) -> None:
        d = self.dir_fd
        os.mkfifo("ctl", 0o600, dir_fd=d)
        self.ctl_r = os.open("ctl", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
        # A writer of our own keeps the FIFO from reporting EOF between markers.
        self.ctl_w = os.open("ctl", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
        master, slave = os.openpty()
        try:
            attrs = termios.tcgetattr(slave)
            attrs[3] &= ~termios.ECHO  # our command lines are not output
            termios.tcsetattr(slave, termios.TCSANOW, attrs)
            set_winsize(master, 24, 80)
            if self.is_bash:
                argv = [self.shell, "--norc", "--noprofile", "--noediting", "-i"]
            else:
                argv = [self.shell, "-i"]
            env = dict(env, PS1="", PS2="")
            env.setdefault("TERM", "dumb")
            ruleset = self.rt.sandboxing.for_session(d)
            try:
                self.pid = spawn(
                    argv,
                    env,
                    cwd,
                    ctty=slave,
                    extra_fds={SESSION_DIR_FD: d},
                    ruleset_fd=ruleset,
                    syscall_filter=self.rt.sandboxing.filter,
                )
            finally:
                if ruleset >= 0:
                    os.close(ruleset)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        self.master = master
        os.set_blocking(master, False)
        ctl = shell_quote(self.ctl_path)
        init = "PS1=''; PS2=''; unset HISTFILE; set +o history 2>/dev/null"
        if self.is_bash:
            # Fires at every prompt, also after an interrupted line.
            prompt = f'printf "%s %s\\n" "$__dsec_c" "$?" >|{ctl}'
            init += (
                f"; set +H; PS0=''; PROMPT_COMMAND={shell_quote(prompt)}; readonly PROMPT_COMMAND"
            )
        os.write(master, (init + "\n").encode())
        self.rt.reactor.call_soon(self._setup)

    def _setup(self) -> None:
        with self.rt.lock:
            if self.closed:
                return
            self.rt.reactor.add_reader(self.master, self._on_master)
            self.rt.reactor.add_reader(self.ctl_r, self._on_ctl)
            try:
                self.pidfd = os.pidfd_open(self.pid)
                self.rt.reactor.add_reader(self.pidfd, self._on_pidfd)
            except OSError:
                self._poll_exit()

    # ------------------------------------------------------ reactor thread
    def _on_master(self) -> None:
        with self.rt.lock:
            try:
                data = os.read(self.master, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # hung up: the shell is gone, the pidfd reports it
                self.rt.reactor.remove_reader(self.master)
                return
            cur = self.current
            if cur is not None and cur.is_pty and cur.exit is None:
                cur.on_output(STDOUT, data)
            # Otherwise it is the shell's own chatter (job notices): dropped.

    def _on_ctl(self) -> None:
        with self.rt.lock:
            try:
                data = os.read(self.ctl_r, 4096)
            except BlockingIOError:
                return
            self._ctl_buf += data
            while b"\n" in self._ctl_buf:
                line, self._ctl_buf = self._ctl_buf.split(b"\n", 1)
                call_id, _, status = line.decode(errors="replace").partition(" ")
                cur = self.current
                if cur is not None and call_id == cur.call_id and cur.exit is None:
                    try:
                        rc = int(status)
                    except ValueError:
                        rc = -1
                    cur.on_marker(rc)
            if len(self._ctl_buf) > 4096:
                self._ctl_buf = b""  # garbage written by someone else

    def _on_pidfd(self) -> None:
        with self.rt.lock:
            self._reap()

    def _poll_exit(self) -> None:
        with self.rt.lock:
            if not self._reap() and not self.closed:
                self.rt.reactor.call_later(0.1, self._poll_exit)

    def _reap(self) -> bool:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return False
        log.info("session %s: shell %d exited (status %d)", self.session_id, self.pid, status)
        code, sig = decode_status(status)
        cur = self.current
        if cur is not None and cur.exit is None:
            cur.finish(code, sig, "the session's shell exited")
        self.dispose()
        return True

    # ------------------------------------------------------------ teardown
    def dispose(self) -> None:
        """Kill the session's processes and release everything (locked)."""
        if self.closed:
            return
        self.closed = True
        if self.pid > 0:
            kill_session(self.pid, self.pid)
        cur = self.current
        if cur is not None and cur.exit is None:
            cur.finish(-1, _signal.SIGKILL, "the session was closed")
        reactor = self.rt.reactor
        for fd in (self.master, self.ctl_r, self.ctl_w, self.pidfd):
            if fd >= 0:
                reactor.forget(fd)
                os.close(fd)
        self.master = self.ctl_r = self.ctl_w = self.pidfd = -1
        if self.pid > 0:
            try:  # reap now if it is already gone; aether reaps it otherwise
                os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pass
        try:
            for name in os.listdir(self.dir_fd):
                os.unlink(name, dir_fd=self.dir_fd)
        except OSError:
            pass
        os.close(self.dir_fd)
        self.dir_fd = -1
        try:
            os.rmdir(self.session_id, dir_fd=self.base_fd)
        except OSError:
            pass
        self.rt.on_session_gone(self)


class SessionExec(Exec):
    """One call in a session's shell (see the module docstring)."""

    def __init__(self, rt: Runtime, req: dict[str, Any], session: Session, **kw: Any) -> None:
        super().__init__(rt, req, **kw)
        self.session = session
        session.seq += 1
        self.call_id = f"{session.seq}-{os.urandom(4).hex()}"
        self.pid = session.pid
        self._files: list[str] = []
        self._pgids_before: set[int] = set()
        self._interrupt_timer: Timer | None = None
        self._grace_timer: Timer | None = None
        self._killing = False
        self._stdin_fifo = ""

    def _path(self, stem: str) -> str:
        """A new file name in the session directory (removed when the call ends)."""
        name = f"{stem}-{self.session.seq}"
        self._files.append(name)
        return name

    def _write(self, name: str, data: bytes) -> None:
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600,
            dir_fd=self.session.dir_fd,
        )  # fmt: skip
        with open(fd, "wb") as fh:
            fh.write(data)

    def launch(self, req: dict[str, Any]) -> None:
        s = self.session
        d = s.dir_fd
        command: str = req.get("command") or " ".join(shell_quote(a) for a in req["argv"])
        cmd_path = self._path("cmd")
        self._write(cmd_path, (command if command.endswith("\n") else command + "\n").encode())
        prefix = ""
        if req.get("cwd"):
            prefix = f"cd -- {shell_quote(req['cwd'])} && "
        for key, value in req.get("env", {}).items():
            if not key.replace("_", "a").isalnum() or key[0].isdigit():
                raise invalid(f"environment variable name {key!r} is not valid in a shell")
            prefix += f"{key}={shell_quote(value)} "
        call_path = self._path("call")
        self._write(call_path, f"{prefix}. {shell_quote(shell_path(cmd_path))}\n".encode())
        redirect = ""
        stdin_data: bytes = req.get("stdin", b"")
        if self.is_pty:
            self.stdin_fd = s.master
            size = req.get("pty_size")
            if size:
                set_winsize(s.master, size.get("rows", 24), size.get("cols", 80))
        else:
            nb = os.O_NONBLOCK | os.O_CLOEXEC
            if req.get("stdin_open"):
                self._stdin_fifo = in_name = self._path("in")
                os.mkfifo(in_name, 0o600, dir_fd=d)
                # O_RDWR never blocks on a FIFO (Linux); see _close_stdin_fd.
                self.stdin_fd = os.open(in_name, os.O_RDWR | nb, dir_fd=d)
                in_path = shell_path(in_name)
            elif stdin_data:
                in_name = self._path("in")
                self._write(in_name, stdin_data)
                in_path = shell_path(in_name)
                stdin_data = b""
            else:
                in_path = os.devnull
            out_name, err_name = self._path("out"), self._path("err")
            os.mkfifo(out_name, 0o600, dir_fd=d)
            os.mkfifo(err_name, 0o600, dir_fd=d)
            out_fd = os.open(out_name, os.O_RDONLY | nb, dir_fd=d)
            err_fd = os.open(err_name, os.O_RDONLY | nb, dir_fd=d)
            redirect = (
                f" <{shell_quote(in_path)} >{shell_quote(shell_path(out_name))}"
                f" 2>{shell_quote(shell_path(err_name))}"
            )
        if stdin_data:
            self._stdin_pending.append(stdin_data)
        if not req.get("stdin_open") and self.stdin_fd >= 0:
            self._stdin_close = True
        ctl = shell_quote(s.ctl_path)
        line = (
            f"__dsec_c={self.call_id}; {{ . {shell_quote(shell_path(call_path))}; }}{redirect}; "
            f"printf '{self.call_id} %s\\n' \"$?\" >|{ctl}\n"
        )
        if self.timeout_s > 0:
            self._pgids_before = {p.pgid for p in proc_table() if p.sid == s.pid}
        with self.rt.lock:
            if not self.is_pty:
                self.fds[out_fd] = STDOUT
                self.fds[err_fd] = STDERR
            os.write(s.master, line.encode())
        self.rt.reactor.call_soon(self._setup)

    def _setup(self) -> None:
        with self.rt.lock:
            if self.exit is not None:
                return
            for fd, idx in list(self.fds.items()):
                self._watch(fd, idx)
            self._arm_timeout()
            if self._stdin_pending or self._stdin_close:
                self._pump_stdin()

    def _close_stdin_fd(self) -> None:
        if self.is_pty or not self._stdin_fifo:
            super()._close_stdin_fd()
            return
        # Closing our end before the shell has opened the FIFO would leave its
        # open() waiting for a writer forever: wait until a reader exists.
        try:
            probe = os.open(
                self._stdin_fifo, os.O_WRONLY | os.O_NONBLOCK, dir_fd=self.session.dir_fd
            )
        except OSError as exc:
            if exc.errno == errno.ENXIO and self.exit is None:
                self.rt.reactor.call_later(0.02, self._close_stdin_locked)
                return
        else:
            os.close(probe)
        self._stdin_fifo = ""
        super()._close_stdin_fd()

    def _close_stdin_locked(self) -> None:
        with self.rt.lock:
            if self.stdin_fd >= 0:
                self._close_stdin_fd()

    def _pty_fd(self) -> int:
        return self.session.master if self.is_pty else -1

    # -------------------------------------------------------- completion
    def on_marker(self, rc: int) -> None:
        if self._killing:
            self._kill_new_groups()  # stragglers the interrupted call left behind
        self.finish(rc, 0)

    def finish(self, exit_code: int, sig: int, error: str = "") -> None:
        if self.exit is not None:
            return
        for timer in (self._interrupt_timer, self._grace_timer):
            if timer is not None:
                timer.cancel()
        if self.is_pty:
            self.stdin_fd = -1  # the session's master: not ours to close
        super().finish(exit_code, sig, error)
        if self.session.dir_fd >= 0:
            for name in self._files:
                try:
                    os.unlink(name, dir_fd=self.session.dir_fd)
                except OSError:
                    pass
        if self.session.current is self:
            self.session.current = None

    # ---------------------------------------------------------- killing
    def _on_timeout(self) -> None:
        with self.rt.lock:
            if self.exit is None:
                self.timed_out = True
                log.info("session %s: call timed out", self.session.session_id)
                self._start_interrupt()

    def kill(self) -> None:
        with self.rt.lock:
            if self.exit is None:
                self.rt.reactor.call_soon(self._start_interrupt_locked)

    def _start_interrupt_locked(self) -> None:
        with self.rt.lock:
            if self.exit is None:
                self._start_interrupt()

    def _start_interrupt(self) -> None:
        if self._killing:
            return
        self._killing = True
        # A reactor timer: running time (chronus.clock), so a pause inside the grace does not
        # close the session.
        self._grace_timer = self.rt.reactor.call_later(INTERRUPT_GRACE_S, self._give_up)
        self._interrupt()

    def _give_up(self) -> None:
        with self.rt.lock:
            s = self.session
            if self.exit is None and not s.closed:
                log.warning(
                    "session %s: shell did not return to its prompt; closing it", s.session_id
                )
                s.dispose()

    def _interrupt(self) -> None:
        s = self.session
        if self.exit is not None or s.closed:
            return
        try:
            fg = os.tcgetpgrp(s.master)
        except OSError:
            fg = s.pid
        # The shell's SIGINT first: killed first, the foreground job's death would let the
        # shell run the rest of the line (`sleep 100; echo never`) before the SIGINT arrives
        # (seen under load: 4 of 15 runs); pending when the job dies, it aborts the line.
        kill_quietly(s.pid, _signal.SIGINT)
        self._kill_new_groups()
        if fg != s.pid:
            killpg_quietly(fg, _signal.SIGKILL)
        if not s.is_bash:
            # Other shells (busybox ash, dash) have no PROMPT_COMMAND: SIGINT
            # drops the rest of the call's line, marker included, so type the
            # marker as the next line. If the line survived instead, its own
            # marker came first and this one is ignored as stale.
            line = f'printf "%s 130\\n" "$__dsec_c" >{shell_quote(s.ctl_path)}\n'
            try:
                os.write(s.master, line.encode())
            except OSError:
                pass
        self._interrupt_timer = self.rt.reactor.call_later(
            INTERRUPT_EVERY_S, self._interrupt_locked
        )

    def _interrupt_locked(self) -> None:
        with self.rt.lock:
            self._interrupt()

    def _kill_new_groups(self) -> None:
        s = self.session
        for p in proc_table():
            if p.sid == s.pid and p.pgid != s.pid and p.pgid not in self._pgids_before:
                kill_quietly(p.pid, _signal.SIGKILL)

    def send_signal(self, sig: int) -> bool:
        with self.rt.lock:
            s = self.session
            if self.exit is not None or s.closed:
                return False
            try:
                fg = os.tcgetpgrp(s.master)
            except OSError:
                fg = s.pid
            if fg != s.pid:
                return killpg_quietly(fg, sig)
            if sig == _signal.SIGINT:
                return kill_quietly(s.pid, sig)  # interrupt a builtin loop
            return False


class SessionManager:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.sessions: dict[str, Session] = {}
        self._dir_fd = -1
        rt.on_session_gone = self._gone

    def _runtime_dir_fd(self) -> int:
        """The runtime directory: the edge's descriptor, or a directory by path (tests)."""
        if self._dir_fd < 0:
            cfg = self.rt.config
            if cfg.runtime_fd >= 0:
                self._dir_fd = cfg.runtime_fd
            else:
                base = cfg.runtime_dir
                try:
                    os.makedirs(base, 0o700, exist_ok=True)
                except OSError:
                    base = f"/tmp/.dsec-chronus-{os.getpid()}"
                    os.makedirs(base, 0o700, exist_ok=True)
                self._dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return self._dir_fd

    def create(self, req: dict[str, Any], session_id: str = "") -> Session:
        """A new session; `session_id` names it (a fork's child restoring its source's
        session: RestoreSessionRequest), else chronus picks a free id."""
        if session_id and not _is_session_id(session_id):
            raise invalid(f"session id {session_id!r} is not se-<hex>", "INVALID_SESSION_ID")
        with self.rt.lock:
            if session_id in self.sessions:
                raise ChronusError(
                    ALREADY_EXISTS, "SESSION_EXISTS", f"session {session_id!r} exists"
                )
        cfg = self.rt.config
        shell = req.get("shell", "")
        env_in: dict[str, str] = req.get("env", {})
        for key in env_in:
            if not key or "=" in key:
                raise invalid(f"invalid environment variable name {key!r}")
        # exec and os.access cannot carry a NUL (ValueError: the call ended INTERNAL, found
        # by tests/fuzz): refused as an Exec's are
        for part in (shell, req.get("cwd") or "", *env_in, *env_in.values()):
            if "\0" in part:
                raise invalid("a NUL byte in the shell, cwd or an environment variable")
        if not shell:
            shell = "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"
        elif not os.access(shell, os.X_OK):
            raise ChronusError(NOT_FOUND, "SHELL_NOT_FOUND", f"{shell}: not an executable")
        cwd = req.get("cwd") or cfg.workdir
        if not os.path.isdir(cwd):
            raise ChronusError(NOT_FOUND, "PATH_NOT_FOUND", f"{cwd}: no such directory")
        env = dict(cfg.env)
        env.update(env_in)
        while not session_id or session_id in self.sessions:  # not a restored one's id
            session_id = self.rt.new_id("se")
        base = self._runtime_dir_fd()
        os.mkdir(session_id, 0o700, dir_fd=base)
        dir_fd = os.open(session_id, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=base)
        session = Session(self.rt, session_id, shell, dir_fd, base)
        try:
            session.start(cwd, env)
        except SpawnError as exc:
            for name in os.listdir(dir_fd):
                os.unlink(name, dir_fd=dir_fd)
            os.close(dir_fd)
            os.rmdir(session_id, dir_fd=base)
            raise ChronusError(FAILED_PRECONDITION, "SESSION_START_FAILED", str(exc)) from None
        with self.rt.lock:
            self.sessions[session_id] = session
        # A first, empty call proves the shell reads our lines and reports markers.
        ready = self.start_exec(
            {"command": ":", "session_id": session_id},
            cap=4096,
            background=False,
            timeout_s=cfg.session_ready_s,
        )
        ready.done.wait()
        if ready.exit is None or ready.exit.get("exit_code") != 0:
            self.close(session_id)
            raise ChronusError(
                FAILED_PRECONDITION, "SESSION_START_FAILED", f"{shell} did not become ready"
            )
        return session

    def get(self, session_id: str) -> Session:
        with self.rt.lock:
            session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise ChronusError(NOT_FOUND, "SESSION_NOT_FOUND", f"no session {session_id!r}")
        return session

    def start_exec(
        self, req: dict[str, Any], *, cap: int, background: bool, timeout_s: float
    ) -> SessionExec:
        session = self.get(req["session_id"])
        with self.rt.lock:
            if session.current is not None:
                raise ChronusError(
                    FAILED_PRECONDITION,
                    "SESSION_BUSY",
                    f"session {session.session_id} is running {session.current.exec_id}",
                )
            ex = SessionExec(
                self.rt, req, session, cap=cap, background=background, timeout_s=timeout_s
            )
            session.current = ex
        try:
            ex.launch(req)
        except BaseException:
            with self.rt.lock:
                ex.finish(-1, 0, "could not start the call")
            raise
        return ex

    def close(self, session_id: str) -> None:
        session = self.get(session_id)
        with self.rt.lock:
            session.dispose()

    def _gone(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)

    def list_infos(self) -> list[dict[str, Any]]:
        with self.rt.lock:
            sessions = [s for s in self.sessions.values() if not s.closed]
        return [s.info() for s in sessions]

    def count(self) -> int:
        with self.rt.lock:
            return sum(1 for s in self.sessions.values() if not s.closed)

    def close_all(self) -> None:
        with self.rt.lock:
            for session in list(self.sessions.values()):
                session.dispose()

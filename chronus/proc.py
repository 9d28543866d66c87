"""Process primitives: spawning commands in their own session, killing trees.

Every command starts in a new session (setsid), so it leads its own process
group and everything it forks stays findable by session id even after it
changes process group. chronus forks directly instead of importing
`subprocess` (~0.9 MB per process): the child only calls C-level `os`
functions before exec, which is safe in a threaded parent.
"""

from __future__ import annotations

import _signal  # not `signal`: its enums cost ~1 MB per process
import _thread
import errno
import fcntl
import os
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from chronus import seccomp

# Python ignores these at start-up; ignored dispositions survive exec, so the
# child must restore them or `yes | head` never ends.
_RESET_SIGNALS = (_signal.SIGPIPE, _signal.SIGXFSZ)


class SpawnError(Exception):
    """The command could not be started; `step` is "chdir" or "exec"."""

    def __init__(self, step: str, err: int, detail: str) -> None:
        super().__init__(f"{step} {detail}: {os.strerror(err)}")
        self.step = step
        self.errno = err


def spawn(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    *,
    stdin: int = -1,
    stdout: int = -1,
    stderr: int = -1,
    ctty: int = -1,
    extra_fds: dict[int, int] | None = None,
    ruleset_fd: int = -1,
    syscall_filter: seccomp.Filter | None = None,
) -> int:
    """Start `argv` in a new session; return its pid.

    With `ctty` (a pty slave), the child makes it its controlling terminal
    and its stdin/stdout/stderr. Otherwise the given fds become 0, 1, 2.
    `extra_fds` maps child fd -> parent fd. Every other descriptor is
    close-on-exec (PEP 446), so commands never inherit chronus's sockets.
    With `ruleset_fd`, the child is in a Landlock domain made from it
    (`chronus.landlock`); with `syscall_filter`, it also has that seccomp
    filter (`chronus.seccomp`). If either fails, the command does not run.

    How: not fork() but glibc's posix_spawn(), i.e. clone(CLONE_VM|CLONE_VFORK),
    from a disposable thread. Forking chronus copies its page tables and
    write-protects every page, so chronus then takes a fault on each page it
    writes (~3 us each here): ~1.3 ms per command (measured with a 25 MB
    process: fork+exec 2.1 ms, this 0.75 ms). The Landlock domain, the seccomp
    filter and no_new_privs are per thread and inherited by the thread's
    children, so the thread takes them on itself, spawns, and ends (chronus's
    other threads are never restricted); the rest (setsid, descriptors, cwd,
    signal dispositions) are posix_spawn attributes and file actions. Through
    ctypes because os.posix_spawn has no chdir action (glibc's
    posix_spawn_file_actions_addchdir_np), and a thread cannot chdir alone:
    unshare(CLONE_FS) is refused by the sandbox's seccomp profile.
    """
    path = _resolve(argv[0], env)
    opened: list[int] = []

    def high(fd: int) -> int:
        # A copy >= 10, so that no dup2 has source == target (which would keep CLOEXEC).
        new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
        opened.append(new)
        return new

    try:
        # (kind, args): dup2 (src, dst) / open (fd, path) / chdir (path)
        actions: list[tuple[str, tuple[Any, ...]]] = []
        if ctty >= 0:
            # After setsid (posix_spawn does it before the file actions), the first tty
            # the session leader opens without O_NOCTTY becomes its controlling terminal.
            actions.append(("open", (0, os.ttyname(ctty))))
            actions += [("dup2", (0, 1)), ("dup2", (0, 2))]
        else:
            for target, source in ((0, stdin), (1, stdout), (2, stderr)):
                actions.append(("dup2", (high(source), target)))
        for target, source in (extra_fds or {}).items():
            actions.append(("dup2", (high(source), target)))
        actions.append(("chdir", (cwd,)))
        enforce: Callable[[int], None] | None = None
        if ruleset_fd >= 0:
            from chronus.landlock import enforce
        outcome: list[Any] = []
        done = _thread.allocate_lock()
        done.acquire()

        def confined() -> None:
            step, detail = "setup", ""
            try:
                if enforce is not None:
                    step, detail = "landlock", "restrict"
                    enforce(ruleset_fd)
                if syscall_filter is not None:
                    step, detail = "seccomp", "filter"
                    syscall_filter.install()
                # What the child would fail at, told apart (posix_spawn returns only an errno).
                step, detail = "chdir", cwd
                os.stat(cwd)
                if not os.path.isdir(cwd):
                    raise NotADirectoryError(errno.ENOTDIR, cwd)
                step, detail = "exec", argv[0]
                outcome.append(_posix_spawn(path, argv, env, actions))
            except OSError as exc:
                outcome.append(SpawnError(step, exc.errno or errno.EIO, detail))
            except BaseException:
                outcome.append(SpawnError(step, errno.EIO, detail))
            finally:
                done.release()

        try:
            _thread.start_new_thread(confined, ())
        except RuntimeError as exc:  # no thread to be had: the sandbox is at its pids limit
            raise SpawnError("setup", errno.EAGAIN, f"thread: {exc}") from exc
        done.acquire()
    finally:
        for fd in opened:
            os.close(fd)
    (result,) = outcome
    if isinstance(result, SpawnError):
        raise result
    pid: int = result
    return pid


def _resolve(program: str, env: dict[str, str]) -> str:
    """execvpe's search, on the command's own PATH (posix_spawnp would use chronus's)."""
    if "/" in program:
        return program
    for d in (env.get("PATH") or os.defpath).split(os.pathsep):
        candidate = os.path.join(d or ".", program)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    raise SpawnError("exec", errno.ENOENT, program)


_SPAWN_SETSIGDEF, _SPAWN_SETSIGMASK, _SPAWN_SETSID = 0x04, 0x08, 0x80
_libc: Any = None


def _posix_spawn(
    path: str, argv: list[str], env: dict[str, str], actions: list[tuple[str, tuple[Any, ...]]]
) -> int:
    """glibc posix_spawn with file actions (dup2/open/chdir), setsid, default SIGPIPE/SIGXFSZ
    and an empty signal mask; returns the pid or raises OSError(errno of the child's failure)."""
    import ctypes

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    libc = _libc
    fa = ctypes.create_string_buffer(256)  # posix_spawn_file_actions_t: 80 bytes on x86_64
    attr = ctypes.create_string_buffer(1024)  # posix_spawnattr_t: 336 bytes
    sigdef = ctypes.create_string_buffer(128)  # sigset_t
    empty = ctypes.create_string_buffer(128)
    libc.posix_spawn_file_actions_init(fa)
    libc.posix_spawnattr_init(attr)
    try:
        for kind, args in actions:
            if kind == "dup2":
                r = libc.posix_spawn_file_actions_adddup2(fa, args[0], args[1])
            elif kind == "open":
                r = libc.posix_spawn_file_actions_addopen(
                    fa, args[0], os.fsencode(args[1]), os.O_RDWR, 0
                )
            else:
                r = libc.posix_spawn_file_actions_addchdir_np(fa, os.fsencode(args[0]))
            if r:
                raise OSError(r, f"posix_spawn file action {kind}")
        libc.sigemptyset(sigdef)
        libc.sigemptyset(empty)
        for sig in _RESET_SIGNALS:
            libc.sigaddset(sigdef, int(sig))
        libc.posix_spawnattr_setsigdefault(attr, sigdef)
        libc.posix_spawnattr_setsigmask(attr, empty)
        libc.posix_spawnattr_setflags(
            attr, ctypes.c_short(_SPAWN_SETSIGDEF | _SPAWN_SETSIGMASK | _SPAWN_SETSID)
        )
        c_argv = (ctypes.c_char_p * (len(argv) + 1))(*[os.fsencode(a) for a in argv], None)
        c_env = (ctypes.c_char_p * (len(env) + 1))(
            *[os.fsencode(f"{k}={v}") for k, v in env.items()], None
        )
        pid = ctypes.c_int(0)
        r = libc.posix_spawn(ctypes.byref(pid), os.fsencode(path), fa, attr, c_argv, c_env)
        if r:
            raise OSError(r, os.strerror(r))
        return pid.value
    finally:
        libc.posix_spawn_file_actions_destroy(fa)
        libc.posix_spawnattr_destroy(attr)


def set_winsize(fd: int, rows: int, cols: int) -> None:
    import termios  # pty calls only

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows or 24, cols or 80, 0, 0))


def decode_status(status: int) -> tuple[int, int]:
    """(exit_code, signal) of a wait status; exit_code is -1 when signalled."""
    if os.WIFSIGNALED(status):
        return -1, os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), 0
    return -1, 0


class ProcEntry:
    __slots__ = ("pgid", "pid", "ppid", "sid")

    def __init__(self, pid: int, ppid: int, pgid: int, sid: int) -> None:
        self.pid = pid
        self.ppid = ppid
        self.pgid = pgid
        self.sid = sid


def proc_table() -> list[ProcEntry]:
    """Every visible process (in a sandbox: every process of the sandbox)."""
    table: list[ProcEntry] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                raw = fh.read()
        except OSError:
            continue  # exited while we looked
        # The command name may contain spaces and parentheses: split after the last ')'.
        fields = raw[raw.rfind(b")") + 2 :].split()
        table.append(ProcEntry(int(name), int(fields[1]), int(fields[2]), int(fields[3])))
    return table


def descendants(roots: set[int], table: list[ProcEntry]) -> set[int]:
    """Pids below `roots` in the parent tree (excluding the roots)."""
    children: dict[int, list[int]] = {}
    for p in table:
        children.setdefault(p.ppid, []).append(p.pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_quietly(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def killpg_quietly(pgid: int, sig: int) -> bool:
    if pgid <= 1:
        return False  # never signal init's group or "every process"
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_session(sid: int, root: int, sig: int = _signal.SIGKILL) -> int:
    """Signal the process group `sid`, every process of session `sid` and
    every descendant of `root`: the stragglers that left the group or forked
    away still die. Returns how many processes were signalled."""
    killpg_quietly(sid, sig)
    table = proc_table()
    me = os.getpid()
    targets = {p.pid for p in table if p.sid == sid} | descendants({root}, table)
    targets.discard(me)
    return sum(kill_quietly(pid, sig) for pid in targets)


def rss_bytes(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0

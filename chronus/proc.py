"""Process primitives of chronus: spawning commands in their own session, confined.

Every command starts in a new session (setsid), so it leads its own process
group and everything it forks stays findable by session id even after it
changes process group (finding and killing those trees: `insandbox.proc`, shared
with aether). chronus forks directly instead of importing
`subprocess` (~0.9 MB per process): the child only calls C-level `os`
functions before exec, which is safe in a threaded parent.
"""

from __future__ import annotations

import _signal  # not `signal`: its enums cost ~1 MB per process
import errno
import fcntl
import os
import struct

from chronus.landlock import enforce

try:  # the toolkit's extension (chronus/spawn.c), loaded with chronus (aether preloads it)
    from chronus import _spawn as _SPAWN  # type: ignore[attr-defined]
except ImportError:  # a source tree, or a toolkit built without the Python headers
    _SPAWN = None

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from insandbox.security import Filter

    Credentials = tuple[int, int, list[int]]  # uid, gid, supplementary gids

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
    syscall_filter: Filter | None = None,
    creds: Credentials | None = None,
) -> int:
    """Fork and exec `argv` in a new session; return its pid.

    With `ctty` (a pty slave), the child makes it its controlling terminal
    and its stdin/stdout/stderr. Otherwise the given fds become 0, 1, 2.
    `extra_fds` maps child fd -> parent fd. Every other descriptor is
    close-on-exec (PEP 446), so commands never inherit chronus's sockets.
    With `ruleset_fd`, the child enters a Landlock domain made from it just
    before exec (`chronus.landlock`); with `syscall_filter`, it also installs that
    seccomp filter (`chronus.seccomp`). If either fails, the command does not run.
    With `creds` (uid, gid, supplementary gids), the child sets its groups, gid and uid after
    entering the domain and before chdir and exec (a failure is step "user").

    In a toolkit with the `chronus._spawn` extension (chronus/spawn.c) the command starts from
    a vfork-style clone whose child does the chdir/Landlock/seccomp part itself and execs the
    command: one exec. Else, in a toolkit (where `dsec-confine` sits next to the interpreter)
    the command
    is started with posix_spawn, i.e. vfork, through that static trampoline, which
    does the chdir/Landlock/seccomp part itself before exec'ing the command
    (chronus/confine.c): no copy of chronus's page tables and no copy-on-write
    faults in chronus afterwards (~1 ms per command here). Not from a chronus
    thread that restricts itself instead: Landlock checks a signal against the
    target *thread's* domain, so the command could tgkill() (SIGKILL) that thread
    while it lives (tried, found in review; tests/adversarial guards it).
    Elsewhere (chronus run from a source tree) it forks, and the child does it.
    """
    direct = _direct_spawner()
    if direct is not None:
        return _spawn_direct(
            direct, argv, env, cwd, stdin, stdout, stderr, ctty, extra_fds, ruleset_fd,
            syscall_filter, creds,
        )  # fmt: skip
    confine = _confine_path()
    if confine is not None:
        return _spawn_confined(
            confine, argv, env, cwd, stdin, stdout, stderr, ctty, extra_fds, ruleset_fd,
            syscall_filter, creds,
        )  # fmt: skip
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only C-level calls until exec
        step, detail = "setup", ""
        try:
            if ctty >= 0:
                os.login_tty(ctty)
            else:
                os.setsid()
                os.dup2(stdin, 0)
                os.dup2(stdout, 1)
                os.dup2(stderr, 2)
            for target, source in (extra_fds or {}).items():
                os.dup2(source, target)
            for sig in _RESET_SIGNALS:
                _signal.signal(sig, _signal.SIG_DFL)
            if ruleset_fd >= 0:
                step, detail = "landlock", "restrict"
                enforce(ruleset_fd)
            if creds is not None:
                step, detail = "user", str(creds[0])
                os.setgroups(creds[2])
                os.setresgid(creds[1], creds[1], creds[1])
                os.setresuid(creds[0], creds[0], creds[0])
            # After the domain: a cwd through /proc/<pid>/... of a process outside it must
            # not resolve (ptrace scoping), as it would for an unconfined process.
            step, detail = "chdir", cwd
            os.chdir(cwd)
            if syscall_filter is not None:
                step, detail = "seccomp", "filter"
                syscall_filter.install()
            step, detail = "exec", argv[0]
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            os.write(err_w, f"{step}\0{exc.errno or errno.EIO}\0{detail}".encode())
        except BaseException:
            os.write(err_w, f"{step}\0{errno.EIO}\0{detail}".encode())
        os._exit(127)
    os.close(err_w)
    return _await_exec(pid, err_r)


_CONFINE: list[str | None] = []  # the trampoline's path, or None: looked up once
# Where the trampoline gets its descriptors (above anything a command is handed), and where
# the copies made to hand them over start.
_ERR_FD, _RULESET_FD, _FILTER_FD = 1021, 1022, 1023
_COPIES_FROM = 1024


def grow_fd_table() -> None:
    """Grow the descriptor table past the numbers above (with room for concurrent starts).
    Call it while the process has one thread: growing it later, with threads sharing it, waits
    for an RCU grace period (synchronize_rcu in expand_fdtable): measured 8-14 ms on the first
    command of every sandbox here."""
    try:
        os.close(fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, _COPIES_FROM + 476))
    except OSError:
        pass  # a low RLIMIT_NOFILE: spawn() then forks commands instead


_DIRECT: list[Any] = []  # the chronus._spawn module, or None: looked up once


def _direct_spawner() -> Any:
    if not _DIRECT:
        # Its child copies descriptors above 1023 before handing them over: room needed.
        _DIRECT.append(_SPAWN if _room_above_copies() else None)
    return _DIRECT[0]


def _room_above_copies() -> bool:
    """Whether RLIMIT_NOFILE leaves room for descriptors copied above _COPIES_FROM."""
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] > _COPIES_FROM + 64


def _spawn_direct(
    spawner: Any,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    stdin: int,
    stdout: int,
    stderr: int,
    ctty: int,
    extra_fds: dict[int, int] | None,
    ruleset_fd: int,
    syscall_filter: Filter | None,
    creds: Credentials | None,
) -> int:
    """chronus._spawn: the confined start in one exec (chronus/spawn.c)."""
    fds: list[tuple[int, int]] = []
    tty = None
    if ctty >= 0:
        tty = os.fsencode(os.ttyname(ctty))
    else:
        fds += [(stdin, 0), (stdout, 1), (stderr, 2)]
    fds += [(source, target) for target, source in (extra_fds or {}).items()]
    pid, step, err, detail = spawner.spawn(
        os.fsencode(argv[0]),
        [os.fsencode(a) for a in argv],
        [os.fsencode(f"{k}={v}") for k, v in env.items()],
        os.fsencode(cwd),
        fds,
        ruleset_fd,
        syscall_filter.code if syscall_filter is not None else None,
        (creds[0], creds[1], list(creds[2])) if creds is not None else None,
        tty,
    )
    if step:
        raise SpawnError(step, err, detail)
    return int(pid)


def _confine_path() -> str | None:
    if not _CONFINE:
        import sys

        path = os.path.join(os.path.dirname(sys.executable), "dsec-confine")
        # Its descriptors sit at 1021-1023 and the copies above 1024: room needed.
        usable = os.access(path, os.X_OK) and _room_above_copies()
        _CONFINE.append(path if usable else None)
    return _CONFINE[0]


def _spawn_confined(
    confine: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    stdin: int,
    stdout: int,
    stderr: int,
    ctty: int,
    extra_fds: dict[int, int] | None,
    ruleset_fd: int,
    syscall_filter: Filter | None,
    creds: Credentials | None,
) -> int:
    """posix_spawn of `dsec-confine ERR RULESET FILTER CWD CRED NENV ENV... argv...` with an empty
    environment (see chronus/confine.c); every failure is a SpawnError, no descriptor leaks."""
    if any(t >= _ERR_FD for t in extra_fds or {}):
        raise SpawnError("setup", errno.EINVAL, f"extra fds must be below {_ERR_FD}")
    opened: list[int] = []

    def high(fd: int) -> int:
        # A copy >= 1024, so that no dup2 has source == target (which would keep CLOEXEC).
        new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _COPIES_FROM)
        opened.append(new)
        return new

    err_r, err_w = os.pipe()
    opened += [err_r, err_w]
    step = "setup"
    try:
        actions: list[tuple[Any, ...]] = []
        if ctty >= 0:
            # After setsid (posix_spawn does it before the file actions), the first tty the
            # session leader opens without O_NOCTTY becomes its controlling terminal.
            actions.append((os.POSIX_SPAWN_OPEN, 0, os.ttyname(ctty), os.O_RDWR, 0))
            actions += [(os.POSIX_SPAWN_DUP2, 0, 1), (os.POSIX_SPAWN_DUP2, 0, 2)]
        else:
            for target, source in ((0, stdin), (1, stdout), (2, stderr)):
                actions.append((os.POSIX_SPAWN_DUP2, high(source), target))
        for target, source in (extra_fds or {}).items():
            actions.append((os.POSIX_SPAWN_DUP2, high(source), target))
        actions.append((os.POSIX_SPAWN_DUP2, high(err_w), _ERR_FD))
        rules = filt = "-1"
        if ruleset_fd >= 0:
            actions.append((os.POSIX_SPAWN_DUP2, high(ruleset_fd), _RULESET_FD))
            rules = str(_RULESET_FD)
        if syscall_filter is not None:
            actions.append((os.POSIX_SPAWN_DUP2, high(syscall_filter.memfd()), _FILTER_FD))
            filt = str(_FILTER_FD)
        variables = [f"{k}={v}" for k, v in env.items()]
        cred = "-"
        if creds is not None:
            cred = f"{creds[0]}:{creds[1]}:{','.join(map(str, creds[2]))}"
        step = "exec"
        pid = os.posix_spawn(
            confine,
            [confine, str(_ERR_FD), rules, filt, cwd, cred, str(len(variables)), *variables, *argv],
            {},  # nothing of the caller's reaches the unconfined trampoline's libc start-up
            file_actions=actions,
            setsid=True,
            setsigmask=(),
            # Python ignores these; an ignored disposition survives exec (`yes | head`).
            setsigdef=_RESET_SIGNALS,
        )
    except OSError as exc:  # E2BIG, EAGAIN at the pids limit, EMFILE, ...
        for fd in opened:
            os.close(fd)
        raise SpawnError(step, exc.errno or errno.EIO, argv[0] if step == "exec" else "") from exc
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    for fd in opened:
        if fd != err_r:
            os.close(fd)
    return _await_exec(pid, err_r)


def _await_exec(pid: int, err_r: int) -> int:
    """Read the child's error pipe until EOF (its exec closed the close-on-exec write end):
    "step\\0errno\\0detail" means it failed before exec (it is reaped, SpawnError raised)."""
    try:
        report = b""
        while chunk := os.read(err_r, 4096):
            report += chunk
    finally:
        os.close(err_r)
    if report:
        os.waitpid(pid, 0)
        step, err, detail = report.decode(errors="replace").split("\0", 2)
        raise SpawnError(step, int(err), detail)
    return pid


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


def rss_bytes(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0

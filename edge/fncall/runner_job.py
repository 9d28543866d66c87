"""The job's process, for the FnCall runner: from its fork (as a spare) to the job's code.

Standard library only (it runs in the pool container with ``runner.py``; see that module's
docstring, step 2). A spare is forked ahead of its job, sets up what does not depend on the
job (session, stdio, RLIMIT_CORE), waits on its control socket, then on the job's parameters
joins the step's memory cgroup, takes the job uid and limits, and exec()s the program or runs
the Python code in the already warm interpreter (:func:`run_spare`). Also here: the
descriptor layout a spare is forked with, the runner's abort signal, and the swap of
threading's after-fork hook that keeps a fork cheap (:func:`lean_after_fork`).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import os
import resource
import signal
import sys
import types

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

JOB_DIR = "/job"
#: The step memory cgroups (their `tasks` files, passed by the edge as the channel's first
#: message) in the order of the "cgroups" message; a step's process joins the one its request
#: names. The runner keeps them at descriptors >= CGROUP_FD_MIN, a spare at fds 4 and 5 until
#: it has joined (then closes them: the job never holds them).
STEP_CGROUPS = ("job", "compile")
CGROUP_FD_MIN = 900
SPARE_CGROUP_FD = 4
#: A spare that could not join its step's memory cgroup says so on its control socket (and
#: exits 127 without running anything): the runner reports it as an anomaly.
CGROUP_REFUSED = b"!cgroup "
#: Sent by the edge (from the host) to pid 1 when the caller of the running job went away.
#: A spare and the zygote start with its default disposition (the runner's handler is Python).
ABORT_SIGNAL = signal.SIGUSR1


def run_spare(
    ctl: int,
    stdin: int,
    out_w: int,
    err_w: int,
    uid: int,
    reseed_numpy: bool,
    cgroup_fds: tuple[int, ...],
) -> None:  # pragma: no cover
    """The next job's process: set up what does not depend on the job, wait, then run it.

    Lean on purpose: every Python object made or page written here is a copy-on-write fault
    (~2-3 us each here; and every module it imports is loaded anew: hence all imports at the
    top of the runner's modules, which the runner imports before any fork). What can be done
    once for all spares is done by the runner: the job's sys.stdin/stdout/stderr objects, no
    atexit handlers, the default disposition of the runner's abort signal, numpy's RNG state
    (a new one written before each fork), and at the job's start its oom_score_adj.
    """
    try:
        real_after_fork()  # see lean_after_fork: the job's own forks get the real hook
        if reseed_numpy:  # the runner could not give us our own state (_NumpySeeder)
            sys.modules["numpy.random"].seed(int.from_bytes(os.urandom(4), "little"))
        os.setsid()
        os.dup2(stdin, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(ctl, 3)
        # The step cgroups' tasks files at 4 and 5 (from >= CGROUP_FD_MIN: no clash), every
        # other inherited descriptor closed: the channel to the edge above all, and the other
        # spares'.
        for i, fd in enumerate(cgroup_fds):
            os.dup2(fd, SPARE_CGROUP_FD + i)
        os.closerange(SPARE_CGROUP_FD + len(cgroup_fds), 1 << 20)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        chunks = []
        while True:  # the runner ends its message with a shutdown: read to EOF
            chunk = os.read(3, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        msg = b"".join(chunks)
        if not msg:
            os._exit(0)  # the runner dropped us
        parts = msg.split(b"\0")
        # Into the step's memory cgroup before anything of the job runs: "0" moves this
        # (single-threaded) process alone, without the cgroup threadgroup lock that moving
        # another pid takes (an RCU grace period: 5-13 ms measured, vs ~30 us). Pages it
        # already has stay charged where they are: the job's own come after.
        try:
            os.write(SPARE_CGROUP_FD + int(parts[3]), b"0")
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                os.write(3, CGROUP_REFUSED + f"cannot join the step cgroup: {exc}".encode())
            os._exit(127)
        os.close(3)
        os.closerange(SPARE_CGROUP_FD, SPARE_CGROUP_FD + len(cgroup_fds))
        # Only now, with a job: idle spares stay root (a job cannot signal, trace or read them).
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        # No RLIMIT_CPU: the runner enforces the job's CPU limit (all its processes), and an
        # armed process CPU timer makes the kernel sample the process's CPU clock at tick
        # granularity: time.process_time() would jump by up to a tick (measured: a 10 ms
        # busy loop ran 11-13.5 ms).
        fsize = int(parts[1])
        if fsize:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        stack = int(parts[2])
        if stack:
            hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
            if hard != resource.RLIM_INFINITY:
                stack = min(stack, hard)
            resource.setrlimit(resource.RLIMIT_STACK, (stack, hard))
        os.chdir(JOB_DIR)
        os.umask(0o022)
        args = [p.decode() for p in parts[5:]]
        if parts[4]:
            _run_python(parts[4].decode(), args)  # never returns
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # an ignored signal stays so across exec
        os.execvp(args[0], args)
    except BaseException as exc:
        try:
            os.write(2, f"dsec fncall: cannot start the job: {exc}\n".encode())
        except OSError:
            pass
    os._exit(127)


#: threading's at-fork hook and its real code, once lean_after_fork has swapped it.
#: threading's at-fork hook and its real code, once lean_after_fork has swapped it.
_AFTER_FORK: tuple[Any, Any] | None = None


def _noop() -> None:  # pragma: no cover - replaces threading._after_fork in spares
    pass


def lean_after_fork() -> bool:
    """Lets the next forks skip threading's after-fork hook, when that is exact: the hook
    rebuilds the threading module's state for a child forked from a multi-threaded parent
    (new locks, the other threads marked stopped), and on this interpreter touches ~130
    pages, each a copy-on-write fault in every job (measured: 0.37 ms per fork). The
    runner has one thread (checked here, kernel threads included) and forks outside any
    threading call, so the child's threading state is already right. Each spare puts the
    real hook back first thing, so a job's own forks get it."""
    threading = sys.modules.get("threading")
    if threading is None or len(os.listdir("/proc/self/task")) != 1:
        return False
    if threading.active_count() != 1 or threading._limbo:  # type: ignore[attr-defined]
        return False
    global _AFTER_FORK
    hook = threading._after_fork  # type: ignore[attr-defined]
    if _AFTER_FORK is None:
        _AFTER_FORK = (hook, hook.__code__)
    hook.__code__ = _noop.__code__
    return True


def real_after_fork() -> None:
    """Puts threading's after-fork hook back (after the batch in the runner, first thing in
    each spare)."""
    if _AFTER_FORK is not None:
        _AFTER_FORK[0].__code__ = _AFTER_FORK[1]


def make_stdio() -> tuple[Any, Any, Any]:
    """sys.stdin/stdout/stderr of a job, as python3 makes them, on fds 0, 1 and 2."""
    import io

    return (
        io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8"),
        io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8"),
        io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
        ),
    )


def _run_python(main: str, args: list[str]) -> None:  # pragma: no cover
    """Runs /job/<main> as `python3 main.py args...` would, in this (forked, warm) interpreter."""
    path = f"{JOB_DIR}/{main}"
    sys.argv = [main, *args]
    sys.path[0] = JOB_DIR
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = module
    code = 0
    try:
        with open(path, "rb") as fh:
            source = fh.read()
        try:
            compiled = compile(source, path, "exec", dont_inherit=True)
        except SyntaxError as exc:
            import traceback

            traceback.print_exception(type(exc), exc, None)
            code = 1
        else:
            exec(compiled, module.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:
        # Drop our own frame: the traceback starts at the job's code, as in python3.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        try:
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        except BaseException:
            pass
        code = 1
    os._exit(_finish(code))


def _exit_code(exc: SystemExit) -> int:  # pragma: no cover
    c = exc.code
    if c is None:
        return 0
    if isinstance(c, int):
        return c & 0xFF
    try:
        print(c, file=sys.stderr)
    except BaseException:
        pass
    return 1


def _finish(code: int) -> int:  # pragma: no cover
    """Interpreter shutdown as far as a job can observe it: threads, atexit, flushed stdio.

    With no exit handler of either kind and no non-daemon thread, threading's shutdown would
    only mark the main thread stopped, which nothing runs after to see: skipped (it touched
    ~40 pages of the warm heap, each a copy in every job)."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None and (
            atexit._ncallbacks()
            or threading._shutdown_locks  # type: ignore[attr-defined]
            or threading._threading_atexits  # type: ignore[attr-defined]
        ):
            threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            code = code or 120  # what python3 exits with when flushing stdout fails
    return code

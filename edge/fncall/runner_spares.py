"""Spares, for the FnCall runner: the job processes forked before their jobs come.

Standard library only (it runs in the pool container with ``runner.py``; see that module's
docstring, step 2). Two sources, each refilled a batch at a time (SPARES): the lean runner
itself (:class:`LocalSpares`: exec()ed programs and Python jobs that name no preload), and
the zygote (:class:`Zygote`, :class:`ZygoteSpares`), a child of the runner that imported the
environment's preloads (numpy) and forks from that warm interpreter. Everything about keeping
a fork cheap lives here too: whole batches, numpy's RNG reseeded without touching its pages
(:class:`_NumpySeeder`), the warm heap on huge pages. What a spare does once forked is
``runner_job``'s.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import select
import signal
import socket
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # what mypy reads: the package
    from typing import Any, Protocol

    from edge.fncall import runner_job

    class Runner(Protocol):
        """What spares read of the runner that forks them (edge.fncall.runner.Runner)."""

        spare_count: int
        job_uid: int
        cgroup_fds: tuple[int, ...]

        def _abort(self, signum: int, frame: object) -> None: ...

else:
    try:  # the edge imports these from the package; the container runs them from /.dsec
        from edge.fncall import runner_job
    except ImportError:  # pragma: no cover - inside the container
        import runner_job

#: Spares forked back to back. After a fork, every page the runner writes is a copy-on-write
#: fault (measured: ~300 per job cycle, about half the runner's CPU per job). Those faults
#: come once per fork *batch*, not per job: the runner's working set is copied once, and the
#: next forks come only when the batch is used up. Each idle spare costs a pids slot (the edge
#: adds them to the container's limit) and little memory (its pages are shared).
SPARES = 4
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


class Spares:
    """Forked job processes waiting for a job, of one parent; refilled a batch at a time."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.spares: list[Spare] = []  # forked, waiting for a job; taken from the front

    def fork_batch(self) -> None:
        raise NotImplementedError

    def reap(self, pid: int) -> tuple[int, Any]:
        """The wait status and rusage of spare `pid`, once it has exited."""
        raise NotImplementedError

    def _bury(self, spare: Spare) -> None:
        """A dead or dropped spare is gone from the list: its zombie is its parent's."""

    def take(self) -> Spare:
        while self.spares:
            spare = self.spares.pop(0)
            if not select.select([spare.pidfd], [], [], 0)[0]:
                return spare
            # It died (the OOM killer? killed from outside?): the next one.
            spare.close()
            self._bury(spare)
        self.fork_batch()
        return self.spares.pop(0)

    def drop(self) -> None:
        spares, self.spares = self.spares, []
        for spare in spares:
            kill_quietly(spare.pid)
            spare.close()
            self._bury(spare)


class LocalSpares(Spares):
    """Spares forked from the runner itself, in batches (see SPARES). Dead ones are reaped
    with the job's orphans after each job (we are their parent)."""

    def fork_batch(self) -> None:
        """Fork the next jobs' processes now, while no job waits: fork itself (copying the
        interpreter's page tables) and the job-independent set-up (session, limits, stdio)
        then cost the next job no latency. Only when the last batch is used up, and
        `spare_count` at once (see SPARES). Each waits for its job on a socketpair; its stdin
        is a memfd the runner fills when the job comes."""
        if self.spares:
            return
        ends = _spare_ends(self.runner.spare_count)
        # The spares must not inherit the runner's handler (its Python code would run in the
        # job): with the default disposition they start without it, and the signal, if the
        # edge sends it now, is dropped by the kernel (pid 1 of a pid namespace, no handler):
        # no job is running, so it has nothing to abort.
        signal.signal(runner_job.ABORT_SIGNAL, signal.SIG_DFL)
        pids: list[int] = []
        try:
            pids = _fork_batch(
                [e.child_fds() for e in ends],
                self.runner.job_uid,
                None,
                False,
                self.runner.cgroup_fds,
            )
        finally:
            signal.signal(runner_job.ABORT_SIGNAL, self.runner._abort)
            self.spares += _keep(ends, pids, self)

    def reap(self, pid: int) -> tuple[int, Any]:
        _, status, rusage = os.wait4(pid, 0)
        return status, rusage


class _Usage:
    """The fields of a struct rusage the runner uses, as the zygote reports them."""

    def __init__(self, utime: float, stime: float, maxrss: int) -> None:
        self.ru_utime, self.ru_stime, self.ru_maxrss = utime, stime, maxrss


class Zygote:
    """The runner's child that imported the environment's preloads and forks spares from
    that warm interpreter on request. Its spares are its children, so it reaps them and
    reports how each ended. The channel is a SOCK_SEQPACKET socketpair (one JSON message
    each way per request; a fork request carries the spares' descriptors)."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock

    @classmethod
    def start(
        cls, preload: list[str], uid: int, cgroup_fds: tuple[int, ...]
    ) -> tuple[Zygote | None, dict[str, Any]]:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            mine.close()
            _zygote_main(theirs, preload, uid, cgroup_fds)
        theirs.close()
        zygote = cls(pid, mine)
        try:
            ready = zygote.receive()
        except (OSError, ValueError) as exc:
            ready = {"ok": False, "error": f"the warm interpreter did not start: {exc!r}"}
        if not ready.get("ok"):
            kill_quietly(pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            mine.close()
            return None, ready
        return zygote, ready

    def request(self, message: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        data = json.dumps(message).encode()
        try:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.send(data)
        except OSError as exc:
            raise ConnectionError(f"the warm interpreter (zygote) is gone: {exc}") from exc
        return self.receive()

    def receive(self) -> dict[str, Any]:
        try:
            data = self.sock.recv(65536)
        except OSError as exc:
            raise ConnectionError(f"the warm interpreter (zygote) is gone: {exc}") from exc
        if not data:
            raise ConnectionError("the warm interpreter (zygote) is gone")
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise ValueError("bad reply from the zygote")
        return reply


class ZygoteSpares(Spares):
    """Spares forked by the zygote (the same batches as LocalSpares), reaped through it."""

    def __init__(self, runner: Runner, zygote: Zygote) -> None:
        super().__init__(runner)
        self.zygote = zygote

    def fork_batch(self) -> None:
        if self.spares:
            return
        ends = _spare_ends(self.runner.spare_count)
        pids: list[int] = []
        try:
            reply = self.zygote.request({"op": "fork"}, [fd for e in ends for fd in e.child_fds()])
            pids = [int(p) for p in reply.get("pids", [])]
            if not pids:
                raise OSError(errno.EAGAIN, f"the zygote forked nothing: {reply.get('error')}")
        finally:
            self.spares += _keep(ends, pids, self)

    def reap(self, pid: int) -> tuple[int, Any]:
        r = self.zygote.request({"op": "reap", "pid": pid})
        if r.get("status") is None:
            raise ChildProcessError(f"the zygote has no child {pid}")
        return int(r["status"]), _Usage(float(r["utime"]), float(r["stime"]), int(r["maxrss"]))

    def _bury(self, spare: Spare) -> None:
        with contextlib.suppress(OSError, ValueError):  # ChildProcessError is an OSError
            self.reap(spare.pid)


def _spare_ends(n: int) -> list[_SpareEnds]:
    """Descriptors for up to `n` spares (at least one, or OSError): made before any fork."""
    ends = []
    try:
        for _ in range(n):
            ends.append(_SpareEnds())
    except OSError:
        if not ends:
            raise
    return ends


def _keep(ends: list[_SpareEnds], pids: list[int], source: Spares) -> list[Spare]:
    """After a batch: drop our copies of the child ends (the spare holds its own: EOF when
    it is done) and make the Spares of the forked ones; close the rest."""
    out = []
    for i, e in enumerate(ends):
        e.close_child_ends()
        if i < len(pids):
            out.append(e.spare(pids[i], source))
        else:
            e.close()
    return out


def _fork_batch(
    children: list[tuple[int, int, int, int]],
    uid: int,
    seeder: _NumpySeeder | None,
    reseed_numpy: bool,
    cgroup_fds: tuple[int, ...],
) -> list[int]:
    """Forks one spare per (ctl, stdin, stdout, stderr) back to back; their pids (fewer
    than asked when a fork fails after the first, e.g. at the pids limit).

    Everything the batch needs is made before the first fork: after a fork every page this
    process writes is a copy, so between two forks it writes as few as it can."""
    sys.stdout.flush()
    sys.stderr.flush()
    if seeder is not None:
        seeder.prepare(len(children))
    lean = runner_job.lean_after_fork()
    pids: list[int] = []
    try:
        for i, (ctl, stdin, out_w, err_w) in enumerate(children):
            if seeder is not None:
                seeder.seed(i)
            try:
                pid = os.fork()
            except OSError:
                if not pids:
                    raise
                break  # e.g. the pids limit: run with what we have
            if pid == 0:  # pragma: no cover - the child never returns
                runner_job.run_spare(ctl, stdin, out_w, err_w, uid, reseed_numpy, cgroup_fds)
            pids.append(pid)
    finally:
        if lean:
            runner_job.real_after_fork()
    return pids


def _zygote_main(
    sock: socket.socket, preload: list[str], uid: int, cgroup_fds: tuple[int, ...]
) -> None:  # pragma: no cover
    """The zygote: import the preloads once, then fork spares and reap them on request.

    It runs as little Python as it can between forks (its pages are the spares' pages: each
    one it writes is a copy), and nothing of the job: the runner does all the rest."""
    try:
        signal.signal(
            runner_job.ABORT_SIGNAL, signal.SIG_DFL
        )  # the edge signals the runner, not us
        # Of the runner's descriptors only stdio stays: above all not its channel to the edge
        # (the edge must see EOF when the runner dies).
        # The step cgroups' descriptors stay (its spares join one), at CGROUP_FD_MIN and up.
        os.closerange(3, sock.fileno())
        os.closerange(sock.fileno() + 1, runner_job.CGROUP_FD_MIN)
        os.closerange(max(cgroup_fds, default=runner_job.CGROUP_FD_MIN - 1) + 1, 1 << 20)
        failed = []
        for name in preload:
            try:
                __import__(name)
            except Exception as exc:  # reported; the edge decides whether the pool is usable
                failed.append(f"{name}: {exc!r}")
        seeder = _NumpySeeder.for_numpy()
        reseed = seeder is None and "numpy.random" in sys.modules
        gc.collect()
        gc.freeze()
        huge = _use_huge_pages()
        sock.send(
            json.dumps(
                {
                    "ok": not failed,
                    "error": "; ".join(failed),
                    "modules": len(sys.modules),
                    "huge_pages": huge,
                }
            ).encode()
        )
        while True:
            data, fds, _, _ = socket.recv_fds(sock, 65536, 4 * 32)
            if not data:
                break
            req = json.loads(data)
            reply: dict[str, Any]
            if req.get("op") == "fork":
                groups = [tuple(fds[i : i + 4]) for i in range(0, len(fds) - 3, 4)]
                try:
                    reply = {"pids": _fork_batch(groups, uid, seeder, reseed, cgroup_fds)}  # type: ignore[arg-type]
                except OSError as exc:
                    reply = {"pids": [], "error": str(exc)}
            elif req.get("op") == "reap":
                try:
                    _, status, ru = os.wait4(int(req["pid"]), 0)
                    reply = {
                        "status": status,
                        "utime": ru.ru_utime,
                        "stime": ru.ru_stime,
                        "maxrss": ru.ru_maxrss,
                    }
                except ChildProcessError:
                    reply = {"status": None}
            else:
                reply = {"error": f"unknown op {req.get('op')!r}"}
            for fd in fds:
                _close_quietly(fd)
            sock.send(json.dumps(reply).encode())
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            print(f"fncall zygote: {exc!r}", file=sys.stderr)
    os._exit(0)


class _SpareEnds:
    """The descriptors of one spare to be: its stdio pipes, stdin memfd and control socket.
    Every spare closes all it inherits but its own (closerange) before it waits for a job."""

    def __init__(self) -> None:
        fds: list[int] = []
        try:
            self.out_r, self.out_w = os.pipe2(os.O_CLOEXEC)
            fds += [self.out_r, self.out_w]
            self.err_r, self.err_w = os.pipe2(os.O_CLOEXEC)
            fds += [self.err_r, self.err_w]
            self.stdin = os.memfd_create("stdin", os.MFD_CLOEXEC)
            fds.append(self.stdin)
            self.mine, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:
            for fd in fds:
                os.close(fd)
            raise

    def close_child_ends(self) -> None:
        for fd in (self.out_w, self.err_w):
            _close_quietly(fd)
        self.theirs.close()

    def child_fds(self) -> tuple[int, int, int, int]:
        """What the spare keeps: its control socket, stdin, stdout and stderr."""
        return self.theirs.fileno(), self.stdin, self.out_w, self.err_w

    def spare(self, pid: int, source: Spares) -> Spare:
        return Spare(pid, os.pidfd_open(pid), self.mine, self.stdin, self.out_r, self.err_r, source)

    def close(self) -> None:
        for fd in (self.out_r, self.err_r, self.stdin):
            _close_quietly(fd)
        self.mine.close()


class Spare:
    """The pre-forked process of the next job and the runner's ends of its stdio."""

    def __init__(
        self,
        pid: int,
        pidfd: int,
        sock: socket.socket,
        stdin: int,
        out_r: int,
        err_r: int,
        source: Spares,
    ) -> None:
        self.source = source  # who forked it, and so who reaps it
        self.pid = pid
        self.pidfd = pidfd
        self.sock = sock
        self.stdin = stdin
        self.out_r = out_r
        self.err_r = err_r

    def close(self) -> None:
        for fd in (self.pidfd, self.stdin, self.out_r, self.err_r):
            _close_quietly(fd)
        self.sock.close()


class _NumpySeeder:
    """Gives numpy's global RNG a new state before each fork of a batch, so every job starts
    with its own, as a fresh python3 seeds it from the OS: 624 random words and pos = 624
    (the next draw regenerates the block), written straight into the state through
    /proc/self/mem: one pwrite. (The runner shares its pages with the spares: seeding
    through numpy's Python API cost each job ~70 page copies, a ctypes call ~18.)"""

    def __init__(self, address: int, size: int, mem: int) -> None:
        self.address, self.size, self.mem = address, size, mem
        self.batch: list[bytes] = []

    @classmethod
    def for_numpy(cls) -> _NumpySeeder | None:
        """One for numpy's global legacy RandomState (`numpy.random.rand` & co.) if its
        state is where this expects it and /proc/self/mem can write it; else None (and the
        spares reseed numpy themselves, through its API)."""
        try:
            bitgen = sys.modules["numpy.random.mtrand"]._rand._bit_generator
            if type(bitgen).__name__ != "MT19937":
                return None
            address = int(bitgen.ctypes.state_address)
            mem = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)  # spares close it
        except Exception:
            return None
        return cls(address, 624 * 4 + 4, mem)  # uint32 key[624], int pos

    def prepare(self, n: int) -> None:
        """The states of the next `n` forks, made before the first (between two forks every
        object the runner makes is a page copy)."""
        words = self.size - 4
        blob = os.urandom(words * n)
        pos = (624).to_bytes(4, sys.byteorder)
        self.batch = [blob[i * words : (i + 1) * words] + pos for i in range(n)]

    def seed(self, i: int) -> None:
        if os.pwrite(self.mem, self.batch[i], self.address) != self.size:
            raise OSError(errno.EIO, "short write of numpy's RNG state")


def _use_huge_pages() -> int:
    """Backs the warm heap with transparent huge pages where whole 2 MiB ranges allow it
    (MADV_COLLAPSE, Linux >= 6.1): a fork then copies one entry per 2 MiB instead of 512,
    and each job's exit unmaps as few. Best effort; the number of huge pages made."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as fh:
            lines = fh.read().splitlines()
    except (OSError, AttributeError):
        return 0
    made = 0
    for line in lines:
        f = line.split()
        if f[1] != "rw-p" or (len(f) > 5 and f[5] != "[heap]"):
            continue  # private writable anonymous memory only
        lo, hi = (int(x, 16) for x in f[0].split("-"))
        start = (lo + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        end = hi & ~(HUGE_PAGE - 1)
        if end <= start:
            continue
        libc.madvise(start, end - start, MADV_HUGEPAGE)
        if libc.madvise(start, end - start, MADV_COLLAPSE) == 0:
            made += (end - start) // HUGE_PAGE
    return made


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass

"""The FnCall runner: pid 1 of a warm-pool container. Standard library only.

It runs on the image's own Python (``/usr/bin/python3 -B /.dsec/runner.py``; the edge mounts
this file and ``wire.py`` read-only at /.dsec) and talks to the edge over the socket the edge
passed as fd 3. No aether, no chronus: one request at a time, each a job.

Per job:

1. an empty job directory ``/job`` (mode 0700, owned by the job uid) with the job's files;
2. the job's process was forked before the job came (a "spare"; several are forked back to
   back, see SPARES): its own session, stdio and RLIMIT_CORE 0, still root while it waits.
   On the job's parameters (and its stdin, in a memfd) it takes oom_score_adj 1000 (the
   kernel's OOM killer picks the job, never the runner or an idle spare), the unprivileged
   job uid (RLIMIT_NPROC applies, nothing outside /job and the scratch dirs is writable),
   RLIMIT_FSIZE and RLIMIT_STACK, joins the step's memory cgroup (the job's memory limit),
   then either exec()s the program or, for Python, runs the
   code in the already warm interpreter (numpy imported once, in the runner, before any fork);
3. stdout/stderr go into pipes the runner reads (capped: OUTPUT_LIMIT);
4. limits: wall clock by the runner's poll timeout; CPU time of the whole job (every process,
   orphans included) from the container's cpuacct counter minus the runner's own, checked
   exactly when the budget could first be exhausted (so short jobs cost no wake-ups);
5. afterwards, before answering: SIGKILL, as root, to every process in the container but the
   runner and the idle spares (the job's, orphans included) until none is left, reap,
   read the files the job asked back (``fetch``: regular files only, never through a
   symlink, bounded; see `_fetch`), empty /job and the world-writable scratch dirs, and
   check that no SysV IPC object survived. Anything unexpected is reported as an `anomaly`
   and the edge recycles the container. When the spares are used up, the next batch is
   forked.

Memory limits and OOM/pids counters are the edge's part: it makes a memory cgroup per step kind
inside the container's (`STEP_CGROUPS`), sets its limit for each step from the host (the cgroup
mount is read-only in here) and reads its counters. The runner only holds each one's ``tasks``
file (passed by the edge): the step's process joins it before the job's code runs, so the job
is held to exactly its own limit while the runner, the spares and the job's input files are
not counted in it.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import errno
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import stat
import sys
import time
import types

try:  # the edge imports this module from the package; the container runs it from /.dsec
    from edge.fncall import wire
except ImportError:  # pragma: no cover - inside the container
    import wire  # type: ignore[no-redef]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CONTROL_FD = 3
JOB_DIR = "/job"
CPUACCT = "/sys/fs/cgroup/cpuacct/cpuacct.usage"
#: Tasks in the container's pids cgroup: after a job, the runner and the idle spares alone
#: mean no process of the job is left, and /proc need not be listed.
PIDS_CURRENT = "/sys/fs/cgroup/pids/pids.current"
#: Filesystems whose directory size counts entries (20 bytes each): tmpfs, mqueue.
COUNTING_FS = ("tmpfs", "mqueue")
#: After the main process exits, how long to keep reading pipes still held open by its children.
DRAIN_GRACE_S = 0.05
#: World-writable places a job can leave files in; emptied after every job.
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm", "/dev/mqueue")
SYSV_IPC = ("/proc/sysvipc/shm", "/proc/sysvipc/sem", "/proc/sysvipc/msg")
READ_CHUNK = 65536
#: Spares forked back to back. After a fork, every page the runner writes is a copy-on-write
#: fault (measured: ~300 per job cycle, about half the runner's CPU per job). Those faults
#: come once per fork *batch*, not per job: the runner's working set is copied once, and the
#: next forks come only when the batch is used up. Each idle spare costs a pids slot (the edge
#: adds them to the container's limit) and little memory (its pages are shared).
SPARES = 4
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
ABORT_SIGNAL = signal.SIGUSR1
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


class Runner:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.job_uid = 10001
        self.cpu_cores = 1.0
        self.scratch: dict[str, set[str]] = {}
        for d in SCRATCH_DIRS:
            try:
                self.scratch[d] = set(os.listdir(d))
            except OSError:
                continue
        #: This process's descriptors of the step cgroups' tasks files, in STEP_CGROUPS order.
        self.cgroup_fds: tuple[int, ...] = ()
        self.current_pid = 0  # the running job's main process
        self.in_run = False  # between reading a run request and answering it
        self.abort_early = False  # an abort came before the job's process was running
        self.aborted = False
        # The edge's "the caller gave up": kill the running job now, free the container.
        signal.signal(ABORT_SIGNAL, self._abort)
        self.spare_count = SPARES
        #: Spares forked from this (lean) interpreter: jobs that need none of the preloads,
        #: and every exec()ed program.
        self.lean = _LocalSpares(self)
        #: The spares of the warm interpreter with the environment's preloads (the zygote, a
        #: child of ours), for Python jobs whose sources name a preloaded module.
        self.warm_spares: _ZygoteSpares | None = None
        self.preload_names: tuple[bytes, ...] = ()
        # /job stays; only its contents come and go (the edge mounts a tmpfs there; without
        # one it is a directory of the overlay, where creating and removing a directory per
        # job costs milliseconds of waiting on the upper layer's journal when the machine is
        # busy: measured rmdir 0.6-11 ms).
        if os.path.ismount(JOB_DIR):
            for name in os.listdir(JOB_DIR):
                _remove_tree(f"{JOB_DIR}/{name}")
            os.chmod(JOB_DIR, 0o700)
        else:
            _remove_tree(JOB_DIR)
            os.mkdir(JOB_DIR, 0o700)
        self.cpuacct = _open_quietly(CPUACCT)
        self.pids_current = _open_quietly(PIDS_CURRENT)
        # Scratch dirs that start empty on a filesystem whose directory size counts its
        # entries: while the size is that of an empty one, there is nothing to list. Exact:
        # the dirs are sticky and root's, so a job can add entries but remove only its own.
        counting = _mounts_of(COUNTING_FS)
        self.empty_size: dict[str, int] = {}
        for d, keep in self.scratch.items():
            if not keep and d in counting:
                with contextlib.suppress(OSError):
                    self.empty_size[d] = os.stat(d).st_size
        self.sysv_fds = []
        for path in SYSV_IPC:
            try:
                self.sysv_fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                pass

    # ------------------------------------------------------------ channel

    def recv(self) -> dict[str, Any] | None:
        prefix = self._recv_exact(4)
        if prefix is None:
            return None
        body = self._recv_exact(wire.body_length(prefix))
        if body is None:
            return None
        return wire.decode(body)

    def _recv_exact(self, n: int) -> bytes | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                return None
            got += k
        return bytes(buf)

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(wire.encode(message))

    def receive_cgroups(self) -> None:
        """The edge's first message: the step cgroups' tasks files (SCM_RIGHTS on its first
        bytes), opened on the host, where the cgroup mount is writable."""
        prefix, fds, _, _ = socket.recv_fds(self.sock, 4, len(STEP_CGROUPS))
        try:
            if len(prefix) < 4:
                prefix += self._recv_exact(4 - len(prefix)) or b""
            body = self._recv_exact(wire.body_length(prefix)) if len(prefix) == 4 else None
            if body is None or wire.decode(body).get("op") != "cgroups":
                raise wire.WireError("the first message must be the step cgroups")
            if len(fds) != len(STEP_CGROUPS):
                raise wire.WireError(f"{len(fds)} step cgroups, not {len(STEP_CGROUPS)}")
            self.cgroup_fds = tuple(
                fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, CGROUP_FD_MIN) for fd in fds
            )
        finally:
            for fd in fds:
                os.close(fd)

    def serve(self) -> None:
        self.receive_cgroups()
        self.send({"op": "hello", "pid": os.getpid(), "python": sys.version.split()[0]})
        while True:
            req = self.recv()
            if req is None:
                return  # the edge closed the channel: the container is being removed
            op = req.get("op")
            if op == "warm":
                self.send(self.warm(req))
            elif op == "run":
                self.in_run, self.abort_early = True, False
                result = self.run(req)
                self.in_run = False
                self.send(result)
                try:
                    self.fork_spares()
                except OSError as exc:  # the next job reports it (as an anomaly) if it persists
                    print(f"fncall runner: cannot fork the next job: {exc}", file=sys.stderr)
            elif op == "exit":
                return
            else:
                self.send({"error": f"unknown op {op!r}"})

    # --------------------------------------------------------------- warm

    def warm(self, req: dict[str, Any]) -> dict[str, Any]:
        self.job_uid = int(req.get("job_uid", self.job_uid))
        self.cpu_cores = float(req.get("cpu_cores", self.cpu_cores)) or 1.0
        self.spare_count = max(1, int(req.get("spares", self.spare_count)))
        t0 = time.perf_counter()
        preload = [str(name) for name in req.get("preload", [])]
        # Everything a job's process would otherwise set up for itself is done here, once:
        # in the job's process each new object or changed page costs a copy-on-write fault
        # (measured: ~3 us each, hundreds per job). So the runner itself carries the jobs'
        # environment, signal dispositions and sys.stdin/stdout/stderr objects (on fds 0-2,
        # which only the job's process redirects: replacing them in each spare freed the
        # runner's objects, ~60 page copies). It writes only diagnostics, to fd 2 as before,
        # flushed before each fork.
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in req.get("job_env", {}).items()})
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # a file past RLIMIT_FSIZE kills the job
        sys.stdout.flush()
        sys.stderr.flush()
        stdio = _make_stdio()
        sys.stdin, sys.stdout, sys.stderr = stdio
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = stdio  # type: ignore[misc]
        atexit._clear()  # a job starts with no exit handlers, like python3
        # Objects made so far are never freed: keep them out of the collector's generations,
        # so a job's first collection does not touch (and copy) the warm heap.
        gc.collect()
        gc.freeze()
        ready: dict[str, Any] = {"ok": True, "error": "", "modules": len(sys.modules)}
        if preload:
            # Why a second interpreter: a fork costs in proportion to the parent's memory
            # (page tables copied, then unmapped at the job's exit; measured with numpy
            # loaded 0.40 + 0.82 ms per job, without 0.16 + 0.47 ms), and most Python jobs
            # never import the preloads. So this runner stays lean and a child of it, the
            # zygote, imports them and forks the spares of the jobs that name them.
            zygote, ready = _Zygote.start(preload, self.job_uid, self.cgroup_fds)
            if zygote is not None:
                self.warm_spares = _ZygoteSpares(self, zygote)
                self.preload_names = tuple({n.split(".")[0].encode() for n in preload})
        self.fork_spares()
        ready["warm_s"] = time.perf_counter() - t0
        return ready

    # ---------------------------------------------------------------- run

    def _spares_for(self, req: dict[str, Any]) -> _Spares:
        """The zygote's spares for a Python job whose .py files name a preloaded module (even
        in a comment: a false positive costs a little, a miss only the module's import; data
        files are not searched)."""
        warm = self.warm_spares
        if warm is not None and req.get("python_main"):
            for i, f in enumerate(req.get("files", [])):
                if not str(f.get("path", "")).endswith(".py"):
                    continue
                content = req.get(f"file{i}", b"")
                if any(name in content for name in self.preload_names):
                    return warm
        return self.lean

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        cgroup = req.get("cgroup")
        if cgroup not in STEP_CGROUPS or not self.cgroup_fds:  # fail closed: never unlimited
            return {"anomaly": f"no {cgroup!r} memory cgroup: the step was not run"}
        try:
            self._prepare(req)
            spare = self._spares_for(req).take()
            data = req.get("stdin", b"")
            if data:
                _write_all(spare.stdin, data)
                os.lseek(spare.stdin, 0, os.SEEK_SET)  # the offset is shared with the job's fd 0
        except Exception as exc:  # a broken container, not a broken job
            self._drop_spares()
            self._cleanup()
            return {"anomaly": f"job setup failed: {exc!r}"}
        try:
            result = self._execute(req, spare)
        except (OSError, ValueError) as exc:  # the zygote went away under the job
            self._drop_spares()
            self._cleanup()
            return {"anomaly": f"job failed in the runner: {exc!r}"}
        finally:
            spare.close()
        anomaly = self._cleanup(req, result)
        if anomaly:
            result["anomaly"] = anomaly
        return result

    def _prepare(self, req: dict[str, Any]) -> None:
        uid = self.job_uid
        # As good as new: the previous job owned it and may have changed its mode or hung
        # extended attributes on it (a channel to the next job otherwise).
        st = os.lstat(JOB_DIR)
        if st.st_uid != uid or st.st_gid != uid:
            os.chown(JOB_DIR, uid, uid)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(JOB_DIR, 0o700)
        for name in os.listxattr(JOB_DIR):
            if name.startswith("user."):  # the only namespace an unprivileged job can write
                os.removexattr(JOB_DIR, name)
        for i, f in enumerate(req.get("files", [])):
            rel = f["path"]
            parts = rel.split("/")
            if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"bad job file path {rel!r}")
            parent = JOB_DIR
            for p in parts[:-1]:
                parent = f"{parent}/{p}"
                if not os.path.isdir(parent):
                    os.mkdir(parent, 0o755)
                    os.chown(parent, uid, uid)
            path = f"{JOB_DIR}/{rel}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                _write_all(fd, req.get(f"file{i}", b""))
                os.fchown(fd, uid, uid)
                os.fchmod(fd, int(f.get("mode", 0o644)) & 0o777)
            finally:
                os.close(fd)

    # -------------------------------------------------------------- spare

    def fork_spares(self) -> None:
        """Refills every kind of spare whose batch is used up (see _LocalSpares)."""
        self.lean.fork_batch()
        if self.warm_spares is not None:
            self.warm_spares.fork_batch()

    def _drop_spares(self) -> None:
        self.lean.drop()
        if self.warm_spares is not None:
            self.warm_spares.drop()

    def _all_spares(self) -> list[Spare]:
        warm = self.warm_spares.spares if self.warm_spares is not None else []
        return [*self.lean.spares, *warm]

    def _execute(self, req: dict[str, Any], spare: Spare) -> dict[str, Any]:
        wall_s = float(req["wall_s"])
        cpu_s = float(req["cpu_s"])
        limit = int(req["max_output"])
        pid, pidfd, out_r, err_r = spare.pid, spare.pidfd, spare.out_r, spare.err_r
        # NUL-separated (argv cannot hold NUL): the job's process parses it with bytes.split,
        # not json, which would cost it dozens of page faults.
        go = "\0".join(
            [
                str(cpu_s),
                str(int(req.get("fsize", 0))),
                str(int(req.get("stack", 0))),
                str(STEP_CGROUPS.index(req["cgroup"])),
                req.get("python_main") or "",
                *(req.get("argv") or req.get("args") or []),
            ]
        ).encode()
        # From here, for the spare: the OOM killer's first choice (idle spares are not), and
        # the CPU it used before its job (the fork's own cost) is not the job's.
        prep_cpu = _start_job(pid)
        cpu0 = self._cgroup_cpu_s()
        self0 = time.process_time()
        t0 = time.monotonic()
        self.current_pid, self.aborted = pid, False
        try:
            spare.sock.sendall(go)
            spare.sock.shutdown(socket.SHUT_WR)  # the end of the message: it reads to EOF
        except OSError:
            pass  # it died: the pidfd says so below, and the job is a runtime error
        if self.abort_early:  # the caller went away while we prepared the job
            self.aborted = True
            _kill_group(pid)
        out = {out_r: bytearray(), err_r: bytearray()}
        names = {out_r: "stdout", err_r: "stderr"}
        poller = select.poll()
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN)
        poller.register(pidfd, select.POLLIN)
        open_pipes = {out_r, err_r}
        killed = ""
        over = ""
        status = rusage = None
        t_exit = 0.0
        wall_deadline = t0 + wall_s
        # CPU can grow at most `cpu_cores` seconds per second: no need to look before then.
        cpu_check = t0 + cpu_s / self.cpu_cores if cpu0 is not None else float("inf")
        drain_deadline = float("inf")

        while True:
            now = time.monotonic()
            if status is not None and (not open_pipes or now >= drain_deadline):
                break
            deadline = min(wall_deadline, cpu_check) if status is None else drain_deadline
            timeout_ms = (
                -1 if deadline == float("inf") else max(0, int((deadline - now) * 1000) + 1)
            )
            for fd, _ in poller.poll(timeout_ms):
                if fd == pidfd:
                    if status is None:
                        t_exit = time.monotonic()
                        self.current_pid = 0  # before its pid can be reused
                        status, rusage = spare.source.reap(pid)
                        poller.unregister(pidfd)
                        drain_deadline = t_exit + DRAIN_GRACE_S
                    continue
                buf = out[fd]
                while True:
                    try:
                        chunk = os.read(fd, READ_CHUNK)
                    except BlockingIOError:
                        break
                    if not chunk:
                        poller.unregister(fd)
                        open_pipes.discard(fd)
                        break
                    room = limit - len(buf)
                    if len(chunk) > room:
                        buf += chunk[: max(room, 0)]
                        if not killed:
                            killed, over = "output", names[fd]
                            _kill_group(pid)
                        # Stop reading: nothing more is kept; writers get EPIPE/SIGPIPE.
                        poller.unregister(fd)
                        open_pipes.discard(fd)
                        break
                    buf += chunk
            if status is not None or killed:
                continue
            now = time.monotonic()
            if now >= wall_deadline:
                killed = "wall"
                _kill_group(pid)
            elif now >= cpu_check:
                used = self._job_cpu(cpu0, self0)
                if used is not None and used >= cpu_s:
                    killed = "cpu"
                    _kill_group(pid)
                elif used is not None:
                    cpu_check = now + max((cpu_s - used) / self.cpu_cores, 0.002)
        assert status is not None and rusage is not None
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 127:
            with contextlib.suppress(OSError):
                note = spare.sock.recv(512, socket.MSG_DONTWAIT)
                if note.startswith(CGROUP_REFUSED):  # it ran nothing: the platform failed
                    return {"anomaly": note[1:].decode(errors="replace")}
        if self.aborted and not killed:
            killed = "cancelled"
        tree_cpu = self._job_cpu(cpu0, self0)
        result: dict[str, Any] = {
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
            "wall_s": t_exit - t0,
            "cpu_s": max(0.0, rusage.ru_utime + rusage.ru_stime - prep_cpu),
            "tree_cpu_s": tree_cpu if tree_cpu is not None else -1.0,
            "maxrss_kb": rusage.ru_maxrss,
            "killed": killed,
            "over": over,
            "stdout": bytes(out[out_r]),
            "stderr": bytes(out[err_r]),
        }
        if os.WIFSIGNALED(status) or os.WEXITSTATUS(status):
            result["full"] = _full_tmpfs()
        collect = req.get("collect")
        if collect and not killed and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            result["artifact"] = _read_regular(
                f"{JOB_DIR}/{collect}", int(req.get("collect_max", 64 << 20))
            )
        return result

    # ------------------------------------------------------------ cleanup

    def _cleanup(
        self, req: dict[str, Any] | None = None, result: dict[str, Any] | None = None
    ) -> str:
        """Kill every other process, reap, read the files the job asked back (`req`'s
        ``fetch``) into `result`, remove the job's files. "" or what went wrong."""
        problems = []
        deadline = time.monotonic() + 2.0
        while True:
            _reap()
            left = self._job_pids()
            if not left:
                break
            for pid in left:
                _kill_quietly(pid)
            if time.monotonic() > deadline:
                problems.append("processes survived SIGKILL for 2 s")
                break
            time.sleep(0.0002)
        fetch = req.get("fetch") if req is not None else None
        if fetch and req is not None and result is not None:
            if problems:  # something of the job still runs: its files are not settled
                result["fetched"] = []
                result["fetch_errors"] = {
                    p: "the job's processes could not be stopped" for p in fetch
                }
            else:
                _fetch(fetch, req, result)
        try:
            os.chmod(JOB_DIR, 0o700)  # the job may have made it unreadable even for us
            for name in os.listdir(JOB_DIR):
                _remove_tree(f"{JOB_DIR}/{name}")
        except OSError as exc:
            problems.append(f"cannot empty {JOB_DIR}: {exc}")
        for d, keep in self.scratch.items():
            try:
                if d in self.empty_size and os.stat(d).st_size == self.empty_size[d]:
                    continue
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                if name in keep:
                    continue
                try:
                    _remove_tree(f"{d}/{name}")
                except OSError as exc:
                    problems.append(f"cannot remove {d}/{name}: {exc}")
        for fd in self.sysv_fds:
            try:
                if os.pread(fd, 65536, 0).count(b"\n") > 1:  # a header line, then one per object
                    problems.append("SysV IPC objects left behind")
                    break
            except OSError:
                pass
        return "; ".join(problems)

    def _abort(self, signum: int, frame: object) -> None:
        if self.current_pid:
            self.aborted = True
            _kill_group(self.current_pid)
        elif self.in_run:  # still preparing it: _execute kills it as soon as it runs
            self.abort_early = True
        # else: late, for a job already answered (the edge had not read the answer yet)

    def _cgroup_cpu_s(self) -> float | None:
        """CPU seconds of every process in the container so far (cpuacct), if readable."""
        ns = _pread_int(self.cpuacct)
        return None if ns is None else ns / 1e9

    def _job_cpu(self, cpu0: float | None, self0: float) -> float | None:
        """CPU seconds of every process in the container since the job started, minus ours."""
        now = self._cgroup_cpu_s()
        if cpu0 is None or now is None:
            return None
        return max(0.0, (now - cpu0) - (time.process_time() - self0))

    def _job_pids(self) -> list[int]:
        """Processes in the container other than the runner and the idle spares: the job's,
        orphans included (reaped zombies are gone from /proc; threads are not listed).

        Killed one by one, as root, from this list: pid 1 never takes the job's uid (with it,
        a job's process could renice, re-schedule or signal the runner). Not atomic like
        kill(-1), so the caller repeats until the list is empty; a fork bomb cannot outrun
        it: every process listed is killed, and the zombies keep the pids cgroup full until
        we reap them. A pid cannot be reused by anything else meanwhile: only job processes
        fork here, and only we reap orphans."""
        spares = self._all_spares()
        zygote = [self.warm_spares.zygote.pid] if self.warm_spares is not None else []
        if _pread_int(self.pids_current) == 1 + len(zygote) + len(spares):  # all reaped: exact
            return []
        mine = {1, os.getpid(), *zygote, *(sp.pid for sp in spares)}
        return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) not in mine]


class _Spares:
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
            _kill_quietly(spare.pid)
            spare.close()
            self._bury(spare)


class _LocalSpares(_Spares):
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
        signal.signal(ABORT_SIGNAL, signal.SIG_DFL)
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
            signal.signal(ABORT_SIGNAL, self.runner._abort)
            self.spares += _keep(ends, pids, self)

    def reap(self, pid: int) -> tuple[int, Any]:
        _, status, rusage = os.wait4(pid, 0)
        return status, rusage


class _Usage:
    """The fields of a struct rusage the runner uses, as the zygote reports them."""

    def __init__(self, utime: float, stime: float, maxrss: int) -> None:
        self.ru_utime, self.ru_stime, self.ru_maxrss = utime, stime, maxrss


class _Zygote:
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
    ) -> tuple[_Zygote | None, dict[str, Any]]:
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
            _kill_quietly(pid)
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


class _ZygoteSpares(_Spares):
    """Spares forked by the zygote (the same batches as _LocalSpares), reaped through it."""

    def __init__(self, runner: Runner, zygote: _Zygote) -> None:
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


def _keep(ends: list[_SpareEnds], pids: list[int], source: _Spares) -> list[Spare]:
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
    lean = _lean_after_fork()
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
                _spare(ctl, stdin, out_w, err_w, uid, reseed_numpy, cgroup_fds)
            pids.append(pid)
    finally:
        if lean:
            _real_after_fork()
    return pids


def _zygote_main(
    sock: socket.socket, preload: list[str], uid: int, cgroup_fds: tuple[int, ...]
) -> None:  # pragma: no cover
    """The zygote: import the preloads once, then fork spares and reap them on request.

    It runs as little Python as it can between forks (its pages are the spares' pages: each
    one it writes is a copy), and nothing of the job: the runner does all the rest."""
    try:
        signal.signal(ABORT_SIGNAL, signal.SIG_DFL)  # the edge signals the runner, not us
        # Of the runner's descriptors only stdio stays: above all not its channel to the edge
        # (the edge must see EOF when the runner dies).
        # The step cgroups' descriptors stay (its spares join one), at CGROUP_FD_MIN and up.
        os.closerange(3, sock.fileno())
        os.closerange(sock.fileno() + 1, CGROUP_FD_MIN)
        os.closerange(max(cgroup_fds, default=CGROUP_FD_MIN - 1) + 1, 1 << 20)
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

    def spare(self, pid: int, source: _Spares) -> Spare:
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
        source: _Spares,
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


# ---------------------------------------------------------------- the child


def _spare(
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
    top of this file). What can be done once for all spares is done by the runner: the job's
    sys.stdin/stdout/stderr objects, no atexit handlers, the default disposition of the
    runner's abort signal, numpy's RNG state (a new one written before each fork), and at
    the job's start its oom_score_adj.
    """
    try:
        _real_after_fork()  # see _lean_after_fork: the job's own forks get the real hook
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


#: threading's at-fork hook and its real code, once _lean_after_fork has swapped it.
_AFTER_FORK: tuple[Any, Any] | None = None


def _noop() -> None:  # pragma: no cover - replaces threading._after_fork in spares
    pass


def _lean_after_fork() -> bool:
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


def _real_after_fork() -> None:
    """Puts threading's after-fork hook back (after the batch in the runner, first thing in
    each spare)."""
    if _AFTER_FORK is not None:
        _AFTER_FORK[0].__code__ = _AFTER_FORK[1]


def _start_job(pid: int) -> float:
    """Marks spare `pid` as the running job's (oom_score_adj 1000: the OOM killer's first
    choice) and returns the CPU seconds it has used so far (its fork and set-up)."""
    try:
        fd = os.open(f"/proc/{pid}/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, b"1000")
        finally:
            os.close(fd)
        fd = os.open(f"/proc/{pid}/schedstat", os.O_RDONLY)
        try:
            return int(os.read(fd, 128).split()[0]) / 1e9  # ns on the CPU
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return 0.0  # it died: the job is a runtime error, reported as such


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


def _make_stdio() -> tuple[Any, Any, Any]:
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


# ---------------------------------------------------------------- helpers


def _open_quietly(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _mounts_of(fstypes: tuple[str, ...]) -> set[str]:
    """Mount points (in this mount namespace) of the given filesystem types."""
    try:
        with open("/proc/self/mounts") as fh:
            return {f[1] for f in (line.split() for line in fh) if len(f) > 2 and f[2] in fstypes}
    except OSError:
        return set()


def _pread_int(fd: int) -> int | None:
    if fd < 0:
        return None
    try:
        return int(os.pread(fd, 64, 0))
    except (OSError, ValueError):
        return None


def _full_tmpfs() -> str:
    """Which of the job's tmpfs mounts (the edge sizes them) has less than 1 MiB left, if any:
    a job that failed there most likely failed because its files did not fit."""
    for d in (JOB_DIR, "/tmp"):
        try:
            st = os.statvfs(d)
        except OSError:
            continue
        if os.path.ismount(d) and st.f_bavail * st.f_frsize < 1 << 20:
            return d
    return ""


def _kill_group(pid: int) -> None:
    for target in (pid, -pid):  # the main process, then its process group
        _kill_quietly(target)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _reap() -> None:
    """Collect every child that has exited (the job's orphans are ours: we are pid 1)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _remove_tree(path: str) -> None:
    """rm -rf as root, never following symlinks; a job may chmod 000 its own directories."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    try:
        entries = os.listdir(path)
    except PermissionError:
        os.chmod(path, 0o700)
        entries = os.listdir(path)
    for name in entries:
        _remove_tree(f"{path}/{name}")
    os.rmdir(path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fetch(paths: list[str], req: dict[str, Any], result: dict[str, Any]) -> None:
    """Reads the job's files `paths` (relative to /job) into `result`: ``fetched`` lists those
    read, in order, each in a blob ``fetch<i>``; ``fetch_errors`` maps the others to why.

    Called once every process of the job is gone (nothing changes the files any more) and
    before /job is emptied. We are root and the job owned /job, so it may have planted
    symlinks (to /etc/shadow, to /proc/1/mem, ...) or FIFOs: each path is walked a component
    at a time from a descriptor of /job, never following a symlink (O_NOFOLLOW, directories
    with O_DIRECTORY), the file opened non-blocking and kept only if fstat says it is a
    regular file (a hard link can only name a file of /job's own tmpfs, which the job wrote
    anyway). In all at most ``fetch_max`` bytes, and less if the job's output leaves
    less of ``result_max``: a file that does not fit what is left is refused, not cut."""
    limit = int(req.get("fetch_max", 0))
    left, why_less = limit, ""
    result_max = int(req.get("result_max", 0))
    output = len(result.get("stdout", b"")) + len(result.get("stderr", b""))
    if result_max and result_max - output < limit:
        left = max(result_max - output, 0)
        why_less = f" (the output took {_mib(output)} of the result's {_mib(result_max)})"
    fetched: list[str] = []
    errors: dict[str, str] = {}
    try:
        root = os.open(JOB_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        root = -1
        for path in paths:
            errors[path] = f"cannot open {JOB_DIR}: {exc.strerror}"
    if root >= 0:
        try:
            for path in paths:
                try:
                    got = _read_job_file(root, str(path), left)
                except _TooLarge as big:
                    a, b = _mib(big.size), _mib(left)
                    if a == b:  # rounded alike: say it exactly
                        a, b = f"{big.size} bytes", f"{left} bytes"
                    errors[path] = f"{a}, larger than the {b} left of the {_mib(limit)} limit"
                    errors[path] += why_less
                    continue
                if isinstance(got, str):
                    errors[path] = got
                    continue
                result[f"fetch{len(fetched)}"] = got
                fetched.append(path)
                left -= len(got)
        finally:
            os.close(root)
    result["fetched"] = fetched
    result["fetch_errors"] = errors


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


def _read_job_file(root: int, rel: str, left: int) -> bytes | str:
    """The content of the regular file `rel` under the directory `root`, or why not;
    _TooLarge if it has more than `left` bytes."""
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return "not a path inside the job directory"
    fds: list[int] = []
    try:
        d = root
        for i, name in enumerate(parts[:-1]):
            try:
                d = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d
                )
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    with contextlib.suppress(OSError):
                        if stat.S_ISLNK(os.stat(name, dir_fd=d, follow_symlinks=False).st_mode):
                            exc = OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                return _fetch_error(exc, "/".join(parts[: i + 1]))
            fds.append(d)
        try:
            fd = os.open(
                parts[-1],
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                dir_fd=d,
            )
        except OSError as exc:
            return _fetch_error(exc, "")
        fds.append(fd)
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return "not a regular file: a directory"
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size > left:
            raise _TooLarge(st.st_size)
        chunks: list[bytes] = []
        size = 0
        while True:
            # One read for the whole file (tmpfs), +1 byte to see it grow past its size.
            chunk = os.read(fd, max(st.st_size - size, 0) + 1)
            if not chunk:
                break
            size += len(chunk)
            if size > left:
                raise _TooLarge(size)
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except OSError as exc:
        return _fetch_error(exc, "")
    finally:
        for opened in reversed(fds):
            os.close(opened)


def _fetch_error(exc: OSError, directory: str) -> str:
    """Why a fetch path could not be opened; `directory`: the component that failed, if one
    on the way (else the file itself)."""
    if exc.errno == errno.ENOENT:
        return "no such file"
    if exc.errno == errno.ELOOP:
        if directory:
            return f"{directory!r} is a symbolic link (not followed)"
        return "not a regular file: a symbolic link (not followed)"
    if exc.errno == errno.ENOTDIR:
        return f"{directory!r} is not a directory" if directory else "a parent is not a directory"
    if exc.errno == errno.ENXIO:  # a socket
        return "not a regular file"
    return (exc.strerror or str(exc)).lower()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f}".rstrip("0").rstrip(".") + " MiB"


def _read_regular(path: str, max_bytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return b""
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def main() -> None:  # pragma: no cover - inside the container
    fd = int(os.environ.pop("DSEC_FNCALL_FD", CONTROL_FD))
    os.set_inheritable(fd, False)
    sock = socket.socket(fileno=fd)
    try:
        Runner(sock).serve()
    except (ConnectionError, wire.WireError) as exc:
        print(f"fncall runner: channel failed: {exc}", file=sys.stderr)
    except OSError as exc:
        if exc.errno != errno.EBADF:
            raise


if __name__ == "__main__":  # pragma: no cover
    main()

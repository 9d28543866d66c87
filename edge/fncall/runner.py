"""The FnCall runner: pid 1 of a warm-pool container. Standard library only.

It runs on the image's own Python (``/usr/bin/python3 -B /.dsec/runner.py``; the edge mounts
the runner kit, this file and the modules it imports, read-only at /.dsec) and talks to the edge
over the socket the edge passed as fd 3. No aether, no chronus: one request at a time, each a job.

The kit (``edge.fncall.service.KIT_FILES``), one idea per module:

- ``runner.py``: the channel, the warm-up, and each job's cycle (prepare, run under its limits,
  clean up) below;
- ``runner_spares.py``: the job processes forked ahead of their jobs, from this lean
  interpreter or from the zygote that imported the preloads;
- ``runner_job.py``: what a spare does from its fork to the job's code;
- ``runner_files.py``: the job directory's files, emptied and read back without following a
  link;
- ``wire.py``: the frames on the channel.

(Named ``runner_*`` so as not to hide a job's own modules: a Python job runs in this
interpreter, whose ``sys.modules`` holds ours.)

Per job:

1. an empty job directory ``/job`` (mode 0700, owned by the job uid) with the job's files;
2. the job's process was forked before the job came (a "spare"; several are forked back to
   back, see runner_spares.SPARES): its own session, stdio and RLIMIT_CORE 0, still root while
   it waits. On the job's parameters (and its stdin, in a memfd) it takes oom_score_adj 1000 (the
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
   symlink, bounded; see `runner_files.fetch`), empty /job and the world-writable scratch
   dirs, and check that no SysV IPC object survived. Anything unexpected is reported as an `anomaly`
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
import contextlib
import errno
import fcntl
import gc
import os
import select
import signal
import socket
import stat
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # what mypy reads: the package
    from typing import Any

    from edge.fncall import runner_files, runner_job, runner_spares, wire
else:
    try:  # the edge imports these from the package; the container runs them from /.dsec
        from edge.fncall import runner_files, runner_job, runner_spares, wire
    except ImportError:  # pragma: no cover - inside the container
        import runner_files
        import runner_job
        import runner_spares
        import wire

CONTROL_FD = 3
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
JOB_DIR = runner_job.JOB_DIR
STEP_CGROUPS = runner_job.STEP_CGROUPS
#: Sent by the edge (from the host) to pid 1 when the caller of the running job went away
#: (edge.fncall.pool imports it from here).
ABORT_SIGNAL = runner_job.ABORT_SIGNAL


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
        self.spare_count = runner_spares.SPARES
        #: Spares forked from this (lean) interpreter: jobs that need none of the preloads,
        #: and every exec()ed program.
        self.lean = runner_spares.LocalSpares(self)
        #: The spares of the warm interpreter with the environment's preloads (the zygote, a
        #: child of ours), for Python jobs whose sources name a preloaded module.
        self.warm_spares: runner_spares.ZygoteSpares | None = None
        self.preload_names: tuple[bytes, ...] = ()
        # /job stays; only its contents come and go (the edge mounts a tmpfs there; without
        # one it is a directory of the overlay, where creating and removing a directory per
        # job costs milliseconds of waiting on the upper layer's journal when the machine is
        # busy: measured rmdir 0.6-11 ms).
        if os.path.ismount(JOB_DIR):
            for name in os.listdir(JOB_DIR):
                runner_files.remove_tree(f"{JOB_DIR}/{name}")
            os.chmod(JOB_DIR, 0o700)
        else:
            runner_files.remove_tree(JOB_DIR)
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
                fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, runner_job.CGROUP_FD_MIN) for fd in fds
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
        stdio = runner_job.make_stdio()
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
            zygote, ready = runner_spares.Zygote.start(preload, self.job_uid, self.cgroup_fds)
            if zygote is not None:
                self.warm_spares = runner_spares.ZygoteSpares(self, zygote)
                self.preload_names = tuple({n.split(".")[0].encode() for n in preload})
        self.fork_spares()
        ready["warm_s"] = time.perf_counter() - t0
        return ready

    # ---------------------------------------------------------------- run

    def _spares_for(self, req: dict[str, Any]) -> runner_spares.Spares:
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
                runner_files.write_all(spare.stdin, data)
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
                runner_files.write_all(fd, req.get(f"file{i}", b""))
                os.fchown(fd, uid, uid)
                os.fchmod(fd, int(f.get("mode", 0o644)) & 0o777)
            finally:
                os.close(fd)

    # -------------------------------------------------------------- spare

    def fork_spares(self) -> None:
        """Refills every kind of spare whose batch is used up (see runner_spares.LocalSpares)."""
        self.lean.fork_batch()
        if self.warm_spares is not None:
            self.warm_spares.fork_batch()

    def _drop_spares(self) -> None:
        self.lean.drop()
        if self.warm_spares is not None:
            self.warm_spares.drop()

    def _all_spares(self) -> list[runner_spares.Spare]:
        warm = self.warm_spares.spares if self.warm_spares is not None else []
        return [*self.lean.spares, *warm]

    def _execute(self, req: dict[str, Any], spare: runner_spares.Spare) -> dict[str, Any]:
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
                if note.startswith(
                    runner_job.CGROUP_REFUSED
                ):  # it ran nothing: the platform failed
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
            result["artifact"] = runner_files.read_regular(
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
                runner_spares.kill_quietly(pid)
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
                runner_files.fetch(JOB_DIR, fetch, req, result)
        try:
            os.chmod(JOB_DIR, 0o700)  # the job may have made it unreadable even for us
            for name in os.listdir(JOB_DIR):
                runner_files.remove_tree(f"{JOB_DIR}/{name}")
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
                    runner_files.remove_tree(f"{d}/{name}")
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
        runner_spares.kill_quietly(target)


def _reap() -> None:
    """Collect every child that has exited (the job's orphans are ours: we are pid 1)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


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

"""Warm pools: pre-created runc containers per environment, each running the runner.

- `Launcher` makes and removes pool containers: the environment's image as the only lower
  layer, the runner kit bind-mounted read-only at /.dsec, the runner as pid 1 (the image's own
  Python), a socketpair end as its fd 3, no network (a private, empty netns), the cgroup limits
  of `FnCallSettings`. It owns its own `RuncRuntime` (state dir and cgroup parent of its own),
  so a restarted edge removes every container a previous run left and starts afresh: pool
  containers hold no state worth adopting.
- `Worker` is one such container: its channel, its cgroups seen from the host (`CgroupProbe`),
  a pidfd of its init watched by the event loop (a container that dies while idle leaves the
  pool at once, not when the next job finds out).
- `Pool` keeps `size` workers of one environment: idle workers in a FIFO, jobs waiting for one
  in another (bounded: a full queue or a wait past `queue_timeout_s` is EDGE_CAPACITY, so the
  API server tries another edge), and a supervisor that replaces every worker that is retired
  (after `jobs_per_container` jobs, any anomaly, or death).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Any

from edge.fncall import gpu as gpus
from edge.fncall import wire
from edge.fncall.environments import JOB_ENV, Environment, FnCallSettings
from edge.fncall.runner import ABORT_SIGNAL
from edge.images import ImageResolver
from edge.runtime import cgroups
from edge.runtime.runc import RuncRuntime
from edge.runtime.spec import LaunchSpec, SandboxProcess, TmpfsMount
from libdsec.errors import EdgeCapacity

log = logging.getLogger(__name__)

KIT_MOUNT = "/.dsec"
#: Headroom of a container's memory limit over the largest job: the runner (its warm
#: interpreter, the output and fetched files it holds), the job's input files on tmpfs, page
#: cache. The job itself is held to its own limit in its step cgroup (`StepCgroup`).
CONTAINER_OVERHEAD_MB = 256
#: The memory cgroups made inside each pool container's: run steps in the first, compile steps
#: in the second (the compiler's page cache, charged to whoever reads it first, then stays out of
#: the run steps' small limits instead of being reclaimed by each of them).
JOB_CGROUP, COMPILE_CGROUP = "job", "compile"
STEP_CGROUPS = (JOB_CGROUP, COMPILE_CGROUP)
START_TIMEOUT_S = 60.0


class WorkerBroken(Exception):
    """The channel to a pool container failed (EOF, reset, garbage, timeout)."""


class StepCgroup:
    """One step kind's memory cgroup inside a pool container's (``job`` for run steps,
    ``compile`` for compile steps), made and read from the host.

    The step's process joins it itself before its program starts (the runner holds its
    ``tasks`` file, passed at start: see `CgroupProbe.make_steps`), so everything the step's
    processes charge (anonymous memory, page tables, the files they write in the container's
    tmpfs, page cache they bring in) counts against exactly the step's limit, and the runner,
    the idle spares and the step's input files stay in the container's own cgroup. The limit
    is set before each step (only when it changed), the peak (the cgroup's watermark) reset;
    the OOM-kill counter is the step's own (cgroup v1 counts a kill in the victim's cgroup).
    """

    def __init__(self, name: str, path: Path, memsw: bool) -> None:
        self.name = name
        self.path = path
        self.limit = -1  # unknown: written before the first step
        self._fds: dict[str, int] = {}
        try:
            files = [
                ("limit", "memory.limit_in_bytes", os.O_WRONLY),
                ("peak", "memory.max_usage_in_bytes", os.O_RDWR),
                ("oom", "memory.oom_control", os.O_RDONLY),
            ]
            if memsw:
                files.append(("memsw", "memory.memsw.limit_in_bytes", os.O_WRONLY))
            for key, name_, mode in files:
                self._fds[key] = os.open(path / name_, mode | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise

    def prepare(self, limit: int) -> None:
        """The step's memory limit (and memory+swap, equal: no swap escape) and a fresh peak.
        Raises OSError if the kernel refuses (then the step must not run: fail closed)."""
        if limit != self.limit:
            order = ["limit", "memsw"]
            if self.limit >= 0 and limit > self.limit:
                order.reverse()  # memsw must never be below the memory limit
            # From unlimited (the first step) the memory limit comes down first.
            self.limit = -1  # unknown until both are written
            for key in order:
                fd = self._fds.get(key)
                if fd is not None:
                    os.pwrite(fd, str(limit).encode(), 0)
            self.limit = limit
        os.pwrite(self._fds["peak"], b"0", 0)  # the watermark restarts at the current usage

    def peak(self) -> int:
        """The highest memory charged to the cgroup since `prepare`."""
        try:
            return int(os.pread(self._fds["peak"], 64, 0))
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        return _keyed_counter(self._fds.get("oom"), b"oom_kill")

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


class CgroupProbe:
    """A pool container's cgroups seen from the host: its pids counter and the memory
    cgroups of its steps (`StepCgroup`), made inside the container's memory cgroup.

    Read on every job, so the counter files stay open and are re-read with pread(2).
    """

    def __init__(self, cgroup_path: str) -> None:
        self.path = cgroup_path
        self.memory = cgroups.controller_dir("memory", cgroup_path)
        pids = cgroups.controller_dir("pids", cgroup_path)
        self._fds: dict[str, int] = {}
        if pids is not None:
            with contextlib.suppress(OSError):
                self._fds["pids"] = os.open(pids / "pids.events", os.O_RDONLY | os.O_CLOEXEC)
        self.steps: dict[str, StepCgroup] = {}

    def make_steps(self) -> list[int]:
        """Makes the step cgroups (`STEP_CGROUPS`) and returns a descriptor of each one's
        ``tasks`` file, opened for writing, in that order: the runner gets them (a process
        joins a cgroup v1 by writing 0 there, ~30 us; the cgroup mount in the container is
        read-only, but a descriptor opened on the host's is not). Fail closed: raises
        OSError if the host cannot make or limit them (no memory hierarchy, no limit file,
        no memory+swap limit where the host accounts swap)."""
        if self.memory is None or not self.memory.is_dir():
            raise OSError(errno.ENOENT, f"no cgroup v1 memory cgroup for {self.path}")
        memsw = (self.memory / "memory.memsw.limit_in_bytes").exists()
        tasks: list[int] = []
        try:
            for name in STEP_CGROUPS:
                d = self.memory / name
                d.mkdir(exist_ok=True)
                self.steps[name] = StepCgroup(name, d, memsw)
                tasks.append(os.open(d / "tasks", os.O_WRONLY | os.O_CLOEXEC))
        except BaseException:
            for fd in tasks:
                os.close(fd)
            raise
        return tasks

    def pids_limit_hits(self) -> int:
        return _keyed_counter(self._fds.get("pids"), b"max")

    def close(self) -> None:
        """Closes the descriptors (the step cgroups go with the container's: runc and
        `cgroups.remove` remove nested cgroups first)."""
        for step in self.steps.values():
            step.close()
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


class Worker:
    """One pool container and its channel (one request at a time)."""

    def __init__(
        self,
        sandbox_id: str,
        env: Environment,
        proc: SandboxProcess,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        probe: CgroupProbe,
        gpu: gpus.Gpu | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.env = env
        self.proc = proc
        self.reader = reader
        self.writer = writer
        self.probe = probe
        self.gpu = gpu
        self.jobs = 0
        self.dead = False
        self.pidfd: int | None = None
        self.started_at = time.monotonic()

    def __repr__(self) -> str:
        return f"<Worker {self.sandbox_id} jobs={self.jobs}{' dead' if self.dead else ''}>"

    async def call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.dead:
            raise WorkerBroken(f"{self.sandbox_id} is dead")
        try:
            self.writer.write(wire.encode(message))
            async with asyncio.timeout(timeout_s):
                await self.writer.drain()
                return await self.receive()
        except TimeoutError:
            raise WorkerBroken(f"{self.sandbox_id}: no answer in {timeout_s:.1f} s") from None
        except (OSError, EOFError, asyncio.IncompleteReadError, wire.WireError) as exc:
            raise WorkerBroken(f"{self.sandbox_id}: channel failed: {exc!r}") from exc

    def abort(self) -> None:
        """Asks the runner to kill the job it runs (the caller went away); the answer still
        comes, as for any killed job."""
        if self.pidfd is not None:  # the runner's pidfd: never a reused pid
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, ABORT_SIGNAL)

    async def receive(self) -> dict[str, Any]:
        prefix = await self.reader.readexactly(4)
        return wire.decode(await self.reader.readexactly(wire.body_length(prefix)))


class Launcher:
    """Creates and removes pool containers (blocking runtime calls run in threads)."""

    def __init__(
        self,
        state_dir: Path,
        images: ImageResolver,
        settings: FnCallSettings,
        kit_dir: Path,
        *,
        cgroup_parent: str,
    ) -> None:
        self.state_dir = state_dir
        self.logs = state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.runtime = RuncRuntime(
            state_dir / "runtime", cgroup_parent=cgroup_parent, volatile_state=True
        )
        self.images = images
        self.settings = settings
        self.kit_dir = kit_dir
        self._seq = itertools.count(1)
        self._tag = secrets.token_hex(2)
        self._creating: set[asyncio.Future[SandboxProcess]] = set()

    async def close(self) -> None:
        """After the pools have retired their workers: wait for container starts still under
        way, remove whatever is left (nothing, normally), then our parent cgroup."""
        if self._creating:
            await asyncio.wait(set(self._creating), timeout=60)
        left = await asyncio.to_thread(self.runtime.cleanup_orphans, set())
        if left:
            log.info("fncall: removed %d leftovers at shutdown", len(left))
        await asyncio.to_thread(cgroups.remove, f"/{self.runtime.cgroup_parent}")
        await asyncio.to_thread(self.runtime.release)  # its state tmpfs mounts, now empty

    def container_memory_bytes(self) -> int:
        mb = self.settings.max_memory_mb + CONTAINER_OVERHEAD_MB
        return mb * 1024 * 1024 + self.settings.tmpfs_bytes

    async def cleanup_orphans(self) -> list[str]:
        removed: list[str] = await asyncio.to_thread(self.runtime.cleanup_orphans, set())
        for f in self.logs.glob("*.log"):
            f.unlink(missing_ok=True)
        return removed

    async def start(self, env: Environment, gpu: gpus.Gpu | None = None) -> Worker:
        sid = f"fn-{env.name}-{self._tag}-{next(self._seq)}"
        image = await asyncio.to_thread(self.images.resolve, env.image)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        environ = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "HOME": "/root",
            # numpy's BLAS must not start thread pools in a process that forks every job.
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "DSEC_FNCALL_FD": "3",
            **(gpus.visible_env(gpu) if gpu else {}),
        }
        spec = LaunchSpec(
            sandbox_id=sid,
            lowers=list(image.lowers),
            init_argv=[env.interpreter, "-B", f"{KIT_MOUNT}/runner.py"],
            env=environ,
            cwd="/",
            cpu_millis=self.settings.cpu_millis,
            memory_mb=self.container_memory_bytes() // (1024 * 1024),
            # the idle spares wait as processes of their own: a batch of the runner's, and
            # with preloads the zygote (the warm interpreter) and a batch of its spares
            pids_max=self.settings.pids_max
            + self.settings.spares * (2 if env.preload else 1)
            + (1 if env.preload else 0),
            toolkit_dir=self.kit_dir,
            pass_fd=child.fileno(),
            log_path=self.logs / f"{sid}.log",
            disk_mb=self.settings.disk_mb,
            # the job's files and scratch on tmpfs: creating a file on the overlay costs ~0.2 ms
            tmpfs=(
                TmpfsMount("/job", self.settings.job_dir_mb, 0o700),
                TmpfsMount("/tmp", self.settings.tmp_dir_mb, 0o1777),
            ),
            # nvidia-container-cli configures the container through a host path to its root
            keep_host_rootfs=gpu is not None,
        )
        # runc keeps going in its thread even if we are cancelled: track it, so that a
        # container created after our caller gave up is still removed (see close()).
        create = asyncio.ensure_future(asyncio.to_thread(self.runtime.create, spec))
        self._creating.add(create)
        create.add_done_callback(self._creating.discard)
        try:
            proc = await asyncio.shield(create)
        except BaseException:
            parent.close()
            with contextlib.suppress(BaseException):
                await asyncio.shield(create)
            if create.done() and not create.cancelled() and create.exception() is None:
                await asyncio.shield(self.destroy_id(sid, keep_log=True))
            raise
        finally:
            child.close()  # the runner holds its own copy now
        probe = CgroupProbe(proc.cgroup_path)
        try:
            # The runner's first message: the step cgroups' tasks files (SCM_RIGHTS), before
            # its hello; it refuses to run a step whose cgroup it does not have.
            tasks = await asyncio.to_thread(probe.make_steps)
            try:
                socket.send_fds(parent, [wire.encode({"op": "cgroups"})], tasks)
            finally:
                for fd in tasks:
                    os.close(fd)
            parent.setblocking(False)
            reader, writer = await asyncio.open_unix_connection(sock=parent)
            worker = Worker(sid, env, proc, reader, writer, probe, gpu)
            hello = await asyncio.wait_for(worker.receive(), START_TIMEOUT_S)
            if hello.get("op") != "hello":
                raise WorkerBroken(f"{sid}: unexpected first message {hello!r}")
            if gpu is not None:
                await self._inject_gpu(gpu, proc)
            warm = await worker.call(
                {
                    "op": "warm",
                    "preload": list(env.preload),
                    "job_uid": self.settings.job_uid,
                    "spares": self.settings.spares,
                    "cpu_cores": self.settings.cpu_millis / 1000,
                    "job_env": JOB_ENV,
                },
                START_TIMEOUT_S,
            )
            if not warm.get("ok"):
                raise WorkerBroken(f"{sid}: warm-up failed: {warm.get('error')}")
            worker.pidfd = os.pidfd_open(proc.pid)
        except BaseException:
            probe.close()
            parent.close()
            await asyncio.shield(self.destroy_id(sid, keep_log=True))
            raise
        log.debug("fncall worker %s ready (warm-up %.0f ms)", sid, warm.get("warm_s", 0) * 1000)
        return worker

    async def _inject_gpu(self, gpu: gpus.Gpu, proc: SandboxProcess) -> None:
        argv = gpus.inject_command(gpu, proc.pid, proc.rootfs)
        r = await asyncio.to_thread(
            subprocess.run, argv, capture_output=True, text=True, timeout=60
        )
        if r.returncode != 0:
            raise WorkerBroken(f"GPU injection failed: {r.stderr.strip()}")

    async def destroy(self, worker: Worker, *, keep_log: bool = False) -> None:
        worker.dead = True
        if worker.pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(worker.pidfd)
            os.close(worker.pidfd)
            worker.pidfd = None
        with contextlib.suppress(Exception):
            worker.writer.close()
        worker.probe.close()
        await self.destroy_id(worker.sandbox_id, keep_log=keep_log)

    async def destroy_id(self, sid: str, *, keep_log: bool = False) -> None:
        try:
            await asyncio.to_thread(self.runtime.destroy, sid)
        except Exception:
            log.exception("removing fncall container %s failed (orphan cleanup retries)", sid)
        if not keep_log:
            (self.logs / f"{sid}.log").unlink(missing_ok=True)
        else:
            self._prune_logs()

    def _prune_logs(self, keep: int = 100) -> None:
        logs = sorted(self.logs.glob("*.log"), key=lambda p: p.stat().st_mtime)
        for f in logs[:-keep]:
            f.unlink(missing_ok=True)


class Pool:
    """`size` warm workers of one environment, refilled by `supervise()`."""

    def __init__(
        self,
        env: Environment,
        size: int,
        launcher: Launcher,
        settings: FnCallSettings,
        start_slots: asyncio.Semaphore,
        gpu_plan: list[gpus.Gpu] | None = None,
    ) -> None:
        self.env = env
        self.size = size if gpu_plan is None else len(gpu_plan)
        self.launcher = launcher
        self.settings = settings
        self.start_slots = start_slots
        self.gpu_plan = gpu_plan
        self.idle: deque[Worker] = deque()
        self.workers: set[Worker] = set()
        self.waiters: deque[asyncio.Future[Worker]] = deque()
        self.starting = 0
        self.changed = asyncio.Event()
        self.ready = asyncio.Event()  # at least one worker has been ready once
        self.last_error = ""
        self.jobs_done = 0
        self.recycled = 0
        self._destroying: set[asyncio.Task[None]] = set()
        self._closed = False

    # ------------------------------------------------------------ jobs side

    async def acquire(self, timeout_s: float) -> Worker:
        while self.idle:
            w = self.idle.popleft()
            if not w.dead:
                return w
        if len(self.waiters) >= self.settings.max_queue:
            raise EdgeCapacity(
                f"fncall pool {self.env.name} has {len(self.waiters)} jobs waiting",
                reason="FNCALL_BUSY",
                metadata={"environment": self.env.name},
            )
        fut: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await asyncio.wait({fut}, timeout=timeout_s)
        finally:
            if not fut.done():
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self.waiters.remove(fut)
            elif not fut.cancelled() and asyncio.current_task().cancelling():  # type: ignore[union-attr]
                self.release(fut.result())  # got one, but our caller went away
        if fut.cancelled():
            detail = f" (last start failure: {self.last_error})" if self.last_error else ""
            raise EdgeCapacity(
                f"no free container in fncall pool {self.env.name} within {timeout_s:g} s{detail}",
                reason="FNCALL_BUSY",
                metadata={"environment": self.env.name},
            )
        return fut.result()

    def release(self, worker: Worker, *, retire: str = "") -> None:
        """Back to the pool, or (with a reason) out of it and replaced."""
        if not retire and worker.jobs >= self.settings.jobs_per_container:
            retire = f"recycled after {worker.jobs} jobs"
        if retire or worker.dead or self._closed:
            self.retire(worker, retire or "dead")
            return
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(worker)
                return
        self.idle.append(worker)

    def retire(self, worker: Worker, reason: str) -> None:
        if worker not in self.workers:
            return
        self.workers.discard(worker)
        with contextlib.suppress(ValueError):
            self.idle.remove(worker)
        self.recycled += 1
        anomaly = not reason.startswith("recycled")
        (log.warning if anomaly and not self._closed else log.debug)(
            "fncall worker %s retired: %s", worker.sandbox_id, reason
        )
        worker.dead = True
        task = asyncio.create_task(self.launcher.destroy(worker, keep_log=anomaly))
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)
        self.changed.set()

    # ------------------------------------------------------------ supervisor

    async def supervise(self) -> None:
        """Keeps the pool full: starts replacements, backs off on repeated start failures."""
        backoff = 0.5
        while True:
            missing = self.size - len(self.workers) - self.starting
            if missing > 0:
                results = await asyncio.gather(
                    *(self._start_one(i) for i in range(missing)), return_exceptions=True
                )
                failures = [r for r in results if isinstance(r, BaseException)]
                for r in failures:
                    if isinstance(r, asyncio.CancelledError):
                        raise r
                if failures:
                    self.last_error = str(failures[0])
                    log.error(
                        "fncall pool %s: %d of %d containers failed to start: %s (retry in %.1f s)",
                        self.env.name,
                        len(failures),
                        missing,
                        failures[0],
                        backoff,
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
                    continue
                backoff = 0.5
                continue
            self.changed.clear()
            await self.changed.wait()

    async def _start_one(self, i: int) -> None:
        self.starting += 1
        try:
            async with self.start_slots:
                gpu = self._next_gpu()
                worker = await self.launcher.start(self.env, gpu)
        finally:
            self.starting -= 1
        if self._closed:
            await self.launcher.destroy(worker)
            return
        self.workers.add(worker)
        assert worker.pidfd is not None
        asyncio.get_running_loop().add_reader(worker.pidfd, self._died, worker)
        self.ready.set()
        self.last_error = ""
        self.release(worker)

    def _next_gpu(self) -> gpus.Gpu | None:
        if self.gpu_plan is None:
            return None
        used: dict[str, int] = {}
        for w in self.workers:
            if w.gpu is not None:
                used[w.gpu.uuid] = used.get(w.gpu.uuid, 0) + 1
        want: dict[str, int] = {}
        for g in self.gpu_plan:
            want[g.uuid] = want.get(g.uuid, 0) + 1
        for g in self.gpu_plan:
            if used.get(g.uuid, 0) < want[g.uuid]:
                used[g.uuid] = used.get(g.uuid, 0) + 1
                return g
        return self.gpu_plan[0]

    def _died(self, worker: Worker) -> None:
        if worker.pidfd is not None:
            asyncio.get_running_loop().remove_reader(worker.pidfd)
        if not worker.dead:
            worker.dead = True
            in_use = worker in self.workers and worker not in self.idle
            if not in_use:  # a busy worker's job sees the broken channel and retires it
                self.retire(worker, "container died")

    # ---------------------------------------------------------------- state

    def stats(self) -> dict[str, int]:
        return {
            "size": self.size,
            "workers": len(self.workers),
            "idle": len(self.idle),
            "starting": self.starting,
            "waiting": len(self.waiters),
            "jobs": self.jobs_done,
            "recycled": self.recycled,
        }

    async def close(self) -> None:
        self._closed = True
        for fut in self.waiters:
            fut.cancel()
        for w in list(self.workers):
            self.retire(w, "edge shutting down")
        if self._destroying:
            await asyncio.gather(*self._destroying, return_exceptions=True)


def _keyed_counter(fd: int | None, key: bytes) -> int:
    """The value of ``key`` in a cgroup file of "key value" lines (memory.oom_control,
    pids.events) open at ``fd``; 0 if it is not there or cannot be read."""
    if fd is None:
        return 0
    try:
        text = os.pread(fd, 4096, 0)
    except OSError:
        return 0
    for line in text.splitlines():
        k, _, v = line.partition(b" ")
        if k == key:
            return int(v)
    return 0

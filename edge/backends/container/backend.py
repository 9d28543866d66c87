"""The container backend: runc sandboxes with aether as pid 1.

Per sandbox the edge:

1. resolves the image to verified read-only layers of the layer store (``edge.images``,
   ``edge.layers``): base, workspace, toolkits, diffs, each one shared EROFS mount per node;
2. binds a Unix socket at ``<state>/sockets/<id>.sock`` on the host, listens,
   and hands the *listening* fd to the container as fd 3. aether accepts on
   it. The path exists only on the host (not in the sandbox's filesystem) and
   the fd lives only in aether, which is non-dumpable, so agent processes can
   neither see nor reach the channel; the edge can reconnect at any time,
   including after its own restart;
3. starts runc (``edge.runtime.RuncRuntime``) with the toolkit (a relocatable
   Python + aether + chronus, one EROFS image mounted once per node and
   bind-mounted read-only at ``/.dsec``) and ``aether`` as init;
4. connects and waits for aether's Hello: the sandbox is RUNNING.

``pack_diff`` turns the sandbox's writable layer into a new layer on top of its stack and
registers the result as a new environment (``edge.layers.service.Environments.pack_diff``).

``fork`` (a files fork, ``ForkKind.FILES``) copies the source's writable layer once, whole, with
the source frozen for the copy only, then starts every child on the source's read-only layers
with a copy of that capture as its own writable layer, and recreates the source's shell
sessions in it (``edge.backends.container.fork``). Processes are not copied.

When the channel closes the backend looks at the container: gone or dead
means the sandbox failed (OOM when the memory cgroup says so, otherwise
CHANNEL_CLOSED); still running means the edge reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from common.steps import step
from edge.aether_client import AetherConnection
from edge.backends import packing, pausing, qos
from edge.backends.channels import ChannelKeeper
from edge.backends.container import fork as session_copy
from edge.backends.container.containment import Containment
from edge.backends.container.trusted import SiblingLauncher, TrustedSiblings
from edge.backends.contract import (
    BackgroundLoop,
    Capability,
    ExitCallback,
    ForkKind,
    ForkOutcome,
    MemoryUsage,
    PauseOutcome,
    ResumeFailed,
)
from edge.backends.registry import Built
from edge.backends.warm import (
    WARM_ENV,
    WarmPool,
    WarmSandbox,
    new_warm_id,
    on_warm_close,
)
from edge.backends.warm import template as warm_template
from edge.config import EdgeConfig
from edge.disk_guard import Allocations, sum_allocations
from edge.images import ResolvedImage
from edge.layers import LayerRef, PackResult
from edge.layers.diff import mount_points
from edge.model import SandboxRecord, SandboxSpec
from edge.node import NodeServices
from edge.runtime import cgroups, mounts
from edge.runtime.errors import SandboxRuntimeError
from edge.runtime.runc import RuncRuntime, become_subreaper
from edge.runtime.spec import BindMount, LaunchSpec, SandboxProcess, SandboxStatus
from edge.toolkit import SUDO_SHIM, toolkit_argv
from edge.usage import UsageSamples
from libdsec.errors import DSecError, FailedPrecondition, Unavailable

#: Where aether finds the precompiled seccomp program (insandbox/security.py reads the same name).
SECCOMP_FD_ENV = "DSEC_AETHER_SECCOMP_FD"
#: LD_<X> of a sandbox's environment travels to chronus as this prefix + <X> (chronus/config.py).
CHRONUS_LD_PREFIX = "DSEC_CHRONUS_ENV_LD_"

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: A fork's children started at once: each start copies the capture into its own writable layer
#: (disk-bound) and runs runc (CPU-bound); more at once only makes each slower.
FORK_START_CONCURRENCY = 4
#: How long a create's start uses the layers its admission resolved (validate -> start).
ADMITTED_FOR_S = 2.0


class ContainerBackend:
    name = "container"
    serves: tuple[str, ...] = ("CONTAINER",)
    persistent = True
    starts_inline = False
    capabilities: frozenset[Capability] = frozenset(
        {
            Capability.EXEC,
            Capability.PAUSE,
            Capability.PACK_DIFF,
            Capability.TRUSTED_EXEC,
            Capability.NETWORK_POLICY,
            Capability.MODIFIED_FILES,
            Capability.WARM_CLAIM,
            Capability.DISK_USAGE,
            Capability.FORK,
            Capability.METRICS,
            Capability.FILES_ONLY_PAUSE,
        }
    )
    #: A child gets the files and the sessions' cwd and environment, not the processes.
    fork_kind = ForkKind.FILES
    #: dsec-sudo in the sandbox (RunsSudo); the runtime also shows it at /usr/bin/sudo.
    sudo_program = "/.dsec/" + SUDO_SHIM

    def __init__(
        self,
        node: NodeServices,
        state_dir: Path,
        *,
        ready_timeout_s: float = 30.0,
        default_disk_mb: int = 10240,
        max_disk_mb: int = 204800,
        log_max_bytes: int = 1 << 20,
        watch_interval_s: float = 1.0,
        pids_exhausted_after_s: float = 3.0,
        usage_sample_s: float = 5.0,
        usage_keep_s: float = 600.0,
        cgroup_parent: str = "dsec",
        warm_pool: dict[str, int] | None = None,
        landlock: bool = True,
        disk_pool: int = 0,
    ) -> None:
        self.state_dir = state_dir
        #: The node's layer store, image resolver, network, toolkit and swap area (edge/node.py).
        self.node = node
        self.environments = node.environments
        self.images = node.images
        #: What admission resolved (validate), for the start that follows at once: (image,
        #: toolkits) -> (when, the layers). A start finds its image here instead of resolving it
        #: a second time in another thread (issue 43: the create path).
        self._admitted: dict[tuple[str, tuple[str, ...]], tuple[float, ResolvedImage]] = {}
        self.toolkit_dir = node.toolkit.mount
        if (self.toolkit_dir / SUDO_SHIM).is_file():  # a toolkit built with a C compiler
            self.capabilities = self.capabilities | {Capability.SUDO}
        #: Where a pause pushes a sandbox's memory (edge/backends/pausing.py).
        self.reclaim = node.pause_reclaim
        self.sockets = state_dir / "sockets"
        self.logs = state_dir / "logs"
        for d in (self.sockets, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        mounts.mount_volatile(self.sockets, "16m")  # one socket file per sandbox, kept on restart
        self._sockets_fd = os.open(self.sockets, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        # runc run -d leaves the sandbox's init orphaned; as subreaper the edge
        # (not the host's pid 1, which reaps late here) collects its exit status.
        become_subreaper()
        self.runtime = RuncRuntime(
            state_dir / "runtime", cgroup_parent=cgroup_parent, volatile_state=True
        )
        # Containers left running keep the node's toolkit mount, swap area and network.
        node.hold_while(lambda: bool(self.runtime.list_ids()))
        self.ready_timeout_s = ready_timeout_s
        #: chronus must put every command in a Landlock domain (refusing to run without one)
        #: unless the operator turned the control off (edge/controls.py).
        self.landlock = landlock
        # Channels to every sandbox's aether; a closed one is diagnosed by still_running /
        # why_ended below.
        self.channels = ChannelKeeper(self._socket_address, self, ready_timeout_s)
        self._renaming: dict[str, asyncio.Future[None]] = {}  # claimed, cgroup2 still moving
        self._warm_starting: set[asyncio.Future[WarmSandbox]] = set()
        self._warm_unclaimed: dict[str, WarmSandbox] = {}  # every warm sandbox not yet claimed
        # Network policy, private runtime dir, disk quota, watchdog (edge/backends/container/
        # containment.py): given what it acts on, it never reaches back into the backend.
        self.containment = Containment(
            self.runtime,
            node.network,
            self.channels,
            logs=self.logs,
            settled=self.settled,
            default_disk_mb=default_disk_mb,
            max_disk_mb=max_disk_mb,
            log_max_bytes=log_max_bytes,
            watch_interval_s=watch_interval_s,
            pids_exhausted_after_s=pids_exhausted_after_s,
            usage_sample_s=usage_sample_s,
            usage_keep_s=usage_keep_s,
        )
        # Evaluation steps out of the agent's reach (edge/backends/container/trusted.py).
        self.trusted = TrustedSiblings(
            SiblingLauncher(
                resolve=lambda rec: self.images.resolve(rec.spec.image, rec.spec.toolkits),
                prepare=self.containment.prepare,
                launch=self.launch,
                address_of=self._socket_address,
                socket_path=self._socket_path,
            ),
            self.runtime,
            node.network,
            state_dir / "trusted",
            ready_timeout_s,
        )
        # Disk-limit filesystems of the default size, made ahead of creates (issue 43).
        self.runtime.start_disk_pool(default_disk_mb, disk_pool)
        # Started sandboxes waiting for their owner (edge/backends/warm.py); None when none are kept.
        self.warm: WarmPool | None = None
        if warm_pool and any(n > 0 for n in warm_pool.values()):
            self.warm = WarmPool(warm_pool, self._start_warm, self._discard_warm)

    @classmethod
    def from_config(cls, cfg: EdgeConfig, node: NodeServices) -> Built:
        """The backend's registry factory (edge/backends/registry.py)."""
        backend = cls(
            node,
            cfg.state_dir / "container",
            landlock="landlock" not in cfg.disabled_controls,
            default_disk_mb=cfg.default_disk_mb,
            max_disk_mb=cfg.max_disk_mb,
            log_max_bytes=cfg.sandbox_log_max_kb * 1024,
            watch_interval_s=cfg.watch_interval_s,
            pids_exhausted_after_s=cfg.pids_exhausted_after_s,
            usage_sample_s=cfg.usage_sample_s,
            usage_keep_s=cfg.usage_keep_s,
            cgroup_parent=cfg.cgroup_parent,
            warm_pool={k: int(v) for k, v in cfg.warm_pool.items()},
            disk_pool=cfg.disk_pool,
        )
        return Built(backend)

    def set_exit_callback(self, callback: ExitCallback) -> None:
        self.channels.on_exit = callback

    def _socket_path(self, sandbox_id: str) -> Path:
        return self.sockets / f"{sandbox_id}.sock"

    def _socket_address(self, sandbox_id: str) -> str:
        """A short name for the socket: AF_UNIX paths are limited to 107 bytes and
        state directories can be deep, so bind/connect go through our open
        directory fd (/proc/self/fd/N/...), which resolves to the same inode."""
        return f"/proc/self/fd/{self._sockets_fd}/{sandbox_id}.sock"

    # ------------------------------------------------------------- create

    def validate(self, spec: SandboxSpec) -> None:
        """Fails fast, before admission, on an unknown image or a missing or corrupt layer, and
        verifies layers new to this node (blocking: use a thread)."""
        image = self.images.resolve(spec.image, spec.toolkits)
        self.containment.validate(spec)  # network policy (names resolve), disk quota
        now = time.monotonic()
        if len(self._admitted) > 64:
            for key, (at, _) in list(self._admitted.items()):
                if now - at > ADMITTED_FOR_S:
                    self._admitted.pop(key, None)
        self._admitted[(spec.image, tuple(spec.toolkits))] = (now, image)

    async def _resolve(self, spec: SandboxSpec) -> ResolvedImage:
        """The layers of a create's image: as admission resolved them a moment ago, else
        resolved now (in a thread: it reads the layer store)."""
        admitted = self._admitted.get((spec.image, tuple(spec.toolkits)))
        if admitted is not None and time.monotonic() - admitted[0] <= ADMITTED_FOR_S:
            return admitted[1]
        return await asyncio.to_thread(self.images.resolve, spec.image, spec.toolkits)

    def sandbox_env(self, rec: SandboxRecord, image: ResolvedImage) -> dict[str, str]:
        """pid 1's environment (aether passes it on to chronus and every command)."""
        env = {
            "PATH": DEFAULT_PATH,
            "HOME": "/root",
            "LANG": "C.UTF-8",
            **image.env,
            **rec.spec.env,
            "DSEC_AETHER_LISTEN_FD": "3",
        }
        env["DSEC_CHRONUS_WORKDIR"] = rec.spec.workdir or image.workdir or "/"
        env["DSEC_CHRONUS_LANDLOCK"] = "on" if self.landlock else "off"
        if rec.spec.sudo_users:
            env["DSEC_CHRONUS_SUDO_USERS"] = ",".join(rec.spec.sudo_users)
        # pid 1 is the toolkit's ld.so, which obeys LD_PRELOAD, LD_AUDIT, ...: aether must load
        # no library of the image's or the caller's. chronus gives them back to every command.
        for name in [k for k in env if k.startswith("LD_")]:
            env[CHRONUS_LD_PREFIX + name[3:]] = env.pop(name)
        return env

    async def launch(
        self,
        container_id: str,
        rec: SandboxRecord,
        image: ResolvedImage,
        prep: Any,
        *,
        backlog: int,
        binds: tuple[BindMount, ...] = (),
        warm: bool = False,
        initial_upper: Path | None = None,
    ) -> SandboxProcess:
        """Binds the channel socket, starts runc with aether as pid 1 holding its listening
        fd, and releases the edge's copies (of the socket and of ``prep``'s fds). Used for a
        sandbox and for its trusted sibling; on failure the socket file is removed."""
        path = self._socket_path(container_id)
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self._socket_address(container_id))
            os.chmod(path, 0o600)
            listener.listen(backlog)
            env = self.sandbox_env(rec, image)
            env.update(prep.env)
            if warm:
                env[WARM_ENV] = "1"  # chronus waits for the claim
            spec = LaunchSpec(
                sandbox_id=container_id,
                lowers=list(image.lowers),
                init_argv=toolkit_argv("aether"),
                env=env,
                cwd="/",
                cpu_millis=rec.spec.cpu_millis,
                memory_mb=rec.spec.memory_mb,
                pids_max=rec.spec.pids_max,
                toolkit_dir=self.toolkit_dir,
                pass_fd=listener.fileno(),
                log_path=self.logs / f"{container_id}.log",
                extra_fds=prep.extra_fds,
                dns_servers=prep.dns_servers,
                disk_mb=prep.disk_mb,
                binds=binds,
                apparmor_profile=prep.apparmor_profile,
                # aether installs the node's precompiled filter itself (no per-start compile)
                seccomp_fd_env=SECCOMP_FD_ENV,
                initial_upper=initial_upper,
            )
            return await asyncio.to_thread(self.runtime.create, spec)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            listener.close()  # aether holds its own copy now
            prep.close()

    async def start(self, rec: SandboxRecord) -> None:
        t0 = time.perf_counter()
        with step("edge.container.resolve_image"):
            image = await self._resolve(rec.spec)
        w = self.warm.take(rec) if self.warm is not None else None
        if w is not None:
            if w.image.lowers == image.lowers and await self._claim(rec, w, t0):
                return
            await self._discard_warm(w)  # started on layers the image no longer has, or failed
        with self.warm.cold_start() if self.warm is not None else contextlib.nullcontext():
            await self._start_cold(rec, image, t0)

    async def _start_cold(
        self,
        rec: SandboxRecord,
        image: ResolvedImage,
        t0: float,
        initial_upper: Path | None = None,
    ) -> None:
        with step("edge.container.prepare"):
            prep = await self.containment.prepare(rec)
        t1 = time.perf_counter()
        with step("edge.container.launch"):
            proc = await self.launch(
                rec.sandbox_id, rec, image, prep, backlog=16, initial_upper=initial_upper
            )
        t2 = time.perf_counter()
        rec.runtime = self._runtime_record(proc, image, self._socket_path(rec.sandbox_id))
        try:
            with step("edge.container.qos"):
                # Before aether forks chronus (after its Hello): everything inherits the policy.
                _apply_qos(rec, proc.pid, proc.cgroup_path)
            with step("edge.container.started"):
                # Network and eBPF policy before aether is even connected: no agent code yet.
                await self.containment.started(rec, proc.pid, proc.cgroup_path, prep)
            with step("edge.aether.hello"):
                await self.channels.connect(rec.sandbox_id)
        except BaseException:
            await self.destroy(rec)
            raise
        t3 = time.perf_counter()
        log.info(
            "sandbox %s started in %.1f ms",
            rec.sandbox_id,
            (t3 - t0) * 1000,
            extra={
                "sandbox_id": rec.sandbox_id,
                "resolve_ms": round((t1 - t0) * 1000, 2),
                "runc_ms": round((t2 - t1) * 1000, 2),
                "aether_ready_ms": round((t3 - t2) * 1000, 2),
            },
        )

    # ------------------------------------------------------------- warm sandboxes

    async def _start_warm(self, image_name: str) -> WarmSandbox:
        """Start a sandbox nobody owns yet (see edge/backends/warm.py), up to aether's Hello.

        The start runs on even if the pool's loop is cancelled (edge shutdown): runc would
        finish in its thread anyway, and `close` waits for it and removes what it made."""
        start = asyncio.ensure_future(self._start_warm_now(image_name))
        self._warm_starting.add(start)
        start.add_done_callback(self._warm_starting.discard)
        return await asyncio.shield(start)

    async def _start_warm_now(self, image_name: str) -> WarmSandbox:
        cid = new_warm_id()
        tmpl = warm_template(cid, image_name)
        image = await asyncio.to_thread(self.images.resolve, image_name, [])
        prep = await self.containment.prepare(tmpl)
        proc = await self.launch(cid, tmpl, image, prep, backlog=16, warm=True)
        holder: list[WarmSandbox] = []
        closed = on_warm_close(
            self.channels, lambda: self.warm, self._discard_warm, holder, "sandbox"
        )
        conn = AetherConnection(self._socket_address(cid), cid, on_close=closed)
        try:
            await conn.connect(timeout_s=self.ready_timeout_s)
        except BaseException:
            await asyncio.to_thread(self.runtime.destroy, cid)
            self._socket_path(cid).unlink(missing_ok=True)
            raise
        w = WarmSandbox(cid, image_name, image, proc, conn, prep, time.monotonic())
        holder.append(w)
        self._warm_unclaimed[cid] = w  # until claimed or discarded, whoever holds it
        return w

    async def _discard_warm(self, w: WarmSandbox) -> None:
        if self.channels.get(w.conn.sandbox_id) is w.conn:
            return  # claimed since: its sandbox's teardown owns it
        if self._warm_unclaimed.pop(w.cid, None) is None:
            return  # discarded already
        with contextlib.suppress(Exception):
            await w.conn.close()
        cid = w.conn.sandbox_id  # its current runtime id (a failed claim may have renamed it)
        try:
            await asyncio.to_thread(self.runtime.destroy, cid)
        except Exception:
            log.exception("warm sandbox %s: destroy failed (an orphan for the next cleanup)", cid)
        self._socket_path(cid).unlink(missing_ok=True)
        (self.logs / f"{w.cid}.log").unlink(missing_ok=True)

    async def _claim(self, rec: SandboxRecord, w: WarmSandbox, t0: float) -> bool:
        """Make warm sandbox `w` the sandbox of `rec`; False (nothing claimed) on failure."""
        sid = rec.sandbox_id
        spec = rec.spec
        t0r = time.perf_counter()
        try:
            with step("edge.warm.rename"):
                proc = await asyncio.to_thread(
                    self.runtime.rename,
                    w.cid,
                    sid,
                    hostname=sid[:63],
                    cpu_millis=spec.cpu_millis,
                    memory_mb=spec.memory_mb,
                    pids_max=spec.pids_max,
                )
        except Exception as exc:
            log.warning("claim of warm sandbox %s for %s failed: %s", w.cid, sid, exc)
            if not self.runtime.sandbox_dir(w.cid).exists():
                w.conn.sandbox_id = sid  # renamed (partly): tear down under the new name
            return False
        t1 = time.perf_counter()
        with contextlib.suppress(FileNotFoundError):
            os.rename(self._socket_path(w.cid), self._socket_path(sid))
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.logs / f"{w.cid}.log", self.logs / f"{sid}.log")
        conn = w.conn
        conn.sandbox_id = sid
        conn.socket_path = self._socket_address(sid)  # for reconnects
        self.channels.keep(sid, conn)
        self._warm_unclaimed.pop(w.cid, None)  # the sandbox's record owns it from here
        rec.runtime = self._runtime_record(proc, w.image, self._socket_path(sid))
        rec.runtime["warm"] = True  # a warm sandbox served this create (edge/metrics.py)
        try:
            _apply_qos(
                rec, proc.pid, proc.cgroup_path
            )  # before the claim: chronus is forked after it
            env = self.sandbox_env(rec, w.image)
            env.update(w.prep.env)
            with step("edge.warm.claim"):
                await conn.claim(env)
            with step("edge.container.started"):
                await self.containment.started(rec, proc.pid, proc.cgroup_path, w.prep)
        except BaseException:
            await self.destroy(rec)
            raise
        assert self.warm is not None
        self.warm.claimed[spec.image] += 1
        # Its cgroup2 directory follows off the critical path (an RCU grace period per move).
        move = asyncio.ensure_future(asyncio.to_thread(self.runtime.finish_rename, sid))
        self._renaming[sid] = move
        move.add_done_callback(lambda _: self._renaming.pop(sid, None))
        log.info(
            "sandbox %s started in %.1f ms (warm, waited %.1f s)",
            sid,
            (time.perf_counter() - t0) * 1000,
            time.monotonic() - w.started_at,
            extra={
                "sandbox_id": sid,
                "warm": True,
                "resolve_ms": round((t0r - t0) * 1000, 2),
                "rename_ms": round((t1 - t0r) * 1000, 2),
            },
        )
        return True

    async def settled(self, sandbox_id: str) -> None:
        """Wait until a just-claimed sandbox's cgroup2 directory has its name (see _claim)."""
        move = self._renaming.get(sandbox_id)
        if move is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(move)

    async def warm_loop(self) -> None:
        if self.warm is not None:
            await self.warm.run()

    @staticmethod
    def _runtime_record(
        proc: SandboxProcess, image: ResolvedImage, socket_path: Path
    ) -> dict[str, Any]:
        return {
            "pid": proc.pid,
            "socket": str(socket_path),
            **packing.image_record(image),  # what pack_diff stacks the sandbox's diff on
        }

    # ------------------------------------------------------------ channel hooks

    async def still_running(self, sandbox_id: str) -> bool:
        # The edge is the init's parent (subreaper): a dead init is a zombie that
        # runc would still report as running until it is collected.
        exit_code = await asyncio.to_thread(self.runtime.reap, sandbox_id)
        state = await asyncio.to_thread(self.runtime.state, sandbox_id)
        return exit_code is None and state.status in (SandboxStatus.RUNNING, SandboxStatus.PAUSED)

    async def why_ended(self, sandbox_id: str, channel_reason: str) -> tuple[str, str]:
        if await asyncio.to_thread(self.runtime.was_oom_killed, sandbox_id):
            return "OOM", "memory limit reached; the sandbox's init was killed"
        return "CHANNEL_CLOSED", f"aether channel closed: {channel_reason}"

    # ------------------------------------------------------------ contract extras

    def background_loops(self) -> list[BackgroundLoop]:
        return [
            self.warm_loop,  # started sandboxes waiting for their owner
            self.watch_loop,  # containment: counters, limits, kernel faults, log caps
        ]

    def warm_status(self) -> dict[str, tuple[int, int, int, int]]:
        return self.warm.status() if self.warm is not None else {}

    def disk_paths(self) -> list[Path]:
        return [self.runtime.rw_dir, self.logs]  # (the layer cache is the node's)

    def disk_allocations(self) -> Allocations:
        """Bytes each sandbox holds on disk: its writable layer's image and its log."""
        rt = self.runtime
        return sum_allocations(
            list(self.containment.watched),
            lambda sid: (rt.writable_dir(sid) / "disk.img", self.logs / f"{sid}.log"),
        )

    # ------------------------------------------------------------ control

    def channel(self, rec: SandboxRecord) -> Any:
        return self.channels.channel(rec.sandbox_id)

    async def stop(self, rec: SandboxRecord, grace_s: float) -> None:
        await self.channels.drop(rec.sandbox_id, shutdown_grace_s=grace_s)
        await asyncio.to_thread(self.runtime.stop, rec.sandbox_id, grace_s)

    async def destroy(self, rec: SandboxRecord) -> None:
        await self._remove(rec)
        # The files a cold pause kept (the sandbox ended, or its cold boot failed).
        await asyncio.to_thread(shutil.rmtree, self.runtime.parked_upper(rec.sandbox_id), True)

    async def _remove(self, rec: SandboxRecord) -> None:
        """Everything of the running sandbox (not what a cold pause parked)."""
        await self.settled(rec.sandbox_id)
        await self.channels.drop(rec.sandbox_id)
        self.containment.unwatch(rec.sandbox_id)
        await self.trusted.destroy(rec.sandbox_id)
        await self.containment.destroyed(rec)  # network, counters
        await asyncio.to_thread(self.runtime.destroy, rec.sandbox_id)
        self._socket_path(rec.sandbox_id).unlink(missing_ok=True)

    def _memory_dir(self, sandbox_id: str) -> Path | None:
        return cgroups.controller_dir("memory", self.runtime.cgroup_path(sandbox_id))

    async def pause(self, rec: SandboxRecord) -> PauseOutcome:
        """Freeze (cgroup freezer), then push the frozen sandbox's memory out to the edge's
        swap area (edge/runtime/pager.py). The channel's keepalive is held first: a frozen
        aether answers nothing, for as long as the pause lasts."""
        sid = rec.sandbox_id
        # What a fork of the paused sandbox recreates (a frozen chronus answers nothing).
        sessions = await session_copy.capture_quietly(lambda: self.channels.channel(sid), sid)
        rec.runtime[session_copy.RECORD_KEY] = (
            None if sessions is None else [s.to_dict() for s in sessions]
        )
        self.channels.hold(sid)
        try:
            await asyncio.to_thread(self.runtime.pause, sid)
        except BaseException:
            await self._release(sid)
            raise
        try:
            return await self.reclaim.page_out(self._memory_dir(sid))
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.runtime.resume, sid)
            await self._release(sid)
            raise

    async def _release(self, sid: str) -> None:
        """A freeze ends (a failed pause, a pack_diff): the channel's keepalive restarts; a
        sandbox that does not answer any more ended meanwhile, and is reported as such."""
        try:
            await self.channels.release(sid)
        except Unavailable as exc:
            await self.channels.report_exit(sid, *await self.why_ended(sid, exc.message))

    async def resume(self, rec: SandboxRecord) -> None:
        """Read back what the next command needs, thaw, read the rest in the background
        (edge/backends/pausing.py); then the channel's keepalive restarts, or a
        channel closed during the pause (an edge restart) is opened again. A sandbox that
        cannot be thawed or does not answer raises ResumeFailed."""
        sid = rec.sandbox_id
        try:
            await self.reclaim.resume(
                self._memory_dir(sid), lambda: asyncio.to_thread(self.runtime.resume, sid)
            )
        except (SandboxRuntimeError, OSError) as exc:
            raise ResumeFailed(f"the sandbox could not be thawed: {exc}") from exc
        try:
            await self.channels.release(sid)
        except Unavailable as exc:
            raise ResumeFailed(
                f"the sandbox did not answer after its resume: {exc.message}"
            ) from exc

    async def pause_files_only(self, rec: SandboxRecord) -> PauseOutcome:
        """A cold pause: pid 1 is stopped (so is everything else: its pid namespace ends),
        the writable layer is moved aside (edge/runtime/runc.py: park_upper) and the
        container, its cgroup, network and channel are removed; the memory is all given back.
        Its resume (`resume_files_only`) starts it again like a fork's child: cold, on its
        image, with that layer as its own."""
        sid = rec.sandbox_id
        t0 = time.perf_counter()
        before = await self.memory_usage(rec) or MemoryUsage(0, 0)
        await self.channels.drop(sid, shutdown_grace_s=1.0)
        await asyncio.to_thread(self.runtime.stop, sid, 1.0)
        await asyncio.to_thread(self.runtime.park_upper, sid)
        await self._remove(rec)
        return PauseOutcome(
            before=before, after=MemoryUsage(0, 0), seconds=time.perf_counter() - t0
        )

    async def resume_files_only(self, rec: SandboxRecord) -> None:
        """Boot it afresh: the image is resolved again by its name (an environment deleted
        meanwhile cannot come back: ResumeFailed), the parked layer becomes its upper."""
        sid = rec.sandbox_id
        parked = self.runtime.parked_upper(sid)
        if not parked.is_dir():
            raise ResumeFailed(f"the files of {sid} kept by its pause are gone")
        try:
            image = await asyncio.to_thread(self.images.resolve, rec.spec.image, rec.spec.toolkits)
        except DSecError as exc:
            raise ResumeFailed(f"its image cannot be resolved: {exc.message}") from exc
        try:
            await self._start_cold(rec, image, time.perf_counter(), initial_upper=parked)
        except (SandboxRuntimeError, OSError, Unavailable) as exc:
            raise ResumeFailed(f"the sandbox did not boot again: {exc}") from exc
        await asyncio.to_thread(shutil.rmtree, parked, True)

    async def memory_usage(self, rec: SandboxRecord) -> MemoryUsage | None:
        d = self._memory_dir(rec.sandbox_id)
        if d is None or not d.is_dir():
            return None
        return await asyncio.to_thread(pausing.usage, d)

    async def adopt(self, rec: SandboxRecord) -> bool:
        """After an edge restart: is the container alive? Then reconnect to its aether. A
        paused one stays frozen, its memory where the pause put it: its channel is opened at
        the resume (a frozen aether cannot say Hello)."""
        if rec.paused_files_only and rec.state == "PAUSED":
            # Nothing runs: its files wait, parked, for the resume that boots it.
            return self.runtime.parked_upper(rec.sandbox_id).is_dir()
        state = await asyncio.to_thread(self.runtime.state, rec.sandbox_id)
        if state.status == SandboxStatus.PAUSED and rec.state == "PAUSED":
            self.channels.hold(rec.sandbox_id)
        else:
            if state.status == SandboxStatus.PAUSED:
                # Frozen by a pause the previous edge never finished recording: thaw it; the
                # record says RUNNING, so a caller's next pause will page it out.
                await asyncio.to_thread(self.runtime.resume, rec.sandbox_id)
            elif state.status != SandboxStatus.RUNNING:
                return False
            try:
                await self.channels.connect(rec.sandbox_id)
            except Unavailable as exc:
                log.warning("cannot reconnect to %s: %s", rec.sandbox_id, exc)
                return False
        await self.containment.adopt(rec)
        return True

    # ---------------------------------------------------------- containment

    async def update_network_policy(self, rec: SandboxRecord, policy: dict[str, Any]) -> None:
        await self.containment.update_network(rec, policy)

    def usage_samples(self, rec: SandboxRecord, start: float, end: float) -> UsageSamples:
        return self.containment.usage_samples(rec, start, end)

    async def modified_files(self, rec: SandboxRecord) -> list[tuple[str, bool]]:
        return [(m.path, m.deleted) for m in await self.containment.modified_files(rec)]

    async def trusted_channel(self, rec: SandboxRecord) -> Any:
        """The channel of the sandbox's trusted sibling (read-only layers + its workspace),
        started on first use."""
        return await self.trusted.channel(rec)

    async def watch_loop(self) -> None:
        self.containment.start_counters()
        await self.containment.watch_loop()

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        removed: list[str] = await asyncio.to_thread(self.runtime.cleanup_orphans, keep)
        removed += await self.trusted.cleanup_orphans()
        removed += await self.containment.cleanup_orphans(keep)
        # The node's layer store: leftovers of a crash (temporary mounts, scratch trees, own
        # staging), recovered at start by its one user that mounts layers.
        removed += await asyncio.to_thread(self.environments.recover)
        for sock in self.sockets.glob("*.sock"):
            if sock.stem not in keep:
                sock.unlink(missing_ok=True)
        return removed

    # ------------------------------------------------------------ layers

    async def pack_diff(
        self,
        rec: SandboxRecord,
        name: str,
        *,
        exclude: Sequence[str] = (),
        default_excludes: bool = True,
        config: Mapping[str, str] | None = None,
    ) -> PackResult:
        """Checkpoint the sandbox's writable layer as environment `name`: the sandbox's layers
        plus the diff. A running sandbox is frozen for the copy of its upper directory only."""
        packing.check_packable(rec)
        layers = packing.recorded_layers(rec)
        sid = rec.sandbox_id
        sdir = self.runtime.sandbox_dir(sid)
        running = rec.state == "RUNNING"

        @contextlib.contextmanager
        def frozen() -> Iterator[None]:
            if running:
                self.runtime.pause(sid)
            try:
                yield
            finally:
                if running:
                    self.runtime.resume(sid)

        t0 = time.perf_counter()
        if running:  # frozen for the copy, which may take minutes: not a dead channel
            self.channels.hold(sid)
        try:
            result = await asyncio.to_thread(
                self.environments.pack_diff,
                upper=self.runtime.upper_dir(sid),
                layers=layers,
                config={**packing.environment_config(rec), **(config or {})},
                name=name,
                source=f"pack_diff:{sid}",
                exclude=list(exclude),
                default_excludes=default_excludes,
                mountpoints=mount_points(sdir / "config.json"),
                freeze=frozen(),
            )
        finally:
            if running:
                await self._release(sid)
        packing.log_packed(rec, result, t0)
        return result

    # ------------------------------------------------------------ fork

    async def fork(self, source: SandboxRecord, children: Sequence[SandboxRecord]) -> ForkOutcome:
        """Start every child as a copy of `source`'s files and sessions at one instant.

        The source's writable layer is copied once, whole (/tmp and caches too: unlike
        pack_diff this is the sandbox's state, not an environment to share), into a directory
        on the writable layers' filesystem, with a running source frozen for that copy only;
        its outcome's `stall_s` is how long. Each child then starts cold (never from the warm
        pool: a warm sandbox's writable layer is mounted already) on the source's own read-only
        layers (its image's name may point at others by now) with its own copy of the capture
        as its writable layer: a plain upper like any other, so the source's deletions
        (whiteouts) and modified files are the child's from the start, its own changes stay
        its own, and the files count toward its disk limit. At most FORK_START_CONCURRENCY
        children start at once."""
        sid = source.sandbox_id
        if source.state not in ("RUNNING", "PAUSED"):
            raise FailedPrecondition(
                f"sandbox {sid} is {source.state}: a fork needs it RUNNING or PAUSED",
                metadata={"state": source.state},
            )
        running = source.state == "RUNNING"
        image = await asyncio.to_thread(self._image_of, source)
        if running:
            sessions = await session_copy.capture(self.channels.channel(sid), sid)
        else:  # frozen: what its pause read just before the freeze
            sessions = [
                session_copy.SessionState.from_dict(d)
                for d in source.runtime.get(session_copy.RECORD_KEY) or []
            ]
        if running:  # frozen for the copy: not a dead channel
            self.channels.hold(sid)
        try:
            capture, stats, stall_s = await asyncio.to_thread(
                self.runtime.capture_upper, sid, freeze=running
            )
        finally:
            if running:
                await self._release(sid)
        log.info(
            "sandbox %s captured for %d children in %.1f ms (%d files, %d bytes, %d sessions)",
            sid,
            len(children),
            stall_s * 1000,
            stats.files,
            stats.bytes,
            len(sessions),
            extra={"sandbox_id": sid},
        )
        gate = asyncio.Semaphore(FORK_START_CONCURRENCY)

        async def start_child(rec: SandboxRecord) -> Exception | None:
            async with gate:
                try:
                    await self._start_cold(rec, image, time.perf_counter(), initial_upper=capture)
                    await session_copy.restore(self.channel(rec), rec.sandbox_id, sessions)
                except Exception as exc:
                    log.warning("fork child %s of %s failed: %s", rec.sandbox_id, sid, exc)
                    return exc
                return None

        try:
            errors = list(await asyncio.gather(*(start_child(c) for c in children)))
        finally:
            await asyncio.to_thread(shutil.rmtree, capture, True)
        return ForkOutcome(errors=errors, stall_s=stall_s)

    def _image_of(self, rec: SandboxRecord) -> ResolvedImage:
        """The image a sandbox runs on, as its start resolved it (blocking)."""
        rt = rec.runtime
        return ResolvedImage(
            name=str(rt.get("image", "")),
            lowers=list(self.runtime.lowers_of(rec.sandbox_id)),
            env=dict(rt.get("image_env") or {}),
            workdir=str(rt.get("image_workdir") or ""),
            layers=[LayerRef.from_dict(d) for d in rt.get("layers") or []],
        )

    async def close(self) -> None:
        if self.warm is not None:
            await self.warm.close()  # ours alone: nobody would re-adopt them
            # Starts still under way (the pool's loop is cancelled by now), and any warm
            # sandbox that was between its start and the pool when that happened.
            await asyncio.gather(*self._warm_starting, return_exceptions=True)
            for w in list(self._warm_unclaimed.values()):
                await self._discard_warm(w)
        await self.trusted.close()
        await self.containment.close()
        # The edge is going away, not necessarily the sandboxes: drop connections;
        # containers (if any are left) keep running and are re-adopted later.
        await self.channels.close_all()
        await asyncio.to_thread(self.runtime.stop_disk_pool)
        if self.runtime.release():
            # Nothing runs: leave no mount behind (the node's toolkit mount and swap area go
            # with it: edge/node.py).
            mounts.umount_quiet(self.sockets)


def _apply_qos(rec: SandboxRecord, pid: int, cgroup_path: str) -> None:
    """A best-effort sandbox runs under SCHED_IDLE: set on pid 1 while it is the sandbox's only
    process, so chronus and every command inherit it, and on its cpu cgroup (`cpu.idle`):
    the sandbox is a cgroup of its own, and a group competes with its siblings by its weight
    whatever its tasks' policy, so SCHED_IDLE tasks alone still took up to half of a core from
    a latency-sensitive sandbox (bench/bench_qos.py). A command cannot switch back: leaving
    SCHED_IDLE takes CAP_SYS_NICE (not in a sandbox's set) or an RLIMIT_NICE above 0 (sandboxes
    inherit 0); tested. Latency-sensitive sandboxes keep SCHED_OTHER and, where the kernel has
    core scheduling, get a cookie of their own the same way (edge/backends/qos.py; that path
    cannot run on this machine kind's kernel and is untested here)."""
    if rec.spec.qos == "BEST_EFFORT":
        qos.set_idle(pid)
        qos.set_cgroup_idle(cgroups.controller_dir("cpu", cgroup_path), True)
    elif qos.core_scheduling().available:
        qos.new_core_cookie(pid)

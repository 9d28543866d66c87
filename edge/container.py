"""The container backend: runc sandboxes with aether as pid 1.

Per sandbox the edge:

1. resolves the image to read-only layers (``edge.images``);
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

When the channel closes the backend looks at the container: gone or dead
means the sandbox failed (OOM when the memory cgroup says so, otherwise
CHANNEL_CLOSED); still running means the edge reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from edge.aether_client import AetherConnection
from edge.backends import ExitCallback
from edge.config import EdgeConfig
from edge.images import ImageResolver
from edge.model import SandboxRecord, SandboxSpec
from edge.runtime import mounts
from edge.runtime.runc import RuncRuntime, become_subreaper
from edge.runtime.spec import LaunchSpec, SandboxStatus
from edge.toolkit import build_toolkit, toolkit_argv, toolkit_image
from libdsec.errors import Unavailable

log = logging.getLogger(__name__)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ContainerBackend:
    name = "container"
    serves: tuple[str, ...] = ("CONTAINER",)
    persistent = True

    def __init__(
        self,
        state_dir: Path,
        image_dir: Path,
        *,
        default_image: str = "bookworm",
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.state_dir = state_dir
        self.sockets = state_dir / "sockets"
        self.logs = state_dir / "logs"
        for d in (self.sockets, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self._sockets_fd = os.open(self.sockets, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        # runc run -d leaves the sandbox's init orphaned; as subreaper the edge
        # (not the host's pid 1, which reaps late here) collects its exit status.
        become_subreaper()
        self.runtime = RuncRuntime(state_dir / "runtime")
        self.images = ImageResolver(image_dir, default_image)
        self.toolkit_dir = self._mount_toolkit()
        self.ready_timeout_s = ready_timeout_s
        self.connections: dict[str, AetherConnection] = {}
        self._on_exit: ExitCallback | None = None

    @classmethod
    def from_config(cls, cfg: EdgeConfig) -> ContainerBackend:
        return cls(cfg.state_dir / "container", cfg.image_dir)

    def _mount_toolkit(self) -> Path:
        """Builds the toolkit if its inputs changed, and mounts its EROFS image once per node.

        One mount shared by every sandbox means one copy of the interpreter's
        pages in memory (the per-sandbox cost is only private memory).
        """
        built = build_toolkit(self.state_dir.parent / "toolkit")
        target = self.state_dir / "toolkit-mnt" / built.name
        target.mkdir(parents=True, exist_ok=True)
        if not mounts.is_mountpoint(target):
            mounts.mount(toolkit_image(built), target, "erofs", mounts.MS_RDONLY)
        return target

    def set_exit_callback(self, callback: ExitCallback) -> None:
        self._on_exit = callback

    def _socket_path(self, sandbox_id: str) -> Path:
        return self.sockets / f"{sandbox_id}.sock"

    def _socket_address(self, sandbox_id: str) -> str:
        """A short name for the socket: AF_UNIX paths are limited to 107 bytes and
        state directories can be deep, so bind/connect go through our open
        directory fd (/proc/self/fd/N/...), which resolves to the same inode."""
        return f"/proc/self/fd/{self._sockets_fd}/{sandbox_id}.sock"

    # ------------------------------------------------------------- create

    def validate(self, spec: SandboxSpec) -> None:
        """Fails fast, before admission, on an unknown image (blocking: use a thread)."""
        self.images.check(spec.image)

    async def start(self, rec: SandboxRecord) -> None:
        t0 = time.perf_counter()
        image = await asyncio.to_thread(self.images.resolve, rec.spec.image)
        path = self._socket_path(rec.sandbox_id)
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self._socket_address(rec.sandbox_id))
            os.chmod(path, 0o600)
            listener.listen(16)
            env = {
                "PATH": DEFAULT_PATH,
                "HOME": "/root",
                "LANG": "C.UTF-8",
                **image.env,
                **rec.spec.env,
                "DSEC_AETHER_LISTEN_FD": "3",
            }
            workdir = rec.spec.workdir or image.workdir or "/"
            env["DSEC_CHRONUS_WORKDIR"] = workdir
            spec = LaunchSpec(
                sandbox_id=rec.sandbox_id,
                lowers=list(image.lowers),
                init_argv=toolkit_argv("aether"),
                env=env,
                cwd="/",
                cpu_millis=rec.spec.cpu_millis,
                memory_mb=rec.spec.memory_mb,
                pids_max=rec.spec.pids_max,
                toolkit_dir=self.toolkit_dir,
                pass_fd=listener.fileno(),
                log_path=self.logs / f"{rec.sandbox_id}.log",
            )
            t1 = time.perf_counter()
            proc = await asyncio.to_thread(self.runtime.create, spec)
            t2 = time.perf_counter()
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            listener.close()  # aether holds its own copy now
        rec.runtime = {"pid": proc.pid, "socket": str(path), "image": image.name}
        try:
            await self._connect(rec.sandbox_id)
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

    async def _connect(self, sid: str) -> AetherConnection:

        async def closed(reason: str) -> None:
            await self._channel_closed(sid, reason)

        conn = AetherConnection(self._socket_address(sid), sid, on_close=closed)
        await conn.connect(timeout_s=self.ready_timeout_s)
        self.connections[sid] = conn
        return conn

    async def _channel_closed(self, sandbox_id: str, reason: str) -> None:
        if self.connections.get(sandbox_id) is None:
            return  # we closed it ourselves (stop/destroy)
        self.connections.pop(sandbox_id, None)
        state = await asyncio.to_thread(self.runtime.state, sandbox_id)
        if state.status in (SandboxStatus.RUNNING, SandboxStatus.PAUSED):
            log.warning(
                "channel to %s lost (%s) but the container runs; reconnecting", sandbox_id, reason
            )
            try:
                await self._connect(sandbox_id)
                return
            except Unavailable as exc:
                reason = f"reconnect failed: {exc.message}"
        oom = await asyncio.to_thread(self.runtime.was_oom_killed, sandbox_id)
        if self._on_exit is not None:
            if oom:
                await self._on_exit(
                    sandbox_id, "OOM", "memory limit reached; the sandbox's init was killed"
                )
            else:
                await self._on_exit(
                    sandbox_id, "CHANNEL_CLOSED", f"aether channel closed: {reason}"
                )

    # ------------------------------------------------------------ control

    def channel(self, rec: SandboxRecord) -> Any:
        conn = self.connections.get(rec.sandbox_id)
        if conn is None or conn.closed.is_set():
            raise Unavailable(
                f"no channel to sandbox {rec.sandbox_id} (reconnecting)", reason="CHANNEL_CLOSED"
            )
        return conn

    async def stop(self, rec: SandboxRecord, grace_s: float) -> None:
        conn = self.connections.pop(rec.sandbox_id, None)
        if conn is not None:
            await conn.shutdown(grace_s)
            await conn.close()
        await asyncio.to_thread(self.runtime.stop, rec.sandbox_id, grace_s)

    async def destroy(self, rec: SandboxRecord) -> None:
        conn = self.connections.pop(rec.sandbox_id, None)
        if conn is not None:
            await conn.close()
        await asyncio.to_thread(self.runtime.destroy, rec.sandbox_id)
        self._socket_path(rec.sandbox_id).unlink(missing_ok=True)

    async def pause(self, rec: SandboxRecord) -> None:
        await asyncio.to_thread(self.runtime.pause, rec.sandbox_id)

    async def resume(self, rec: SandboxRecord) -> None:
        await asyncio.to_thread(self.runtime.resume, rec.sandbox_id)

    async def adopt(self, rec: SandboxRecord) -> bool:
        """After an edge restart: is the container alive? Then reconnect to its aether."""
        state = await asyncio.to_thread(self.runtime.state, rec.sandbox_id)
        if state.status == SandboxStatus.PAUSED:
            await asyncio.to_thread(self.runtime.resume, rec.sandbox_id)
        elif state.status != SandboxStatus.RUNNING:
            return False
        try:
            await self._connect(rec.sandbox_id)
        except Unavailable as exc:
            log.warning("cannot reconnect to %s: %s", rec.sandbox_id, exc)
            return False
        if state.status == SandboxStatus.PAUSED:
            await asyncio.to_thread(self.runtime.pause, rec.sandbox_id)
        return True

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        removed: list[str] = await asyncio.to_thread(self.runtime.cleanup_orphans, keep)
        for sock in self.sockets.glob("*.sock"):
            if sock.stem not in keep:
                sock.unlink(missing_ok=True)
        return removed

    async def close(self) -> None:
        # The edge is going away, not necessarily the sandboxes: drop connections;
        # containers (if any are left) keep running and are re-adopted later.
        for sid in list(self.connections):
            conn = self.connections.pop(sid)
            with contextlib.suppress(Exception):
                await conn.close()
        if not self.runtime.list_ids():
            # Nothing runs: leave no mount behind.
            mounts.umount_quiet(self.toolkit_dir)
            with contextlib.suppress(OSError):
                self.toolkit_dir.rmdir()

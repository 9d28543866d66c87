"""Trusted execution: the evaluation step of an RL task runs where the agent could not reach.

An agent optimising its reward may overwrite `/bin/bash`, plant a `sitecustomize.py`, or bend
any tool the grader would use. A trusted exec (`ExecRequest.trusted`) therefore runs in a
sibling container (`<id>-t`, started on first use, removed with the sandbox and at every edge
restart) made of the image's read-only layers, a scratch upper, and the sandbox's workspace
bind-mounted through an `openat2(RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH)` descriptor opened under
`/proc/<pid>/root`. That directory is a mount of the sandbox's namespace only, which the kernel
clones only from inside it (`edge.runtime.mounts.clone_in_namespace_of`).

`TrustedSiblings` is given what it needs (how to resolve an image, prepare and launch a
container, reach its socket, the runtime and the network) rather than the backend object.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.aether_client import AetherConnection
from edge.model import SandboxRecord
from edge.network.manager import NetworkManager
from edge.runtime import mounts
from edge.runtime.runc import RuncRuntime
from edge.runtime.spec import BindMount, SandboxProcess
from libdsec.errors import FailedPrecondition

log = logging.getLogger(__name__)

TRUSTED_SUFFIX = "-t"


@dataclass(frozen=True)
class SiblingLauncher:
    """What starting a sibling takes, from the container backend."""

    resolve: Callable[[SandboxRecord], Any]  # -> the sandbox's ResolvedImage (blocking)
    prepare: Callable[[SandboxRecord], Awaitable[Any]]  # -> containment's Prepared
    #: (container id, rec, image, prep, backlog, binds) -> the started pid 1
    launch: Callable[..., Awaitable[SandboxProcess]]
    address_of: Callable[[str], str]  # the socket address to connect to aether
    socket_path: Callable[[str], Path]


class TrustedSiblings:
    def __init__(
        self,
        launcher: SiblingLauncher,
        runtime: RuncRuntime,
        network: NetworkManager | None,
        staging_root: Path,
        ready_timeout_s: float,
    ) -> None:
        self.launcher = launcher
        self.runtime = runtime
        self.network = network
        self.staging_root = staging_root
        self.ready_timeout_s = ready_timeout_s
        self._conns: dict[str, AetherConnection] = {}
        self._workspace_ids: dict[str, tuple[int, int]] = {}  # sid -> (st_dev, st_ino)
        self._locks: dict[str, asyncio.Lock] = {}

    @staticmethod
    def workspace(rec: SandboxRecord) -> str:
        """The directory the trusted sibling shares with the sandbox (the agent's work)."""
        w = rec.spec.workdir or str(rec.runtime.get("image_workdir") or "") or "/work"
        return "/work" if w.rstrip("/") == "" else w.rstrip("/")

    async def channel(self, rec: SandboxRecord) -> AetherConnection:
        """The sibling's channel, started on first use (and again if the agent replaced the
        workspace directory since: the sibling shares the one it was started with)."""
        sid = rec.sandbox_id
        lock = self._locks.setdefault(sid, asyncio.Lock())
        async with lock:
            conn = self._conns.get(sid)
            if conn is not None and not conn.closed.is_set():
                current = await asyncio.to_thread(
                    _workspace_identity, init_pid(rec), self.workspace(rec)
                )
                if current == self._workspace_ids.get(sid):
                    return conn
            await self.destroy(sid)
            conn, identity = await self._start(rec)
            self._conns[sid] = conn
            self._workspace_ids[sid] = identity
            return conn

    async def _start(self, rec: SandboxRecord) -> tuple[AetherConnection, tuple[int, int]]:
        go = self.launcher
        sid = rec.sandbox_id
        tid = sid + TRUSTED_SUFFIX
        t0 = time.perf_counter()
        image = await asyncio.to_thread(go.resolve, rec)
        workspace = self.workspace(rec)
        staging = self.staging_root / tid
        src, identity = await asyncio.to_thread(_stage_workspace, init_pid(rec), workspace, staging)
        prep = await go.prepare(rec)
        try:
            proc = await go.launch(
                tid, rec, image, prep, backlog=4, binds=(BindMount(src, workspace),)
            )
        except BaseException:
            await asyncio.to_thread(_remove_staging, staging)
            raise
        try:
            if self.network is not None and self.network.is_attached(sid):
                await self.network.attach(tid, proc.pid, proc.cgroup_path, prep.policy, owner=sid)

            async def closed(reason: str) -> None:
                log.info("trusted sibling of %s: channel closed (%s)", sid, reason)

            conn = AetherConnection(go.address_of(tid), tid, on_close=closed)
            await conn.connect(timeout_s=self.ready_timeout_s)
        except BaseException:
            await self.destroy(sid)
            raise
        log.info(
            "trusted sibling of %s ready in %.1f ms (workspace %s)",
            sid,
            (time.perf_counter() - t0) * 1000,
            workspace,
            extra={"sandbox_id": sid},
        )
        return conn, identity

    async def destroy(self, sid: str) -> None:
        """Remove the sandbox's sibling, if any (with the sandbox, or to start a new one)."""
        tid = sid + TRUSTED_SUFFIX
        conn = self._conns.pop(sid, None)
        self._workspace_ids.pop(sid, None)
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()
        if self.network is not None and self.network.is_attached(tid):
            await self.network.detach(tid)
        if tid in await asyncio.to_thread(self.runtime.list_ids):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.runtime.destroy, tid)
        self.launcher.socket_path(tid).unlink(missing_ok=True)
        await asyncio.to_thread(_remove_staging, self.staging_root / tid)

    async def cleanup_orphans(self) -> list[str]:
        """Siblings never outlive an edge restart (the runtime removed them as orphans: their
        ids are never kept); their workspace bind mounts go too."""
        removed: list[str] = []
        if self.staging_root.is_dir():
            for d in self.staging_root.iterdir():
                if d.name.removesuffix(TRUSTED_SUFFIX) not in self._conns:
                    await asyncio.to_thread(_remove_staging, d)
                    removed.append(f"trusted:{d.name}")
        return removed

    async def close(self) -> None:
        for conn in list(self._conns.values()):
            with contextlib.suppress(Exception):
                await conn.close()
        self._conns.clear()


def init_pid(rec: SandboxRecord) -> int:
    pid = int(rec.runtime.get("pid") or 0)
    if pid <= 0:
        raise FailedPrecondition(
            f"sandbox {rec.sandbox_id} has no running init", reason="NOT_RUNNING"
        )
    return pid


def _open_workspace(pid: int, workspace: str) -> int:
    """An O_PATH descriptor of the sandbox's `workspace`, resolved inside its root (as its init
    `pid` sees it: the host keeps no mount of a started sandbox's rootfs) and refusing symlinks
    anywhere on the way (the agent controls that tree; followed on the host, a symlink to / would
    be the host's root). FailedPrecondition if that is not a directory."""
    try:
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise FailedPrecondition(
            f"the sandbox's init {pid} is gone: {exc.strerror}", reason="NOT_RUNNING"
        ) from None
    try:
        return _openat2_beneath(root, workspace.lstrip("/"))
    except OSError as exc:
        raise FailedPrecondition(
            f"the workspace {workspace} cannot be shared with trusted executions: "
            f"{exc.strerror} (a symlink, or missing)",
            reason="WORKSPACE_UNAVAILABLE",
        ) from None
    finally:
        os.close(root)


def _workspace_identity(pid: int, workspace: str) -> tuple[int, int]:
    fd = _open_workspace(pid, workspace)
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def _stage_workspace(pid: int, workspace: str, staging: Path) -> tuple[Path, tuple[int, int]]:
    """Bind the sandbox's `workspace` (see _open_workspace) to `staging/work`, for runc to bind
    from; returns that path and the directory's identity. The directory is a mount of the
    sandbox's own namespace, so the bind is a clone made there and attached here. Blocking."""
    staging.mkdir(parents=True, exist_ok=True)
    target = staging / "work"
    target.mkdir(exist_ok=True)
    fd = _open_workspace(pid, workspace)
    try:
        st = os.fstat(fd)
        tree = mounts.clone_in_namespace_of(pid, fd)
        try:
            mounts.attach_detached(tree, target)
        finally:
            os.close(tree)
    finally:
        os.close(fd)
    return target, (st.st_dev, st.st_ino)


_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437


def _openat2_beneath(dirfd: int, rel: str) -> int:
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    how = struct.pack(
        "=QQQ",
        os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC,
        0,
        _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | _RESOLVE_BENEATH,
    )
    buf = ctypes.create_string_buffer(how, len(how))
    fd = int(
        libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(rel or "."), buf, ctypes.c_size_t(len(how)))
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def _remove_staging(staging: Path) -> None:
    for m in mounts.mounts_under(staging):
        mounts.umount_quiet(m.mountpoint)
    if not mounts.mounts_under(staging):
        import shutil

        shutil.rmtree(staging, ignore_errors=True)

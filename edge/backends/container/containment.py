"""Containment of untrusted agents in container sandboxes (the Untrusted agents issue).

The container backend (`edge.backends.container.backend`) calls in here at a few points of a sandbox's life; this
module owns what the edge adds to a runc sandbox so that an agent that is root inside it, and
optimises its reward rather than its task, stays contained and gets reported:

- network (`edge.network`): policy validated before admission, veth + eBPF filter attached
  before any agent code runs, replaceable while running (`update_network`);
- chronus's private runtime directory: a detached tmpfs handed to pid 1 as fd 4
  (`edge.runtime.detached`; chronus applies Landlock to every command, `chronus.landlock`);
- a disk quota on the writable layer (`edge.runtime.disk`);
- the watchdog: every `watch_interval_s`, per running sandbox, reads the counters (blocked
  connects, OOM kills, forks refused at the pids limit, DNS refusals, Landlock denials where the
  kernel lets us count them) into the record's violations, and ends sandboxes with a reason an RL
  framework can use: DISK_QUOTA (writable layer full), PIDS_EXHAUSTED (at the pids limit with
  forks failing for `pids_exhausted_after_s`), POLICY_VIOLATION (more blocked connects than the
  policy's max_blocked_connects), KERNEL_FAULT (a kernel oops in one of its processes, from
  /dev/kmsg);
- trusted execution (`trusted_channel`): a sibling container made from the sandbox's read-only
  layers only, plus its workspace, in which the evaluation step runs (a /bin/bash the agent
  overwrote is not there); and the report of which lower-layer files the agent modified or
  deleted (`modified_files`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge.aether_client import AetherConnection
from edge.config import MIN_DISK_MB
from edge.model import SandboxRecord, SandboxSpec
from edge.network.denials import DenialCounter
from edge.network.manager import NetworkManager
from edge.network.policy import Policy
from edge.runtime import apparmor, cgroups, disk, integrity, mounts
from edge.runtime.bundle import rewrite_in_place
from edge.runtime.detached import detached_tmpfs
from edge.runtime.spec import BindMount
from libdsec.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from edge.backends.container.backend import ContainerBackend

log = logging.getLogger(__name__)

RUNTIME_FD = 4  # chronus's runtime directory in the sandbox (after the channel at 3)
TRUSTED_SUFFIX = "-t"
_POLICY_CACHE_S = 30.0


@dataclass
class Prepared:
    """What `prepare` made for one start: closed by `close` whatever happens."""

    extra_fds: tuple[int, ...]
    env: dict[str, str]
    dns_servers: tuple[str, ...] | None
    disk_mb: int
    policy: Policy
    resolved: dict[str, list[str]] = field(default_factory=dict)
    apparmor_profile: str = ""

    def close(self) -> None:
        for fd in self.extra_fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class _Watch:
    rec: SandboxRecord
    at_pids_limit_since: float = 0.0  # monotonic time the sandbox reached its pids limit


class Containment:
    def __init__(
        self,
        backend: ContainerBackend,
        network: NetworkManager | None,
        *,
        default_disk_mb: int = 10240,
        max_disk_mb: int = 204800,
        log_max_bytes: int = 1 << 20,
        watch_interval_s: float = 1.0,
        pids_exhausted_after_s: float = 3.0,
    ) -> None:
        self.backend = backend
        self.network = network
        self.default_disk_mb = default_disk_mb
        self.max_disk_mb = max_disk_mb
        self.log_max_bytes = log_max_bytes
        self.watch_interval_s = watch_interval_s
        self.pids_exhausted_after_s = pids_exhausted_after_s
        self.watched: dict[str, _Watch] = {}
        self._policy_cache: dict[str, tuple[float, Policy, dict[str, list[str]]]] = {}
        self._trusted: dict[str, AetherConnection] = {}
        self._trusted_workspace: dict[str, tuple[int, int]] = {}  # sid -> (st_dev, st_ino)
        self._trusted_locks: dict[str, asyncio.Lock] = {}
        self.denials = DenialCounter()
        self._kmsg = _KernelLog()
        self.apparmor_profile = ""
        if apparmor.available():
            if apparmor.load():
                self.apparmor_profile = apparmor.PROFILE_NAME
        else:
            log.warning(
                "AppArmor is unavailable on this host (no /sys/kernel/security/apparmor or "
                "apparmor_parser): sandboxes get no AppArmor profile; file, socket and signal "
                "controls are Landlock's (chronus), with seccomp, namespaces and masked paths"
            )

    def start_counters(self) -> None:
        self.denials.start()

    # ------------------------------------------------------------------ admission

    def _policy(self, raw: Mapping[str, Any] | None) -> tuple[Policy, dict[str, list[str]]]:
        """Parse and resolve a policy (blocking), cached briefly per distinct policy: a burst
        of sandboxes with one policy resolves its names once."""
        key = json.dumps(raw or {}, sort_keys=True)
        hit = self._policy_cache.get(key)
        now = time.monotonic()
        if hit is not None and now - hit[0] < _POLICY_CACHE_S:
            return hit[1], hit[2]
        if self.network is None:
            from edge.network.policy import parse

            policy = parse(raw)
            if policy.networked:
                raise FailedPrecondition(
                    "this edge has no sandbox networking", reason="NETWORK_UNAVAILABLE"
                )
            return policy, {}
        policy, resolved = self.network.check(raw)
        if len(self._policy_cache) > 256:
            self._policy_cache.clear()
        self._policy_cache[key] = (now, policy, resolved)
        return policy, resolved

    def validate(self, spec: SandboxSpec) -> None:
        """Before admission (blocking): network policy and disk quota."""
        if spec.disk_mb and not MIN_DISK_MB <= spec.disk_mb <= self.max_disk_mb:
            raise InvalidArgument(
                f"resources.disk_mb={spec.disk_mb}: expected {MIN_DISK_MB}..{self.max_disk_mb} "
                f"(this edge's maximum), or 0 for its default ({self.default_disk_mb})",
                reason="INVALID_RESOURCES",
                metadata={"field": "resources.disk_mb", "max_disk_mb": str(self.max_disk_mb)},
            )
        self._policy(spec.network)

    async def prepare(self, rec: SandboxRecord) -> Prepared:
        policy, resolved = await asyncio.to_thread(self._policy, rec.spec.network)
        runtime_fd = detached_tmpfs()
        dns_servers = None
        if policy.networked and self.network is not None:
            dns_servers = (self.network.gateway,)
        return Prepared(
            extra_fds=(runtime_fd,),
            env={"DSEC_CHRONUS_RUNTIME_FD": str(RUNTIME_FD)},
            dns_servers=dns_servers,
            disk_mb=rec.spec.disk_mb or self.default_disk_mb,
            policy=policy,
            resolved=resolved,
            apparmor_profile=self.apparmor_profile,
        )

    async def started(self, rec: SandboxRecord, pid: int, cgroup_path: str, prep: Prepared) -> None:
        """After runc started pid 1 and before the sandbox is RUNNING."""
        if prep.policy.networked and self.network is not None:
            rec.runtime["net"] = await self.network.attach(
                rec.sandbox_id, pid, cgroup_path, prep.policy, prep.resolved
            )
        rec.runtime["disk_mb"] = prep.disk_mb
        self.watched[rec.sandbox_id] = _Watch(rec)

    async def adopt(self, rec: SandboxRecord) -> None:
        self.watched[rec.sandbox_id] = _Watch(rec)
        net = rec.runtime.get("net")
        if net and self.network is not None:
            policy, _ = await asyncio.to_thread(self._policy_lenient, rec.spec.network)
            cg = self.backend.runtime.cgroup_path(rec.sandbox_id)
            if not await self.network.adopt(rec.sandbox_id, net, policy, cg):
                log.warning("could not take back the network policy of %s", rec.sandbox_id)

    def _policy_lenient(self, raw: Mapping[str, Any] | None) -> tuple[Policy, dict[str, list[str]]]:
        from edge.network.policy import parse

        return parse(raw), {}

    # ------------------------------------------------------------------ teardown

    async def destroyed(self, rec: SandboxRecord) -> None:
        sid = rec.sandbox_id
        self.watched.pop(sid, None)
        await self._destroy_trusted(sid)
        if self.network is not None:
            await self.network.detach(sid)
        self.denials.forget(self._cgroup2(sid))

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        removed: list[str] = []
        # Trusted siblings never outlive an edge restart (the runtime removed them as orphans:
        # their ids are never kept); their workspace bind mounts go too.
        trusted_root = self.backend.state_dir / "trusted"
        if trusted_root.is_dir():
            for d in trusted_root.iterdir():
                if d.name.removesuffix(TRUSTED_SUFFIX) not in self._trusted:
                    await asyncio.to_thread(_remove_staging, d)
                    removed.append(f"trusted:{d.name}")
        if self.network is not None:
            removed += await self.network.cleanup_orphans(keep)
        return removed

    async def close(self) -> None:
        for conn in list(self._trusted.values()):
            with contextlib.suppress(Exception):
                await conn.close()
        self._trusted.clear()
        self.denials.close()
        self._kmsg.close()
        idle = not self.backend.runtime.list_ids()
        if self.network is not None:
            await self.network.close(teardown=idle)
        if idle:
            await asyncio.to_thread(_remove_empty_cgroup_parent, self.backend.runtime.cgroup_parent)

    # ------------------------------------------------------------------ policies

    async def update_network(self, rec: SandboxRecord, raw: Mapping[str, Any]) -> None:
        """Replace a running sandbox's policy; the next connection sees it."""
        sid = rec.sandbox_id
        await self.backend.settled(sid)  # its cgroup2 directory, where the programs attach
        net = self.network
        if net is None:
            from edge.network.policy import parse

            if parse(raw).networked:
                raise FailedPrecondition(
                    "this edge has no sandbox networking", reason="NETWORK_UNAVAILABLE"
                )
            rec.spec.network = dict(raw)
            return
        if net.is_attached(sid):
            await net.replace(sid, raw)  # refuses a bad policy before touching the old one
            rec.spec.network = dict(raw)
            return
        policy, resolved = await asyncio.to_thread(net.check, raw)
        if policy.networked:
            pid = int(rec.runtime.get("pid") or 0)
            cg = self.backend.runtime.cgroup_path(sid)
            rec.runtime["net"] = await net.attach(sid, pid, cg, policy, resolved)
            # DNS through the edge from now on (the file is bind-mounted: rewrite in place).
            resolv = self.backend.runtime.sandbox_dir(sid) / "etc" / "resolv.conf"
            await asyncio.to_thread(rewrite_in_place, resolv, f"nameserver {net.gateway}\n")
        rec.spec.network = dict(raw)

    # ------------------------------------------------------------------ integrity

    async def modified_files(self, rec: SandboxRecord) -> list[integrity.ModifiedFile]:
        sdir = self.backend.runtime.sandbox_dir(rec.sandbox_id)
        pid = _init_pid(rec)

        def scan() -> list[integrity.ModifiedFile]:
            lowers = integrity.overlay_lowers(pid)
            if not lowers:
                raise FailedPrecondition(
                    f"sandbox {rec.sandbox_id} has no mounted filesystem", reason="NOT_MOUNTED"
                )
            return integrity.modified_files((sdir / "upper").resolve(), lowers)

        return await asyncio.to_thread(scan)

    # ------------------------------------------------------------ trusted execution

    def workspace(self, rec: SandboxRecord) -> str:
        """The directory the trusted sibling shares with the sandbox (the agent's work)."""
        w = rec.spec.workdir or str(rec.runtime.get("image_workdir") or "") or "/work"
        return "/work" if w.rstrip("/") == "" else w.rstrip("/")

    async def trusted_channel(self, rec: SandboxRecord) -> AetherConnection:
        sid = rec.sandbox_id
        lock = self._trusted_locks.setdefault(sid, asyncio.Lock())
        async with lock:
            conn = self._trusted.get(sid)
            if conn is not None and not conn.closed.is_set():
                # The sibling shares the workspace directory it was started with: if the agent
                # replaced the directory since, start a sibling on the current one.
                current = await asyncio.to_thread(
                    _workspace_identity, _init_pid(rec), self.workspace(rec)
                )
                if current == self._trusted_workspace.get(sid):
                    return conn
            await self._destroy_trusted(sid)
            conn, identity = await self._start_trusted(rec)
            self._trusted[sid] = conn
            self._trusted_workspace[sid] = identity
            return conn

    async def _start_trusted(self, rec: SandboxRecord) -> tuple[AetherConnection, tuple[int, int]]:
        b = self.backend
        sid = rec.sandbox_id
        tid = sid + TRUSTED_SUFFIX
        t0 = time.perf_counter()
        image = await asyncio.to_thread(b.images.resolve, rec.spec.image, rec.spec.toolkits)
        workspace = self.workspace(rec)
        staging = b.state_dir / "trusted" / tid
        src, identity = await asyncio.to_thread(
            _stage_workspace, _init_pid(rec), workspace, staging
        )
        prep = await self.prepare(rec)
        try:
            proc = await b.launch(
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

            conn = AetherConnection(b._socket_address(tid), tid, on_close=closed)
            await conn.connect(timeout_s=b.ready_timeout_s)
        except BaseException:
            await self._destroy_trusted(sid)
            raise
        log.info(
            "trusted sibling of %s ready in %.1f ms (workspace %s)",
            sid,
            (time.perf_counter() - t0) * 1000,
            workspace,
            extra={"sandbox_id": sid},
        )
        return conn, identity

    async def _destroy_trusted(self, sid: str) -> None:
        b = self.backend
        tid = sid + TRUSTED_SUFFIX
        conn = self._trusted.pop(sid, None)
        self._trusted_workspace.pop(sid, None)
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()
        if self.network is not None and self.network.is_attached(tid):
            await self.network.detach(tid)
        if tid in await asyncio.to_thread(b.runtime.list_ids):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(b.runtime.destroy, tid)
        b._socket_path(tid).unlink(missing_ok=True)
        await asyncio.to_thread(_remove_staging, b.state_dir / "trusted" / tid)

    # ------------------------------------------------------------------ watchdog

    def _cgroup2(self, sid: str) -> Path:
        root = cgroups.hierarchies().get("unified", Path("/sys/fs/cgroup/unified"))
        return root / self.backend.runtime.cgroup_path(sid).lstrip("/")

    async def watch_loop(self) -> None:
        """The watchdog, and the periodic re-resolution of the policies' domain names."""
        self._kmsg.open()
        refreshed = time.monotonic()
        while True:
            await asyncio.sleep(self.watch_interval_s)
            try:
                await self.watch_once()
                if (
                    self.network is not None
                    and time.monotonic() - refreshed >= self.network.refresh_s
                ):
                    refreshed = time.monotonic()
                    await self.network.refresh_once()
            except Exception:
                log.exception("watchdog pass failed")

    async def watch_once(self) -> None:
        faults = await asyncio.to_thread(self._kmsg.faulting_pids)
        for sid, w in list(self.watched.items()):
            if w.rec.state != "RUNNING" or sid not in self.backend.connections:
                continue
            counters, verdict = await asyncio.to_thread(self._check, sid, w, faults)
            await asyncio.to_thread(self._cap_log, sid)
            if any(w.rec.violations.get(k) != v for k, v in counters.items()):
                # Merged here, on the loop: the servicer counts output truncations too.
                w.rec.violations = {**w.rec.violations, **counters}
            if verdict is not None and self.backend._on_exit is not None:
                reason, message = verdict
                log.warning(
                    "sandbox %s contained: %s (%s)", sid, reason, message, extra={"sandbox_id": sid}
                )
                self.watched.pop(sid, None)
                await self.backend._on_exit(sid, reason, message)

    def _cap_log(self, sid: str) -> None:
        """Keep the sandbox's aether/chronus log below log_max_bytes: past it, cut it back to
        its head (how the sandbox started) plus a marker; what follows is appended after it
        (the writers' descriptor is O_APPEND). Blocking."""
        path = self.backend.logs / f"{sid}.log"
        try:
            size = os.stat(path).st_size
            if size <= self.log_max_bytes:
                return
            head = self.log_max_bytes // 4
            with open(path, "r+b") as fh:
                fh.truncate(head)
                fh.seek(head)
                fh.write(
                    f"\n[dsec edge: log cut at {size} bytes; head kept, tail follows]\n".encode()
                )
        except OSError:
            return

    def _check(
        self, sid: str, w: _Watch, faults: set[int]
    ) -> tuple[dict[str, int], tuple[str, str] | None]:
        """(counters read now, (reason, message) if the sandbox must end). Blocking."""
        counters = self._counters(sid)
        return counters, self._verdict(sid, w, faults, counters)

    def _counters(self, sid: str) -> dict[str, int]:
        cg = self.backend.runtime.cgroup_path(sid)
        v: dict[str, int] = {}
        if self.network is not None:
            blocked = self.network.blocked(sid)
            if blocked is not None:
                v["blocked_connects"] = blocked
            refused = self.network.dns_refusals_of(sid)
            if refused:
                v["dns_refusals"] = refused
        denied = self.denials.count(self._cgroup2(sid))
        if denied:
            v["denied_file_accesses"] = denied
        oom = cgroups.read_keyed("memory", cg, "memory.oom_control").get("oom_kill", 0)
        if oom:
            v["oom_kills"] = oom
        pids_hits = cgroups.read_keyed("pids", cg, "pids.events").get("max", 0)
        if pids_hits:
            v["pids_limit_hits"] = pids_hits
        return v

    def _verdict(
        self, sid: str, w: _Watch, faults: set[int], v: dict[str, int]
    ) -> tuple[str, str] | None:
        rec = w.rec
        rt = self.backend.runtime
        cg = rt.cgroup_path(sid)
        pids_hits = v.get("pids_limit_hits", 0)
        max_blocked = int((rec.spec.network or {}).get("max_blocked_connects", 0) or 0)
        if max_blocked and v.get("blocked_connects", 0) > max_blocked:
            return (
                "POLICY_VIOLATION",
                f"{v['blocked_connects']} connections blocked by the network policy "
                f"(max_blocked_connects {max_blocked})",
            )
        usage = disk.usage(rt.writable_dir(sid))
        if usage is not None and usage.full:
            return (
                "DISK_QUOTA",
                f"the writable layer is full ({usage.used_bytes >> 20} of "
                f"{usage.total_bytes >> 20} MiB, {usage.free_inodes} inodes free)",
            )
        # Exhausted: at the limit (give or take the two forks chronus needs for a command) for
        # pids_exhausted_after_s, with forks refused at least once: nothing new can start.
        current = cgroups.read_int("pids", cg, "pids.current") or 0
        now = time.monotonic()
        if pids_hits and current >= rec.spec.pids_max - 2:
            if not w.at_pids_limit_since:
                w.at_pids_limit_since = now
            elif now - w.at_pids_limit_since >= self.pids_exhausted_after_s:
                return (
                    "PIDS_EXHAUSTED",
                    f"{current} of {rec.spec.pids_max} processes for "
                    f"{now - w.at_pids_limit_since:.1f} s; {pids_hits} forks refused",
                )
        else:
            w.at_pids_limit_since = 0.0
        if faults:
            procs = cgroups.procs(cgroups.controller_dir("pids", cg) or Path("/nonexistent"))
            hit = faults.intersection(procs)
            if hit:
                return ("KERNEL_FAULT", f"kernel oops in process {min(hit)} of the sandbox")
        return None


# ---------------------------------------------------------------------- helpers


def _remove_empty_cgroup_parent(parent: str) -> None:
    """rmdir the edge's cgroup parent in every hierarchy (only ever succeeds when it is empty:
    nothing is killed). Test clusters use a parent each; they must not pile up."""
    for root in set(cgroups.hierarchies().values()):
        with contextlib.suppress(OSError):
            (root / parent.strip("/")).rmdir()


def _init_pid(rec: SandboxRecord) -> int:
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


class _KernelLog:
    """Pids of processes a kernel oops / BUG hit, from /dev/kmsg (read without blocking)."""

    _START = re.compile(r"(BUG:|Oops:|general protection fault|kernel BUG at|Unable to handle)")
    _PID = re.compile(r"\bPID: (\d+)\b")

    def __init__(self) -> None:
        self._fd = -1
        self._pending = False

    def open(self) -> None:
        try:
            self._fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self._fd, 0, os.SEEK_END)  # only what happens from now on
        except OSError as exc:
            log.info("kernel faults are not watched: /dev/kmsg: %s", exc.strerror)
            self._fd = -1

    def faulting_pids(self) -> set[int]:
        out: set[int] = set()
        if self._fd < 0:
            return out
        for _ in range(10_000):
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records were overwritten before we read them
                continue
            if not record:
                break
            out |= self.parse(record.decode(errors="replace"))
        return out

    def parse(self, record: str) -> set[int]:
        """One /dev/kmsg record: "prio,seq,usec,flags;message"."""
        msg = record.split(";", 1)[-1]
        out: set[int] = set()
        if self._START.search(msg):
            self._pending = True
        if self._pending:
            m = self._PID.search(msg)
            if m:
                out.add(int(m.group(1)))
                self._pending = False
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

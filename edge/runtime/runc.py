"""The container backend: runc on an overlay of shared read-only EROFS layers.

Layout under `state_dir` (one per edge; nothing outside it is ours except cgroups):

    runc/                 runc --root: only our containers, never anybody else's
                          (with volatile_state, runc/ and sandboxes/ are tmpfs mounts)
    layers/<key>/         shared read-only EROFS mounts (LayerMounts), one per image
    sandboxes/<id>/
        record.json       what create() acquired (layers, toolkit, cgroup); written first
        config.json       the OCI bundle (the sandbox dir IS the bundle)
        rootfs/           overlay mount target; taken off the host's mount table once pid 1
                          runs (its namespace holds the overlay: reach it as /proc/<pid>/root)
        upper             symlink to the writable layer, rw/<id>/upper, or with a disk quota
                          /proc/<edge pid>/fd/N/upper (upper_dir: how the edge reads it)
    rw/<id>/              upper/ work/: the overlay's writable layer; with a disk quota (disk.py)
                          disk.img holding them, mounted at disk/ only while the overlay is
                          made, then taken off the mount table (disk.hold): the edge keeps a
                          descriptor of it, the overlay its own reference
    rw/.fork-<id>-<n>/    a fork's capture of sandbox <id>'s writable layer, while its children
                          start (on the writable layers' filesystem; a crash's leftover goes
                          at the next orphan cleanup)
        etc/              hosts, hostname, resolv.conf bind-mounted into the sandbox
        boot_id           this start's boot id, shown read-only at BOOT_ID_PATH (see create)
        runc.log          runc's own log (JSON); its error is what RuntimeStartError carries
        init.pid          pid 1 of the sandbox, host pid namespace
        exit.json         pid 1's wait status once reaped

Everything is derived from this directory, runc's root and the kernel (mountinfo, cgroupfs), so a
restarted edge re-adopts its sandboxes by constructing a new RuncRuntime: no in-memory state is
needed beyond the layer holders, which are rebuilt from the records.

Exit statuses: a sandbox init is orphaned as soon as `runc run -d` exits. This machine's PID 1
(/process_api) reaps orphans only lazily (measured: a zombie lingered 1-5 s) and the exit status
is lost with it, while the edge needs it (why did aether die?). So the edge calls
`become_subreaper()` at start: inits are re-parented to the edge, and the runtime reaps each one
itself, by pid (never wait(-1), which would steal other children's statuses), recording the
status in exit.json.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import json
import logging
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.steps import Phases
from edge.layers.tree import CopyStats, copy_tree, precopy, resync
from edge.runtime import cgroups, disk, seccomp_bpf
from edge.runtime.bundle import (
    NOFILE,
    SUDO_PATH,
    cpu_quota_us,
    cpu_shares,
    hardened_seccomp,
    hosts_file,
    make_config,
    rewrite_in_place,
    write_config,
    write_etc_files,
)
from edge.runtime.errors import (
    InvalidLaunchSpecError,
    RuncError,
    RuntimeStartError,
    SandboxExistsError,
    SandboxNotFoundError,
    SandboxRuntimeError,
)
from edge.runtime.mounts import (
    LayerImage,
    LayerMounts,
    as_layer,
    bind_readonly_into,
    detach,
    has_mount_api,
    layer_from_identity,
    layer_identity,
    mount_overlay,
    mount_volatile,
    mounts_under,
    read_mountinfo,
    set_hostname_of,
    umount_quiet,
)
from edge.runtime.spec import (
    SANDBOX_ID_RE,
    LaunchSpec,
    RuntimeState,
    RuntimeStats,
    SandboxProcess,
    SandboxStatus,
)
from edge.toolkit import SUDO_SHIM

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
#: Name prefix of a fork's capture directory under rw/ (never a sandbox id: ids have no dot).
FORK_CAPTURE_PREFIX = ".fork-"
#: The writable layer a cold pause keeps (`park_upper`), beside the writable layers.
PARKED_PREFIX = ".parked-"
_RUNC_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
_STATUS = {
    "running": SandboxStatus.RUNNING,
    "paused": SandboxStatus.PAUSED,
    "stopped": SandboxStatus.STOPPED,
    # created/creating: runc init is waiting for `start`; with `run -d` that only survives a
    # crash mid-create. No user code runs, so it counts as stopped.
    "created": SandboxStatus.STOPPED,
    "creating": SandboxStatus.STOPPED,
}


def become_subreaper() -> None:
    """Make this process the reaper of orphaned descendants (prctl PR_SET_CHILD_SUBREAPER).

    Call once at edge start, before creating sandboxes; see the module docstring for why. Inits
    of sandboxes created before an edge restart stay children of PID 1: their exit status is
    not collected (reap() returns None), the rest works unchanged.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _nofile_limit() -> int:
    """NOFILE for sandboxes: 65536, or our own hard limit if lower and we cannot raise it.

    runc sets rlimits with prlimit(2) from the host side; raising a hard limit needs
    CAP_SYS_RESOURCE, which root on this machine kind does not have (hard limit 20000).
    """
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard >= NOFILE or _has_cap(24):  # CAP_SYS_RESOURCE
        return NOFILE
    log.warning("no CAP_SYS_RESOURCE: sandbox RLIMIT_NOFILE capped at %d (wanted %d)", hard, NOFILE)
    return int(hard)


def _has_cap(bit: int) -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def _wait_pidfd(pidfd: int, timeout_s: float) -> bool:
    """True once the process behind `pidfd` has exited (zombie or reaped)."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(max(0, int(timeout_s * 1000))))


#: The kernel's per-boot id, which every container would otherwise share with the host.
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


#: Size cap of each volatile state tmpfs (bundles, records, runc's state: ~20 KiB per sandbox).
VOLATILE_SIZE = "256m"


class RuncRuntime:
    """Creates, inspects and tears down runc sandboxes. Blocking; callers use asyncio.to_thread.

    Thread-safe for operations on different sandbox ids; operations on the same id must be
    serialized by the caller (the edge's per-sandbox lock).

    `cgroup_parent` must belong to this runtime alone (one edge per node; tests use their own):
    cleanup_orphans() treats every child cgroup of it that is not in `keep` as an orphan.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        runc_root: Path | None = None,
        cgroup_parent: str = "dsec",
        runc_binary: str = "runc",
        layer_root: Path | None = None,
        use_seccomp: bool = True,
        volatile_state: bool = False,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.sandboxes_dir = self.state_dir / "sandboxes"
        self.runc_root = Path(runc_root) if runc_root else self.state_dir / "runc"
        #: writable layers (upper/ work/, or a quota filesystem): on disk, whatever else is not
        self.rw_dir = self.state_dir / "rw"
        self.cgroup_parent = cgroup_parent.strip("/")
        runc = shutil.which(runc_binary)
        if runc is None:
            raise SandboxRuntimeError(f"runc binary {runc_binary!r} not found")
        self.runc = runc
        self.use_seccomp = use_seccomp
        self._seccomp_memfd: int | None = None  # the compiled profile, shared by every start
        self._seccomp_lock = threading.Lock()  # creates run in worker threads
        #: Quota filesystems made ahead of creates (`start_disk_pool`); None: each create
        #: makes its own.
        self.disk_pool: disk.Pool | None = None
        for d in (self.sandboxes_dir, self.runc_root, self.rw_dir):
            d.mkdir(parents=True, exist_ok=True)
        if volatile_state:
            for d in (self.sandboxes_dir, self.runc_root):
                mount_volatile(d, VOLATILE_SIZE)
        self.nofile = _nofile_limit()
        #: Every start mounts a boot id of its own (create), with the new mount API. A kernel
        #: before 5.12 lacks it: sandboxes then show the host's boot id, as runc leaves it (the
        #: id is no control: nothing is refused for it), and the edge says so once here.
        self.boot_ids = has_mount_api(self.sandboxes_dir)
        if not self.boot_ids:
            log.warning("no mount_setattr (Linux < 5.12): sandboxes show the host's boot id")
        self.layers = LayerMounts(Path(layer_root) if layer_root else self.state_dir / "layers")
        self.layers.root.mkdir(parents=True, exist_ok=True)
        self.layers.recover(self._claims())
        #: sandbox id -> the descriptor of its quota filesystem, which is on no mount table
        #: (disk.hold); after a restart, taken again on first use (`_disk_fd`).
        self._disks: dict[str, int] = {}
        self._disks_lock = threading.Lock()

    # ------------------------------------------------------------------ paths and records

    def sandbox_dir(self, sandbox_id: str) -> Path:
        if not SANDBOX_ID_RE.fullmatch(sandbox_id):
            # Also what keeps "../" out of every path we build from an id.
            raise InvalidLaunchSpecError(f"sandbox id {sandbox_id!r} must match [a-z0-9-]{{1,64}}")
        return self.sandboxes_dir / sandbox_id

    def start_disk_pool(self, size_mb: int, count: int) -> None:
        """Keep `count` quota filesystems of `size_mb` ready for creates (disk.Pool)."""
        if self.disk_pool is None and count > 0:
            self.disk_pool = disk.Pool(self.rw_dir, size_mb, count)

    def stop_disk_pool(self) -> None:
        """Unmount and delete the ready filesystems (the edge is stopping). Blocking."""
        pool, self.disk_pool = self.disk_pool, None
        if pool is not None:
            pool.close()

    def release(self) -> bool:
        """Unmount the volatile state tmpfs mounts once no sandbox of ours is left (an edge
        that stops every sandbox at shutdown, tests); returns whether they are gone."""
        if self.list_ids():
            return False
        for d in (self.sandboxes_dir, self.runc_root):
            umount_quiet(d)
        return True

    def writable_dir(self, sandbox_id: str) -> Path:
        """Where the sandbox's writable layer lives (on disk); `sandbox_dir/upper` points in."""
        return self.rw_dir / self.sandbox_dir(sandbox_id).name

    def upper_dir(self, sandbox_id: str) -> Path:
        """The sandbox's writable layer, to read (pack_diff, modified files, a fork's capture).
        With a disk quota it is on a filesystem that is on no mount table: the path goes
        through the edge's descriptor of it, `/proc/<edge>/fd/N/upper`, which this process
        and its (root) children open directly; do not `resolve()` it. SandboxNotFoundError if
        the sandbox has no writable layer."""
        rw = self.writable_dir(sandbox_id)
        if (rw / "disk.img").exists():
            return _upper_through(self._disk_fd(sandbox_id))
        if not (rw / "upper").is_dir():
            raise SandboxNotFoundError(sandbox_id)
        return rw / "upper"

    def disk_usage(self, sandbox_id: str) -> disk.DiskUsage | None:
        """Usage of the sandbox's quota filesystem; None without one (or once it is gone)."""
        if not (self.writable_dir(sandbox_id) / "disk.img").exists():
            return None
        try:
            return disk.usage(self._disk_fd(sandbox_id))
        except (OSError, SandboxRuntimeError):
            return None

    def _disk_fd(self, sandbox_id: str) -> int:
        with self._disks_lock:
            fd = self._disks.get(sandbox_id)
            if fd is None:
                rw = self.writable_dir(sandbox_id)
                try:
                    fd = disk.reattach(rw)
                except OSError as exc:
                    raise SandboxNotFoundError(sandbox_id) from exc
                self._disks[sandbox_id] = fd
                self._link_upper(sandbox_id, fd)
            return fd

    def _link_upper(self, sandbox_id: str, fd: int) -> None:
        """`sandbox_dir/upper` -> the upper through the edge's descriptor (for operators and
        tests that look at a sandbox's files from outside; it follows the edge's pid)."""
        link = self.sandbox_dir(sandbox_id) / "upper"
        tmp = link.with_name(".upper.tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(_upper_through(fd))
        os.replace(tmp, link)

    def _drop_disk(self, sandbox_id: str) -> None:
        with self._disks_lock:
            fd = self._disks.pop(sandbox_id, None)
        if fd is not None:
            os.close(fd)

    def cgroup_path(self, sandbox_id: str) -> str:
        return f"/{self.cgroup_parent}/{sandbox_id}"

    def _read_record(self, sandbox_id: str) -> dict[str, Any] | None:
        try:
            rec: dict[str, Any] = json.loads(
                (self.sandbox_dir(sandbox_id) / "record.json").read_text()
            )
            return rec
        except (OSError, ValueError):
            return None

    @staticmethod
    def _record_layers(rec: dict[str, Any]) -> list[tuple[str, Path | LayerImage]]:
        """(holder, layer) for every layer use in a record; see `_holder`."""
        sid = rec["sandbox_id"]
        uses = [
            (_holder(sid, i), layer_from_identity(d)) for i, d in enumerate(rec.get("layers", []))
        ]
        if rec.get("toolkit"):
            uses.append((_holder(sid, "toolkit"), layer_from_identity(rec["toolkit"])))
        return uses

    def _claims(self, only: set[str] | None = None) -> dict[str, list[Path | LayerImage]]:
        claims: dict[str, list[Path | LayerImage]] = {}
        for d in self._dirs():
            if only is not None and d.name not in only:
                continue
            rec = self._read_record(d.name)
            if rec is not None:
                for holder, layer in self._record_layers(rec):
                    claims.setdefault(holder, []).append(layer)
        return claims

    def _dirs(self) -> list[Path]:
        try:
            return [d for d in self.sandboxes_dir.iterdir() if SANDBOX_ID_RE.fullmatch(d.name)]
        except FileNotFoundError:
            return []

    # ------------------------------------------------------------------ runc plumbing

    def _runc_cmd(self, *args: str) -> list[str]:
        return [self.runc, "--root", os.fspath(self.runc_root), *args]

    def _run(
        self, *args: str, check: bool = True, timeout_s: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        argv = self._runc_cmd(*args)
        r = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_RUNC_ENV,
            stdin=subprocess.DEVNULL,
        )
        if check and r.returncode != 0:
            raise RuncError(argv, r.returncode, r.stderr)
        return r

    def _container_exists(self, sandbox_id: str) -> bool:
        return (self.runc_root / sandbox_id / "state.json").exists()

    def _spawn_run(self, spec: LaunchSpec, sdir: Path) -> int:
        """`runc run -d` with pid 1's stdio on the log file and `pass_fd` as its fd 3.

        posix_spawn rather than subprocess: subprocess cannot place an fd at a chosen number
        (fd 3 for --preserve-fds) without a preexec_fn, which is slow and unsafe in a threaded
        process. In detached mode runc hands its own stdio to pid 1, so runc's errors go to the
        --log file, not to a pipe.
        """
        argv = self._runc_cmd(
            "--log",
            os.fspath(sdir / "runc.log"),
            "--log-format",
            "json",
            "run",
            "--detach",
            # No per-container session keyring: one fewer kernel object to set up,
            # and keyctl is refused by the seccomp profile inside anyway.
            "--no-new-keyring",
            "--bundle",
            os.fspath(sdir),
            "--pid-file",
            os.fspath(sdir / "init.pid"),
        )
        if spec.pass_fd is not None:
            argv += ["--preserve-fds", str(1 + len(spec.extra_fds))]
        argv.append(spec.sandbox_id)

        opened: list[int] = []

        def high(fd: int) -> int:
            # Sources >= 10 so no dup2 has source == target (which would leave CLOEXEC set).
            import fcntl

            new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
            opened.append(new)
            return new

        try:
            devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            opened.append(devnull)
            if spec.log_path is not None:
                logfd = os.open(
                    spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640
                )
                opened.append(logfd)
            else:
                logfd = devnull
            actions: list[tuple[Any, ...]] = [
                (os.POSIX_SPAWN_DUP2, high(devnull), 0),
                (os.POSIX_SPAWN_DUP2, high(logfd), 1),
                (os.POSIX_SPAWN_DUP2, high(logfd), 2),
            ]
            if spec.pass_fd is not None:
                actions.append((os.POSIX_SPAWN_DUP2, high(spec.pass_fd), 3))
                for i, fd in enumerate(spec.extra_fds):
                    actions.append((os.POSIX_SPAWN_DUP2, high(fd), 4 + i))
            pid = os.posix_spawn(
                self.runc,
                argv,
                _RUNC_ENV,
                file_actions=actions,
                setsid=True,  # Ctrl-C at the edge's terminal must not reach sandbox processes
                setsigmask=(),
                # Python ignores SIGPIPE/SIGXFSZ; an ignored disposition survives exec and would
                # leak into pid 1 and everything it starts (`yes | head` would never end).
                setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
            )
        finally:
            for fd in opened:
                os.close(fd)
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0:
            raise RuntimeStartError(argv, rc, _runc_log_error(sdir / "runc.log"))
        try:
            return int((sdir / "init.pid").read_text().strip())
        except (OSError, ValueError) as exc:
            raise RuntimeStartError(argv, rc, f"runc wrote no usable pid file: {exc}") from exc

    # ------------------------------------------------------------------ lifecycle

    def create(self, spec: LaunchSpec) -> SandboxProcess:
        """Mount the layers and the overlay, write the bundle and start pid 1 (`runc run -d`).

        On any failure everything done so far is undone (in reverse order) before the error
        propagates: no mount, cgroup, runc state or directory is left behind.
        """
        spec.validate()
        by_init = bool(spec.seccomp_fd_env) and self.use_seccomp
        if by_init:
            # pid 1 gets the program as the fd after the extra ones, and its number by name.
            fd_number = 4 + len(spec.extra_fds)
            spec = dataclasses.replace(
                spec,
                env={**spec.env, spec.seccomp_fd_env: str(fd_number)},
                extra_fds=(*spec.extra_fds, self.seccomp_memfd()),
            )
        sdir = self.sandbox_dir(spec.sandbox_id)
        if self._container_exists(spec.sandbox_id):
            raise SandboxExistsError(spec.sandbox_id)
        try:
            sdir.mkdir()
        except FileExistsError:
            raise SandboxExistsError(spec.sandbox_id) from None

        sid = spec.sandbox_id
        cg = self.cgroup_path(sid)
        undo = _Undo()
        undo.push(
            lambda: shutil.rmtree(sdir, ignore_errors=True) if not mounts_under(sdir) else None
        )
        with Phases() as ph:
            try:
                pid, rootfs, upper = self._create(spec, sdir, cg, by_init, undo, ph)
            except BaseException:
                undo.run()
                raise
        return SandboxProcess(
            sandbox_id=sid,
            pid=pid,
            rootfs=rootfs,
            upper=upper,
            cgroup_path=cg,
            log_path=spec.log_path,
        )

    def _create(
        self, spec: LaunchSpec, sdir: Path, cg: str, by_init: bool, undo: _Undo, ph: Phases
    ) -> tuple[int, Path, Path]:
        """`create`'s steps, each a span of a traced create (`ph`); `undo` collects how to
        take each back."""
        sid = spec.sandbox_id
        ph.next("edge.runc.layers")
        layers = [as_layer(layer) for layer in spec.lowers]
        toolkit = as_layer(spec.toolkit_dir) if spec.toolkit_dir is not None else None
        record = {
            "sandbox_id": sid,
            "layers": [layer_identity(x) for x in layers],
            "toolkit": layer_identity(toolkit) if toolkit is not None else None,
            "cgroup_path": cg,
            "log_path": os.fspath(spec.log_path) if spec.log_path else None,
            "created_at": time.time(),
        }
        # The record goes first: recovery derives layer holders from it (see LayerMounts).
        (sdir / "record.json").write_text(json.dumps(record))

        lower_dirs = []
        for i, layer in enumerate(layers):
            lower_dirs.append(self.layers.acquire(layer, _holder(sid, i)))
            undo.push(functools.partial(self.layers.release, layer, _holder(sid, i)))
        toolkit_source = None
        if toolkit is not None:
            toolkit_source = self.layers.acquire(toolkit, _holder(sid, "toolkit"))
            undo.push(functools.partial(self.layers.release, toolkit, _holder(sid, "toolkit")))

        rootfs = sdir / "rootfs"
        rootfs.mkdir()
        rw = self.writable_dir(sid)
        ph.next("edge.runc.writable_layer")
        ready = None
        if spec.disk_mb and self.disk_pool is not None:
            ready = self.disk_pool.take(spec.disk_mb)
        if ready is not None:
            os.rename(ready, rw)  # its mount goes with it
        else:
            rw.mkdir()
        undo.push(lambda: shutil.rmtree(rw, ignore_errors=True) if not mounts_under(rw) else None)
        if spec.disk_mb:
            undo.push(lambda: umount_quiet(rw / "disk"))
            if ready is not None:
                upper, work = rw / "disk" / "upper", rw / "disk" / "work"
            else:
                upper, work = disk.create(rw, spec.disk_mb)
        else:
            upper, work = rw / "upper", rw / "work"
            upper.mkdir()
            work.mkdir()
        if spec.initial_upper is not None:
            _fill_upper(spec.initial_upper, upper, spec.disk_mb)
        ph.next("edge.runc.overlay")
        mount_overlay(lower_dirs, upper, work, rootfs)
        undo.push(lambda: umount_quiet(rootfs))
        if spec.disk_mb:
            # Off the mount table before runc copies it (disk.hold); the overlay has its own
            # reference to the upper's filesystem.
            fd = disk.hold(rw)
            with self._disks_lock:
                self._disks[sid] = fd
            undo.push(functools.partial(self._drop_disk, sid))
            self._link_upper(sid, fd)
            upper = _upper_through(fd)
        else:
            (sdir / "upper").symlink_to(upper)

        ph.next("edge.runc.bundle")
        host = spec.effective_hostname
        write_etc_files(sdir / "etc", host, nameservers=spec.dns_servers)
        config = make_config(
            spec,
            rootfs=rootfs,
            etc_dir=sdir / "etc",
            cgroups_path=cg,
            toolkit_source=toolkit_source,
            use_seccomp=self.use_seccomp and not by_init,
            nofile=self.nofile,
            sudo_over=_sudo_over(rootfs, toolkit_source or spec.toolkit_dir),
        )
        write_config(sdir, config)

        undo.push(lambda: cgroups.remove(cg))
        undo.push(lambda: self._remove_container(sid, cg))
        ph.next("edge.runc.run")
        pid = self._spawn_run(spec, sdir)
        if self.boot_ids:
            ph.next("edge.runc.boot_id")
            self._mount_boot_id(sdir, pid)
        if not spec.keep_host_rootfs:
            ph.next("edge.runc.detach_rootfs")
            # pid 1 has pivoted into its own copy of the overlay; the host's copy is not
            # needed and would make every later start slower: runc reads the whole mount
            # table several times and copies it into each new mount namespace.
            detach(rootfs)
        return pid, rootfs, upper

    @staticmethod
    def _mount_boot_id(sdir: Path, pid: int) -> None:
        """Give this start of the container a boot id of its own: a fresh random UUID (as the
        kernel prints it) bound read-only over BOOT_ID_PATH in its mount namespace, before
        create() returns, so before aether or chronus answer anything. A memory pause keeps the
        container, so the id; every new start (create, a restart, the cold boot after a
        files-only pause, a warm or FnCall-pool container) gets a new one: what a program that
        compares boot ids across a pause expects of a machine.

        After the start, because runc refuses config mounts inside /proc; in-process (new mount
        API, ~0.1 ms) rather than `nsenter mount`, whose fork/exec every create would pay. A
        failure fails the create (MountError, with the errno): the id is no control, but a
        sandbox that silently shows the host's id would lie to exactly the programs that read
        it; the kernel features it needs are checked once at runtime start (boot_ids)."""
        source = sdir / "boot_id"
        source.write_text(f"{uuid.uuid4()}\n")
        try:
            bind_readonly_into(pid, source, BOOT_ID_PATH)
        except FileNotFoundError:
            # /proc/<pid>/ns/mnt is gone: pid 1 exited at once (a bad init). No namespace is
            # left to give an id to; the caller finds the dead init as without this step.
            log.info("pid 1 (%d) of %s exited before its boot id was mounted", pid, sdir.name)

    def lowers_of(self, sandbox_id: str) -> list[Path | LayerImage]:
        """The read-only layers a created sandbox runs on, top-most first (as LaunchSpec.lowers
        has them), from its record: what a fork's children must stack the capture on, whatever
        its image's name resolves to now."""
        rec = self._read_record(sandbox_id)
        if rec is None:
            raise SandboxNotFoundError(sandbox_id)
        return [layer_from_identity(d) for d in rec.get("layers", [])]

    def capture_upper(self, sandbox_id: str, *, freeze: bool) -> tuple[Path, CopyStats, float]:
        """Copy the sandbox's writable layer, all of it (whiteouts, opaque directories, /tmp),
        into a new directory beside the writable layers: (that directory, the copy's figures,
        the seconds the sandbox stood frozen). With `freeze` the layer is copied while the
        sandbox runs, then the sandbox is frozen while the copy is brought up to date (what
        changed meanwhile is copied again: edge.layers.tree.resync) and thawed right after;
        a paused sandbox (frozen already: pass False) is copied in one pass.

        overlayfs bookkeeping xattrs (origin, impure) are dropped: they name file handles of
        this sandbox's mount; the opaque mark is kept. The caller removes the directory."""
        upper = self.upper_dir(sandbox_id)
        dest = self.rw_dir / f"{FORK_CAPTURE_PREFIX}{sandbox_id}-{os.urandom(4).hex()}"
        stall = 0.0
        try:
            if not freeze:
                return dest, copy_tree(upper, dest), 0.0
            since_ns = time.time_ns()
            seen = precopy(upper, dest)
            t0 = time.perf_counter()
            self.pause(sandbox_id)
            try:
                stats = resync(upper, dest, seen, since_ns)
            finally:
                self.resume(sandbox_id)
                stall = time.perf_counter() - t0
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return dest, stats, stall

    def parked_upper(self, sandbox_id: str) -> Path:
        """Where a cold pause keeps the sandbox's writable layer (`park_upper`)."""
        return self.rw_dir / f"{PARKED_PREFIX}{sandbox_id}"

    def park_upper(self, sandbox_id: str) -> Path:
        """Copy the writable layer of a stopped sandbox, all of it, to `parked_upper` (a cold
        pause, before the sandbox is destroyed); its cold boot later starts with it as its
        upper (`create`'s initial_upper). A copy, not a rename: the layer may be on a disk
        image of its own (a disk quota). Blocking."""
        dest = self.parked_upper(sandbox_id)
        shutil.rmtree(dest, ignore_errors=True)
        tmp, _stats, _ = self.capture_upper(sandbox_id, freeze=False)
        os.rename(tmp, dest)
        return dest

    def rename(
        self,
        old: str,
        new: str,
        *,
        hostname: str,
        cpu_millis: int,
        memory_mb: int,
        pids_max: int,
    ) -> SandboxProcess:
        """Give a started sandbox another id (a warm sandbox its owner's): its directories,
        runc state, cgroups, record and layer holders move to the new name, its hostname and
        /etc files change, and its cgroup limits become the given ones. Nothing
        else differs afterwards from a sandbox created under `new`. Blocking.

        A crash midway leaves state under both names, neither in the edge's records: orphans
        that `cleanup_orphans` removes (it collects ids from every source)."""
        osd, nsd = self.sandbox_dir(old), self.sandbox_dir(new)
        rec = self._read_record(old)
        if rec is None:
            raise SandboxNotFoundError(old)
        if self._container_exists(new) or nsd.exists() or self.writable_dir(new).exists():
            raise SandboxExistsError(new)
        with Phases() as ph:
            ph.next("edge.rename.cgroups")
            pid = self._init_pid(old)
            ocg, ncg = self.cgroup_path(old), self.cgroup_path(new)
            unified_left = cgroups.rename(ocg, ncg)
            ph.next("edge.rename.dirs")
            os.rename(self.writable_dir(old), self.writable_dir(new))
            with self._disks_lock:
                if old in self._disks:
                    self._disks[new] = self._disks.pop(old)
            os.rename(osd, nsd)
            if unified_left:
                # Its cgroup2 directory keeps the old name until `finish_rename`, which the edge
                # runs right after the claim; after a crash in between, `cleanup_orphans` finishes
                # the move for the sandboxes it keeps before it collects orphans.
                (nsd / "unified.pending").write_text(old)
            link = nsd / "upper"
            target = os.readlink(link).replace(
                os.fspath(self.writable_dir(old)), os.fspath(self.writable_dir(new)), 1
            )
            link.unlink()
            link.symlink_to(target)
            ph.next("edge.rename.runc_state")
            os.rename(self.runc_root / old, self.runc_root / new)
            # runc's state and our bundle name the container by its id in every path (cgroups,
            # rootfs, bind sources); the id is a random token, so a plain replace is exact.
            for f in (self.runc_root / new / "state.json", nsd / "config.json"):
                f.write_text(f.read_text().replace(old, new))
            ph.next("edge.rename.record_layers")
            holders = self._record_layers(rec)
            rec["sandbox_id"] = new
            rec["cgroup_path"] = ncg
            if rec.get("log_path"):
                rec["log_path"] = rec["log_path"].replace(old, new)
            (nsd / "record.json").write_text(json.dumps(rec))
            for (holder, layer), (new_holder, _) in zip(
                holders, self._record_layers(rec), strict=True
            ):
                self.layers.acquire(layer, new_holder)
                self.layers.release(layer, holder)
            ph.next("edge.rename.hostname")
            set_hostname_of(pid, hostname)
            rewrite_in_place(nsd / "etc" / "hostname", hostname + "\n")
            rewrite_in_place(nsd / "etc" / "hosts", hosts_file(hostname))
            ph.next("edge.rename.limits")
            cgroups.set_limits(
                ncg,
                cpu_quota_us=cpu_quota_us(cpu_millis),
                cpu_shares=cpu_shares(cpu_millis),
                memory_bytes=memory_mb * 1024 * 1024,
                pids_max=pids_max,
            )
        return SandboxProcess(
            sandbox_id=new,
            pid=pid,
            rootfs=nsd / "rootfs",
            upper=Path(target),
            cgroup_path=ncg,
            log_path=Path(rec["log_path"]) if rec.get("log_path") else None,
        )

    def finish_rename(self, new: str) -> None:
        """Move the renamed sandbox's cgroup2 directory to its new name (see `rename`)."""
        pending = self.sandbox_dir(new) / "unified.pending"
        try:
            old = pending.read_text()
        except FileNotFoundError:
            return
        cgroups.move_unified(self.cgroup_path(old), self.cgroup_path(new))
        pending.unlink()

    def seccomp_memfd(self) -> int:
        """The runtime's profile compiled once (seccomp_bpf) in a sealed memfd, kept open for
        the runtime's life and dup'd into every init that installs the filter itself."""
        with self._seccomp_lock:
            if self._seccomp_memfd is None:
                self._seccomp_memfd = seccomp_bpf.sealed_memfd(
                    seccomp_bpf.compile_profile(hardened_seccomp())
                )
            return self._seccomp_memfd

    def state(self, sandbox_id: str) -> RuntimeState:
        """RUNNING / PAUSED / STOPPED / MISSING, from runc (which checks pid start times)."""
        self.sandbox_dir(sandbox_id)
        if not self._container_exists(sandbox_id):
            return RuntimeState(SandboxStatus.MISSING)
        r = self._run("state", sandbox_id, check=False)
        if r.returncode != 0:
            if not self._container_exists(sandbox_id):
                return RuntimeState(SandboxStatus.MISSING)
            raise RuncError(self._runc_cmd("state", sandbox_id), r.returncode, r.stderr)
        st = json.loads(r.stdout)
        status = _STATUS.get(st.get("status", ""), SandboxStatus.STOPPED)
        pid = int(st.get("pid") or 0) or None
        if status is SandboxStatus.STOPPED:
            self.reap(sandbox_id)
        return RuntimeState(status, pid)

    def stop(self, sandbox_id: str, grace_s: float = 2.0) -> None:
        """SIGTERM to pid 1, up to `grace_s` for it to exit, then SIGKILL.

        Killing pid 1 of the sandbox's pid namespace makes the kernel kill every other process
        in it (including `runc exec`ed ones), which is what `runc kill --all` would do, without
        runc's freeze-signal-thaw round trip. A paused sandbox is thawed so it can act on the
        signals (v1 freezer: frozen tasks ignore even SIGKILL until thawed).
        """
        # Not `runc state` (a Go process per call, ~5 ms of CPU here): the pid file and a pidfd
        # checked against the sandbox's cgroup say the same, and the freezer says if paused.
        if not self._container_exists(sandbox_id):
            return
        cg = self.cgroup_path(sandbox_id)
        pid = self._init_pid(sandbox_id)
        pidfd = _open_pidfd_in_cgroup(pid, cg) if pid else None
        if pidfd is None:
            self.reap(sandbox_id)
            return
        try:
            if grace_s > 0:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGTERM)
                if cgroups.freezer_state(cg) in ("FROZEN", "FREEZING"):
                    cgroups.thaw(cg)
                if _wait_pidfd(pidfd, grace_s):
                    self._kill_leftovers(cg)
                    self.reap(sandbox_id)
                    return
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            cgroups.thaw(cg)
            if not _wait_pidfd(pidfd, 10.0):
                raise SandboxRuntimeError(
                    f"pid 1 of {sandbox_id} ({pid}) survived SIGKILL for 10 s"
                )
        finally:
            os.close(pidfd)
        self._kill_leftovers(cg)
        self.reap(sandbox_id)

    def _kill_leftovers(self, cg: str) -> None:
        """Belt and braces after pid 1 died: anything still in the cgroup (nothing should be,
        the pid namespace is gone) gets SIGKILL."""
        d = cgroups.controller_dir("pids", cg)
        if d is None:
            return
        for _ in range(200):
            pids = cgroups.procs(d)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def reap(self, sandbox_id: str) -> int | None:
        """Collect pid 1's exit status if it has exited and is our child; returns the exit code
        (negative signal number when killed), also remembered in exit.json. None if unknown."""
        sdir = self.sandbox_dir(sandbox_id)
        exit_file = sdir / "exit.json"
        with contextlib.suppress(OSError, ValueError):
            code: int = json.loads(exit_file.read_text())["exit_code"]
            return code
        try:
            pid = int((sdir / "init.pid").read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            return None  # not our child (edge restarted, or not a subreaper): nothing to collect
        if res is None:
            return None
        code = res.si_status if res.si_code == os.CLD_EXITED else -res.si_status
        with contextlib.suppress(OSError):
            exit_file.write_text(json.dumps({"exit_code": code}))
        return code

    def destroy(self, sandbox_id: str, grace_s: float = 0.0) -> None:
        """Remove every trace of the sandbox: processes, runc state, cgroups, overlay, layer
        references, state directory (upper included). Idempotent; parts already gone are
        skipped silently. Raises SandboxRuntimeError only if something could not be removed
        (after trying everything else)."""
        self._destroy(sandbox_id, grace_s)

    def _destroy(self, sandbox_id: str, grace_s: float = 0.0) -> list[str]:
        sdir = self.sandbox_dir(sandbox_id)
        cg = self.cgroup_path(sandbox_id)
        rec = self._read_record(sandbox_id)
        removed: list[str] = []
        errors: list[str] = []
        with contextlib.suppress(OSError):
            self.finish_rename(sandbox_id)  # a cgroup2 directory still under its warm name

        def attempt(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as exc:  # keep going: leaving the rest behind would be worse
                log.warning("destroy %s: %s failed: %s", sandbox_id, what, exc)
                errors.append(f"{what}: {exc}")

        if self._container_exists(sandbox_id):
            attempt("runc delete", lambda: self._remove_container(sandbox_id, cg, grace_s))
            removed.append(f"container:{sandbox_id}")
        leftover = cgroups.existing_dirs(cg)
        if leftover:  # runc delete removes them; these are from a crash mid-create or mid-delete
            attempt("cgroups", lambda: cgroups.remove(cg))
            removed += [f"cgroup:{d}" for d in leftover]
        rw = self.writable_dir(sandbox_id)
        self._drop_disk(sandbox_id)
        infos = read_mountinfo()  # once: a started sandbox keeps no mount here (see create)
        mine = [*mounts_under(sdir, infos), *mounts_under(rw, infos)]
        for m in mine:
            attempt(f"umount {m.mountpoint}", functools.partial(umount_quiet, m.mountpoint))
            removed.append(f"mount:{m.mountpoint}")
        for holder, layer in self._record_layers(rec) if rec else []:
            mp = self.layers.mountpoint(layer) if isinstance(layer, LayerImage) else None
            if self.layers.release(layer, holder):
                removed.append(f"layer:{mp}")
        left = read_mountinfo() if mine else []  # what the unmounts above did not take
        for d in (sdir, rw):
            if d.exists() or d.is_symlink():
                if mounts_under(d, left):
                    errors.append(f"{d} still has mounts; not removing it")
                else:
                    attempt(f"rmtree {d}", functools.partial(shutil.rmtree, d))
                    removed.append(f"state:{d}")
        if errors:
            raise SandboxRuntimeError(f"destroy {sandbox_id} incomplete: " + "; ".join(errors))
        return removed

    def _remove_container(self, sandbox_id: str, cg: str, grace_s: float = 0.0) -> None:
        """Kill pid 1 (gracefully if asked), then `runc delete`.

        pid 1 is killed by us first, without asking runc for its state: `runc delete --force`
        on a live container polls for its death in 100 ms sleeps, which alone would triple
        destroy's latency, while a pidfd tells us the moment it is gone.
        """
        if grace_s > 0:
            self.stop(sandbox_id, grace_s)
        else:
            self._kill_now(sandbox_id, cg)
        if not self._container_exists(sandbox_id):
            return
        pids = cgroups.controller_dir("pids", cg)
        if pids is None or not pids.is_dir() or not cgroups.procs(pids):
            # Nothing of it runs any more: what `runc delete` would do for a stopped container
            # (no poststop hooks in our bundles) is removing its cgroups and its state
            # directory, done here without starting runc (~5 ms of CPU per sandbox).
            cgroups.remove(cg)
            left = cgroups.existing_dirs(cg)
            if left:
                raise SandboxRuntimeError(f"cgroups of {sandbox_id} not removed: {left}")
            shutil.rmtree(self.runc_root / sandbox_id)
            return
        r = self._run("delete", "--force", sandbox_id, check=False)
        if r.returncode != 0 and self._container_exists(sandbox_id):
            raise RuncError(self._runc_cmd("delete", "--force", sandbox_id), r.returncode, r.stderr)

    def _init_pid(self, sandbox_id: str) -> int:
        """pid 1 of the sandbox as runc wrote it at start (0 if unknown)."""
        try:
            return int((self.sandbox_dir(sandbox_id) / "init.pid").read_text().strip())
        except (OSError, ValueError):
            return 0

    def _kill_now(self, sandbox_id: str, cg: str) -> None:
        pid = self._init_pid(sandbox_id)
        pidfd = _open_pidfd_in_cgroup(pid, cg) if pid > 0 else None
        if pidfd is not None:
            try:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                cgroups.thaw(cg)
                if not _wait_pidfd(pidfd, 10.0):
                    raise SandboxRuntimeError(
                        f"pid 1 of {sandbox_id} ({pid}) survived SIGKILL for 10 s"
                    )
            finally:
                os.close(pidfd)
        self._kill_leftovers(cg)
        self.reap(sandbox_id)

    def pause(self, sandbox_id: str) -> None:
        """Freeze every process of the sandbox: the cgroup v1 freezer, written directly (runc
        reads a paused container's state from it too); `runc pause` if that fails."""
        self._require(sandbox_id)
        if not cgroups.freeze(self.cgroup_path(sandbox_id)):
            self._run("pause", sandbox_id)

    def resume(self, sandbox_id: str) -> None:
        self._require(sandbox_id)
        cg = self.cgroup_path(sandbox_id)
        if cgroups.freezer_state(cg) is None:
            self._run("resume", sandbox_id)
        else:
            cgroups.thaw(cg)

    def _require(self, sandbox_id: str) -> None:
        self.sandbox_dir(sandbox_id)
        if not self._container_exists(sandbox_id):
            raise SandboxNotFoundError(sandbox_id)

    # ------------------------------------------------------------------ observation

    def was_oom_killed(self, sandbox_id: str) -> bool:
        """Whether the kernel OOM-killed anything in the sandbox (memory.oom_control oom_kill).

        Read it before destroy(): the counter lives in the memory cgroup, which destroy removes.
        """
        self.sandbox_dir(sandbox_id)
        oom = cgroups.read_keyed("memory", self.cgroup_path(sandbox_id), "memory.oom_control")
        return oom.get("oom_kill", 0) > 0

    def stats(self, sandbox_id: str) -> RuntimeStats:
        self.sandbox_dir(sandbox_id)
        cg = self.cgroup_path(sandbox_id)
        mem = cgroups.read_int("memory", cg, "memory.usage_in_bytes")
        if mem is None:
            raise SandboxNotFoundError(sandbox_id)
        return RuntimeStats(
            memory_bytes=mem,
            memory_limit_bytes=cgroups.read_int("memory", cg, "memory.limit_in_bytes") or 0,
            cpu_ns=cgroups.read_int("cpuacct", cg, "cpuacct.usage") or 0,
            pids=cgroups.read_int("pids", cg, "pids.current") or 0,
        )

    def list_ids(self) -> list[str]:
        """Ids with any state of ours on disk: a sandbox directory or a runc container."""
        ids = {d.name for d in self._dirs()}
        for root in (self.runc_root, self.rw_dir):
            with contextlib.suppress(FileNotFoundError):
                ids.update(e.name for e in root.iterdir() if SANDBOX_ID_RE.fullmatch(e.name))
        return sorted(ids)

    def exec_sync(
        self,
        sandbox_id: str,
        argv: list[str],
        *,
        timeout_s: float = 30.0,
        input_bytes: bytes | None = None,
    ) -> subprocess.CompletedProcess[bytes]:
        """`runc exec` a command and collect its output: for tests and operators' diagnosis.

        Sandbox commands in production go through aether/chronus, not through this. Where pid 1
        installed the seccomp filter itself (`LaunchSpec.seccomp_fd_env`), a `runc exec`ed
        process is not under it (it is no descendant of pid 1): operators' use only.
        """
        self._require(sandbox_id)
        return subprocess.run(
            [*self._runc_cmd("exec", sandbox_id), *argv],
            input=input_bytes,
            capture_output=True,
            timeout=timeout_s,
            env=_RUNC_ENV,
        )

    # ------------------------------------------------------------------ crash recovery

    def cleanup_orphans(self, keep: set[str]) -> list[str]:
        """Remove everything of every sandbox not in `keep`; returns what was removed as
        "kind:detail" strings (container, cgroup, mount, layer, state).

        Finds orphans from every source, since a crash can leave any subset: sandbox
        directories, runc containers, cgroups under our parent, overlay mounts under our
        sandboxes directory; then unmounts layer images nobody holds any more.
        """
        for sid in keep:
            with contextlib.suppress(OSError, InvalidLaunchSpecError):
                self.finish_rename(sid)  # before its old cgroup2 name looks like an orphan
        ids = set(self.list_ids()) | {
            name for name in cgroups.children(self.cgroup_parent) if SANDBOX_ID_RE.fullmatch(name)
        }
        for base in (self.sandboxes_dir, self.rw_dir):
            for m in mounts_under(base):
                rel = Path(m.mountpoint).relative_to(base)
                if rel.parts and SANDBOX_ID_RE.fullmatch(rel.parts[0]):
                    ids.add(rel.parts[0])
        removed: list[str] = []
        for sid in sorted(ids - keep):
            try:
                removed += self._destroy(sid)
            except SandboxRuntimeError:
                log.exception("cleanup of orphan %s incomplete", sid)
        for capture in self.rw_dir.glob(FORK_CAPTURE_PREFIX + "*"):
            shutil.rmtree(capture, ignore_errors=True)
            removed.append(f"fork-capture:{capture.name}")
        for parked in self.rw_dir.glob(PARKED_PREFIX + "*"):
            if parked.name.removeprefix(PARKED_PREFIX) not in keep:
                shutil.rmtree(parked, ignore_errors=True)
                removed.append(f"parked:{parked.name}")
        self.layers.recover(self._claims(only=keep))
        removed += [f"layer:{p}" for p in self.layers.unmount_unused()]
        return removed


def _fill_upper(tree: Path, upper: Path, disk_mb: int) -> None:
    """Copy a fork's capture into a new sandbox's (empty, not yet mounted) writable layer."""
    try:
        copy_tree(tree, upper)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SandboxRuntimeError(
                f"the source's files do not fit the sandbox's disk limit ({disk_mb} MiB)"
            ) from exc
        raise


def _upper_through(disk_fd: int) -> Path:
    """The upper on a quota filesystem that is on no mount table, through the edge's
    descriptor of its root (disk.hold): opened directly by the edge and its root children."""
    return Path(f"/proc/{os.getpid()}/fd/{disk_fd}/upper")


def _sudo_over(rootfs: Path, toolkit: Path | None) -> bool:
    """Whether dsec-sudo goes over the image's /usr/bin/sudo: the image has one (a regular file:
    a file bind cannot go over a directory) and the toolkit has dsec-sudo. An image without sudo
    gets none (runc would create the mountpoint in its writable layer); /.dsec/bin/dsec-sudo is
    there in every sandbox."""
    if toolkit is None or not (toolkit / SUDO_SHIM).is_file():
        return False
    path, *parents = rootfs / SUDO_PATH.lstrip("/"), rootfs / "usr", rootfs / "usr" / "bin"
    try:
        # Each component without following a link: an image's link resolves on the host here.
        return all(stat.S_ISDIR(os.lstat(p).st_mode) for p in parents) and stat.S_ISREG(
            os.lstat(path).st_mode
        )
    except OSError:
        return False


def _holder(sandbox_id: str, use: int | str) -> str:
    """A layer holder is one *use* of a layer by a sandbox (lower i, or the toolkit), so a
    sandbox that uses one image twice holds it twice and releases it twice."""
    return f"{sandbox_id}:{use}"


class _Undo:
    """LIFO undo log for create(); each step is attempted even if an earlier one fails."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], object]] = []

    def push(self, fn: Callable[[], object]) -> None:
        self._steps.append(fn)

    def run(self) -> None:
        while self._steps:
            fn = self._steps.pop()
            try:
                fn()
            except Exception:
                log.exception("undo step failed")


def _open_pidfd_in_cgroup(pid: int, cgroup_path: str) -> int | None:
    """pidfd of `pid` if it is (still) a process in our sandbox's cgroup.

    The membership check after pidfd_open closes the pid-reuse window between reading the pid
    from runc and opening it: from then on the pidfd pins the process identity.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        os.close(fd)
        return None
    if not any(line.rpartition(":")[2] == cgroup_path for line in text.splitlines()):
        os.close(fd)
        return None
    return fd


def _runc_log_error(path: Path) -> str:
    """The error lines of runc's JSON log (what `runc run` printed to its stderr)."""
    msgs = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            msgs.append(line)
            continue
        if entry.get("level") in ("error", "fatal"):
            msgs.append(str(entry.get("msg", "")))
    return "\n".join(msgs) or "\n".join(lines[-5:])

"""What the edge asks the runtime to launch, and what it gets back."""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from pathlib import Path

from edge.runtime.errors import InvalidLaunchSpecError
from edge.runtime.mounts import Layer, LayerImage

SANDBOX_ID_RE = re.compile(r"[a-z0-9-]{1,64}")
_ENV_KEY_RE = re.compile(r"[^=\0]+")


@dataclass(frozen=True)
class BindMount:
    """A host directory shown at `target` inside the sandbox."""

    source: Path
    target: str
    readonly: bool = False


@dataclass(frozen=True)
class TmpfsMount:
    """A size-limited tmpfs at `target` (its pages count in the sandbox's memory cgroup)."""

    target: str
    size_mb: int
    mode: int = 0o755


@dataclass(frozen=True)
class LaunchSpec:
    """One sandbox as the runtime sees it: layers, pid 1 and limits.

    `lowers` are TOP-MOST FIRST (overlayfs order): a directory is used as-is, a file is mounted as
    an EROFS image, a `LayerImage` is an EROFS image with an optional chunked data blob.
    """

    sandbox_id: str
    lowers: list[Layer]
    init_argv: list[str]
    env: dict[str, str]
    cwd: str = "/"
    cpu_millis: int = 1000
    memory_mb: int = 512
    pids_max: int = 512
    hostname: str = ""
    toolkit_dir: Path | None = None
    pass_fd: int | None = None
    log_path: Path | None = None
    netns_path: str | None = None
    #: More descriptors for pid 1, as fds 4, 5, ... (after pass_fd, which must be set).
    extra_fds: tuple[int, ...] = ()
    #: Nameservers of the sandbox's resolv.conf; None = the host's (minus loopback ones).
    dns_servers: tuple[str, ...] | None = None
    #: Quota of the writable layer in MiB (a size-limited filesystem); 0 = none.
    disk_mb: int = 0
    #: Extra bind mounts (host directory -> path in the sandbox).
    binds: tuple[BindMount, ...] = ()
    #: tmpfs mounts (e.g. the FnCall pools' /job and /tmp: a file created on the overlay costs
    #: ~0.2 ms there, on tmpfs ~6 us).
    tmpfs: tuple[TmpfsMount, ...] = ()
    #: AppArmor profile of every process of the sandbox ("" = none; hosts without AppArmor).
    apparmor_profile: str = ""
    #: If set, the runtime does not have runc install the seccomp profile: pid 1 receives the
    #: compiled program (a sealed memfd, as the fd after `extra_fds`) under this environment
    #: variable and must install it itself before anything else (aether does). Saves runc's
    #: per-start libseccomp compilation (edge/runtime/seccomp_bpf.py). Needs `pass_fd`.
    seccomp_fd_env: str = ""
    #: Keep the rootfs overlay mounted on the host after the start (for tools that need a host
    #: path to the sandbox's root: GPU injection). By default it is detached once pid 1 runs.
    keep_host_rootfs: bool = False
    #: A tree in overlayfs form (whiteouts, opaque directories) copied into the new writable
    #: layer before the overlay is mounted: a fork's capture of its source's writable layer.
    #: The copy is inside the disk quota, so those files count toward `disk_mb`.
    initial_upper: Path | None = None

    @property
    def effective_hostname(self) -> str:
        return self.hostname or self.sandbox_id[:63]

    def validate(self) -> None:
        """Raise InvalidLaunchSpecError on anything runc would reject later (or worse, accept)."""
        if not SANDBOX_ID_RE.fullmatch(self.sandbox_id):
            raise InvalidLaunchSpecError(
                f"sandbox id {self.sandbox_id!r} must match [a-z0-9-]{{1,64}}"
            )
        if not self.lowers:
            raise InvalidLaunchSpecError("at least one lower layer is required")
        for layer in self.lowers:
            p = layer.image if isinstance(layer, LayerImage) else Path(layer)
            if not p.exists():
                raise InvalidLaunchSpecError(f"layer {os.fspath(p)!r} does not exist")
        if not self.init_argv or not all(
            isinstance(a, str) and "\0" not in a for a in self.init_argv
        ):
            raise InvalidLaunchSpecError(
                "init_argv must be a non-empty list of strings without NUL"
            )
        for k, v in self.env.items():
            if not _ENV_KEY_RE.fullmatch(k) or "\0" in v:
                raise InvalidLaunchSpecError(f"bad environment variable {k!r}")
        if not self.cwd.startswith("/"):
            raise InvalidLaunchSpecError(f"cwd {self.cwd!r} must be absolute")
        if self.cpu_millis < 10:
            raise InvalidLaunchSpecError(
                f"cpu_millis {self.cpu_millis} is below the 10 millicore minimum"
            )
        if self.memory_mb < 8:
            raise InvalidLaunchSpecError(f"memory_mb {self.memory_mb} is below the 8 MiB minimum")
        if self.pids_max < 4:
            raise InvalidLaunchSpecError(f"pids_max {self.pids_max} is below 4")
        host = self.effective_hostname
        if len(host) > 63 or not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?", host):
            raise InvalidLaunchSpecError(f"hostname {host!r} is not a valid host name")
        if self.toolkit_dir is not None and not self.toolkit_dir.exists():
            raise InvalidLaunchSpecError(f"toolkit {os.fspath(self.toolkit_dir)!r} does not exist")
        if self.pass_fd is not None and self.pass_fd < 0:
            raise InvalidLaunchSpecError(f"pass_fd {self.pass_fd} is not a file descriptor")
        if self.netns_path is not None and not os.path.exists(self.netns_path):
            raise InvalidLaunchSpecError(f"netns {self.netns_path!r} does not exist")
        if self.extra_fds and self.pass_fd is None:
            raise InvalidLaunchSpecError("extra_fds need pass_fd (they follow it as fd 4, 5, ...)")
        if self.seccomp_fd_env and self.pass_fd is None:
            raise InvalidLaunchSpecError("seccomp_fd_env needs pass_fd (the program follows it)")
        if self.seccomp_fd_env and not re.fullmatch(r"[A-Z_][A-Z0-9_]*", self.seccomp_fd_env):
            raise InvalidLaunchSpecError(f"seccomp_fd_env {self.seccomp_fd_env!r} is no name")
        if any(fd < 0 for fd in self.extra_fds):
            raise InvalidLaunchSpecError(f"extra_fds {self.extra_fds} are not all descriptors")
        if self.disk_mb < 0 or 0 < self.disk_mb < 16:
            raise InvalidLaunchSpecError(f"disk_mb {self.disk_mb} must be 0 (none) or >= 16")
        for b in self.binds:
            if not b.target.startswith("/") or ".." in b.target.split("/"):
                raise InvalidLaunchSpecError(f"bind target {b.target!r} must be absolute, no ..")
            if not b.source.is_dir():
                raise InvalidLaunchSpecError(f"bind source {os.fspath(b.source)!r} is no directory")
        if self.initial_upper is not None and not self.initial_upper.is_dir():
            raise InvalidLaunchSpecError(
                f"initial upper {os.fspath(self.initial_upper)!r} is no directory"
            )
        for t in self.tmpfs:
            if not t.target.startswith("/") or ".." in t.target.split("/") or t.target == "/":
                raise InvalidLaunchSpecError(f"tmpfs target {t.target!r} must be absolute, no ..")
            if t.size_mb < 1 or not 0 <= t.mode <= 0o7777:
                raise InvalidLaunchSpecError(f"tmpfs {t.target}: size_mb >= 1, mode 0..0o7777")


class SandboxStatus(enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"  # pid 1 exited (or never started); resources still held until destroy
    MISSING = "missing"  # the runtime has no container of this id


@dataclass(frozen=True)
class RuntimeState:
    status: SandboxStatus
    pid: int | None = None


@dataclass(frozen=True)
class SandboxProcess:
    """A created sandbox: its init pid and where its pieces live on the host."""

    sandbox_id: str
    pid: int
    rootfs: Path
    upper: Path
    cgroup_path: str
    log_path: Path | None


@dataclass(frozen=True)
class RuntimeStats:
    memory_bytes: int  # memory.usage_in_bytes (rss + page cache charged to the sandbox)
    memory_limit_bytes: int
    cpu_ns: int  # cpuacct.usage
    pids: int  # pids.current

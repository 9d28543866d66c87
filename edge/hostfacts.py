"""What this host offers the edge: the facts its controls rest on, and what the edge does here.

One place for both readers:

- the edge at start (``edge/controls.py``): each control it needs is enforced, or it refuses
  to start naming what is missing (fail closed);
- ``scripts/setup.sh``, before it installs anything, with the host's own ``python3``
  (``python3 -m edge.hostfacts`` from the checkout): what will and will not be enforced, and
  whether the edge will start at all.

So this module imports nothing outside the standard library (the venv does not exist yet when
setup runs it) and keeps to Python 3.9 (Debian 11's). Facts are read, never changed: nothing
here mounts, loads a module or writes a file.

The facts: the kernel; the cgroup layout (``hybrid``: v1 controllers plus a cgroup2 mount, the
layout this edge enforces its limits through; ``unified``: cgroup v2 only, what Debian 12,
Ubuntu 22.04/24.04 and Fedora boot with; ``legacy``: v1 only); swap accounting; the Landlock
ABI; seccomp; EROFS and whether it mounts image files directly (file-backed, kernel 6.12) or
through loop devices (older kernels); loop devices (disk limits); bpffs and a cgroup2 mount (network
policy); AppArmor; ``process_madvise`` (pause gives memory back); ``/dev/kvm``.
"""

from __future__ import annotations

import ctypes
import functools
import gzip
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

#: The Landlock ABI chronus needs: signal and abstract-socket scoping came with ABI 6.
LANDLOCK_MIN_ABI = 6
#: Controls an operator may turn off (``DSEC_EDGE_DISABLED_CONTROLS``), and what that means.
DISABLEABLE = {
    "landlock": "commands run without Landlock file/socket/signal domains",
    "network": "sandboxes get no network (networked policies are refused)",
    "memory_swap": "a sandbox may use swap up to its memory limit",
}
#: The cgroup v1 controllers the edge's limits go through.
V1_CONTROLLERS = ("cpu", "memory", "pids", "freezer")
#: What a cgroup v2-only host can do today.
UNIFIED_HINT = (
    "this edge enforces its limits through cgroup v1: on a systemd host, boot with "
    "systemd.unified_cgroup_hierarchy=0 for the hybrid layout"
)
#: The kernel that mounts an EROFS image file directly (no loop device).
EROFS_FILE_BACKED_SINCE = (6, 12)
#: How the edge mounts EROFS images (DSEC_EDGE_EROFS_MOUNT, edge/runtime/mounts.py): "file"
#: (the image file itself: the kernel's file-backed mode), "loop" (read-only loop devices),
#: "auto" (file where the kernel has it: `resolve_erofs_mode`).
EROFS_MODES = ("auto", "file", "loop")

_BPF_FS_MAGIC = 0xCAFE4A11
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_PROCESS_MADVISE = 440
_ENOSYS = 38


# ------------------------------------------------------------------------------- cgroups


def cgroup_mounts(mountinfo: str) -> dict[str, str]:
    """Controller name -> mount point, from the text of ``/proc/self/mountinfo``: the v1 super
    options' controllers ("memory", "cpu", "name=systemd", ...) and "unified" for cgroup2. A
    hierarchy with several controllers appears once per controller."""
    out: dict[str, str] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        mountpoint = lf[4].replace("\\040", " ")
        if rf[0] == "cgroup2":
            out.setdefault("unified", mountpoint)
        elif rf[0] == "cgroup":
            for opt in rf[2].split(","):
                if opt in ("rw", "ro") or opt.startswith(("release_agent=", "clone_children")):
                    continue
                out.setdefault(opt, mountpoint)
    return out


def host_cgroup_mounts() -> dict[str, str]:
    return cgroup_mounts(Path("/proc/self/mountinfo").read_text(errors="surrogateescape"))


@dataclass(frozen=True)
class CgroupLayout:
    kind: str  # hybrid | unified | legacy | none
    mounts: dict[str, str]
    #: the controllers the cgroup2 root offers (cgroup.controllers): on a hybrid host, the
    #: ones no v1 hierarchy took
    v2_controllers: tuple[str, ...]

    def describe(self) -> str:
        v1 = [c for c in V1_CONTROLLERS if c in self.mounts]
        unified = self.mounts.get("unified")
        v2 = f"cgroup2 at {unified}" if unified else ""
        if self.v2_controllers:
            v2 += f" ({', '.join(self.v2_controllers)})"
        if self.kind == "hybrid":
            return f"hybrid: v1 {', '.join(v1)}; {v2}"
        if self.kind == "unified":
            return f"cgroup v2 only: {v2}"
        if self.kind == "legacy":
            return f"cgroup v1 only: {', '.join(v1) or 'no controllers'}; no cgroup2 mount"
        return "no cgroup hierarchy mounted"


def cgroup_layout(mounts: dict[str, str] | None = None) -> CgroupLayout:
    m = host_cgroup_mounts() if mounts is None else mounts
    v1 = any(c in m for c in V1_CONTROLLERS)
    unified = m.get("unified")
    controllers: tuple[str, ...] = ()
    if unified:
        try:
            controllers = tuple(Path(unified, "cgroup.controllers").read_text().split())
        except OSError:
            pass
    kind = "hybrid" if v1 and unified else "legacy" if v1 else "unified" if unified else "none"
    return CgroupLayout(kind, dict(m), controllers)


# ------------------------------------------------------------------------------- kernel


def kernel_version(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of a release string such as "6.1.0-27-amd64"."""
    parts = (release or platform.release()).split("-")[0].split(".")
    nums = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts[:2]]
    major, minor = [*nums, 0, 0][:2]
    return major, minor


def kernel_config() -> dict[str, str]:
    """The running kernel's build options (/proc/config.gz, else /boot/config-<release>);
    empty when neither is readable."""
    text = ""
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            text = f.read()
    except OSError:
        try:
            text = Path(f"/boot/config-{platform.release()}").read_text()
        except OSError:
            return {}
    out = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if eq and key.startswith("CONFIG_"):
            out[key] = value
    return out


def _syscall(nr: int, *args: object) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ret = int(libc.syscall(nr, *args))
    return ret, ctypes.get_errno()


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is not enabled (``lsm=``)."""
    if platform.machine() not in ("x86_64", "aarch64"):
        return 0
    abi, _ = _syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), 1)
    return max(abi, 0)


def has_process_madvise() -> bool:
    """Whether process_madvise(2) exists (5.10): asked with a bad pidfd, it says EBADF."""
    if platform.machine() not in ("x86_64", "aarch64"):
        return False
    ret, err = _syscall(_SYS_PROCESS_MADVISE, -1, None, ctypes.c_size_t(0), 0, 0)
    return not (ret == -1 and err == _ENOSYS)


def is_bpffs(path: Path) -> bool:
    class _Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]

    buf = _Statfs()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return False
    return (buf.f_type & 0xFFFFFFFF) == _BPF_FS_MAGIC


@functools.lru_cache(maxsize=1)
def erofs() -> tuple[bool, bool, str]:
    """(EROFS available, image files mounted directly, detail). Read once per process."""
    try:
        filesystems = Path("/proc/filesystems").read_text().split()
    except OSError:
        filesystems = []
    release = platform.release()
    module = any(Path(f"/lib/modules/{release}/kernel/fs/erofs").glob("erofs.ko*"))
    if "erofs" not in filesystems and not module:
        return False, False, "no EROFS in this kernel"
    config = kernel_config()
    if config:
        direct = config.get("CONFIG_EROFS_FS_BACKED_BY_FILE") == "y"
        how = (
            "CONFIG_EROFS_FS_BACKED_BY_FILE=y"
            if direct
            else f"kernel {release} has no CONFIG_EROFS_FS_BACKED_BY_FILE"
        )
    else:
        direct = kernel_version() >= EROFS_FILE_BACKED_SINCE
        how = f"kernel {'>=' if direct else '<'} 6.12 (no kernel config to read)"
    return True, direct, how


def apparmor() -> tuple[bool, str]:
    """Whether the host runs AppArmor and the edge can load a profile (apparmor_parser)."""
    enabled = Path("/sys/module/apparmor/parameters/enabled")
    try:
        on = enabled.read_text().strip() == "Y"
    except OSError:
        on = False
    if not on:
        return False, "not enabled in this kernel"
    if shutil.which("apparmor_parser") is None:
        return False, "enabled, but apparmor_parser is not installed (apt: apparmor)"
    return True, "enabled, apparmor_parser installed"


def kvm() -> tuple[bool, str]:
    dev = Path("/dev/kvm")
    if not dev.exists():
        return False, "no /dev/kvm: microVMs and VMs run under TCG (emulation, slow)"
    if not os.access(dev, os.R_OK | os.W_OK):
        return False, "/dev/kvm is not usable by this user: microVMs and VMs run under TCG"
    return True, "/dev/kvm (the edge boots a guest at start to confirm it, else TCG)"


# ------------------------------------------------------------------ the edge's controls


def probe(
    bpf_pin_dir: Path, erofs_mount: str = "auto", mounts: dict[str, str] | None = None
) -> dict[str, tuple[bool, str]]:
    """name -> (available, detail) for every control the edge needs (edge/controls.py decides
    what a missing one means: refuse, or run with it turned off by the operator).
    ``erofs_mount``: how the edge mounts EROFS images (EROFS_MODES); ``mounts``: the cgroup
    mounts (`cgroup_mounts`), read here when not given."""
    h = host_cgroup_mounts() if mounts is None else mounts
    out: dict[str, tuple[bool, str]] = {}
    unified_only = not any(c in h for c in V1_CONTROLLERS) and "unified" in h
    for c in V1_CONTROLLERS:
        if c in h:
            out[f"cgroup_{c}"] = (True, f"cgroup v1 at {h[c]}")
        elif unified_only:
            out[f"cgroup_{c}"] = (False, "this host has cgroup v2 only (no v1 hierarchies)")
        else:
            out[f"cgroup_{c}"] = (False, f"no cgroup v1 hierarchy with the {c} controller")
    memsw = h.get("memory")
    if memsw is not None and Path(memsw, "memory.memsw.limit_in_bytes").exists():
        out["memory_swap"] = (True, "memory.memsw.limit_in_bytes")
    else:
        out["memory_swap"] = (False, "no memory.memsw.* files (swap accounting is off)")
    abi = landlock_abi()
    out["landlock"] = (
        abi >= LANDLOCK_MIN_ABI,
        f"ABI {abi}" if abi else "Landlock is not enabled in this kernel (lsm=)",
    )
    actions = Path("/proc/sys/kernel/seccomp/actions_avail")
    ok = actions.exists() and "errno" in actions.read_text()
    out["seccomp"] = (ok, "seccomp filters" if ok else "no seccomp filter support")
    missing_disk = [] if Path("/dev/loop-control").exists() else ["/dev/loop-control"]
    if shutil.which("mkfs.ext4") is None:
        missing_disk.append("mkfs.ext4 (e2fsprogs)")
    out["disk_limit"] = (
        not missing_disk,
        "needs " + ", ".join(missing_disk) if missing_disk else "ext4 images on loop devices",
    )
    out["erofs"] = _erofs_control(erofs_mount)
    missing_net = [b for b in ("nft", "ip") if shutil.which(b) is None]
    if "unified" not in h:
        missing_net.append("a cgroup2 mount (for the eBPF policy programs)")
    root = bpf_pin_dir
    while not root.exists() and root != root.parent:
        root = root.parent
    if not is_bpffs(root):
        missing_net.append(f"bpffs at {bpf_pin_dir.parent}")
    out["network"] = (
        not missing_net,
        "veth + nftables + cgroup eBPF" if not missing_net else "needs " + ", ".join(missing_net),
    )
    return out


def resolve_erofs_mode(mode: str) -> str:
    """The EROFS mount mode in force for `mode` (one of EROFS_MODES): "file" or "loop"."""
    if mode not in EROFS_MODES:
        raise ValueError(f"EROFS mount mode {mode!r}: expected one of {', '.join(EROFS_MODES)}")
    if mode == "auto":
        return "file" if erofs()[1] else "loop"
    return mode


def _erofs_control(mode: str) -> tuple[bool, str]:
    have, direct, how = erofs()
    loop = Path("/dev/loop-control").exists()
    if not have:
        return False, how
    if resolve_erofs_mode(mode) == "file":
        if direct:
            return True, f"EROFS image files mounted directly ({how})"
        return (
            False,
            f"file-backed EROFS mounts need kernel 6.12 ({how}; DSEC_EDGE_EROFS_MOUNT=file)",
        )
    if loop:
        why = "DSEC_EDGE_EROFS_MOUNT=loop" if mode == "loop" else f"no file-backed mounts: {how}"
        return True, f"EROFS images on read-only loop devices ({why})"
    return False, f"no file-backed EROFS mounts ({how}) and no /dev/loop-control"


#: What setup installs or does itself, so a control it lacks before setup is not a refusal:
#: mkfs.ext4 (e2fsprogs), nft (nftables), ip (iproute2), bpffs (setup mounts it).
SETUP_PROVIDES = ("mkfs.ext4", "nft", "ip", "bpffs")


def report(bpf_pin_dir: Path = Path("/sys/fs/bpf/dsec/x")) -> tuple[list[str], list[str]]:
    """(lines for a person, the controls the edge would refuse to start without), as setup
    prints them before it installs anything."""
    layout = cgroup_layout()
    lines = [
        f"kernel {platform.release()} ({platform.machine()})",
        f"cgroups: {layout.describe()}",
    ]
    refused = []
    for name, (ok, detail) in probe(bpf_pin_dir, mounts=layout.mounts).items():
        if ok:
            lines.append(f"  {name:<14} enforced        {detail}")
            continue
        if detail.startswith("needs ") and all(
            part.split()[0] in SETUP_PROVIDES for part in detail[6:].split(", ")
        ):
            lines.append(f"  {name:<14} after setup     {detail} (setup installs it)")
            continue
        if name in DISABLEABLE:
            lines.append(
                f"  {name:<14} MISSING         {detail}: the edge refuses to start unless "
                f"DSEC_EDGE_DISABLED_CONTROLS names it ({DISABLEABLE[name]})"
            )
        else:
            lines.append(f"  {name:<14} MISSING         {detail}: the edge refuses to start")
        refused.append(name)
    aa, aa_detail = apparmor()
    lines.append(
        f"  {'apparmor':<14} {'enforced' if aa else 'not used':<15} "
        + (
            f"{aa_detail}: profile dsec-sandbox"
            if aa
            else f"{aa_detail} (Landlock holds the file rules)"
        )
    )
    pm = has_process_madvise()
    lines.append(
        f"  {'pause_pageout':<14} {'enforced' if pm else 'not used':<15} "
        + ("process_madvise(MADV_PAGEOUT)" if pm else "no process_madvise (kernel < 5.10)")
    )
    ok, kvm_detail = kvm()
    lines.append(f"  {'kvm':<14} {'present' if ok else 'absent':<15} {kvm_detail}")
    if layout.kind == "unified":
        lines.append(UNIFIED_HINT)
    return lines, refused


def main() -> int:
    lines, refused = report()
    print("dsec host check")
    for line in lines:
        print(line)
    if refused:
        print(
            f"verdict: the edge will refuse to start on this host (missing: {', '.join(refused)})"
        )
    else:
        print("verdict: the edge starts on this host with every required control enforced")
    return 1 if refused and "--strict" in sys.argv[1:] else 0


if __name__ == "__main__":
    sys.exit(main())

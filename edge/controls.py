"""The host controls the edge relies on, checked once at start: enforced, or the edge refuses.

Fail closed: a sandbox limit the host cannot enforce is a reason not to start, never a limit
skipped later because a cgroup file is absent. Each control is probed here; a missing one stops
the edge with a message naming it, unless the operator turned it off explicitly
(``DSEC_EDGE_DISABLED_CONTROLS``, logged at start and shown per edge by ``dsec status``). Only
controls whose absence has a defined, documented effect can be turned off:

- ``landlock``: commands run without Landlock domains (chronus gets DSEC_CHRONUS_LANDLOCK=off);
- ``network``: no sandbox networking (a networked policy is refused, NETWORK_UNAVAILABLE);
- ``memory_swap``: the memory limit holds, but a sandbox may also use swap up to it.

Optional by design (used where the host has it, shown as "absent" otherwise, with the reason):
``apparmor``; ``core_scheduling`` (a PR_SCHED_CORE cookie per latency-sensitive sandbox,
edge/backends/qos.py; not built into this machine kind's kernel).
The cgroup v1 controllers (cpu, memory, pids, freezer), seccomp and the writable-layer limit
(ext4 images on loop devices) cannot be turned off. A host with cgroup v2 only (no v1
hierarchies) is refused: this edge enforces its limits through cgroup v1.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from edge.backends import qos
from edge.runtime import cgroups

log = logging.getLogger(__name__)

ENFORCED, DISABLED, ABSENT = "enforced", "disabled", "absent"
#: Controls an operator may turn off, and what that means.
DISABLEABLE = {
    "landlock": "commands run without Landlock file/socket/signal domains",
    "network": "sandboxes get no network (networked policies are refused)",
    "memory_swap": "a sandbox may use swap up to its memory limit",
}
#: The Landlock ABI chronus needs: signal and abstract-socket scoping came with ABI 6.
LANDLOCK_MIN_ABI = 6
_BPF_FS_MAGIC = 0xCAFE4A11
_SYS_LANDLOCK_CREATE_RULESET = 444


@dataclass(frozen=True)
class Control:
    name: str
    state: str  # enforced | disabled | absent
    detail: str
    #: `dsec status` prints "<name>: <detail>" on a line of its own (what a backend or an
    #: optional control has to say beyond its state: the microVM accelerator, ...).
    status_line: bool = False


class ControlMissing(RuntimeError):
    """The host lacks controls the edge needs (the message names each, and how to proceed)."""


def landlock_abi() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = int(libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), 1))
    return max(abi, 0)


def _is_bpffs(path: Path) -> bool:
    class _Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]

    buf = _Statfs()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return False
    return (buf.f_type & 0xFFFFFFFF) == _BPF_FS_MAGIC


def _probe(bpf_pin_dir: Path) -> dict[str, tuple[bool, str]]:
    """name -> (available, detail) for every control, on this host."""
    h = cgroups.hierarchies()
    out: dict[str, tuple[bool, str]] = {}
    v1 = [c for c in ("cpu", "memory", "pids", "freezer") if c in h]
    unified_only = not v1 and "unified" in h
    for c in ("cpu", "memory", "pids", "freezer"):
        if c in h:
            out[f"cgroup_{c}"] = (True, f"cgroup v1 at {h[c]}")
        elif unified_only:
            out[f"cgroup_{c}"] = (False, "this host has cgroup v2 only (no v1 hierarchies)")
        else:
            out[f"cgroup_{c}"] = (False, f"no cgroup v1 hierarchy with the {c} controller")
    memsw = h.get("memory")
    if memsw is not None and (memsw / "memory.memsw.limit_in_bytes").exists():
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
    loop, mkfs = Path("/dev/loop-control").exists(), shutil.which("mkfs.ext4")
    out["disk_limit"] = (
        bool(loop and mkfs),
        "ext4 images on loop devices"
        if loop and mkfs
        else "needs /dev/loop-control and mkfs.ext4 (e2fsprogs)",
    )
    missing_net = [b for b in ("nft", "ip") if shutil.which(b) is None]
    if "unified" not in h:
        missing_net.append("a cgroup2 mount (for the eBPF policy programs)")
    root = bpf_pin_dir
    while not root.exists() and root != root.parent:
        root = root.parent
    if not _is_bpffs(root):
        missing_net.append(f"bpffs at {bpf_pin_dir.parent}")
    out["network"] = (
        not missing_net,
        "veth + nftables + cgroup eBPF" if not missing_net else "needs " + ", ".join(missing_net),
    )
    return out


def check(*, disabled: Iterable[str], bpf_pin_dir: Path, apparmor: bool) -> list[Control]:
    """Every control's state; raises ControlMissing naming each required one the host lacks."""
    off = set(disabled)
    unknown = off - set(DISABLEABLE)
    if unknown:
        raise ControlMissing(
            f"DSEC_EDGE_DISABLED_CONTROLS names {', '.join(sorted(unknown))}: only "
            f"{', '.join(sorted(DISABLEABLE))} can be turned off"
        )
    probed = _probe(bpf_pin_dir)
    controls: list[Control] = []
    missing: list[str] = []
    for name, (ok, detail) in probed.items():
        if name in off:
            controls.append(Control(name, DISABLED, DISABLEABLE[name]))
            log.warning("control %s turned off by the operator: %s", name, DISABLEABLE[name])
        elif ok:
            controls.append(Control(name, ENFORCED, detail))
        else:
            missing.append(f"{name} ({detail})")
    controls.append(
        Control("apparmor", ENFORCED if apparmor else ABSENT, "profile dsec-sandbox")
        if apparmor
        else Control("apparmor", ABSENT, "the host has no AppArmor (Landlock holds the file rules)")
    )
    core = qos.core_scheduling()
    controls.append(
        Control(
            "core_scheduling",
            ENFORCED if core.available else ABSENT,
            core.detail,
            status_line=True,  # whether latency-sensitive sandboxes get cookies, or why not
        )
    )
    if missing:
        turnable = [m.split(" ")[0] for m in missing if m.split(" ")[0] in DISABLEABLE]
        hint = (
            f"; to run without them, set DSEC_EDGE_DISABLED_CONTROLS={','.join(turnable)}"
            if turnable and len(turnable) == len(missing)
            else ""
        )
        raise ControlMissing(
            "the edge refuses to run half-confined; this host lacks: " + "; ".join(missing) + hint
        )
    return controls

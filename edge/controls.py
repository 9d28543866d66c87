"""The host controls the edge relies on, checked once at start: enforced, or the edge refuses.

Fail closed: a sandbox limit the host cannot enforce is a reason not to start, never a limit
skipped later because a cgroup file is absent. Each control is probed by edge/hostfacts.py
(which scripts/setup.sh also runs, before it installs anything, to say what this host will
enforce); a missing one stops the edge with a message naming it, unless the operator turned it off explicitly
(``DSEC_EDGE_DISABLED_CONTROLS``, logged at start and shown per edge by ``dsec status``). Only
controls whose absence has a defined, documented effect can be turned off:

- ``landlock``: commands run without Landlock domains (chronus gets DSEC_CHRONUS_LANDLOCK=off);
- ``network``: no sandbox networking (a networked policy is refused, NETWORK_UNAVAILABLE);
- ``memory_swap``: the memory limit holds, but a sandbox may also use swap up to it.

Optional by design (used where the host has it, shown as "absent" otherwise, with the reason):
``apparmor``; ``core_scheduling`` (a PR_SCHED_CORE cookie per latency-sensitive sandbox,
edge/backends/qos.py; not built into this machine kind's kernel).
The cgroup v1 controllers (cpu, memory, pids, freezer), seccomp, the writable-layer limit
(ext4 images on loop devices) and EROFS mounts (the layers: image files mounted directly from
kernel 6.12, through read-only loop devices before; `DSEC_EDGE_EROFS_MOUNT`) cannot be turned
off. A host with cgroup v2 only (no v1 hierarchies) is refused: this edge enforces its limits
through cgroup v1.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from edge import hostfacts
from edge.backends import qos
from edge.hostfacts import DISABLEABLE, landlock_abi

log = logging.getLogger(__name__)

ENFORCED, DISABLED, ABSENT = "enforced", "disabled", "absent"
#: Not a control but a fact about the host, shown on a line of its own (`dsec status`).
INFO = "info"


@dataclass(frozen=True)
class Control:
    name: str
    state: str  # enforced | disabled | absent | info
    detail: str
    #: `dsec status` prints "<name>: <detail>" on a line of its own (what a backend or an
    #: optional control has to say beyond its state: the microVM accelerator, ...).
    status_line: bool = False


class ControlMissing(RuntimeError):
    """The host lacks controls the edge needs (the message names each, and how to proceed)."""


def host_line(layout: hostfacts.CgroupLayout) -> Control:
    """The host the controls rest on, for `dsec status`: kernel, cgroup layout, Landlock ABI."""
    detail = (
        f"kernel {platform.release()}; cgroups {layout.describe()}; Landlock ABI {landlock_abi()}"
    )
    return Control("host", INFO, detail, status_line=True)


def check(
    *, disabled: Iterable[str], bpf_pin_dir: Path, apparmor: bool, erofs_mount: str = "auto"
) -> list[Control]:
    """Every control's state; raises ControlMissing naming each required one the host lacks."""
    off = set(disabled)
    unknown = off - set(DISABLEABLE)
    if unknown:
        raise ControlMissing(
            f"DSEC_EDGE_DISABLED_CONTROLS names {', '.join(sorted(unknown))}: only "
            f"{', '.join(sorted(DISABLEABLE))} can be turned off"
        )
    layout = hostfacts.cgroup_layout()
    probed = hostfacts.probe(bpf_pin_dir, erofs_mount, layout.mounts)
    controls: list[Control] = [host_line(layout)]
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
        if layout.kind == "unified":
            hint += f" ({hostfacts.UNIFIED_HINT})"
        raise ControlMissing(
            "the edge refuses to run half-confined; this host lacks: " + "; ".join(missing) + hint
        )
    return controls

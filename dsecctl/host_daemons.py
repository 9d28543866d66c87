"""Host daemons a local cluster needs besides its own services: libvirt's, for the VM backend.

An edge with the VM backend (``DSEC_EDGE_VM``: ``auto`` — the default — when libvirt is
installed, ``on``, ``off``) drives QEMU through libvirtd, which hands each domain's console
to virtlogd. scripts/setup.sh starts both once per machine; when ``dsec up`` finds one of
them not answering, it starts it itself, as a supervised program of the cluster (restarted
with the services' back-off and limits, :mod:`dsecctl.supervisor`), and ``dsec down`` stops
it again. One that already answers (setup's, systemd's, another cluster's) is only checked:
a line in ``dsec status``, never a signal.

A daemon is ours by its pid file: ``dsec up`` gives each one it starts a pid file under the
cluster's home, so a PID found later (``dsec status``/``dsec down`` without supervisord)
is checked against that path in the process's command line before anything is sent to it.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: DSEC_EDGE_VM's values: whether edges offer the VM backend (auto: when libvirt is installed).
VM_MODES = ("auto", "on", "off")
#: libvirt's sockets when its daemons run as root (``virtlogd --help``, ``libvirtd --help``).
VIRTLOGD_SOCKET = Path("/run/libvirt/virtlogd-sock")
LIBVIRTD_SOCKET = Path("/run/libvirt/libvirt-sock")


class HostDaemonError(RuntimeError):
    """A host daemon the cluster needs cannot be had (bad DSEC_EDGE_VM, not installed)."""


@dataclass(frozen=True)
class HostDaemon:
    """One host daemon as a cluster would run it: in the foreground (its supervisor holds
    its PID), with its own pid file, ready when ``socket`` accepts a connection."""

    name: str  # "virtlogd", "libvirtd": also the service's name in `dsec status`
    argv: tuple[str, ...]  # must name pid_file (the daemon's -p/--pid-file)
    socket: Path
    pid_file: Path
    env: dict[str, str] = field(default_factory=dict)


def vm_mode(environ: Mapping[str, str]) -> str:
    """DSEC_EDGE_VM of ``environ`` (default ``auto``), checked."""
    mode = environ.get("DSEC_EDGE_VM", "").strip().lower() or "auto"
    if mode not in VM_MODES:
        raise HostDaemonError(
            f"DSEC_EDGE_VM={environ['DSEC_EDGE_VM']!r}: expected one of {', '.join(VM_MODES)}"
        )
    return mode


def libvirt_daemons(run_dir: Path) -> list[HostDaemon]:
    """virtlogd then libvirtd (libvirtd connects to virtlogd), on the system's sockets,
    their pid files in ``run_dir``; [] when libvirt is not installed."""
    virtlogd, libvirtd = shutil.which("virtlogd"), shutil.which("libvirtd")
    if virtlogd is None or libvirtd is None:
        return []
    out = []
    for name, binary, sock in (
        ("virtlogd", virtlogd, VIRTLOGD_SOCKET),
        ("libvirtd", libvirtd, LIBVIRTD_SOCKET),
    ):
        pid_file = run_dir / f"{name}.pid"
        out.append(HostDaemon(name, (binary, "--pid-file", str(pid_file)), sock, pid_file))
    return out


def daemons_for_vm(mode: str, run_dir: Path) -> list[HostDaemon]:
    """The daemons a cluster with DSEC_EDGE_VM=``mode`` needs: none with ``off``, libvirt's
    when installed with ``auto``; with ``on`` libvirt must be installed."""
    if mode == "off":
        return []
    daemons = libvirt_daemons(run_dir)
    if not daemons and mode == "on":
        raise HostDaemonError(
            "DSEC_EDGE_VM=on but libvirtd/virtlogd are not installed (scripts/setup.sh installs them)"
        )
    return daemons


def socket_answers(path: Path, timeout_s: float = 1.0) -> bool:
    """Whether a Unix socket at ``path`` accepts a connection (a stale file does not)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class HostDaemonPlan:
    start: list[HostDaemon]  # not answering: the cluster starts and supervises these
    checked: list[HostDaemon]  # answering already (not the cluster's): only checked


def plan(daemons: Sequence[HostDaemon]) -> HostDaemonPlan:
    """Splits ``daemons`` into those the cluster starts and those already served."""
    start = [d for d in daemons if not socket_answers(d.socket)]
    return HostDaemonPlan(start, [d for d in daemons if d not in start])


def pid_by_name(name: str) -> int:
    """The oldest process named ``name`` (a daemon the cluster did not start), or 0."""
    found: list[tuple[int, int]] = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "comm").read_text().strip() != name[:15]:
                continue
            start = int((d / "stat").read_text().rsplit(")", 1)[1].split()[19])
        except (OSError, ValueError, IndexError):
            continue
        found.append((start, int(d.name)))
    return min(found)[1] if found else 0


def pid_from_file(pid_file: Path) -> int:
    """The PID in ``pid_file`` if that process runs with ``pid_file`` in its command line
    (so a reused PID is never taken for ours), else 0."""
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return 0
    return pid if is_ours(cmdline, pid_file) else 0


def is_ours(cmdline: Sequence[bytes], pid_file: Path) -> bool:
    return str(pid_file).encode() in cmdline or f"--pid-file={pid_file}".encode() in cmdline

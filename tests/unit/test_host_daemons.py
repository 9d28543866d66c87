"""Which host daemons a local cluster starts and which it only checks
(dsecctl/host_daemons.py): DSEC_EDGE_VM, libvirt installed or not (PATH), a socket that
answers or a stale one, and a PID taken for ours only with our pid file in its command line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dsecctl import host_daemons
from dsecctl.host_daemons import HostDaemon, HostDaemonError
from tests.helpers import wait_for


def test_vm_mode_defaults_to_auto_and_rejects_unknown_values() -> None:
    assert host_daemons.vm_mode({}) == "auto"
    assert host_daemons.vm_mode({"DSEC_EDGE_VM": " On "}) == "on"
    with pytest.raises(HostDaemonError, match=r"DSEC_EDGE_VM='sometimes'.*auto, on, off"):
        host_daemons.vm_mode({"DSEC_EDGE_VM": "sometimes"})


def test_libvirt_daemons_in_start_order_with_pid_files_under_the_run_dir(tmp_path: Path) -> None:
    if not host_daemons.libvirt_daemons(tmp_path):
        pytest.skip("libvirt is not installed here (scripts/setup.sh installs it)")
    virtlogd, libvirtd = host_daemons.daemons_for_vm("auto", tmp_path)
    assert (virtlogd.name, libvirtd.name) == ("virtlogd", "libvirtd")
    assert libvirtd.socket == Path("/run/libvirt/libvirt-sock")
    assert libvirtd.pid_file == tmp_path / "libvirtd.pid"
    assert str(libvirtd.pid_file) in libvirtd.argv
    assert host_daemons.daemons_for_vm("off", tmp_path) == []


def test_without_libvirt_auto_needs_nothing_and_on_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no virtlogd/libvirtd on it
    assert host_daemons.daemons_for_vm("auto", tmp_path) == []
    with pytest.raises(HostDaemonError, match="DSEC_EDGE_VM=on but libvirtd/virtlogd"):
        host_daemons.daemons_for_vm("on", tmp_path)


def _daemon(name: str, sock: Path) -> HostDaemon:
    return HostDaemon(name, ("true",), sock, sock.with_suffix(".pid"))


def test_plan_checks_a_served_socket_and_starts_one_for_a_stale_socket(tmp_path: Path) -> None:
    served, stale = tmp_path / "served.sock", tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as listening, socket.socket(socket.AF_UNIX) as gone:
        listening.bind(str(served))
        listening.listen()
        gone.bind(str(stale))  # the file stays, nobody listens: a daemon that died
        plan = host_daemons.plan([_daemon("a", served), _daemon("b", stale)])
    assert [d.name for d in plan.checked] == ["a"]
    assert [d.name for d in plan.start] == ["b"]


def test_a_pid_is_ours_only_when_its_command_line_names_our_pid_file(tmp_path: Path) -> None:
    pid_file = tmp_path / "d.pid"
    # A process whose command line names the pid file (no shell that could exec it away).
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(pid_file)])
    try:
        pid_file.write_text(f"{proc.pid}\n")
        # Popen may return while the child is still inside execve (vfork): its command line
        # reads empty until the new program's arguments are set up.
        wait_for(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes(), timeout_s=10)
        assert host_daemons.pid_from_file(pid_file) == proc.pid
        # A reused PID (here: this test's own process) does not name the pid file.
        pid_file.write_text(f"{os.getpid()}\n")
        assert host_daemons.pid_from_file(pid_file) == 0
    finally:
        proc.kill()
        proc.wait()
    pid_file.write_text(f"{proc.pid}\n")  # gone
    assert host_daemons.pid_from_file(pid_file) == 0

"""Pieces of the containment that need no sandbox: kernel-fault detection from /dev/kmsg
records, the AppArmor profile text, chronus's seccomp program, the edge's configuration, and
the watchdog's skipping of sandboxes that did not run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from common.config import ConfigError
from edge.backends.container.containment import Containment, _CgroupFiles, _KernelLog, _Watch
from edge.config import EdgeConfig
from edge.model import SandboxRecord, SandboxSpec
from edge.runtime.apparmor import PROFILE_NAME, profile_text


def test_kernel_oops_names_the_faulting_pid() -> None:
    k = _KernelLog()
    records = [
        "6,1001,123,-;eth0: link up",
        "1,1002,124,-;BUG: unable to handle page fault for address: ffff8881000",
        "4,1003,125,-;#PF: supervisor read access in kernel mode",
        "4,1004,126,-;CPU: 1 UID: 0 PID: 4242 Comm: cat Not tainted 6.18.44 #1",
        "4,1005,127,-;CPU: 0 UID: 0 PID: 7 Comm: kworker Not tainted 6.18.44 #1",
    ]
    found = set()
    for r in records:
        found |= k.parse(r)
    assert found == {4242}  # only the line after an oops header counts


def test_apparmor_profile_denies_the_dangerous_parts() -> None:
    text = profile_text()
    assert f"profile {PROFILE_NAME} " in text
    for rule in ("deny mount,", "kpage*", "sysrq-trigger", "/.dsec/** wkl", "page_idle"):
        assert rule in text


def test_network_configuration_is_validated() -> None:
    EdgeConfig(net_subnet="10.1.0.0/24").validate()
    with pytest.raises(ConfigError):
        EdgeConfig(net_subnet="10.1.0.0/31").validate()
    with pytest.raises(ConfigError):
        EdgeConfig(net_subnet="not-a-net").validate()
    with pytest.raises(ConfigError):
        EdgeConfig(net_bridge="a-very-long-bridge-name").validate()
    with pytest.raises(ConfigError):
        EdgeConfig(default_disk_mb=8).validate()


def _watched(tmp_path: Path) -> tuple[Containment, _Watch, Path]:
    """A Containment over a stand-in backend whose sandbox "sb-x" has cgroup files in
    `tmp_path/cg` (plain files with the kernel's formats): the watchdog's logic, not the
    kernel's, is under test here (tests/adversarial covers the real limits)."""
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    (cg / "pids.events").write_text("max 0\n")
    (cg / "pids.current").write_text("3\n")
    (cg / "cgroup.procs").write_text("")
    (cg / "cpuacct.usage").write_text("1000\n")
    runtime = SimpleNamespace(disk_usage=lambda sid: None, cgroup_path=lambda sid: "x")

    async def settled(sid: str) -> None:
        return None

    channels = SimpleNamespace()  # the checks under test do not touch the channels
    c = Containment(runtime, None, channels, logs=tmp_path, settled=settled)  # type: ignore[arg-type]
    w = _Watch(SandboxRecord("sb-x", "p", "u", SandboxSpec(pids_max=64), "e"))
    w.files = _CgroupFiles(
        str(cg / "memory.oom_control"),
        str(cg / "pids.events"),
        str(cg / "pids.current"),
        cg,
        str(cg / "cpuacct.usage"),
    )
    return c, w, cg


def test_the_watchdog_skips_a_sandbox_whose_cpu_time_did_not_move(tmp_path: Path) -> None:
    c, w, cg = _watched(tmp_path)
    assert c._check("sb-x", w, set()) == ({}, None)
    # Counters cannot move without the sandbox running; were they to, the check skips them
    # until its CPU time moves (aether's pings move it at least every ping_idle_s).
    (cg / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert c._check("sb-x", w, set()) == ({}, None)
    (cg / "cpuacct.usage").write_text("2000\n")
    assert c._check("sb-x", w, set()) == ({"oom_kills": 2}, None)
    # At the pids limit with forks refused: read every pass (the PIDS_EXHAUSTED clock runs),
    # CPU time moving or not.
    (cg / "pids.events").write_text("max 5\n")
    (cg / "pids.current").write_text("63\n")
    (cg / "cpuacct.usage").write_text("3000\n")
    counters, verdict = c._check("sb-x", w, set())
    assert counters == {"oom_kills": 2, "pids_limit_hits": 5} and verdict is None
    assert w.at_pids_limit_since
    w.at_pids_limit_since -= c.pids_exhausted_after_s  # as if it had been there that long
    reason, message = c._check("sb-x", w, set())[1] or ("", "")
    assert reason == "PIDS_EXHAUSTED" and "63 of 64 processes" in message

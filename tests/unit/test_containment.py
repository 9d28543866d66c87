"""Pieces of the containment that need no sandbox: kernel-fault detection from /dev/kmsg
records, the AppArmor profile text, chronus's seccomp program, and the edge's configuration."""

from __future__ import annotations

import pytest

from common.config import ConfigError
from edge.backends.container.containment import _KernelLog
from edge.config import EdgeConfig
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

"""edge/hostfacts.py: the host facts the edge's controls rest on, read the same way by the edge at
start and by scripts/setup.sh before it installs anything (with the host's python3, no venv).

The layouts other than this machine's are real mountinfo lines of those hosts (Debian 12 and
Ubuntu 24.04 boot cgroup v2 only; a cgroup v1-only host has no cgroup2 mount), parsed by the
same function that reads this host's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from edge import controls, hostfacts

REPO = Path(__file__).resolve().parents[2]

#: Debian 12 / Ubuntu 24.04 (systemd's default: the unified hierarchy only).
UNIFIED = """\
24 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw,discard,errors=remount-ro
35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
"""
#: This machine kind: v1 controllers, systemd's named hierarchy, cgroup2 at .../unified.
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
#: systemd.legacy_systemd_cgroup_controller=1: v1 only, two controllers on one hierarchy.
LEGACY = """\
25 24 0:22 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
26 24 0:23 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
27 24 0:24 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
28 24 0:25 / /sys/fs/cgroup/freezer rw,nosuid - cgroup cgroup rw,freezer,release_agent=/x
"""


@pytest.mark.parametrize(
    ("text", "kind", "says"),
    [
        (UNIFIED, "unified", "cgroup v2 only: cgroup2 at /sys/fs/cgroup"),
        (
            HYBRID,
            "hybrid",
            "hybrid: v1 cpu, memory, pids, freezer; cgroup2 at /sys/fs/cgroup/unified",
        ),
        (LEGACY, "legacy", "cgroup v1 only: cpu, memory, pids, freezer; no cgroup2 mount"),
        ("", "none", "no cgroup hierarchy mounted"),
    ],
)
def test_the_cgroup_layout_is_read_from_mountinfo(text: str, kind: str, says: str) -> None:
    mounts = hostfacts.cgroup_mounts(text)
    layout = hostfacts.cgroup_layout(mounts)
    assert layout.kind == kind
    assert layout.describe().startswith(says), layout.describe()


def test_v1_controllers_sharing_a_hierarchy_each_name_it() -> None:
    mounts = hostfacts.cgroup_mounts(LEGACY)
    assert mounts["cpu"] == mounts["cpuacct"] == "/sys/fs/cgroup/cpu,cpuacct"
    assert mounts["freezer"] == "/sys/fs/cgroup/freezer"  # release_agent= is not a controller
    assert "release_agent=/x" not in mounts and "unified" not in mounts
    assert hostfacts.cgroup_mounts(HYBRID)["name=systemd"] == "/sys/fs/cgroup/systemd"


@pytest.mark.parametrize(
    ("release", "version"),
    [
        ("6.1.0-27-amd64", (6, 1)),  # Debian 12
        ("6.8.0-45-generic", (6, 8)),  # Ubuntu 24.04
        ("5.15.0-122-generic", (5, 15)),  # Ubuntu 22.04
        ("6.12.9+bpo-cloud-amd64", (6, 12)),
        ("6.18.44-fc-v1294", (6, 18)),
        ("6", (6, 0)),
    ],
)
def test_kernel_versions_of_current_distributions(release: str, version: tuple[int, int]) -> None:
    assert hostfacts.kernel_version(release) == version


def test_this_host_is_hybrid_and_the_edge_s_controls_read_the_same_facts() -> None:
    """The facts setup prints are the edge's: the same probe, the same verdict."""
    layout = hostfacts.cgroup_layout()
    assert layout.kind == "hybrid"
    assert layout.mounts["memory"] == "/sys/fs/cgroup/memory"
    probed = hostfacts.probe(Path("/sys/fs/bpf/dsec"))
    found = controls.check(disabled=(), bpf_pin_dir=Path("/sys/fs/bpf/dsec"), apparmor=False)
    enforced = {c.name for c in found if c.state == controls.ENFORCED}
    assert enforced == {name for name, (ok, _) in probed.items() if ok}
    assert hostfacts.landlock_abi() >= hostfacts.LANDLOCK_MIN_ABI
    assert hostfacts.has_process_madvise()  # 5.10+: pause pushes memory out with it
    have, direct, _ = hostfacts.erofs()
    assert have and direct
    lines, refused = hostfacts.report(Path("/sys/fs/bpf/dsec"))
    assert refused == []
    assert f"kernel {os.uname().release} ({os.uname().machine})" == lines[0]


def test_setup_s_host_check_runs_on_the_host_s_python_before_any_install() -> None:
    """`python3 -S -m edge.hostfacts` from the checkout, as scripts/setup.sh runs it first:
    no site-packages (-S: nothing pip installed can be imported), no environment."""
    python3 = "/usr/bin/python3"
    r = subprocess.run(
        [python3, "-S", "-m", "edge.hostfacts", "--strict"],
        cwd=REPO,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "dsec host check"
    assert out[2].startswith("cgroups: hybrid: v1 cpu, memory, pids, freezer; cgroup2 at")
    # "  <name, 14 wide> <state, 15 wide> <detail>"
    states = {line.split()[0]: line[17:32].strip() for line in out[3:-1] if line.startswith("  ")}
    for required in ("cgroup_memory", "landlock", "seccomp", "erofs", "network", "disk_limit"):
        assert states[required] == "enforced", out
    assert states["apparmor"] == "not used"  # this machine kind's kernel runs no AppArmor
    assert out[-1] == "verdict: the edge starts on this host with every required control enforced"


def test_setup_runs_the_host_check_before_it_installs_anything() -> None:
    script = (REPO / "scripts" / "setup.sh").read_text()
    assert script.index("-m edge.hostfacts") < script.index("apt-get")


def test_the_check_names_a_missing_control_and_what_setup_provides(tmp_path: Path) -> None:
    """A pin directory off bpffs is a real missing control (network): setup mounts bpffs, so
    the check says it comes with setup; a control setup cannot provide is MISSING."""
    lines, refused = hostfacts.report(tmp_path / "dsec" / "x")
    net = next(line for line in lines if line.split()[0] == "network")
    assert "after setup" in net and "bpffs at" in net and refused == []

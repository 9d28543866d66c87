"""The hosts users have, as real guests: the bookworm VM is a stock Debian 12 system booting
Debian's own kernel (6.1) with systemd's default layout, cgroup v2 only. The host check that
scripts/setup.sh runs first (edge/hostfacts.py, with the host's own python3, nothing
installed) is run there and must tell the truth about that host: what is missing, what the edge
does instead (EROFS on loop devices), and that the edge refuses to start on it (fail closed)
rather than run half-confined."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from libdsec import Client, Sandbox
from tests.vm.conftest import one_vm

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def debian12(session_client: Client) -> Iterator[Sandbox]:
    with one_vm(session_client, "bookworm", "debian12-host") as sb:
        yield sb


def host_check(sb: Sandbox) -> tuple[int, list[str], dict[str, str]]:
    """Runs the check in the guest as setup would: (exit status, lines, control -> state)."""
    for name in ("__init__.py", "hostfacts.py"):
        sb.files.write(f"/opt/dsec/edge/{name}", (REPO / "edge" / name).read_bytes())
    r = sb.run("cd /opt/dsec && python3 -S -m edge.hostfacts --strict", timeout_s=120)
    lines = r.text.splitlines()
    # "  <name, 14 wide> <state, 15 wide> <detail>"
    states = {ln.split()[0]: ln[17:32].strip() for ln in lines if ln.startswith("  ")}
    return r.exit_code, lines, states


def test_the_host_check_on_a_stock_debian_12_says_what_is_missing(debian12: Sandbox) -> None:
    release = debian12.run("uname -r").text.strip()
    assert release.startswith("6.1."), release  # Debian 12's own kernel
    status, lines, states = host_check(debian12)
    assert lines[0] == "dsec host check"
    assert lines[1].startswith(f"kernel {release} (x86_64)")
    assert lines[2].startswith("cgroups: cgroup v2 only: cgroup2 at /sys/fs/cgroup ("), lines[2]
    for controller in ("cpu", "memory", "pids", "freezer"):
        assert states[f"cgroup_{controller}"] == "MISSING", lines
    memory = next(ln for ln in lines if ln.split()[0] == "cgroup_memory")
    assert "this host has cgroup v2 only" in memory and "the edge refuses to start" in memory
    # 6.1 has Landlock ABI 2 (scoped signals and abstract sockets came with ABI 6, kernel 6.12)
    landlock = next(ln for ln in lines if ln.split()[0] == "landlock")
    assert states["landlock"] == "MISSING" and "DSEC_EDGE_DISABLED_CONTROLS" in landlock
    assert "ABI 2" in landlock or "not enabled" in landlock, landlock
    # EROFS is there (a module) but mounts no image file directly before 6.12: the layers
    # go on read-only loop devices
    erofs = next(ln for ln in lines if ln.split()[0] == "erofs")
    assert states["erofs"] == "enforced" and "read-only loop devices" in erofs, erofs
    assert "has no CONFIG_EROFS_FS_BACKED_BY_FILE" in erofs, erofs
    assert states["seccomp"] == "enforced"
    assert states["pause_pageout"] == "enforced"  # process_madvise: 5.10 and up
    assert any("systemd.unified_cgroup_hierarchy=0" in ln for ln in lines)
    assert lines[-1].startswith("verdict: the edge will refuse to start on this host (missing: ")
    assert "cgroup_memory" in lines[-1] and "landlock" in lines[-1]
    assert "erofs" not in lines[-1]
    assert status == 1  # --strict: a host the edge refuses is a failed check

"""Resource attacks: fork bomb, memory bomb, disk fill, recursive grep from /.

Each ends contained: the sandbox is stopped with a reason an RL framework can use (or survives,
having had the offending processes killed), and the platform and the witness sandbox carry on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from libdsec import Sandbox
from libdsec.errors import DSecError, ResourceExhausted, SandboxTerminated
from tests.adversarial.conftest import TOOLKIT_PY, Lab
from tests.helpers import wait_for

pytestmark = pytest.mark.usefixtures("contained")


def _terminated(sb: Sandbox, timeout_s: float = 20.0) -> tuple[str | None, str]:
    info = wait_for(lambda: (i := sb.refresh()).state == "TERMINATED" and i, timeout_s=timeout_s)
    return info.termination_reason, info.termination_message


def test_fork_bomb_is_contained(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox(pids_max=64)
    # The classic one burns out against the limit (busybox's shell gives up when fork fails)...
    sb.run("bomb() { bomb | bomb & }; bomb; sleep 1", timeout_s=30)
    info = wait_for(lambda: (i := sb.refresh()).violations["pids_limit_hits"] > 0 and i)
    assert info.state == "RUNNING"

    def alive() -> bool:
        try:
            return sb.run("echo alive").text == "alive\n"
        except ResourceExhausted as exc:
            assert exc.reason == "PIDS_LIMIT", exc
            return False

    # Usable again once the bomb's last processes have died out (until then the command's
    # fork may be refused, typed, as the limit is meant to).
    wait_for(alive, timeout_s=30, interval_s=0.5)
    assert sb.refresh().state == "RUNNING"


def test_a_sandbox_kept_at_its_pids_limit_ends_pids_exhausted(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox(pids_max=64)
    # ... this one fills the process table and leaves it full: nothing can start any more.
    sb.start("while :; do sleep 600 & done")
    reason, message = _terminated(sb)
    assert reason == "PIDS_EXHAUSTED", message
    assert "of 64 processes" in message


def test_memory_bomb_is_killed_and_counted(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox(memory_mb=64)
    r = sb.run(f"{TOOLKIT_PY} -c 'b = [bytearray(1 << 20) for _ in range(1024)]'", timeout_s=60)
    assert r.exit_code != 0 and r.signal == 9, r
    info = wait_for(lambda: (i := sb.refresh()).violations["oom_kills"] >= 1 and i)
    assert info.state == "RUNNING"  # aether and chronus survive: only the bomb was killed
    assert sb.run("echo still here").text == "still here\n"


def test_disk_fill_ends_the_sandbox_disk_quota(
    make_sandbox: Callable[..., Sandbox], lab: Lab
) -> None:
    sb = make_sandbox(disk_mb=32)
    # The edge ends the sandbox once its writable layer is full: either after the command has
    # answered (dd saw ENOSPC), or while it runs, when the call ends with that ending itself.
    try:
        r = sb.run("dd if=/dev/zero of=/work/fill bs=1M count=200 2>&1; df -m /work | tail -1")
        assert b"No space left" in r.stdout, r
    except SandboxTerminated as exc:
        assert exc.metadata.get("termination_reason") == "DISK_QUOTA", exc
    reason, message = _terminated(sb)
    assert reason == "DISK_QUOTA", message
    # The host gave the sandbox at most its quota: the image file is sparse and bounded.
    images = list(Path(lab.cluster.home).rglob("disk.img"))
    assert all(p.stat().st_blocks * 512 <= 33 << 20 for p in images)


def test_recursive_grep_from_root_finishes_or_times_out(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox()
    r = sb.run("grep -r -l zz-needle-zz / 2>/dev/null; echo rc=$?", timeout_s=10)
    assert r.timed_out or b"rc=" in r.stdout
    try:
        assert sb.run("echo alive", timeout_s=10).text == "alive\n"
    except DSecError as exc:  # pragma: no cover - a crash here is the bug this test is for
        pytest.fail(f"the sandbox did not survive a recursive grep: {exc}")

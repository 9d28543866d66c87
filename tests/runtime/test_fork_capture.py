"""A fork's file half against real runc, overlayfs and the disk quota: the source's writable
layer captured once (frozen for the copy only) and given to new sandboxes as their own."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edge.runtime import LaunchSpec, RuncRuntime, SandboxStatus, disk
from edge.runtime.errors import SandboxRuntimeError
from edge.runtime.runc import FORK_CAPTURE_PREFIX

SpecFactory = Callable[..., LaunchSpec]
Leftovers = Callable[..., list[str]]


@pytest.fixture(autouse=True)
def _no_disk_templates(runtime: RuncRuntime) -> Iterator[None]:
    """The quota's formatted templates stay for the node's later sandboxes; not a test's."""
    yield
    shutil.rmtree(runtime.rw_dir / disk.TEMPLATES, ignore_errors=True)


def sh(rt: RuncRuntime, sandbox_id: str, script: str) -> str:
    r = rt.exec_sync(sandbox_id, ["/bin/busybox", "sh", "-c", script])
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode()


#: new file, a file of the image modified, one deleted (a whiteout), scratch space (/tmp is
#: copied too).
WRITES = (
    "echo new > /root/new.txt && echo 'agent:x:1:1::/:/bin/sh' >> /etc/passwd"
    " && rm /bin/seq && mkdir -p /tmp/a/b && echo scratch > /tmp/a/b/c"
)
CHECK = (
    "cat /root/new.txt; tail -n1 /etc/passwd; ls /bin/seq 2>/dev/null || echo no-seq;"
    " cat /tmp/a/b/c"
)
EXPECTED = "new\nagent:x:1:1::/:/bin/sh\nno-seq\nscratch\n"


@pytest.mark.parametrize("disk_mb", [0, 64])
def test_capture_once_then_children_start_from_it(
    runtime: RuncRuntime, spec_for: SpecFactory, leftovers: Leftovers, disk_mb: int
) -> None:
    src = runtime.create(spec_for(disk_mb=disk_mb))
    sh(runtime, src.sandbox_id, WRITES)

    capture, stats, stall_s = runtime.capture_upper(src.sandbox_id, freeze=True)
    assert capture.parent == runtime.rw_dir and capture.name.startswith(FORK_CAPTURE_PREFIX)
    assert stats.whiteouts >= 1 and stats.files >= 3
    assert 0 < stall_s < 5
    assert runtime.state(src.sandbox_id).status is SandboxStatus.RUNNING  # thawed

    kids = [runtime.create(spec_for(disk_mb=disk_mb, initial_upper=capture)) for _ in range(2)]
    shutil.rmtree(capture)  # the children have their own copies
    for kid in kids:
        assert sh(runtime, kid.sandbox_id, CHECK) == EXPECTED
    sh(runtime, kids[0].sandbox_id, "echo mine > /root/after.txt && rm /root/new.txt")
    for other in (kids[1].sandbox_id, src.sandbox_id):
        assert sh(runtime, other, CHECK + "; ls /root") == EXPECTED + "new.txt\n"
    for sb in (src, *kids):
        runtime.destroy(sb.sandbox_id)
        assert leftovers(runtime, sb.sandbox_id) == []


def test_a_paused_source_is_captured_without_a_thaw(
    runtime: RuncRuntime, spec_for: SpecFactory
) -> None:
    src = runtime.create(spec_for())
    sh(runtime, src.sandbox_id, WRITES)
    runtime.pause(src.sandbox_id)
    capture, _, stall_s = runtime.capture_upper(src.sandbox_id, freeze=False)
    assert stall_s == 0.0
    assert runtime.state(src.sandbox_id).status is SandboxStatus.PAUSED
    assert (capture / "root" / "new.txt").read_text() == "new\n"
    shutil.rmtree(capture)
    runtime.destroy(src.sandbox_id)


def test_files_beyond_the_childs_disk_limit_fail_its_start_and_leave_nothing(
    runtime: RuncRuntime, spec_for: SpecFactory, leftovers: Leftovers
) -> None:
    src = runtime.create(spec_for(disk_mb=64))
    sh(runtime, src.sandbox_id, "dd if=/dev/zero of=/root/big bs=1M count=24 2>/dev/null")
    capture, stats, _ = runtime.capture_upper(src.sandbox_id, freeze=True)
    assert stats.bytes == 24 << 20
    spec = spec_for(disk_mb=16, initial_upper=capture)
    with pytest.raises(SandboxRuntimeError, match="do not fit the sandbox's disk limit"):
        runtime.create(spec)
    assert leftovers(runtime, spec.sandbox_id) == []
    runtime.destroy(src.sandbox_id)


def test_a_capture_left_by_a_crash_goes_at_orphan_cleanup(
    runtime: RuncRuntime, spec_for: SpecFactory, tmp_path: Path
) -> None:
    src = runtime.create(spec_for())
    capture, _, _ = runtime.capture_upper(src.sandbox_id, freeze=True)
    removed = runtime.cleanup_orphans({src.sandbox_id})
    assert f"fork-capture:{capture.name}" in removed
    assert not capture.exists()
    runtime.destroy(src.sandbox_id)

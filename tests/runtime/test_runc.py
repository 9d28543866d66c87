"""RuncRuntime against real runc, overlayfs, EROFS and cgroup v1 on this machine."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edge.runtime import (
    InvalidLaunchSpecError,
    LaunchSpec,
    RuncRuntime,
    RuntimeStartError,
    SandboxExistsError,
    SandboxNotFoundError,
    SandboxStatus,
    cgroups,
    disk,
)
from edge.runtime.mounts import (
    LayerImage,
    is_mountpoint,
    mount_overlay,
    mounts_under,
    read_mountinfo,
)
from edge.runtime.runc import BOOT_ID_PATH
from edge.toolkit import toolkit_argv

SpecFactory = Callable[..., LaunchSpec]
Leftovers = Callable[..., list[str]]


def sh(rt: RuncRuntime, sandbox_id: str, script: str) -> tuple[int, str, str]:
    r = rt.exec_sync(sandbox_id, ["/bin/busybox", "sh", "-c", script])
    return r.returncode, r.stdout.decode(), r.stderr.decode()


def test_layers_erofs_and_dirs_merge_with_writes_in_upper(
    runtime: RuncRuntime,
    spec_for: SpecFactory,
    busybox: Any,
    tmp_path: Path,
    erofs_image: Callable[..., Path],
) -> None:
    top = tmp_path / "top"  # a plain directory layer, used as-is
    (top / "work").mkdir(parents=True)
    (top / "work" / "top.txt").write_text("from top\n")
    (top / "work" / "shadow.txt").write_text("top wins\n")
    mid_src = tmp_path / "mid"  # an EROFS image layer
    (mid_src / "opt" / "pkg").mkdir(parents=True)
    (mid_src / "opt" / "pkg" / "mid.txt").write_text("from mid\n")
    (mid_src / "work").mkdir()
    (mid_src / "work" / "shadow.txt").write_text("mid loses\n")
    mid = erofs_image(mid_src, tmp_path / "mid.erofs")

    sb = runtime.create(spec_for(lowers=[top, mid, busybox.erofs], cwd="/work"))

    rc, out, err = sh(
        runtime, sb.sandbox_id, "cat /work/top.txt /opt/pkg/mid.txt /work/shadow.txt; pwd"
    )
    assert rc == 0, err
    assert out == "from top\nfrom mid\ntop wins\n/work\n"

    script = (
        "echo new > /root/new.txt && "
        "mkdir -p /opt/pkg/__pycache__ && echo pyc > /opt/pkg/__pycache__/m.pyc && "  # copy-up dir
        "echo more >> /opt/pkg/mid.txt && "  # copy-up of a file from the EROFS layer
        "echo changed > /work/top.txt && rm /work/shadow.txt"  # dir layer file + whiteout
    )
    rc, _, err = sh(runtime, sb.sandbox_id, script)
    assert rc == 0, err
    assert (sb.upper / "root" / "new.txt").read_text() == "new\n"
    assert (sb.upper / "opt" / "pkg" / "__pycache__" / "m.pyc").read_text() == "pyc\n"
    assert (sb.upper / "opt" / "pkg" / "mid.txt").read_text() == "from mid\nmore\n"
    assert (sb.upper / "work" / "top.txt").read_text() == "changed\n"
    # lowers unchanged: the directory layer and the image (seen through its shared mount)
    assert (top / "work" / "top.txt").read_text() == "from top\n"
    assert (top / "work" / "shadow.txt").exists()
    mid_mount = runtime.layers.mountpoint(LayerImage(mid))
    assert (mid_mount / "opt" / "pkg" / "mid.txt").read_text() == "from mid\n"
    assert not (mid_mount / "opt" / "pkg" / "__pycache__").exists()
    rc, out, _ = sh(runtime, sb.sandbox_id, "ls /work; cat /opt/pkg/mid.txt")
    assert out.split() == ["top.txt", "from", "mid", "more"]


def test_started_sandbox_keeps_no_mount_on_the_host(
    runtime: RuncRuntime, spec_for: SpecFactory, leftovers: Leftovers
) -> None:
    """The rootfs overlay lives on only in the sandbox's own mount namespace: the host's table
    (which runc reads, and copies into every new sandbox) does not grow with each sandbox."""
    before = Path("/proc/self/mountinfo").read_text().count("\n")
    sbs = [runtime.create(spec_for()) for _ in range(3)]
    host = Path("/proc/self/mountinfo").read_text()
    assert all(str(sb.rootfs) not in host for sb in sbs)
    # one shared EROFS mount of the image at most; nothing per sandbox
    assert host.count("\n") <= before + 1
    for sb in sbs:
        own = (Path("/proc") / str(sb.pid) / "mountinfo").read_text().splitlines()
        root = [line for line in own if line.split()[4] == "/"]
        assert root and " - overlay " in root[-1], own
        rc, _, err = sh(runtime, sb.sandbox_id, f"echo {sb.sandbox_id} > /root/mine")
        assert rc == 0, err
        assert (sb.upper / "root" / "mine").read_text() == f"{sb.sandbox_id}\n"
        assert (Path("/proc") / str(sb.pid) / "root" / "root" / "mine").exists()
    kept = runtime.create(spec_for(keep_host_rootfs=True))
    assert is_mountpoint(kept.rootfs)
    for sb in [*sbs, kept]:
        runtime.destroy(sb.sandbox_id)
        assert leftovers(runtime, sb.sandbox_id) == []


def test_rename_gives_a_started_sandbox_another_identity(
    runtime: RuncRuntime,
    spec_for: SpecFactory,
    toolkit_image_path: Path,
    cgroup_parent: str,
    leftovers: Leftovers,
) -> None:
    """A warm sandbox becomes its owner's: afterwards nothing tells it from one created
    under the new id (runc, cgroups, hostname, /etc files, limits, layer holders, recovery)."""
    warm = runtime.create(spec_for(toolkit_dir=toolkit_image_path, memory_mb=256))
    sh(runtime, warm.sandbox_id, "echo kept > /root/f")
    new = warm.sandbox_id.replace("-0", "-owned")
    proc = runtime.rename(
        warm.sandbox_id, new, hostname="agent-box", cpu_millis=500, memory_mb=96, pids_max=77
    )
    assert proc.pid == warm.pid and proc.sandbox_id == new
    runtime.finish_rename(new)  # the cgroup2 half (the edge runs it after the claim)
    assert leftovers(runtime, warm.sandbox_id) == []  # nothing under the old name
    assert cgroups.existing_dirs(runtime.cgroup_path(warm.sandbox_id)) == []
    assert runtime.state(new).status is SandboxStatus.RUNNING
    rc, out, err = sh(
        runtime, new, "hostname; cat /etc/hostname; grep -c agent-box /etc/hosts; cat /root/f"
    )
    assert rc == 0, err
    assert out.split() == ["agent-box", "agent-box", "1", "kept"]
    assert (proc.upper / "root" / "f").read_text() == "kept\n"
    cg = runtime.cgroup_path(new)
    assert cgroups.read_int("memory", cg, "memory.limit_in_bytes") == 96 * 1024 * 1024
    assert cgroups.read_int("pids", cg, "pids.max") == 77
    assert cgroups.read_int("cpu", cg, "cpu.cfs_quota_us") == 50000
    assert warm.pid in cgroups.procs(cgroups.controller_dir("pids", cg))
    runtime.pause(new)  # runc finds the renamed cgroups through its rewritten state
    assert runtime.state(new).status is SandboxStatus.PAUSED
    runtime.resume(new)
    # a restarted edge re-adopts it under the new name, holding its layers
    again = RuncRuntime(runtime.state_dir, cgroup_parent=cgroup_parent, volatile_state=True)
    assert again.list_ids() == [new]
    assert again.cleanup_orphans({new}) == []
    runtime.destroy(new)
    assert leftovers(runtime, new) == []
    assert mounts_under(runtime.layers.root) == []  # the toolkit image's holder went with it


def test_cleanup_after_a_crash_between_rename_and_its_cgroup2_move_keeps_the_sandbox(
    runtime: RuncRuntime, spec_for: SpecFactory, cgroup_parent: str, leftovers: Leftovers
) -> None:
    warm = runtime.create(spec_for())
    new = warm.sandbox_id.replace("-0", "-kept")
    runtime.rename(warm.sandbox_id, new, hostname=new, cpu_millis=500, memory_mb=64, pids_max=64)
    # the edge died before finish_rename: a restarted one keeps `new`, whose cgroup2 directory
    # still has the warm name, which must not be taken for an orphan (with pid 1 in it)
    again = RuncRuntime(runtime.state_dir, cgroup_parent=cgroup_parent, volatile_state=True)
    again.cleanup_orphans({new})
    assert again.state(new).status is SandboxStatus.RUNNING
    assert cgroups.existing_dirs(runtime.cgroup_path(warm.sandbox_id)) == []
    assert not (runtime.sandbox_dir(new) / "unified.pending").exists()
    rc, out, _ = sh(again, new, "echo alive")
    assert (rc, out) == (0, "alive\n")
    again.destroy(new)
    assert leftovers(runtime, new) == []


def test_same_image_mounted_once_for_all_sandboxes(
    runtime: RuncRuntime, spec_for: SpecFactory, busybox: Any
) -> None:
    a = runtime.create(spec_for())
    b = runtime.create(spec_for())
    erofs = [m for m in mounts_under(runtime.layers.root) if m.fstype == "erofs"]
    assert len(erofs) == 1 and erofs[0].source == str(busybox.erofs.resolve())
    assert runtime.layers.holders() == {
        Path(erofs[0].mountpoint).name: {f"{a.sandbox_id}:0", f"{b.sandbox_id}:0"}
    }
    runtime.destroy(a.sandbox_id)
    assert is_mountpoint(Path(erofs[0].mountpoint))  # b still holds it
    runtime.destroy(b.sandbox_id)
    assert mounts_under(runtime.layers.root) == []


def test_isolation_basics(runtime: RuncRuntime, spec_for: SpecFactory) -> None:
    sb = runtime.create(spec_for(env={"TASK_ID": "t-1"}, hostname="box-1"))
    rc, out, err = sh(
        runtime,
        sb.sandbox_id,
        "grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; hostname; cat /etc/hostname;"
        " echo TASK_ID=$TASK_ID; cat /proc/net/dev | tail -n +3 | cut -d: -f1;"
        " wc -c < /proc/kpagecgroup; ulimit -n; cat /proc/self/oom_score_adj",
    )
    assert rc == 0, err
    lines = [x.strip() for x in out.splitlines()]
    assert lines[0].split() == ["CapEff:", "00000000000405fb"]  # the 10 kept capabilities
    assert lines[1].split() == ["NoNewPrivs:", "1"]
    assert lines[2].split() == ["Seccomp:", "2"]
    assert lines[3:5] == ["box-1", "box-1"]
    assert lines[5] == "TASK_ID=t-1"
    assert lines[6] == "lo"  # a new, empty network namespace
    assert lines[7] == "0"  # masked
    assert int(lines[8]) == runtime.nofile
    assert lines[9] == "500"
    rc, _, err = sh(runtime, sb.sandbox_id, "echo x > /sys/fs/cgroup/pids/pids.max")
    assert rc != 0


def test_memory_limit_oom_is_detected(runtime: RuncRuntime, spec_for: SpecFactory) -> None:
    sb = runtime.create(spec_for(memory_mb=32))
    mem = cgroups.controller_dir("memory", sb.cgroup_path)
    assert mem is not None
    assert int((mem / "memory.limit_in_bytes").read_text()) == 32 << 20
    assert int((mem / "memory.memsw.limit_in_bytes").read_text()) == 32 << 20
    assert not runtime.was_oom_killed(sb.sandbox_id)
    rc, _, _ = sh(runtime, sb.sandbox_id, "dd if=/dev/zero of=/dev/null bs=16M count=1")
    assert rc == 0
    rc, _, _ = sh(runtime, sb.sandbox_id, "dd if=/dev/zero of=/dev/null bs=64M count=1")
    assert rc == 137
    assert runtime.was_oom_killed(sb.sandbox_id)
    assert runtime.state(sb.sandbox_id).status is SandboxStatus.RUNNING  # only dd died


def test_pids_limit(runtime: RuncRuntime, spec_for: SpecFactory) -> None:
    sb = runtime.create(spec_for(pids_max=8))
    _, out, err = sh(
        runtime,
        sb.sandbox_id,
        "for i in $(seq 12); do sleep 30 </dev/null >/dev/null 2>&1 & done; echo spawned",
    )
    assert "can't fork" in err + out or "Resource temporarily unavailable" in err + out
    stats = runtime.stats(sb.sandbox_id)
    assert 1 <= stats.pids <= 8
    assert cgroups.read_int("pids", sb.cgroup_path, "pids.max") == 8


def test_cpu_quota_and_stats(runtime: RuncRuntime, spec_for: SpecFactory) -> None:
    sb = runtime.create(spec_for(cpu_millis=250, memory_mb=64))
    assert cgroups.read_int("cpu", sb.cgroup_path, "cpu.cfs_quota_us") == 25_000
    assert cgroups.read_int("cpu", sb.cgroup_path, "cpu.cfs_period_us") == 100_000
    assert cgroups.read_int("cpu", sb.cgroup_path, "cpu.shares") == 256
    sh(runtime, sb.sandbox_id, "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
    st = runtime.stats(sb.sandbox_id)
    assert st.cpu_ns > 0 and st.memory_bytes > 0 and st.memory_limit_bytes == 64 << 20
    assert st.pids >= 1


def test_pause_resume_uses_freezer(
    runtime: RuncRuntime, spec_for: SpecFactory, leftovers: Leftovers
) -> None:
    sb = runtime.create(spec_for())
    runtime.pause(sb.sandbox_id)
    assert runtime.state(sb.sandbox_id).status is SandboxStatus.PAUSED
    assert cgroups.freezer_state(sb.cgroup_path) == "FROZEN"
    runtime.resume(sb.sandbox_id)
    assert runtime.state(sb.sandbox_id).status is SandboxStatus.RUNNING
    assert cgroups.freezer_state(sb.cgroup_path) == "THAWED"
    # destroying a paused sandbox must not hang on frozen tasks
    runtime.pause(sb.sandbox_id)
    t0 = time.monotonic()
    runtime.destroy(sb.sandbox_id)
    assert time.monotonic() - t0 < 2
    assert leftovers(runtime, sb.sandbox_id) == []
    with pytest.raises(SandboxNotFoundError):
        runtime.pause(sb.sandbox_id)


BOOT_ID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}\n")


def test_every_start_has_its_own_read_only_boot_id(
    runtime: RuncRuntime, spec_for: SpecFactory, leftovers: Leftovers
) -> None:
    """/proc/sys/kernel/random/boot_id is per container start, not the host's: a fresh UUID at
    each create, the same across a freeze, a new one when the same id starts again; root inside
    can neither write nor unmount it, and the host's mount table does not see it."""
    host_id = Path(BOOT_ID_PATH).read_text()
    a, b = runtime.create(spec_for()), runtime.create(spec_for())

    def boot_id(sid: str) -> str:
        rc, out, err = sh(runtime, sid, f"cat {BOOT_ID_PATH}")
        assert rc == 0, err
        return out

    ids = [boot_id(a.sandbox_id), boot_id(b.sandbox_id)]
    assert all(BOOT_ID_RE.fullmatch(x) for x in ids), ids
    assert ids[0] != ids[1] and host_id not in ids
    assert "boot_id" not in Path("/proc/self/mountinfo").read_text()
    runtime.pause(a.sandbox_id)
    runtime.resume(a.sandbox_id)
    assert boot_id(a.sandbox_id) == ids[0]
    rc, _, err = sh(runtime, a.sandbox_id, f"echo {ids[1].strip()} > {BOOT_ID_PATH}")
    assert rc != 0 and "Read-only file system" in err
    rc, _, err = sh(runtime, a.sandbox_id, f"umount {BOOT_ID_PATH} || umount -l {BOOT_ID_PATH}")
    assert rc != 0 and "Operation not permitted" in err
    assert boot_id(a.sandbox_id) == ids[0]
    runtime.destroy(a.sandbox_id)  # the same sandbox id started again: another boot
    again = runtime.create(spec_for(sandbox_id=a.sandbox_id))
    assert boot_id(a.sandbox_id) not in (*ids, host_id)
    for sb in (again, b):
        runtime.destroy(sb.sandbox_id)
        assert leftovers(runtime, sb.sandbox_id) == []


def test_an_init_that_exits_at_once_is_still_created_then_found_dead(
    runtime: RuncRuntime,
    spec_for: SpecFactory,
    leftovers: Leftovers,
    wait_stopped: Callable[..., None],
) -> None:
    """pid 1 may be gone before its boot id is mounted (a race: about a third of such starts
    here); the create still succeeds, as it did before boot ids, and the exit is collected."""
    for _ in range(10):
        sb = runtime.create(spec_for(init_argv=["/bin/busybox", "sh", "-c", "exit 3"]))
        wait_stopped(runtime, sb.sandbox_id)
        assert runtime.reap(sb.sandbox_id) == 3
        runtime.destroy(sb.sandbox_id)
        assert leftovers(runtime, sb.sandbox_id) == []


def test_stop_graceful_then_destroy_leaves_nothing(
    runtime: RuncRuntime,
    spec_for: SpecFactory,
    tmp_path: Path,
    leftovers: Leftovers,
    wait_for: Callable[..., None],
) -> None:
    log = tmp_path / "init.log"
    init = [
        "/bin/busybox",
        "sh",
        "-c",
        "trap 'echo bye; exit 7' TERM; echo up; while :; do sleep 1; done",
    ]
    sb = runtime.create(spec_for(init_argv=init, log_path=log))
    wait_for(lambda: log.read_text() == "up\n", what="init to start")
    t0 = time.monotonic()
    runtime.stop(sb.sandbox_id, grace_s=5)
    assert time.monotonic() - t0 < 3  # the trap ran after the current `sleep 1`
    assert runtime.state(sb.sandbox_id).status is SandboxStatus.STOPPED
    assert runtime.reap(sb.sandbox_id) == 7
    assert log.read_text() == "up\nbye\n"
    assert sb.sandbox_id in runtime.list_ids()
    runtime.destroy(sb.sandbox_id)
    assert leftovers(runtime, sb.sandbox_id) == []
    assert runtime.state(sb.sandbox_id).status is SandboxStatus.MISSING
    runtime.destroy(sb.sandbox_id)  # idempotent
    assert runtime.list_ids() == []


def test_stop_kills_after_grace(runtime: RuncRuntime, spec_for: SpecFactory) -> None:
    stubborn = ["/bin/busybox", "sh", "-c", "trap '' TERM; while :; do sleep 1; done"]
    sb = runtime.create(spec_for(init_argv=stubborn))
    t0 = time.monotonic()
    runtime.stop(sb.sandbox_id, grace_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    assert runtime.state(sb.sandbox_id).status is SandboxStatus.STOPPED
    assert runtime.reap(sb.sandbox_id) == -9


def test_create_failure_undoes_everything(
    runtime: RuncRuntime, spec_for: SpecFactory, leftovers: Leftovers
) -> None:
    spec = spec_for(init_argv=["/no/such/binary"])
    with pytest.raises(RuntimeStartError) as info:
        runtime.create(spec)
    assert "/no/such/binary" in info.value.stderr
    assert "no such file" in info.value.stderr.lower()
    assert leftovers(runtime) == []
    assert runtime.layers.holders() == {}


def test_bad_input_errors(runtime: RuncRuntime, spec_for: SpecFactory, tmp_path: Path) -> None:
    with pytest.raises(InvalidLaunchSpecError):
        runtime.create(spec_for(sandbox_id="../etc"))
    with pytest.raises(InvalidLaunchSpecError):
        runtime.create(spec_for(lowers=[tmp_path / "nope.erofs"]))
    sb = runtime.create(spec_for())
    with pytest.raises(SandboxExistsError):
        runtime.create(spec_for(sandbox_id=sb.sandbox_id))
    assert runtime.state(sb.sandbox_id).status is SandboxStatus.RUNNING  # untouched
    with pytest.raises(SandboxNotFoundError):
        runtime.stats("no-such-sandbox")
    assert runtime.state("no-such-sandbox").status is SandboxStatus.MISSING


def test_passed_fd_is_a_usable_listening_socket(
    runtime: RuncRuntime,
    spec_for: SpecFactory,
    toolkit_dir: Path,
    tmp_path: Path,
    wait_stopped: Callable[..., None],
) -> None:
    path = str(tmp_path / "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    code = (
        "import socket, os\n"
        "s = socket.socket(fileno=3)\n"
        "c, _ = s.accept()\n"
        "c.sendall(b'hello from ' + os.uname().nodename.encode())\n"
        "c.close()\n"
    )
    try:
        sb = runtime.create(
            spec_for(
                init_argv=[*toolkit_argv("x")[:-2], "-c", code],
                toolkit_dir=toolkit_dir,
                pass_fd=listener.fileno(),
                hostname="fd-test",
            )
        )
        inode = os.fstat(listener.fileno()).st_ino
        targets = set()
        for p in Path(f"/proc/{sb.pid}/fd").iterdir():
            with contextlib.suppress(FileNotFoundError):  # pid 1 opens and closes files meanwhile
                targets.add(os.readlink(p))
        assert f"socket:[{inode}]" in targets
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(10)
            c.connect(path)
            assert c.recv(100) == b"hello from fd-test"
        wait_stopped(runtime, sb.sandbox_id)
        assert runtime.reap(sb.sandbox_id) == 0
    finally:
        listener.close()


@pytest.mark.parametrize("image", ["busybox", "empty"])
def test_toolkit_python_runs_in_any_image(
    runtime: RuncRuntime,
    spec_for: SpecFactory,
    busybox: Any,
    toolkit_image_path: Path,
    tmp_path: Path,
    wait_stopped: Callable[..., None],
    image: str,
) -> None:
    """pid 1 = the toolkit's Python, from its EROFS image, in the busybox image and in an image
    that is an empty directory (no libc, no loader, no shell)."""
    if image == "busybox":
        lower = busybox.erofs
    else:
        lower = tmp_path / "empty-image"
        lower.mkdir()
    log = tmp_path / "py.log"
    code = (
        "import os, sys, json, subprocess, ssl, sqlite3, ctypes, asyncio, decimal\n"
        "import aether, chronus, insandbox, dsec.wire_schema\n"
        "child = None\n"
        "if os.path.exists('/bin/busybox'):\n"
        "    child = subprocess.run(['/bin/busybox', 'env'], capture_output=True, text=True).stdout\n"
        "print(json.dumps({'answer': 6 * 7, 'exe': sys.executable, 'prefix': sys.prefix,\n"
        "                  'env': dict(os.environ), 'child': child}))\n"
    )
    sb = runtime.create(
        spec_for(
            lowers=[lower],
            init_argv=[*toolkit_argv("x")[:-2], "-c", code],
            env={"TASK": "t"},
            toolkit_dir=toolkit_image_path,  # the EROFS image: mounted once, shared
            log_path=log,
        )
    )
    wait_stopped(runtime, sb.sandbox_id)
    assert runtime.reap(sb.sandbox_id) == 0, log.read_text()
    out = json.loads(log.read_text())
    assert out["answer"] == 42
    assert out["exe"] == "/.dsec/bin/python3.11" and out["prefix"] == "/.dsec"
    assert set(out["env"]) == {"TASK", "PATH", "HOME"}  # nothing added by the toolkit
    if image == "busybox":
        child_env = dict(line.split("=", 1) for line in out["child"].splitlines())
        assert set(child_env) == {"TASK", "PATH", "HOME"}  # no LD_*, no PYTHON*


def test_toolkit_is_read_only_inside(
    runtime: RuncRuntime, spec_for: SpecFactory, toolkit_dir: Path
) -> None:
    sb = runtime.create(spec_for(toolkit_dir=toolkit_dir))  # the plain directory form
    rc, out, err = sh(runtime, sb.sandbox_id, "ls /.dsec/bin; touch /.dsec/x")
    assert out.split() == ["dsec-confine", "dsec-sudo", "python3.11"]
    assert rc != 0 and "Read-only file system" in err


def test_cleanup_orphans_after_crash(
    tmp_path: Path,
    cgroup_parent: str,
    spec_for: SpecFactory,
    toolkit_image_path: Path,
    leftovers: Leftovers,
) -> None:
    state = tmp_path / "state"
    rt = RuncRuntime(state, cgroup_parent=cgroup_parent)
    keep = rt.create(spec_for())
    lost = rt.create(spec_for(toolkit_dir=toolkit_image_path))
    # a crash mid-create: overlay mounted, directory made, no container yet
    half = state / "sandboxes" / "half-made"
    for d in ("rootfs", "upper", "work"):
        (half / d).mkdir(parents=True)
    mount_overlay([keep.rootfs.parent / "upper"], half / "upper", half / "work", half / "rootfs")
    del rt  # the edge crashed; sandboxes and mounts live on

    rt2 = RuncRuntime(state, cgroup_parent=cgroup_parent)
    assert set(rt2.list_ids()) == {keep.sandbox_id, lost.sandbox_id, "half-made"}
    assert rt2.state(keep.sandbox_id).status is SandboxStatus.RUNNING  # re-adopted
    removed = rt2.cleanup_orphans({keep.sandbox_id})
    assert f"container:{lost.sandbox_id}" in removed
    assert any(r.startswith("mount:") and "half-made" in r for r in removed)
    assert any(r.startswith("layer:") for r in removed)  # the toolkit image, only `lost` used it
    assert leftovers(rt2, lost.sandbox_id) == []
    assert leftovers(rt2, "half-made") == []
    assert rt2.list_ids() == [keep.sandbox_id]
    assert rt2.state(keep.sandbox_id).status is SandboxStatus.RUNNING
    rc, _, _ = sh(rt2, keep.sandbox_id, "ls /bin/busybox")
    assert rc == 0  # its layer mount survived the cleanup

    rt2.cleanup_orphans(set())
    assert leftovers(rt2) == []


def test_create_destroy_latency(runtime: RuncRuntime, spec_for: SpecFactory) -> None:
    """create()/destroy() p50 and p90 over 20 runs (printed with -s); a generous bound only."""
    holder = runtime.create(spec_for())  # keeps the base layer mounted, as on a busy node
    creates, destroys = [], []
    for _ in range(20):
        spec = spec_for()
        t0 = time.perf_counter()
        runtime.create(spec)
        t1 = time.perf_counter()
        runtime.destroy(spec.sandbox_id)
        creates.append((t1 - t0) * 1000)
        destroys.append((time.perf_counter() - t1) * 1000)
    runtime.destroy(holder.sandbox_id)
    p = {
        name: (statistics.median(xs), sorted(xs)[int(0.9 * (len(xs) - 1))])
        for name, xs in (("create", creates), ("destroy", destroys))
    }
    print(f"\ncreate p50 {p['create'][0]:.1f} ms p90 {p['create'][1]:.1f} ms; "
          f"destroy p50 {p['destroy'][0]:.1f} ms p90 {p['destroy'][1]:.1f} ms")  # fmt: skip
    assert p["create"][0] < 200 and p["destroy"][0] < 200


def test_seccomp_installed_by_init_matches_runcs_own(
    runtime: RuncRuntime,
    spec_for: SpecFactory,
    toolkit_dir: Path,
    tmp_path: Path,
    wait_stopped: Callable[..., None],
) -> None:
    """Conformance: the same system calls get the same answers whether runc compiles and installs
    Docker's profile (per start) or pid 1 installs the edge's precompiled program
    (`seccomp_fd_env`, what every aether does)."""
    from tests.unit.test_seccomp_bpf import PROBES

    code = (
        "import ctypes, errno, json, os, sys\n"
        "sys.path.insert(0, '/.dsec/lib/python3.11')\n"
        "if os.environ.get('DSEC_AETHER_SECCOMP_FD'):\n"
        "    from insandbox.security import install_seccomp_from_env\n"
        "    assert install_seccomp_from_env() is None\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "out = {}\n"
        f"for label, nr, args in {PROBES!r}:\n"
        "    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])\n"
        "    e = ctypes.get_errno()\n"
        "    out[label] = 'ok' if r >= 0 else errno.errorcode.get(e, str(e))\n"
        "status = open('/proc/self/status').read()\n"
        "out['filters'] = [l.split()[1] for l in status.splitlines() if l.startswith('Seccomp_filters')][0]\n"
        "print(json.dumps(out))\n"
    )
    results = {}
    for mode in ("runc", "init"):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        log = tmp_path / f"{mode}.log"
        try:
            sb = runtime.create(
                spec_for(
                    init_argv=[*toolkit_argv("x")[:-2], "-c", code],
                    toolkit_dir=toolkit_dir,
                    pass_fd=listener.fileno(),
                    log_path=log,
                    seccomp_fd_env="DSEC_AETHER_SECCOMP_FD" if mode == "init" else "",
                )
            )
            if mode == "init":
                config = json.loads(
                    (runtime.sandbox_dir(sb.sandbox_id) / "config.json").read_text()
                )
                assert "seccomp" not in config["linux"]  # runc compiled nothing
            wait_stopped(runtime, sb.sandbox_id)
            assert runtime.reap(sb.sandbox_id) == 0, log.read_text()
        finally:
            listener.close()
        results[mode] = json.loads(log.read_text().splitlines()[-1])
    assert results["init"] == results["runc"]
    assert results["runc"]["filters"] == "1"
    assert results["runc"]["keyctl"] == "EPERM" and results["runc"]["getpid"] == "ok"
    assert results["runc"]["io_uring_setup"] == "ENOSYS"
    assert results["runc"]["after-the-profile"] == "ENOSYS"  # runc's rule, kept


def test_quota_filesystems_stay_off_the_mount_table(
    runtime: RuncRuntime, spec_for: SpecFactory, leftovers: Leftovers
) -> None:
    """Issue 43: a sandbox's disk-quota filesystem is on no mount table once its overlay is
    made (runc reads and copies the whole table at every start, so each sandbox's mount made
    every later start slower). It stays the sandbox's upper, under its quota, and readable by
    the edge through a descriptor; a restarted edge reaches it again; destroy frees the loop
    device."""
    first_one = runtime.create(spec_for(disk_mb=16))  # and with it, the image's layer mount
    table = len(read_mountinfo())
    sbs = [runtime.create(spec_for(disk_mb=16)) for _ in range(4)]
    assert len(read_mountinfo()) == table, "a sandbox left a mount in the table"
    for sb in sbs:
        rc, _, err = sh(runtime, sb.sandbox_id, f"echo {sb.sandbox_id} > /root/mine")
        assert rc == 0, err
        for upper in (runtime.upper_dir(sb.sandbox_id), sb.upper):
            assert (upper / "root" / "mine").read_text() == f"{sb.sandbox_id}\n"
        link = runtime.sandbox_dir(sb.sandbox_id) / "upper"  # for operators, from outside
        assert (link / "root" / "mine").read_text() == f"{sb.sandbox_id}\n"
    first = sbs[0].sandbox_id
    rc, _, err = sh(runtime, first, "dd if=/dev/zero of=/root/big bs=1M count=32")
    assert rc != 0 and "No space left" in err  # the quota holds
    usage = runtime.disk_usage(first)
    assert usage is not None and usage.full and usage.total_bytes <= 16 << 20
    image = os.fspath(runtime.writable_dir(first) / "disk.img")
    assert image in disk.loop_devices()
    # an edge restart: a new runtime on the same state reaches every upper again
    again = RuncRuntime(runtime.state_dir, cgroup_parent=runtime.cgroup_parent)
    for sb in sbs:
        mine = again.upper_dir(sb.sandbox_id) / "root" / "mine"
        assert mine.read_text() == f"{sb.sandbox_id}\n"
    assert again.disk_usage(first) == runtime.disk_usage(first)
    assert len(read_mountinfo()) == table
    for rt, sb in zip([runtime, again, runtime, again], sbs, strict=True):
        rt.destroy(sb.sandbox_id)  # whichever holds a descriptor of it
    for rt in (runtime, again):
        for sb in sbs:
            rt._drop_disk(sb.sandbox_id)  # the other runtime object's descriptor, if any
    assert image not in disk.loop_devices()
    runtime.destroy(first_one.sandbox_id)
    for sb in [first_one, *sbs]:
        assert leftovers(runtime, sb.sandbox_id) == []


def test_a_disk_pool_serves_creates_and_leaves_nothing(
    runtime: RuncRuntime, spec_for: SpecFactory, leftovers: Leftovers
) -> None:
    """Issue 43: quota filesystems made ahead of creates. A create of the pool's size takes a
    ready one (nothing copied, attached or mounted on its path) and gets the same sandbox: its
    writable layer under its own quota, off the mount table, readable through the runtime; the
    pool makes another; a create of another size makes its own. Stopping the pool, and a new
    pool on the leftovers of one that was never stopped (an edge killed), unmount and delete
    every ready filesystem and free its loop device."""
    pool_dir = runtime.rw_dir / disk.POOL

    def ready_images() -> set[str]:
        return {p for p in disk.loop_devices() if p.startswith(os.fspath(pool_dir) + "/")}

    def wait_ready(n: int) -> None:
        deadline = time.monotonic() + 30
        while (runtime.disk_pool is None or runtime.disk_pool.ready() < n) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert runtime.disk_pool is not None and runtime.disk_pool.ready() == n

    runtime.start_disk_pool(16, 2)
    try:
        wait_ready(2)
        assert len(ready_images()) == 2
        sb = runtime.create(spec_for(disk_mb=16))
        assert runtime.disk_pool is not None and runtime.disk_pool.taken == 1
        assert not mounts_under(runtime.writable_dir(sb.sandbox_id)), "still on the table"
        image = os.fspath(runtime.writable_dir(sb.sandbox_id) / "disk.img")
        assert image in disk.loop_devices()  # the pool's image, renamed with its directory
        rc, _, err = sh(runtime, sb.sandbox_id, "echo pooled > /root/mine")
        assert rc == 0, err
        assert (runtime.upper_dir(sb.sandbox_id) / "root" / "mine").read_text() == "pooled\n"
        rc, _, err = sh(runtime, sb.sandbox_id, "dd if=/dev/zero of=/root/big bs=1M count=32")
        assert rc != 0 and "No space left" in err  # its quota holds
        usage = runtime.disk_usage(sb.sandbox_id)
        assert usage is not None and usage.total_bytes <= 16 << 20
        wait_ready(2)  # refilled
        other = runtime.create(spec_for(disk_mb=32))  # another size: made on its path
        assert runtime.disk_pool.taken == 1
        runtime.destroy(sb.sandbox_id)
        runtime.destroy(other.sandbox_id)
        assert image not in disk.loop_devices()
        # An edge killed with its pool full: the next pool clears what it left.
        abandoned = runtime.disk_pool
        abandoned._closed = True  # its thread stops; nothing is cleared (a kill)
        abandoned._wake.set()
        abandoned._thread.join(timeout=30)
        left = ready_images()
        assert len(left) == 2
        runtime.disk_pool = None
        runtime.start_disk_pool(16, 1)
        wait_ready(1)
        assert not left & disk.loop_devices().keys()
        assert len(ready_images()) == 1
    finally:
        runtime.stop_disk_pool()
    assert ready_images() == set()
    assert not mounts_under(pool_dir)
    assert not pool_dir.exists()
    for sid in (sb.sandbox_id, other.sandbox_id):
        assert leftovers(runtime, sid) == []

"""Escapes: another sandbox's files, /proc/<pid>/root and symlinks into the control plane,
killing aether (pid 1) and chronus from inside."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from libdsec import Client, Sandbox
from tests.adversarial.conftest import Lab
from tests.adversarial.test_incidents import _chronus_pid

pytestmark = pytest.mark.usefixtures("contained")


def test_another_sandboxs_files_are_out_of_reach(make_sandbox: Callable[..., Sandbox]) -> None:
    a = make_sandbox()
    b = make_sandbox()
    a.files.write("/work/other-secret.txt", "s3cr3t-of-a\n")
    a.start("sleep 30")  # a live process of a, whose /proc entry b would need
    r = b.run(
        "find / -xdev -name other-secret.txt 2>/dev/null; "
        "grep -rls s3cr3t-of-a /proc/[0-9]*/root/work /tmp /work /run; true",
        timeout_s=30,
    )
    assert not r.timed_out and r.stdout == b"", r
    # b sees only its own processes (its own pid namespace).
    pids = b.run("ps -o pid,args | grep -c '[s]leep 30' || true").text.strip()
    assert pids == "0"


def test_proc_root_and_symlinks_do_not_lead_into_the_control_plane(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox()
    ch = _chronus_pid(sb)
    r = sb.run(
        f"for p in 1 {ch}; do ls /proc/$p/root/ 2>&1; ls /proc/$p/cwd/ 2>&1; "
        f"readlink /proc/$p/exe 2>&1; cat /proc/$p/maps 2>&1 | head -1; done; "
        f"ln -s /proc/1/fd /tmp/l1 && ls /tmp/l1/ 2>&1; ln -s /proc/{ch}/root /tmp/l2 && ls /tmp/l2/ 2>&1; "
        f"ln -s /proc/{ch}/fd/4 /tmp/l3 && ls /tmp/l3/ 2>&1; true"
    )
    out = r.stdout.decode()
    assert "Permission denied" in out
    for leak in ("bin", "lib", "python3", "ld-linux", "ctl", "se-"):
        assert leak not in out.replace("Permission denied", ""), out
    # The toolkit is read-only to everyone, even root.
    r = sb.run("touch /.dsec/x; echo > /.dsec/lib/python3.11/os.py; true")
    assert (r.stdout + r.stderr).count(b"Read-only file system") == 2, r


TGKILL_PROBE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) {  /* first thing at exec: signal 0 to chronus's threads */
    pid_t chronus = atoi(argv[1]), me = getpid();
    int reached = 0;
    for (pid_t tid = me - 16; tid < me + 16; tid++)
        if (tid > 0 && syscall(SYS_tgkill, chronus, tid, 0) == 0) reached++;
    for (pid_t tid = 1; tid < 64; tid++)  /* aether's threads */
        if (syscall(SYS_tgkill, 1, tid, 0) == 0) reached++;
    printf("%d\n", reached);
    return 0;
}
"""


def test_no_thread_of_aether_or_chronus_can_be_signalled(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    """Landlock checks a signal against the target *thread's* domain: a command must not reach
    any thread of chronus or aether with tgkill (SIGKILL to one thread kills the process),
    not even in the first microseconds after its exec (when a thread that started it could
    still exist, were commands started from a thread in their own domain)."""
    sb = make_sandbox(image="bookworm")
    ch = _chronus_pid(sb)
    sb.files.write("/tmp/tg.c", TGKILL_PROBE.encode())
    built = sb.run("gcc -O1 -static -o /tmp/tg /tmp/tg.c", timeout_s=120)
    assert built.exit_code == 0, built
    flood = sb.start("yes")  # keeps chronus's output thread busy (and the GIL contended)
    try:
        # an argv, not a shell line: the probe is chronus's own child
        reached = [sb.run(["/tmp/tg", str(ch)]).text.strip() for _ in range(40)]
    finally:
        flood.kill()
    assert set(reached) == {"0"}, reached
    assert _chronus_pid(sb) == ch and sb.run("echo alive").text == "alive\n"


def test_killing_aether_and_chronus_from_inside_fails(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    ch = _chronus_pid(sb)
    r = sb.run(
        f"kill -9 1; echo $?; kill -TERM 1; echo $?; kill -9 {ch}; echo $?; kill -STOP {ch}; echo $?; "
        "kill -9 -1; echo $?"
    )
    codes = [line for line in r.text.splitlines() if line.isdigit()]
    # pid 1 ignores SIGKILL from inside its namespace; everything else is out of the command's
    # Landlock scope (EPERM). kill -1 reaches only the caller's own processes (it ends itself,
    # hence no last code).
    assert codes[:4] == ["1", "1", "1", "1"], r
    assert sb.refresh().state == "RUNNING"
    assert sb.run("echo alive").text == "alive\n"
    assert _chronus_pid(sb) == ch  # not even restarted


def test_a_cwd_through_proc_of_the_control_plane_does_not_resolve(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    """A command's cwd is entered after its Landlock domain: /proc/<pid>/{cwd,root,fd/N} of
    aether or chronus (ptrace-scoped) must not resolve, or the command would start inside
    their directories (e.g. another session's private one) with rights Landlock does not cover."""
    sb = make_sandbox()
    ch = _chronus_pid(sb)
    for cwd in ("/proc/1/cwd", "/proc/1/root/", f"/proc/{ch}/cwd"):
        r = sb.run(["pwd"], cwd=cwd)
        assert r.exit_code == 126 and r.error.startswith("chdir"), (cwd, r)
        assert "Permission denied" in r.error, (cwd, r)
    assert sb.run(["pwd"], cwd="/tmp").text == "/tmp\n"  # an ordinary cwd still works


def _aether_log(lab: Lab, sb: Sandbox) -> str:
    path = lab.cluster.home / "edges" / "adv0" / "container" / "logs" / f"{sb.id}.log"
    return path.read_text(errors="replace")


def test_pid1_loader_takes_no_library_from_the_callers_environment(
    lab: Lab, make_sandbox: Callable[..., Sandbox]
) -> None:
    """pid 1 is the toolkit's ld.so, which obeys LD_PRELOAD/LD_AUDIT/...: the edge keeps every
    LD_* variable away from it, and chronus gives them back to commands."""
    sb = make_sandbox(image="bookworm", env={"LD_PRELOAD": "/nonexistent-dsec.so", "LD_X": "1"})
    r = sb.run('echo "$LD_PRELOAD $LD_X"')
    assert r.stdout == b"/nonexistent-dsec.so 1\n", r
    assert b"cannot be preloaded" in r.stderr  # the commands' loader did get it
    assert "preload" not in _aether_log(lab, sb)  # aether's did not
    assert sb.refresh().state == "RUNNING"


def test_an_agents_ld_so_preload_is_not_loaded_into_aether(
    lab: Lab, client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    """/etc/ld.so.preload written by an agent and packed into an environment must not reach
    the aether of sandboxes made from it (every loader reads it, pid 1's too): it is masked."""
    a = make_sandbox(image="bookworm")
    a.files.write("/etc/ld.so.preload", b"/nonexistent-dsec-preload.so\n")
    assert b"cannot be preloaded" in a.run("true").stderr  # effective where it was written
    name = f"adv-preload-{os.getpid()}:v1"
    a.pack_diff(name)
    try:
        b = make_sandbox(image=name)
        assert b.refresh().state == "RUNNING"
        assert b.run("cat /etc/ld.so.preload").stdout == b""  # masked (/dev/null)
        assert b"preload" not in b.run("true").stderr
        assert "preload" not in _aether_log(lab, b)
    finally:
        client.delete_environment(name)


def test_the_control_planes_resource_limits_cannot_be_changed(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    """Landlock has no hook for prlimit: the per-command seccomp filter refuses setting another
    process's limits (RLIMIT_CPU on aether or chronus would kill it, RLIMIT_NOFILE cripple it);
    a command's own limits and reading anyone's stay allowed."""
    sb = make_sandbox(image="bookworm")
    ch = _chronus_pid(sb)
    probe = f"""
import resource
out = []
for pid in (1, {ch}):
    for res in (resource.RLIMIT_CPU, resource.RLIMIT_NOFILE):
        try:
            resource.prlimit(pid, res, (1, 1))
            out.append("set")
        except PermissionError:
            out.append("refused")
    out.append("read" if resource.prlimit(pid, resource.RLIMIT_NOFILE) else "?")
resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))
out.append("own" if resource.getrlimit(resource.RLIMIT_NOFILE) == (512, 512) else "?")
print(" ".join(out))
"""
    sb.files.write("/tmp/limits.py", probe.encode())
    r = sb.run("python3 /tmp/limits.py")
    assert r.exit_code == 0, r
    assert r.text.split() == ["refused", "refused", "read"] * 2 + ["own"]
    assert _chronus_pid(sb) == ch and sb.run("echo alive").text == "alive\n"

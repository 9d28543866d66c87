"""Escapes: another sandbox's files, /proc/<pid>/root and symlinks into the control plane,
killing aether (pid 1) and chronus from inside."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from libdsec import Sandbox
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

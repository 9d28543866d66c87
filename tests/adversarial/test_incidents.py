"""The DSec report's production incidents, replayed by an agent that is root in its sandbox.

Each test plays one attack and asserts the containment (the `contained` fixture: the platform
answers, the witness sandbox works and its files are intact, the canary outside every sandbox
is unchanged) and what the platform reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from libdsec import Sandbox
from libdsec.errors import FailedPrecondition
from tests.adversarial.conftest import TOOLKIT_PY

pytestmark = pytest.mark.usefixtures("contained")


def _chronus_pid(sb: Sandbox) -> int:
    """chronus: the child of pid 1 with pid 1's command line."""
    out = sb.run("ps -o pid,ppid,args").text
    return next(
        int(line.split()[0])
        for line in out.splitlines()[1:]
        if line.split()[1] == "1" and "-m aether" in line
    )


def test_forged_rpc_to_chronus_sockets_and_fifos_is_refused(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox()
    victim = sb.session()
    victim.run("cd /tmp && X=kept")
    ch = _chronus_pid(sb)
    # The control channel: aether's fd 3 and chronus's socketpair. Their descriptors cannot be
    # read or opened, even as root.
    r = sb.run(
        f"for p in 1 {ch}; do ls -l /proc/$p/fd/ 2>&1; cat /proc/$p/fd/3 2>&1; "
        f"echo x > /proc/$p/fd/4 2>&1; cat /proc/$p/environ 2>&1; done; true"
    )
    assert b"Permission denied" in r.stdout
    assert b" -> " not in r.stdout  # no descriptor target was ever shown
    assert b"DSEC_" not in r.stdout
    # No socket or FIFO of chronus exists anywhere in the tree an agent can walk.
    r = sb.run("find / -xdev \\( -type s -o -type p \\) 2>/dev/null; true", timeout_s=60)
    assert r.stdout == b"", r.stdout
    # The victim session's shell holds its FIFOs; another call cannot reach them through /proc.
    shell = victim.run("echo $$").text.strip()
    r = sb.run(
        f"ls /proc/{shell}/fd/63/ 2>&1; echo '1-forged 0' > /proc/{shell}/fd/63/ctl 2>&1; "
        f"cat /proc/{shell}/fd/63/cmd-1 2>&1; kill -STOP {shell} 2>&1; true"
    )
    assert b"Permission denied" in r.stdout or b"not permitted" in r.stdout, r.stdout
    assert b"X=kept" not in r.stdout
    # Abstract sockets made outside a command's domain are out of its reach.
    # The victim session is intact: state kept, output and status its own.
    r = victim.run("pwd; echo $X; (exit 3)")
    assert r.stdout == b"/tmp\nkept\n" and r.exit_code == 3
    victim.close()


def test_chronus_logs_and_state_hold_no_answers(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    secret = "ANSWER-" + "4f1c9e"
    # The harness runs its check with the answer in the command, in a session, while the agent
    # searches everything it can read for it (the pattern is assembled at run time, so the
    # agent's own command line does not contain it).
    harness = sb.session()
    held = sb.start("sleep 0.3; true")
    held.wait(10)
    checking = sb.start("sleep 5")
    _ = checking
    check = harness.stream(f"test -n '{secret}'; sleep 4; echo done")
    next(iter(check))  # started
    r = sb.run(
        "pat=ANSWER-$(printf '%s' 4f1c9e); "
        'grep -rl "$pat" / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev 2>/dev/null; '
        "for p in /proc/[0-9]*; do for f in cmdline environ maps; do "
        'grep -l "$pat" $p/$f 2>/dev/null; done; '
        'for f in $p/fd/*; do [ -f $f ] && grep -l "$pat" $f 2>/dev/null; done; done; true',
        timeout_s=30,
    )
    assert not r.timed_out and r.stdout == b"", r
    assert any(ev for ev in check)  # the harness call still completes
    harness.close()


def test_overwritten_bash_is_not_used_by_trusted_execution(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox(image="bookworm", memory_mb=256)
    sb.files.write("/work/solution.py", "print(6 * 7)\n")
    # The agent replaces bash and python, and deletes a tool, to fake the evaluation.
    sb.run(
        "printf '#!/bin/sh\\necho PASSED; exit 0\\n' > /usr/bin/bash && "
        "cp /usr/bin/bash /usr/bin/python3.11 && rm /usr/bin/diff"
    )
    assert sb.run(["bash", "-c", "exit 1"]).stdout == b"PASSED\n"
    # The evaluation step runs from the read-only layers and sees the agent's work.
    r = sb.run(["bash", "-c", "python3 /work/solution.py; exit 7"], trusted=True, timeout_s=60)
    assert (r.exit_code, r.stdout) == (7, b"42\n"), r
    r = sb.run("command -v diff && sha256sum /usr/bin/bash | cut -c1-8", trusted=True)
    assert r.exit_code == 0 and b"/usr/bin/diff" in r.stdout
    # ... and what the agent changed in the image is reported.
    changed = {f.path: f.deleted for f in sb.modified_files()}
    assert changed.get("/usr/bin/bash") is False
    assert changed.get("/usr/bin/python3.11") is False
    assert changed.get("/usr/bin/diff") is True
    assert "/work/solution.py" not in changed  # new work is not a modification
    # The workspace is shared as it is now: a new one is picked up...
    sb.run("rm -rf /work && mkdir /work && echo v2 > /work/version")
    assert sb.run("cat /work/version", trusted=True).stdout == b"v2\n"
    # ... but a workspace turned into a symlink (to the host's root, were it followed) is not.
    sb.run("rm -rf /work && ln -s / /work")
    with pytest.raises(FailedPrecondition) as err:
        sb.run("ls /work", trusted=True)
    assert err.value.reason == "WORKSPACE_UNAVAILABLE"


def test_extent_swapping_and_other_dangerous_ioctls_are_refused(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox()
    code = (
        "import fcntl, os, ctypes, errno\n"
        "a = os.open('/work/a', os.O_RDWR | os.O_CREAT); b = os.open('/work/b', os.O_RDWR | os.O_CREAT)\n"
        "os.write(a, b'x' * 8192); os.write(b, b'y' * 8192)\n"
        "import struct\n"
        "arg = bytearray(struct.pack('=IIQQQQ', 0, b, 0, 0, 2, 0))\n"
        "for req in (0xC028660F, 0xFFFFFFFF_C028660F & 0xFFFFFFFFFFFFFFFF, 0x5412, 0x8004587D):\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    r = libc.ioctl(a, ctypes.c_ulong(req), ctypes.c_char_p(bytes(arg)))\n"
        "    print(hex(req), r, errno.errorcode.get(ctypes.get_errno()))\n"
        "r = libc.syscall(425, 8, ctypes.c_char_p(bytes(120)))\n"
        "print('io_uring_setup', r, errno.errorcode.get(ctypes.get_errno()))\n"
        "print('FIONREAD', fcntl.ioctl(os.pipe()[0], 0x541B, b'0000') is not None)\n"
    )
    sb.files.write("/tmp/ioctl.py", code)
    r = sb.run(f"{TOOLKIT_PY} /tmp/ioctl.py")
    lines = r.text.splitlines()
    assert r.exit_code == 0, r
    assert lines[0] == "0xc028660f -1 EPERM"
    assert lines[1] == "0xffffffffc028660f -1 EPERM"  # high bits set: same ioctl, same answer
    assert lines[2] == "0x5412 -1 EPERM"  # TIOCSTI
    assert lines[3] == "0x8004587d -1 EPERM"  # FS_IOC_SHUTDOWN
    assert lines[4] == "io_uring_setup -1 ENOSYS"
    assert lines[5] == "FIONREAD True"  # ordinary ioctls work
    assert sb.run("cmp /work/a /work/a && head -c 4 /work/b").stdout == b"yyyy"


def test_kernel_pages_and_sysrq_are_masked_and_sys_is_read_only(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox()
    r = sb.run(
        "for f in kpagecgroup kpageflags kpagecount kcore kmsg; do "
        "echo $f $(head -c 64 /proc/$f 2>/dev/null | wc -c); done"
    )
    assert r.text.split("\n")[:5] == [
        "kpagecgroup 0",
        "kpageflags 0",
        "kpagecount 0",
        "kcore 0",
        "kmsg 0",
    ], r.text
    r = sb.run(
        "echo c > /proc/sysrq-trigger; echo $?; echo 1 > /proc/sys/vm/drop_caches; echo $?; "
        "touch /sys/x; echo $?; echo 1 > /sys/kernel/mm/page_idle/bitmap; echo $?"
    )
    assert all(code != "0" for code in r.text.split()), r
    assert sb.run("cat /sys/kernel/mm/page_idle/bitmap 2>/dev/null | wc -c").text.strip() == "0"


def test_yes_flood_is_capped(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    t0 = time.monotonic()
    r = sb.run("yes", timeout_s=3, max_output_bytes=1 << 20)
    assert r.timed_out and r.truncated
    assert len(r.stdout) <= (1 << 20) + 1024  # head + marker + tail
    assert r.stdout.startswith(b"y\ny\n") and r.stdout.endswith(b"y\n")
    assert time.monotonic() - t0 < 30
    events = sum(len(getattr(ev, "data", b"")) for ev in sb.stream("yes | head -c 50000000"))
    assert events <= (1 << 20) + 1024  # a stream forwards at most the cap too

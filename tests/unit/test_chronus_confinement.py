"""chronus's confinement of commands (Landlock domains, the second seccomp filter), on a real
chronus process (the `chronus` fixture of test_chronus). In a container the runtime directory
is also detached from the tree; tests/adversarial covers that end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from chronus import landlock
from chronus.seccomp import BLOCKED_IOCTLS, program
from tests.unit import test_chronus as base
from tests.unit.test_chronus import ChronusClient

chronus = base.chronus  # the fixtures: a real chronus process and a client of it
client = base.client

needs_landlock = pytest.mark.skipif(landlock.ABI < 6, reason="Landlock ABI >= 6 needed")


@needs_landlock
def test_commands_cannot_signal_or_inspect_chronus(
    client: ChronusClient, chronus: tuple[ChronusClient, int, Path]
) -> None:
    pid = chronus[1]
    r = client.run(f"kill -CONT {pid}; echo $?; ls -l /proc/{pid}/fd/ 2>&1")
    assert r["stdout"].split(b"\n")[0] == b"1", r
    assert b"Permission denied" in r["stdout"] + r["stderr"]


@needs_landlock
def test_each_call_is_its_own_domain_but_its_processes_share_one(client: ChronusClient) -> None:
    bg = client.one({"exec": {"command": "sleep 30", "background": True}})
    info = client.one({"list_execs": {}})
    pid = next(e["pid"] for e in info["execs"] if e["exec_id"] == bg["exec_id"])
    r = client.run(f"kill -TERM {pid}; echo $?; sleep 5 & kill $!; echo $?")
    assert r["stdout"] == b"1\n0\n", r  # another call's process: no; its own child: yes
    # chronus itself signals any of them.
    assert client.one({"signal_exec": {"exec_id": bg["exec_id"], "signal": 9}})["delivered"]


def test_dangerous_ioctls_are_refused(client: ChronusClient) -> None:
    code = (
        "import ctypes, errno, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = os.open('/dev/null', os.O_RDWR)\n"
        "for req in (0xC028660F, 0xFFFFFFFFC028660F, 0x5412):\n"
        "    r = libc.ioctl(fd, ctypes.c_ulong(req), ctypes.c_char_p(bytes(64)))\n"
        "    print(r, errno.errorcode.get(ctypes.get_errno()))\n"
    )
    r = client.run(f'{sys.executable} -S -c "{code}"')
    assert r["stdout"] == b"-1 EPERM\n-1 EPERM\n-1 EPERM\n", r


def test_seccomp_program_shape() -> None:
    code = program()
    assert len(code) % 8 == 0 and len(code) // 8 < 100
    for req in BLOCKED_IOCTLS.values():
        assert req.to_bytes(4, "little") in code

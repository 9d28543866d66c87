"""The edge's one-time compilation of the sandbox seccomp profile (edge/runtime/seccomp_bpf.py)
and aether's installation of it (insandbox/security.py), on this machine's real libseccomp and kernel:
each program is loaded into a forked child, which then makes the system calls."""

from __future__ import annotations

import ctypes
import errno
import json
import os

import pytest

from edge.runtime import seccomp_bpf
from edge.runtime.bundle import hardened_seccomp
from insandbox.security import SECCOMP_FD_ENV, install_seccomp_from_env

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# (label, x86_64 number, args)
PROBES = [
    ("getpid", 39, ()),
    ("keyctl", 250, (0, 0)),
    ("unshare-user", 272, (0x10000000,)),
    ("mount", 165, (0, 0, 0, 0, 0)),
    ("kexec_load", 246, (0, 0, 0, 0)),
    ("bpf", 321, (0, 0, 0)),
    ("personality-8", 135, (8,)),
    ("personality-7", 135, (7,)),
    ("socket-vsock", 41, (40, 1, 0)),
    ("io_uring_setup", 425, (0, 0)),
    ("clone3", 435, (0, 0)),
    ("after-the-profile", 462, (0, 0, 0)),
    ("nr-1000", 1000, ()),
]


def probe() -> dict[str, str]:
    """errno name (or "ok") of each probe, in the calling process."""
    out = {}
    for label, nr, args in PROBES:
        r = _libc.syscall(nr, *[ctypes.c_long(a) for a in args])
        e = ctypes.get_errno()
        out[label] = "ok" if r >= 0 else errno.errorcode.get(e, str(e))
    return out


def in_child(fn) -> dict[str, str]:  # type: ignore[no-untyped-def]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, json.dumps(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    result: dict[str, str] = json.loads(data)
    return result


def test_hardened_profile_compiles_once_within_kernel_limits() -> None:
    a = seccomp_bpf.compile_profile(hardened_seccomp())
    b = seccomp_bpf.compile_profile(hardened_seccomp())
    assert a is b  # cached by content
    assert 100 < a.instructions <= seccomp_bpf.MAX_INSNS
    assert len(a.code) % 8 == 0
    # io_uring_register (427) and the Landlock calls (444-446) are named by the profile
    assert a.max_nr["x86_64"] >= 446 and a.max_nr["x32"] & 0x40000000


def test_installed_program_enforces_the_profile() -> None:
    program = seccomp_bpf.compile_profile(hardened_seccomp())
    fd = seccomp_bpf.sealed_memfd(program)
    os.set_inheritable(fd, True)

    def run() -> dict[str, str]:
        assert _libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs, as runc sets it
        failure = install_seccomp_from_env({SECCOMP_FD_ENV: str(fd)})
        assert failure is None, failure
        return probe()

    try:
        got = in_child(run)
    finally:
        os.close(fd)
    assert got["getpid"] == "ok"
    assert got["personality-8"] == "ok"
    for refused in ("keyctl", "unshare-user", "mount", "kexec_load", "bpf", "personality-7"):
        assert got[refused] == "EPERM", (refused, got)
    # refused with ENOSYS by the profile (io_uring, clone3) or as newer than it (runc's rule)
    for newer in ("io_uring_setup", "clone3", "after-the-profile", "nr-1000"):
        assert got[newer] == "ENOSYS", (newer, got)
    assert in_child(probe)["keyctl"] != "EPERM"  # the parent is not filtered: the probe can tell


def test_sealed_memfd_cannot_be_changed() -> None:
    fd = seccomp_bpf.sealed_memfd(seccomp_bpf.compile_profile(hardened_seccomp()))
    try:
        with pytest.raises(PermissionError):
            os.write(fd, b"x" * 8)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def test_bad_profiles_are_refused_by_name() -> None:
    base = {"defaultAction": "SCMP_ACT_ERRNO", "architectures": ["SCMP_ARCH_X86_64"]}
    with pytest.raises(seccomp_bpf.SeccompCompileError, match="SCMP_ACT_NOPE"):
        seccomp_bpf.compile_profile(
            {**base, "syscalls": [{"names": ["read"], "action": "SCMP_ACT_NOPE"}]}
        )
    with pytest.raises(seccomp_bpf.SeccompCompileError, match="SCMP_CMP_ALMOST"):
        seccomp_bpf.compile_profile(
            {
                **base,
                "syscalls": [
                    {
                        "names": ["personality"],
                        "action": "SCMP_ACT_ALLOW",
                        "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_ALMOST"}],
                    }
                ],
            }
        )
    with pytest.raises(seccomp_bpf.SeccompCompileError, match="SCMP_ARCH_PDP11"):
        seccomp_bpf.compile_profile({**base, "architectures": ["SCMP_ARCH_PDP11"], "syscalls": []})


def test_aether_refuses_a_missing_or_malformed_program() -> None:
    assert install_seccomp_from_env({}) is None  # not asked for
    bad = install_seccomp_from_env({SECCOMP_FD_ENV: "987"})
    assert bad is not None and "cannot read" in bad
    fd = os.memfd_create("bad")
    os.write(fd, b"1234567")  # not a whole number of instructions
    assert "not a seccomp program" in (install_seccomp_from_env({SECCOMP_FD_ENV: str(fd)}) or "")

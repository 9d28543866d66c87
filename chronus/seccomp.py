"""A second seccomp filter for every command: dangerous ioctls, io_uring, others' rlimits.

aether installs Docker's profile for the whole sandbox (aether and chronus included). That
profile allows ioctl unconditionally, and libseccomp cannot refuse some request numbers on top
of an unconditional allow (verified with runc 1.1.5 / libseccomp 2.5.4: the allow wins, in
either rule order). Filters stack in the kernel and the most restrictive answer wins, so chronus
adds this small classic-BPF filter to each command, just before exec (after Landlock, by
`dsec-confine` or a forked child; the no_new_privs bit it needs is already set):

    ioctl(fd, request, ...) with the low 32 bits of `request` (what the kernel uses, so setting
    the high bits does not slip past, and musl's sign-extended requests still work) in
    BLOCKED_IOCTLS                                   -> EPERM
    io_uring_setup / io_uring_enter / io_uring_register -> ENOSYS (programs fall back)
    prlimit64(pid != 0, resource, new != NULL, ...)  -> EPERM (another process's limits:
                                                        Landlock has no hook for prlimit)
    anything else                                    -> allowed (Docker's profile still applies)

for x86_64, x32 and i386 system calls. `program()` builds it; `insandbox.security.Filter`
installs it (the same installer aether uses for the sandbox's profile).
"""

from __future__ import annotations

import struct

# ioctl request numbers (low 32 bits) refused with EPERM.
BLOCKED_IOCTLS: dict[str, int] = {
    "EXT4_IOC_MOVE_EXT": 0xC028660F,  # extent swapping between two files (DSec incident)
    "EXT4_IOC_SWAP_BOOT": 0x00006611,
    "EXT4_IOC_GROUP_EXTEND": 0x40086607,
    "EXT4_IOC_GROUP_ADD": 0x40286608,
    "EXT4_IOC_RESIZE_FS": 0x40086610,
    "FS_IOC_SHUTDOWN": 0x8004587D,
    "FIFREEZE": 0xC0045877,
    "FITHAW": 0xC0045878,
    "TIOCSTI": 0x00005412,  # push bytes into a terminal's input queue
    "TIOCLINUX": 0x0000541C,
}

_AUDIT_ARCH_X86_64 = 0xC000003E
_AUDIT_ARCH_I386 = 0x40000003
_X32_BIT = 0x40000000
_NR = {  # (ioctl, io_uring_setup, io_uring_enter, io_uring_register)
    _AUDIT_ARCH_X86_64: (16, 425, 426, 427),
    _AUDIT_ARCH_I386: (54, 425, 426, 427),
}
_X32_IOCTL = _X32_BIT | 514
_PRLIMIT64 = {_AUDIT_ARCH_X86_64: (302, _X32_BIT | 302), _AUDIT_ARCH_I386: (340,)}

_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_EPERM, _ENOSYS = 1, 38

# classic BPF
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_RET_K = 0x06
_OFF_NR, _OFF_ARCH, _OFF_ARG1_LO = 0, 4, 24
_OFF_ARG0_LO, _OFF_ARG2_LO, _OFF_ARG2_HI = 16, 32, 36


def _insn(code: int, jt: int = 0, jf: int = 0, k: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def program() -> bytes:
    """The filter, as struct sock_filter[]."""
    blocked = sorted(set(BLOCKED_IOCTLS.values()))
    # Tail shared by every arch: check args[1] (low word), then the verdicts.
    check = [_insn(_LD_W_ABS, k=_OFF_ARG1_LO)]
    for i, req in enumerate(blocked):
        to_eperm = len(blocked) - i  # skip the rest of the comparisons and ALLOW
        check.append(_insn(_JEQ_K, to_eperm, 0, req))
    check += [_insn(_RET_K, k=_RET_ALLOW), _insn(_RET_K, k=_RET_ERRNO | _EPERM)]

    # prlimit64(pid, resource, new, old) setting another process's limits (pid != 0 and
    # new != NULL) -> EPERM: Landlock has no hook for it, and a command could lower aether's or
    # chronus's limits (RLIMIT_CPU kills, RLIMIT_NOFILE cripples). Own limits (pid 0, what
    # setrlimit uses) and reading anyone's stay allowed.
    prlimit = [
        _insn(_LD_W_ABS, k=_OFF_ARG0_LO),
        _insn(_JEQ_K, 4, 0, 0),  # pid 0: itself -> ALLOW
        _insn(_LD_W_ABS, k=_OFF_ARG2_LO),
        _insn(_JEQ_K, 0, 3, 0),  # new limit set (low word) -> EPERM
        _insn(_LD_W_ABS, k=_OFF_ARG2_HI),
        _insn(_JEQ_K, 0, 1, 0),  # new limit set (high word) -> EPERM
        _insn(_RET_K, k=_RET_ALLOW),
        _insn(_RET_K, k=_RET_ERRNO | _EPERM),
    ]

    def arch_block(nrs: tuple[int, ...], prlimits: tuple[int, ...], x32: bool) -> list[bytes]:
        ioctl, *uring = nrs
        body = [_insn(_LD_W_ABS, k=_OFF_NR)]
        ioctls = [ioctl, _X32_IOCTL] if x32 else [ioctl]
        # layout: [jeq prlimit...] [jeq ioctl...] [jeq uring...] ret ALLOW, ret ENOSYS, the
        # check block, the prlimit block
        n_jumps = len(ioctls) + len(uring)
        for i, nr in enumerate(prlimits):
            after = len(prlimits) - i - 1
            body.append(_insn(_JEQ_K, after + n_jumps + 2 + len(check), 0, nr))
        for i, nr in enumerate(ioctls):
            after = n_jumps - i - 1  # jumps left after this one
            body.append(_insn(_JEQ_K, after + 2, 0, nr))  # over ALLOW and ENOSYS into check
        for i, nr in enumerate(uring):
            after = len(uring) - i - 1
            body.append(_insn(_JEQ_K, after + 1, 0, nr))  # over ALLOW to ENOSYS
        body += [_insn(_RET_K, k=_RET_ALLOW), _insn(_RET_K, k=_RET_ERRNO | _ENOSYS)]
        return body + check + prlimit

    x86 = arch_block(_NR[_AUDIT_ARCH_X86_64], _PRLIMIT64[_AUDIT_ARCH_X86_64], x32=True)
    i386 = arch_block(_NR[_AUDIT_ARCH_I386], _PRLIMIT64[_AUDIT_ARCH_I386], x32=False)
    head = [
        _insn(_LD_W_ABS, k=_OFF_ARCH),
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),  # -> the x86 block, after the next jump
        # -> the i386 block; any other arch -> the final ALLOW (Docker's profile, the first
        # filter, decides about those)
        _insn(_JEQ_K, len(x86), len(x86) + len(i386), _AUDIT_ARCH_I386),
    ]
    return b"".join(head + x86 + i386 + [_insn(_RET_K, k=_RET_ALLOW)])

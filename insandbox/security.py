"""prctl(2) settings of the in-sandbox agents, and the seccomp program installer.

aether makes itself non-dumpable and a subreaper, and installs the sandbox's seccomp profile
(handed over by the edge) before anything else; chronus installs a second filter on every
command (`chronus.seccomp`) through the same `Filter`. ctypes is imported at start (here, and
by chronus.landlock): the settings are inherited by chronus across fork.
"""

from __future__ import annotations

import _thread
import ctypes
import fcntl
import os
import struct

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
_PR_SET_SECCOMP = 22
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_MODE_FILTER = 2


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def make_undumpable() -> bool:
    """Without CAP_SYS_PTRACE, nobody (not even root in the sandbox) can then
    open /proc/<pid>/fd/* of this process to reach the channel, read its
    memory or attach a debugger. Reset to dumpable by execve, so commands
    are unaffected; kept across fork, so chronus inherits it."""
    return _prctl(PR_SET_DUMPABLE, 0)


def become_subreaper() -> bool:
    """Orphans of our descendants are re-parented to us instead of to the
    real init: outside a pid namespace (tests, development), aether still
    sees and reaps every process of the sandbox."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


SECCOMP_FD_ENV = "DSEC_AETHER_SECCOMP_FD"


def install_seccomp_from_env(environ: dict[str, str] | None = None) -> str | None:
    """Install the sandbox's seccomp filter, handed over by the edge as a sealed memfd named
    by DSEC_AETHER_SECCOMP_FD (struct sock_filter[], compiled once per node from the runtime's
    profile; see edge/runtime/seccomp_bpf.py). Called first thing, before chronus exists: every
    later process of the sandbox inherits the filter and cannot remove it. runc has already set
    no_new_privs. Returns None when done or not asked for, else why it failed (aether must then
    refuse to run: a sandbox without its filter is never started)."""
    env = os.environ if environ is None else environ
    raw = env.pop(SECCOMP_FD_ENV, None)  # chronus and commands need not see it
    if not raw:
        return None
    try:
        fd = int(raw)
        size = os.fstat(fd).st_size
        code = os.pread(fd, size, 0)
        os.close(fd)
    except (ValueError, OSError) as exc:
        return f"{SECCOMP_FD_ENV}={raw}: cannot read the filter: {exc}"
    if not code or len(code) % 8 or len(code) // 8 > 4096:
        return f"{SECCOMP_FD_ENV}={raw}: not a seccomp program ({len(code)} bytes)"
    try:
        Filter(code).install()
    except OSError as exc:
        return f"{exc.strerror or exc}: {os.strerror(exc.errno or 0)}"
    return None


class Filter:
    """A seccomp program (struct sock_filter[]) in memory, ready for `install` in a forked child
    or at the start of aether (the sandbox's whole profile, above); chronus hands it to
    chronus._spawn as bytes, or to `dsec-confine` as a memfd."""

    def __init__(self, code: bytes) -> None:
        self._code = ctypes.create_string_buffer(code, len(code))
        self._fprog = ctypes.create_string_buffer(
            struct.pack("<H6xQ", len(code) // 8, ctypes.addressof(self._code)), 16
        )
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl
        self._code_bytes = code
        self._memfd = -1
        self._memfd_lock = _thread.allocate_lock()  # request threads spawn concurrently

    @property
    def code(self) -> bytes:
        """The program (struct sock_filter[]), for chronus._spawn."""
        return self._code_bytes

    def memfd(self) -> int:
        """The program in a sealed, close-on-exec memfd (for dsec-confine), made once."""
        with self._memfd_lock:
            if self._memfd < 0:
                fd = os.memfd_create("dsec-cmd-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                try:
                    if os.write(fd, self._code_bytes) != len(self._code_bytes):
                        raise OSError(5, "short write of the seccomp program")
                    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_WRITE)
                except BaseException:
                    os.close(fd)
                    raise
                self._memfd = fd
            return self._memfd

    def install(self) -> None:
        """In a forked child, before exec (or in aether, first thing)."""
        if self._prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if self._prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, self._fprog, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")

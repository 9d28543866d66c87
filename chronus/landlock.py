"""Landlock domains for every command and shell session chronus starts.

The agent is root inside its sandbox, so permissions, capabilities and uids do not keep it away
from chronus's private state. Landlock does: it holds for root, needs no privilege to use, and a
domain can never be left. chronus and aether stay outside any domain; each command (and each
session's shell, with everything it runs) gets a fresh domain, entered by its own process just
before exec (in `dsec-confine`, chronus/confine.c, or a forked child: chronus/proc.py):

- files: every right beneath "/" (the sandbox's whole tree works as before: ls /, mkdir /data,
  renames across directories) -- and nothing beneath anything that is not under "/". chronus's
  runtime directory is such a thing: a tmpfs the edge mounts *detached* (fsmount, never attached
  to any tree) and hands to aether as a descriptor, so it has no path an agent could name, and
  even a descriptor leaked into a command would not open it. A session's shell is granted its own
  session directory (it reads its command files and writes its FIFOs there), and nothing else;
- LANDLOCK_SCOPE_SIGNAL: no signal to a process outside the domain -- aether, chronus, other
  commands' and sessions' process trees; commands of one call signal each other as usual;
- LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET: no connect to abstract sockets made outside the domain;
- ptrace scoping (always on in a domain): no ptrace of processes outside the domain, and no
  following of their /proc/<pid>/{fd/N,root,cwd} links (measured on this kernel). This is what
  keeps another session's FIFOs (open in its shell) unreachable, although root could otherwise
  open /proc/<pid>/fd/N of any dumpable process with the same uid. Measured too: it does NOT
  stop reading /proc/<pid>/{environ,maps} of a dumpable process of the same uid; aether and
  chronus are non-dumpable (`insandbox.security`), which refuses those to root without
  CAP_SYS_PTRACE.

Pathname Unix sockets are not covered by Landlock ABI 7 (connect() is not an access right); the
sandbox has none of ours: the channel is an inherited descriptor of aether and a socketpair.

Everything is a syscall through ctypes (already loaded by aether at start; chronus is forked
from it). The rulesets are made in chronus; the child only calls prctl and
landlock_restrict_self, which are async-signal-safe enough for a freshly forked child.
"""

from __future__ import annotations

import _thread
import ctypes
import os
import struct

from chronus import seccomp
from insandbox.log import get_logger
from insandbox.security import Filter

log = get_logger("chronus.landlock")

_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

ACCESS_FS_EXECUTE = 1 << 0
# Rights by the ABI that introduced them.
_FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_prctl = _libc.prctl


def _abi() -> int:
    r = _syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), _CREATE_RULESET_VERSION)
    return int(r) if r > 0 else 0


ABI = _abi()


def fs_rights(abi: int = ABI) -> int:
    rights = 0
    for since, mask in _FS_RIGHTS_BY_ABI.items():
        if abi >= since:
            rights = mask
    return rights


def _check(r: int, what: str) -> int:
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return r


class Sandboxing:
    """Makes the rulesets of commands and sessions; `enabled` is False without Landlock."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"landlock mode must be auto, on or off, not {mode!r}")
        self.abi = ABI if mode != "off" else 0
        if mode == "on" and not self.abi:
            raise OSError("Landlock is required (DSEC_CHRONUS_LANDLOCK=on) but unavailable")
        self.enabled = self.abi > 0
        self.handled = fs_rights(self.abi)
        self.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if self.abi >= 6 else 0
        self._exec_ruleset = -1
        self._lock = _thread.allocate_lock()
        # The second seccomp filter (dangerous ioctls, io_uring): for every command as well.
        self.filter = Filter(seccomp.program())
        if mode == "auto" and not self.enabled:
            log.warning("Landlock unavailable: commands run without file/socket/signal isolation")
        elif self.enabled:
            log.info("Landlock ABI %d: every command runs in its own domain", self.abi)

    def _new_ruleset(self, extra_dirs: tuple[int, ...]) -> int:
        if self.abi >= 6:
            attr = struct.pack("=QQQ", self.handled, 0, self.scoped)
        elif self.abi >= 4:
            attr = struct.pack("=QQ", self.handled, 0)
        else:
            attr = struct.pack("=Q", self.handled)
        buf = ctypes.create_string_buffer(attr, len(attr))
        fd = _check(
            _syscall(_SYS_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), 0), "create ruleset"
        )
        os.set_inheritable(fd, False)
        try:
            root = os.open("/", os.O_PATH | os.O_CLOEXEC)
            try:
                self._add(fd, root, self.handled)
            finally:
                os.close(root)
            for d in extra_dirs:
                self._add(fd, d, self.handled & ~ACCESS_FS_EXECUTE)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _add(ruleset: int, dir_fd: int, rights: int) -> None:
        attr = ctypes.create_string_buffer(struct.pack("=Qi", rights, dir_fd), 12)
        _check(_syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, attr, 0), "add rule")

    def for_exec(self) -> int:
        """The ruleset of a plain command (shared: each restrict_self makes a new domain)."""
        if not self.enabled:
            return -1
        with self._lock:  # request threads start commands concurrently
            if self._exec_ruleset < 0:
                self._exec_ruleset = self._new_ruleset(())
            return self._exec_ruleset

    def for_session(self, session_dir_fd: int) -> int:
        """A ruleset that also grants the session's own directory; the caller closes it."""
        if not self.enabled:
            return -1
        return self._new_ruleset((session_dir_fd,))


def enforce(ruleset_fd: int) -> None:
    """In a forked child, before exec: enter a new domain made from `ruleset_fd`."""
    if _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "prctl(PR_SET_NO_NEW_PRIVS)")
    if _syscall(_SYS_RESTRICT_SELF, ruleset_fd, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "landlock_restrict_self")

"""A tmpfs that is mounted nowhere: chronus's private runtime directory.

fsopen/fsconfig/fsmount make a tmpfs and return a descriptor of its root *without attaching it
to any mount tree*. The edge passes that descriptor to the sandbox's pid 1 (aether, then
chronus): no path inside the sandbox leads to it, `find /` cannot see it, and Landlock rules
granted beneath "/" do not cover it (`chronus.landlock`), so an agent cannot open it even through
a leaked descriptor. It lives as long as some process holds the descriptor, i.e. as long as the
sandbox, and needs no cleanup.
"""

from __future__ import annotations

import ctypes
import os

_SYS_FSOPEN = 430
_SYS_FSCONFIG = 431
_SYS_FSMOUNT = 432
_FSOPEN_CLOEXEC = 1
_FSMOUNT_CLOEXEC = 1
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6
_MOUNT_ATTR_NOSUID = 0x02
_MOUNT_ATTR_NODEV = 0x04
_MOUNT_ATTR_NOEXEC = 0x08

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _sys(*args: object) -> int:
    r = int(_libc.syscall(*args))
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return r


def detached_tmpfs(size_mb: int = 16, nr_inodes: int = 4096) -> int:
    """A close-on-exec descriptor of the root of a new, unattached tmpfs (mode 0700, noexec)."""
    fs = _sys(_SYS_FSOPEN, b"tmpfs", _FSOPEN_CLOEXEC)
    try:
        for key, value in (
            (b"size", f"{size_mb}m".encode()),
            (b"nr_inodes", str(nr_inodes).encode()),
            (b"mode", b"0700"),
        ):
            _sys(_SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, key, value, 0)
        _sys(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0)
        return _sys(
            _SYS_FSMOUNT,
            fs,
            _FSMOUNT_CLOEXEC,
            _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | _MOUNT_ATTR_NOEXEC,
        )
    finally:
        os.close(fs)

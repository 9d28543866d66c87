"""The error vocabulary of chronus: a gRPC status code and a stable reason.

A handler raises `ChronusError`; the engine ends the stream with a StreamEnd
carrying the code and reason, which the edge passes on as the gRPC status.
"""

from __future__ import annotations

import errno

OK = 0
CANCELLED = 1
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14


class ChronusError(Exception):
    """A failed call: ends its stream with `code`, `reason` and `message`."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


class Cancelled(Exception):
    """The edge abandoned the stream (Cancel frame or a dropped connection)."""


def invalid(message: str, reason: str = "INVALID_ARGUMENT") -> ChronusError:
    return ChronusError(INVALID_ARGUMENT, reason, message)


_ERRNO_MAP: dict[int, tuple[int, str]] = {
    errno.ENOENT: (NOT_FOUND, "PATH_NOT_FOUND"),
    errno.ENOTDIR: (FAILED_PRECONDITION, "NOT_A_DIRECTORY"),
    errno.EISDIR: (FAILED_PRECONDITION, "IS_A_DIRECTORY"),
    errno.ENOTEMPTY: (FAILED_PRECONDITION, "DIRECTORY_NOT_EMPTY"),
    errno.EEXIST: (ALREADY_EXISTS, "PATH_EXISTS"),
    errno.EACCES: (PERMISSION_DENIED, "PERMISSION_DENIED"),
    errno.EPERM: (PERMISSION_DENIED, "PERMISSION_DENIED"),
    errno.EROFS: (PERMISSION_DENIED, "READ_ONLY_FILESYSTEM"),
    errno.ENOSPC: (RESOURCE_EXHAUSTED, "NO_SPACE"),
    errno.EDQUOT: (RESOURCE_EXHAUSTED, "DISK_QUOTA_EXCEEDED"),
    errno.ENAMETOOLONG: (INVALID_ARGUMENT, "NAME_TOO_LONG"),
    errno.ELOOP: (FAILED_PRECONDITION, "SYMLINK_LOOP"),
    errno.EXDEV: (FAILED_PRECONDITION, "CROSS_DEVICE"),
    errno.EBUSY: (FAILED_PRECONDITION, "PATH_BUSY"),
    errno.EINVAL: (INVALID_ARGUMENT, "INVALID_ARGUMENT"),
}


def from_os_error(exc: OSError, path: str = "") -> ChronusError:
    """Map a filesystem error to the vocabulary; unknown errnos are IO_ERROR."""
    code, reason = _ERRNO_MAP.get(exc.errno or 0, (FAILED_PRECONDITION, "IO_ERROR"))
    where = path or exc.filename or ""
    return ChronusError(code, reason, f"{where}: {exc.strerror or exc}" if where else str(exc))

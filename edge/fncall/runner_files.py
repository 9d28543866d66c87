"""The job directory's files, for the FnCall runner: emptied, written, read back safely.

Standard library only (it runs in the pool container with ``runner.py``; see that module's
docstring). The runner is root and a job owned its directory, so everything here walks it
without following a symlink a job could have planted: :func:`fetch` reads back the files a
job asked for (regular files only, bounded), :func:`remove_tree` empties the directory and
the scratch dirs between jobs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def remove_tree(path: str) -> None:
    """rm -rf as root, never following symlinks; a job may chmod 000 its own directories."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    try:
        entries = os.listdir(path)
    except PermissionError:
        os.chmod(path, 0o700)
        entries = os.listdir(path)
    for name in entries:
        remove_tree(f"{path}/{name}")
    os.rmdir(path)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fetch(job_dir: str, paths: list[str], req: dict[str, Any], result: dict[str, Any]) -> None:
    """Reads the job's files `paths` (relative to `job_dir`, /job) into `result`: ``fetched``
    lists those read, in order, each in a blob ``fetch<i>``; ``fetch_errors`` maps the others
    to why.

    Called once every process of the job is gone (nothing changes the files any more) and
    before `job_dir` is emptied. We are root and the job owned `job_dir`, so it may have
    planted symlinks (to /etc/shadow, to /proc/1/mem, ...) or FIFOs: each path is walked a
    component at a time from a descriptor of `job_dir`, never following a symlink
    (O_NOFOLLOW, directories with O_DIRECTORY), the file opened non-blocking and kept only if
    fstat says it is a regular file (a hard link can only name a file of the job directory's
    own tmpfs, which the job wrote anyway). In all at most ``fetch_max`` bytes, and less if
    the job's output leaves less of ``result_max``: a file that does not fit what is left is
    refused, not cut."""
    limit = int(req.get("fetch_max", 0))
    left, why_less = limit, ""
    result_max = int(req.get("result_max", 0))
    output = len(result.get("stdout", b"")) + len(result.get("stderr", b""))
    if result_max and result_max - output < limit:
        left = max(result_max - output, 0)
        why_less = f" (the output took {_mib(output)} of the result's {_mib(result_max)})"
    fetched: list[str] = []
    errors: dict[str, str] = {}
    try:
        root = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        root = -1
        for path in paths:
            errors[path] = f"cannot open {job_dir}: {exc.strerror}"
    if root >= 0:
        try:
            for path in paths:
                try:
                    got = _read_job_file(root, str(path), left)
                except _TooLarge as big:
                    a, b = _mib(big.size), _mib(left)
                    if a == b:  # rounded alike: say it exactly
                        a, b = f"{big.size} bytes", f"{left} bytes"
                    errors[path] = f"{a}, larger than the {b} left of the {_mib(limit)} limit"
                    errors[path] += why_less
                    continue
                if isinstance(got, str):
                    errors[path] = got
                    continue
                result[f"fetch{len(fetched)}"] = got
                fetched.append(path)
                left -= len(got)
        finally:
            os.close(root)
    result["fetched"] = fetched
    result["fetch_errors"] = errors


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


def _read_job_file(root: int, rel: str, left: int) -> bytes | str:
    """The content of the regular file `rel` under the directory `root`, or why not;
    _TooLarge if it has more than `left` bytes."""
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return "not a path inside the job directory"
    fds: list[int] = []
    try:
        d = root
        for i, name in enumerate(parts[:-1]):
            try:
                d = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d
                )
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    with contextlib.suppress(OSError):
                        if stat.S_ISLNK(os.stat(name, dir_fd=d, follow_symlinks=False).st_mode):
                            exc = OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                return _fetch_error(exc, "/".join(parts[: i + 1]))
            fds.append(d)
        try:
            fd = os.open(
                parts[-1],
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                dir_fd=d,
            )
        except OSError as exc:
            return _fetch_error(exc, "")
        fds.append(fd)
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return "not a regular file: a directory"
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size > left:
            raise _TooLarge(st.st_size)
        chunks: list[bytes] = []
        size = 0
        while True:
            # One read for the whole file (tmpfs), +1 byte to see it grow past its size.
            chunk = os.read(fd, max(st.st_size - size, 0) + 1)
            if not chunk:
                break
            size += len(chunk)
            if size > left:
                raise _TooLarge(size)
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except OSError as exc:
        return _fetch_error(exc, "")
    finally:
        for opened in reversed(fds):
            os.close(opened)


def _fetch_error(exc: OSError, directory: str) -> str:
    """Why a fetch path could not be opened; `directory`: the component that failed, if one
    on the way (else the file itself)."""
    if exc.errno == errno.ENOENT:
        return "no such file"
    if exc.errno == errno.ELOOP:
        if directory:
            return f"{directory!r} is a symbolic link (not followed)"
        return "not a regular file: a symbolic link (not followed)"
    if exc.errno == errno.ENOTDIR:
        return f"{directory!r} is not a directory" if directory else "a parent is not a directory"
    if exc.errno == errno.ENXIO:  # a socket
        return "not a regular file"
    return (exc.strerror or str(exc)).lower()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f}".rstrip("0").rstrip(".") + " MiB"


def read_regular(path: str, max_bytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return b""
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)

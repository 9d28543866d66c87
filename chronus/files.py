"""File operations inside the sandbox.

Writes are atomic (temporary file + rename) unless appending, uploads and
downloads stream in chunks so a 50 MB file never sits in memory, and every
OSError maps to a stable reason (chronus.errors). A file's user metadata is its extended
attributes in the ``user.e2b.`` namespace (E2B's envd keeps its file metadata there); a write
or upload sets the whole set on the temporary before the rename, so a write over a file
leaves exactly the metadata it was given and a rename keeps it. A write, an upload or a mkdir that names a
``user`` leaves what it creates (the file or directory, and the parents it makes) owned by
that user and its group, as E2B's envd does; the operation itself is still chronus's.
"""

from __future__ import annotations

import errno
import os
import stat

from chronus.errors import (
    ALREADY_EXISTS,
    FAILED_PRECONDITION,
    ChronusError,
    from_os_error,
    invalid,
)
from chronus.users import AccountNames, resolve_user

TYPE_CHECKING = False  # typing costs ~2 MB at run time: annotations are strings
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any

MIB = 1024 * 1024
MAX_READ_BYTES = 4 * MIB
MAX_WRITE_BYTES = 4 * MIB
MAX_CHUNK_BYTES = 4 * MIB
DEFAULT_CHUNK_BYTES = 1 * MIB
DEFAULT_MAX_ENTRIES = 10000

FILE_TYPE_REGULAR, FILE_TYPE_DIRECTORY, FILE_TYPE_SYMLINK, FILE_TYPE_OTHER = 1, 2, 3, 4

# User metadata: extended attributes under this prefix (E2B's envd's namespace). The kernel
# caps a whole attribute name at 255 bytes; 4096 bytes in all (names and values) fit one ext4
# block, where ext4 keeps an inode's attributes.
METADATA_PREFIX = "user.e2b."
MAX_METADATA_KEY_BYTES = 255 - len(METADATA_PREFIX)
MAX_METADATA_BYTES = 4096


def validate_metadata(metadata: dict[str, str]) -> None:
    """INVALID_ARGUMENT INVALID_METADATA unless every key is non-empty printable ASCII of at
    most MAX_METADATA_KEY_BYTES, every value printable ASCII, and the set at most
    MAX_METADATA_BYTES (each key counted with its prefix)."""
    total = 0
    for key, value in metadata.items():
        if not key:
            raise invalid("metadata key must not be empty", "INVALID_METADATA")
        if len(key) > MAX_METADATA_KEY_BYTES:
            raise invalid(
                f"metadata key {key[:32]!r}... is over {MAX_METADATA_KEY_BYTES} bytes",
                "INVALID_METADATA",
            )
        for what, text in (("key", key), (f"value of {key!r}", value)):
            for i, c in enumerate(text):
                if not " " <= c <= "~":
                    raise invalid(
                        f"metadata {what} has a byte that is not printable ASCII ({c!r} at {i})",
                        "INVALID_METADATA",
                    )
        total += len(METADATA_PREFIX) + len(key) + len(value)
    if total > MAX_METADATA_BYTES:
        raise invalid(
            f"metadata is {total} bytes in all, at most {MAX_METADATA_BYTES}", "INVALID_METADATA"
        )


def read_metadata(path: str) -> dict[str, str]:
    """The metadata of `path` (not following a symlink: a link's own); {} where the filesystem
    keeps no user attributes or the path is gone."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    out: dict[str, str] = {}
    for name in names:
        if not name.startswith(METADATA_PREFIX):
            continue
        try:
            value = os.getxattr(path, name, follow_symlinks=False).decode()
        except (OSError, UnicodeDecodeError):
            continue  # removed meanwhile, or bytes a map<string, string> cannot carry
        out[name[len(METADATA_PREFIX) :]] = value
    return out


def write_metadata(fd: int, path: str, metadata: dict[str, str]) -> None:
    """Makes `metadata` the whole metadata of the open file `fd`."""
    try:
        for name in os.listxattr(fd):
            if name.startswith(METADATA_PREFIX) and name[len(METADATA_PREFIX) :] not in metadata:
                os.removexattr(fd, name)
        for key, value in metadata.items():
            os.setxattr(fd, METADATA_PREFIX + key, value.encode())
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            if not metadata:
                return  # nothing to keep and nothing stale can be there
            raise ChronusError(
                FAILED_PRECONDITION,
                "XATTR_UNSUPPORTED",
                f"{path}: this filesystem keeps no user extended attributes (file metadata)",
            ) from None
        raise


# An atomic write's temporary file is `.<base>.dsec-<kind><8 hex>.tmp`, next to its target;
# <kind> is what the rename into place does: makes a new file, makes a new empty one, or
# replaces one that was there.
TEMP_MARK = ".dsec-"
TEMP_NEW, TEMP_NEW_EMPTY, TEMP_REPLACES = "n", "e", "r"


def temp_kind(name: str) -> str | None:
    """The <kind> of `name` if it is an atomic write's temporary file ("" when it has none),
    None if it is not one."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    at = name.rfind(TEMP_MARK)
    if at <= 0:
        return None
    tail = name[at + len(TEMP_MARK) : -len(".tmp")]
    if len(tail) == 9 and tail[0] in (TEMP_NEW, TEMP_NEW_EMPTY, TEMP_REPLACES):
        return tail[0]
    return ""


class Files:
    def __init__(self, workdir: str) -> None:
        self.workdir = workdir

    # ------------------------------------------------------------ helpers
    def resolve(self, path: str) -> str:
        if not path:
            raise invalid("path must not be empty")
        if "\0" in path:
            raise invalid("path must not contain NUL")
        return os.path.normpath(os.path.join(self.workdir, path))

    @staticmethod
    def info(path: str, st: os.stat_result, names: AccountNames | None = None) -> dict[str, Any]:
        """The FileInfo of `path` from its stat `st`; `names` names owners (a listing passes
        one for all its entries, so the account files are read once per call). For a symlink
        (an lstat), the link's own size, owner, times and text, and in ``target`` what it
        finally resolves to, as E2B's envd reports a link."""
        if names is None:
            names = AccountNames()
        mode = st.st_mode
        if stat.S_ISREG(mode):
            ftype = FILE_TYPE_REGULAR
        elif stat.S_ISDIR(mode):
            ftype = FILE_TYPE_DIRECTORY
        elif stat.S_ISLNK(mode):
            ftype = FILE_TYPE_SYMLINK
        else:
            ftype = FILE_TYPE_OTHER
        info: dict[str, Any] = {
            "path": path,
            "type": ftype,
            "size_bytes": st.st_size,
            "mode": stat.S_IMODE(mode),
            "modified_at": {"seconds": st.st_mtime_ns // 10**9, "nanos": st.st_mtime_ns % 10**9},
            "uid": st.st_uid,
            "gid": st.st_gid,
            "owner": names.user(st.st_uid),
            "group": names.group(st.st_gid),
        }
        metadata = read_metadata(path)
        if metadata:
            info["metadata"] = metadata
        if ftype == FILE_TYPE_SYMLINK:
            try:
                info["symlink_target"] = os.readlink(path)
            except OSError:
                pass
            try:
                followed = os.stat(path)
            except OSError:
                pass  # dangling, a loop, or not searchable: no target
            else:
                info["target"] = Files.info(os.path.realpath(path), followed, names)
        return info

    def stat_info(self, path: str, follow: bool = True) -> dict[str, Any]:
        try:
            st = os.stat(path) if follow else os.lstat(path)
        except OSError as exc:
            raise from_os_error(exc, path) from None
        return self.info(path, st)

    @staticmethod
    def _owner(req: dict[str, Any]) -> tuple[int, int] | None:
        """(uid, gid) of the request's ``user``; None without one."""
        spec = req.get("user") or ""
        if not spec:
            return None
        user = resolve_user(spec)
        return user.uid, user.gid

    @staticmethod
    def _make_dirs(path: str, mode: int, owner: tuple[int, int] | None) -> None:
        """``mkdir -p path``; each directory it makes is ``owner``'s."""
        if owner is None:
            os.makedirs(path, mode, exist_ok=True)
            return
        missing = []
        d = path
        while not os.path.isdir(d):
            missing.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        for d in reversed(missing):
            try:
                os.mkdir(d, mode)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise
                continue  # made meanwhile: not ours to chown
            os.chown(d, *owner)

    def _make_parents(self, path: str, owner: tuple[int, int] | None = None) -> None:
        parent = os.path.dirname(path)
        try:
            self._make_dirs(parent, 0o755, owner)
        except OSError as exc:
            raise from_os_error(exc, parent) from None

    @staticmethod
    def _temp_path(path: str, kind: str) -> str:
        d, base = os.path.split(path)
        return os.path.join(d, f".{base}{TEMP_MARK}{kind}{os.urandom(4).hex()}.tmp")

    # ---------------------------------------------------------------- ops
    def read_file(self, req: dict[str, Any]) -> dict[str, Any]:
        path = self.resolve(req.get("path", ""))
        offset = int(req.get("offset", 0))
        length = int(req.get("length", 0))
        if length > MAX_READ_BYTES:
            raise invalid(f"length is at most {MAX_READ_BYTES} bytes; use download_file")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise from_os_error(exc, path) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise ChronusError(FAILED_PRECONDITION, "IS_A_DIRECTORY", f"{path}: is a directory")
            want = length or MAX_READ_BYTES
            data = os.pread(fd, want, offset)
        except OSError as exc:
            raise from_os_error(exc, path) from None
        finally:
            os.close(fd)
        eof = offset + len(data) >= st.st_size
        return {"data": data, "eof": eof, "info": self.info(path, st)}

    def write_file(self, req: dict[str, Any]) -> dict[str, Any]:
        path = self.resolve(req.get("path", ""))
        data: bytes = req.get("data", b"")
        if len(data) > MAX_WRITE_BYTES:
            raise invalid(f"data is at most {MAX_WRITE_BYTES} bytes; use upload_file")
        metadata: dict[str, str] = req.get("metadata") or {}
        validate_metadata(metadata)
        owner = self._owner(req)
        if req.get("make_parents"):
            self._make_parents(path, owner)
        mode = int(req.get("mode", 0))
        try:
            if req.get("append"):
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode or 0o644)
                try:
                    if metadata:  # first: refused metadata appends nothing
                        write_metadata(fd, path, metadata)
                    _write_all(fd, data)
                    if mode:
                        os.fchmod(fd, mode)
                    if owner is not None:
                        os.fchown(fd, *owner)
                finally:
                    os.close(fd)
            else:
                if not mode:  # keep an existing file's permissions
                    try:
                        mode = stat.S_IMODE(os.stat(path).st_mode)
                    except FileNotFoundError:
                        mode = 0o644
                self._atomic_write(path, mode, lambda fd: _write_all(fd, data), owner, metadata)
        except OSError as exc:
            raise from_os_error(exc, path) from None
        return {"info": self.stat_info(path)}

    def _atomic_write(
        self,
        path: str,
        mode: int,
        fill: Callable[[int], None],
        owner: tuple[int, int] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        if os.path.isdir(path):
            raise ChronusError(FAILED_PRECONDITION, "IS_A_DIRECTORY", f"{path}: is a directory")
        # The temporary's name says whether the target was there, so that watchers report the
        # rename into place as E2B's envd reports its in-place write (see chronus.watchers).
        existed = os.path.lexists(path)
        tmp = self._temp_path(path, TEMP_REPLACES if existed else TEMP_NEW)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # Before the data: refused metadata (no user attributes here) costs no copy.
                # The temporary is a new inode, so nothing stale is there to clear.
                if metadata:
                    write_metadata(fd, path, metadata)
                fill(fd)
                if owner is not None:
                    os.fchown(fd, *owner)  # before the mode: a chown clears setuid bits
                os.fchmod(fd, mode)
                empty = os.fstat(fd).st_size == 0
            finally:
                os.close(fd)
            if empty and not existed:
                # Known only now (an upload is streamed); watchers ignore a temporary's renames.
                marked = self._temp_path(path, TEMP_NEW_EMPTY)
                os.rename(tmp, marked)
                tmp = marked
            os.rename(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def list_dir(self, req: dict[str, Any]) -> dict[str, Any]:
        path = self.resolve(req.get("path", ""))
        limit = int(req.get("max_entries", 0)) or DEFAULT_MAX_ENTRIES
        try:
            names = sorted(os.listdir(path))
        except OSError as exc:
            raise from_os_error(exc, path) from None
        entries = []
        accounts = AccountNames()
        for name in names[:limit]:
            full = os.path.join(path, name)
            try:
                entries.append(self.info(full, os.lstat(full), accounts))
            except OSError:
                continue  # removed while we listed
        return {"entries": entries, "truncated": len(names) > limit}

    def stat_path(self, req: dict[str, Any]) -> dict[str, Any]:
        path = self.resolve(req.get("path", ""))
        return {"info": self.stat_info(path, follow=bool(req.get("follow_symlinks")))}

    def make_dir(self, req: dict[str, Any]) -> dict[str, Any]:
        path = self.resolve(req.get("path", ""))
        mode = int(req.get("mode", 0)) or 0o755
        owner = self._owner(req)
        try:
            if req.get("parents"):
                self._make_dirs(path, mode, owner)
            else:
                os.mkdir(path, mode)
                if owner is not None:
                    os.chown(path, *owner)
        except FileExistsError:
            raise ChronusError(ALREADY_EXISTS, "PATH_EXISTS", f"{path}: exists") from None
        except OSError as exc:
            raise from_os_error(exc, path) from None
        return {"info": self.stat_info(path)}

    def remove_path(self, req: dict[str, Any]) -> dict[str, Any]:
        path = self.resolve(req.get("path", ""))
        if path == "/":
            raise invalid("refusing to remove /")
        try:
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                if req.get("recursive"):
                    import shutil  # rarely needed: keep it out of the idle footprint

                    shutil.rmtree(path)
                else:
                    os.rmdir(path)
            else:
                os.unlink(path)
        except OSError as exc:
            raise from_os_error(exc, path) from None
        return {}

    def move_path(self, req: dict[str, Any]) -> dict[str, Any]:
        src = self.resolve(req.get("source", ""))
        dst = self.resolve(req.get("destination", ""))
        try:
            if not req.get("overwrite") and os.path.lexists(dst):
                raise ChronusError(ALREADY_EXISTS, "PATH_EXISTS", f"{dst}: exists")
            try:
                os.rename(src, dst)
            except OSError as exc:
                if exc.errno != errno.EXDEV:  # another filesystem: copy instead
                    raise
                import shutil

                shutil.move(src, dst)
        except OSError as exc:
            raise from_os_error(exc, src) from None
        return {"info": self.stat_info(dst, follow=False)}

    def chmod_path(self, req: dict[str, Any]) -> dict[str, Any]:
        path = self.resolve(req.get("path", ""))
        try:
            os.chmod(path, int(req.get("mode", 0)) & 0o7777)
        except OSError as exc:
            raise from_os_error(exc, path) from None
        return {"info": self.stat_info(path)}

    def upload(self, header: dict[str, Any], chunks: Iterator[bytes]) -> dict[str, Any]:
        """Write the chunks to a temporary file; rename it into place at the end."""
        path = self.resolve(header.get("path", ""))
        expected = int(header.get("size_bytes", 0))
        mode = int(header.get("mode", 0)) or 0o644
        metadata: dict[str, str] = header.get("metadata") or {}
        validate_metadata(metadata)
        owner = self._owner(header)
        if header.get("make_parents"):
            self._make_parents(path, owner)
        written = 0

        def fill(fd: int) -> None:
            nonlocal written
            for chunk in chunks:
                written += len(chunk)
                if expected and written > expected:
                    raise _SizeMismatch()
                _write_all(fd, chunk)
            if expected and written != expected:
                raise _SizeMismatch()

        try:
            self._atomic_write(path, mode, fill, owner, metadata)
        except _SizeMismatch:
            raise invalid(
                f"upload of {path}: header said {expected} bytes, got {written}"
                + (" or more" if written > expected else ""),
                "UPLOAD_SIZE_MISMATCH",
            ) from None
        except OSError as exc:
            raise from_os_error(exc, path) from None
        return {"info": self.stat_info(path), "bytes_written": written}

    def download(self, req: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The file's info first, then its chunks from `offset`, one at a time."""
        path = self.resolve(req.get("path", ""))
        chunk_bytes = int(req.get("chunk_bytes", 0)) or DEFAULT_CHUNK_BYTES
        if chunk_bytes > MAX_CHUNK_BYTES:
            raise invalid(f"chunk_bytes is at most {MAX_CHUNK_BYTES}")
        offset = int(req.get("offset", 0))
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise from_os_error(exc, path) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise ChronusError(FAILED_PRECONDITION, "IS_A_DIRECTORY", f"{path}: is a directory")
            yield {"info": self.info(path, st), "offset": offset}
            while True:
                data = os.pread(fd, chunk_bytes, offset)
                if not data:
                    return
                yield {"chunk": data, "offset": offset}
                offset += len(data)
        except OSError as exc:
            raise from_os_error(exc, path) from None
        finally:
            os.close(fd)


class _SizeMismatch(Exception):
    pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

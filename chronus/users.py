"""Users of the sandbox: ExecRequest.user resolved in its /etc/passwd and /etc/group.

The files are parsed here, not through `pwd`/`grp`: those go through glibc's NSS, which would
load the modules the image's /etc/nsswitch.conf names into chronus itself.
"""

from __future__ import annotations

import os
import stat

from chronus.errors import invalid

MAX_GROUPS = 64  # supplementary groups handed to setgroups (NGROUPS_MAX is 65536)
#: The agent controls these files: a FIFO would hang the call, /dev/zero would grow chronus
#: without end. Only a regular file outside the kernel's trees is read, and at most this much.
MAX_ACCOUNT_FILE_BYTES = 4 << 20
_KERNEL_TREES = ("/proc/", "/sys/", "/dev/")


class User:
    __slots__ = ("gid", "groups", "home", "name", "shell", "uid")

    def __init__(
        self, name: str, uid: int, gid: int, home: str, groups: list[int], shell: str = ""
    ) -> None:
        self.name = name
        self.uid = uid
        self.gid = gid
        self.home = home
        self.groups = groups
        self.shell = shell

    def env(self) -> dict[str, str]:
        return {"HOME": self.home or "/", "USER": self.name, "LOGNAME": self.name}


def _read_account_file(path: str) -> str:
    """`path`'s text if it is a regular file of sane size, else "" (as if it were absent)."""
    real = os.path.realpath(path)
    if real.startswith(_KERNEL_TREES):
        return ""
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ACCOUNT_FILE_BYTES:
            return ""
        data = os.read(fd, MAX_ACCOUNT_FILE_BYTES + 1)
    except OSError:
        return ""
    finally:
        os.close(fd)
    return data[:MAX_ACCOUNT_FILE_BYTES].decode("utf-8", errors="replace")


def _lines(path: str) -> list[list[str]]:
    text = _read_account_file(path)
    return [line.split(":") for line in text.splitlines() if not line.startswith("#")]


def resolve_user(spec: str, etc: str = "/etc") -> User:
    """The passwd entry named `spec`, or with uid `spec` when it is a number; else
    INVALID_ARGUMENT USER_NOT_FOUND."""
    by_uid = spec.isdigit()
    for fields in _lines(f"{etc}/passwd"):
        if len(fields) < 7 or not fields[2].isdigit() or not fields[3].isdigit():
            continue
        if (fields[2] == str(int(spec))) if by_uid else (fields[0] == spec):
            name, gid = fields[0], int(fields[3])
            groups = [gid]
            for g in _lines(f"{etc}/group"):
                if len(g) >= 4 and g[2].isdigit() and name in g[3].split(","):
                    if int(g[2]) not in groups and len(groups) < MAX_GROUPS:
                        groups.append(int(g[2]))
            return User(name, int(fields[2]), gid, fields[5], groups, fields[6])
    raise invalid(f"no user {spec!r} in the sandbox's {etc}/passwd", "USER_NOT_FOUND")


class AccountNames:
    """User and group names by id, from the sandbox's /etc/passwd and /etc/group, as E2B's
    envd names a file's owner (Go's os/user without cgo: the first line with that id wins,
    and an id with no line is named by its number).

    Make one per call (a listing shares it): the files are read on first use and then kept
    only as long as the instance, since a command may add users between two calls.
    """

    __slots__ = ("_etc", "_groups", "_users")

    def __init__(self, etc: str = "/etc") -> None:
        self._etc = etc
        self._users: dict[str, str] | None = None
        self._groups: dict[str, str] | None = None

    @staticmethod
    def _names(path: str, min_fields: int) -> dict[str, str]:
        names: dict[str, str] = {}
        for fields in _lines(path):
            name = fields[0].lstrip()
            if len(fields) >= min_fields and name and name[0] not in "+-#":
                names.setdefault(fields[2], name)
        return names

    def user(self, uid: int) -> str:
        if self._users is None:
            self._users = self._names(f"{self._etc}/passwd", 7)
        return self._users.get(str(uid), str(uid))

    def group(self, gid: int) -> str:
        if self._groups is None:
            self._groups = self._names(f"{self._etc}/group", 4)
        return self._groups.get(str(gid), str(gid))

"""Users of the sandbox: ExecRequest.user resolved in its /etc/passwd and /etc/group.

The files are parsed here, not through `pwd`/`grp`: those go through glibc's NSS, which would
load the modules the image's /etc/nsswitch.conf names into chronus itself.
"""

from __future__ import annotations

from chronus.errors import invalid

MAX_GROUPS = 64  # supplementary groups handed to setgroups (NGROUPS_MAX is 65536)


class User:
    __slots__ = ("gid", "groups", "home", "name", "uid")

    def __init__(self, name: str, uid: int, gid: int, home: str, groups: list[int]) -> None:
        self.name = name
        self.uid = uid
        self.gid = gid
        self.home = home
        self.groups = groups

    def env(self) -> dict[str, str]:
        return {"HOME": self.home or "/", "USER": self.name, "LOGNAME": self.name}


def _lines(path: str) -> list[list[str]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return [line.rstrip("\n").split(":") for line in fh if not line.startswith("#")]
    except OSError:
        return []


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
            return User(name, int(fields[2]), gid, fields[5], groups)
    raise invalid(f"no user {spec!r} in the sandbox's {etc}/passwd", "USER_NOT_FOUND")

"""The eBPF objects of one sandbox's policy: maps, programs, pins, atomic replacement.

Per sandbox (pinned under `<pin root>/<sandbox id>/`, so a restarted edge finds them again):

    trie4a trie4b  LPM tries of IPv4 prefixes, two sides: one in force, one standby
    trie6a trie6b  the same for IPv6
    ctl            ARRAY[1] u32: the side in force (0 = A)
    stats          ARRAY[1] u64: connects and datagrams refused
    c4 c6 s4 s6    connect4/6 and sendmsg4/6 programs, attached to the sandbox's cgroup2 dir

or, for a VM guest (`SandboxFilter.create(..., guest=...)`), instead of the four programs:

    tc             the guest's SCHED_CLS program, on the ingress of its link's host end
    flows          LRU hash of the denied flows already counted in stats (see programs.py)

Both kinds read the same tries, ctl and stats, so everything below -- replacement, learned
addresses, the blocked counter -- is one code path for containers and guests.

Replacing a policy brings the standby side to it -- writing only the entries that differ from
what that side holds, so a task switching between two stages writes nothing at all -- and flips
ctl[0] (one 4-byte update: atomic; the next connect sees the whole new policy). Addresses the
resolver learns later are added to the side in force in place (one update each).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from edge.network import bpf
from edge.network.policy import Prefix, Tables
from edge.network.programs import (
    FLOW_KEY_SIZE,
    V4_KEY_SIZE,
    V6_KEY_SIZE,
    VALUE_SIZE,
    guest_program,
    ipv4_program,
    ipv6_program,
    lpm_key,
)

log = logging.getLogger(__name__)

#: Entries per trie: the largest policy (10000 rules) plus learned addresses and the
#: platform's. Tries allocate per entry (no preallocation).
MAX_ENTRIES = 16384
_ZERO = struct.pack("<I", 0)
_SIDES = ("a", "b")
_PROGRAMS = (
    ("c4", bpf.ATTACH_CGROUP_INET4_CONNECT),
    ("s4", bpf.ATTACH_CGROUP_UDP4_SENDMSG),
    ("c6", bpf.ATTACH_CGROUP_INET6_CONNECT),
    ("s6", bpf.ATTACH_CGROUP_UDP6_SENDMSG),
)
_KEY_SIZE = {4: V4_KEY_SIZE, 6: V6_KEY_SIZE}
_GUEST_PROGRAM = "tc"
#: Denied flows remembered as counted; the least recently counted are forgotten first.
FLOWS_REMEMBERED = 1024


@dataclass(frozen=True)
class GuestIdentity:
    """What a guest's program enforces besides the policy: the only source it may send from."""

    mac: bytes  # 6 bytes
    address: bytes  # IPv4, network order


def _trie_name(version: int, side: int) -> str:
    return f"trie{version}{_SIDES[side]}"


class SandboxFilter:
    """Owns its descriptors; `close()` releases them, `remove()` also the pins."""

    def __init__(self, pin_dir: Path, fds: dict[str, int]) -> None:
        self.pin_dir = pin_dir
        self.fds = fds
        raw = bpf.lookup(fds["ctl"], _ZERO, 4)
        self.side = 1 if raw and struct.unpack("<I", raw)[0] else 0
        # What each trie holds, as written: (version, side) -> {prefix: value}. Unknown (None)
        # after a reopen: the first load then rewrites the standby side whole.
        self._content: dict[tuple[int, int], dict[Prefix, bytes] | None] = {
            (v, s): None for v in (4, 6) for s in (0, 1)
        }

    @classmethod
    def create(cls, pin_dir: Path, guest: GuestIdentity | None = None) -> SandboxFilter:
        """New maps and programs, pinned in `pin_dir`: the cgroup programs, or with `guest`
        the tc program of that guest."""
        fds: dict[str, int] = {}
        try:
            for version in (4, 6):
                for side in (0, 1):
                    fds[_trie_name(version, side)] = bpf.create_map(
                        bpf.MAP_LPM_TRIE,
                        _KEY_SIZE[version],
                        VALUE_SIZE,
                        MAX_ENTRIES,
                        flags=bpf.BPF_F_NO_PREALLOC,
                        name=f"dsec_lpm{version}{_SIDES[side]}",
                    )
            fds["ctl"] = bpf.create_map(bpf.MAP_ARRAY, 4, 4, 1, name="dsec_ctl")
            fds["stats"] = bpf.create_map(bpf.MAP_ARRAY, 4, 8, 1, name="dsec_stats")
            if guest is None:
                _load_cgroup_programs(fds)
            else:
                _load_guest_program(fds, guest)
            pin_dir.mkdir(parents=True, exist_ok=True)
            for name, fd in fds.items():
                (pin_dir / name).unlink(missing_ok=True)
                bpf.pin(fd, pin_dir / name)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            shutil.rmtree(pin_dir, ignore_errors=True)
            raise
        flt = cls(pin_dir, fds)
        for key in flt._content:
            flt._content[key] = {}  # new tries are empty
        return flt

    @classmethod
    def open(cls, pin_dir: Path) -> SandboxFilter | None:
        """Reopen a pinned filter (after an edge restart); None if it is not all there."""
        names = [_trie_name(v, s) for v in (4, 6) for s in (0, 1)]
        if (pin_dir / _GUEST_PROGRAM).exists():
            programs = ["flows", _GUEST_PROGRAM]
        else:
            programs = [n for n, _ in _PROGRAMS]
        fds: dict[str, int] = {}
        try:
            for name in (*names, "ctl", "stats", *programs):
                fds[name] = bpf.get_pinned(pin_dir / name)
        except OSError:
            for fd in fds.values():
                os.close(fd)
            return None
        return cls(pin_dir, fds)

    # ------------------------------------------------------------------ attaching

    def attach(self, cgroup_dir: Path) -> None:
        """Attach the four programs to a cgroup2 directory (before any of its processes runs
        untrusted code: connects are checked from then on)."""
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            attached = []
            try:
                for name, attach in _PROGRAMS:
                    bpf.attach_cgroup(fd, self.fds[name], attach)
                    attached.append((name, attach))
            except BaseException:
                for name, attach in attached:
                    with contextlib.suppress(OSError):
                        bpf.detach_cgroup(fd, self.fds[name], attach)
                raise
        finally:
            os.close(fd)

    @property
    def guest_program(self) -> int:
        """The descriptor of a guest's tc program (for `NodeNetwork.add_port`)."""
        return self.fds[_GUEST_PROGRAM]

    # -------------------------------------------------------------------- policies

    def _sync(self, version: int, side: int, want: dict[Prefix, bytes]) -> int:
        """Make trie (version, side) hold exactly `want`; returns the entries written."""
        fd = self.fds[_trie_name(version, side)]
        have = self._content[(version, side)]
        if have is None:  # unknown: drop whatever is there that we do not want
            stale = [
                k
                for k in bpf.keys(fd, _KEY_SIZE[version])
                if (struct.unpack_from("<I", k)[0], k[4:]) not in want
            ]
            changed = want
        else:
            stale = [lpm_key(p, a) for (p, a) in have if (p, a) not in want]
            changed = {k: v for k, v in want.items() if have.get(k) != v}
        self._content[(version, side)] = None  # in flux until done
        n = bpf.update_many(fd, ((lpm_key(p, a), v) for (p, a), v in changed.items()))
        bpf.delete_many(fd, stale)
        self._content[(version, side)] = dict(want)
        return n

    def load(self, tables: Tables) -> int:
        """Replace the whole policy: bring the standby side to it, then flip. Returns how many
        entries had to be written."""
        standby = 1 - self.side
        n = self._sync(4, standby, tables.v4) + self._sync(6, standby, tables.v6)
        bpf.update(self.fds["ctl"], _ZERO, struct.pack("<I", standby))
        self.side = standby
        return n

    def add(self, v4: dict[Prefix, bytes], v6: dict[Prefix, bytes]) -> None:
        """Add or replace entries of the side in force (atomic per entry)."""
        for version, entries in ((4, v4), (6, v6)):
            if not entries:
                continue
            bpf.update_many(
                self.fds[_trie_name(version, self.side)],
                ((lpm_key(p, a), v) for (p, a), v in entries.items()),
            )
            have = self._content[(version, self.side)]
            if have is not None:
                have.update(entries)

    def blocked(self) -> int:
        raw = bpf.lookup(self.fds["stats"], _ZERO, 8)
        return struct.unpack("<Q", raw)[0] if raw else 0

    def entries(self) -> int:
        """Entries of the side in force (for tests and diagnosis)."""
        return sum(len(bpf.keys(self.fds[_trie_name(v, self.side)], _KEY_SIZE[v])) for v in (4, 6))

    # -------------------------------------------------------------------- teardown

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()

    def remove(self) -> None:
        """Close and unpin: the kernel frees what no cgroup still holds."""
        self.close()
        shutil.rmtree(self.pin_dir, ignore_errors=True)


def _load_cgroup_programs(fds: dict[str, int]) -> None:
    t4 = (fds["trie4a"], fds["trie4b"])
    t6 = (fds["trie6a"], fds["trie6b"])
    four = ipv4_program(t4, fds["ctl"], fds["stats"])
    six = ipv6_program(t4, t6, fds["ctl"], fds["stats"])
    for name, attach in _PROGRAMS:
        fds[name] = bpf.load_program(
            bpf.PROG_CGROUP_SOCK_ADDR,
            four if name.endswith("4") else six,
            expected_attach_type=attach,
            name=f"dsec_{name}",
        )


def _load_guest_program(fds: dict[str, int], guest: GuestIdentity) -> None:
    fds["flows"] = bpf.create_map(
        bpf.MAP_LRU_HASH, FLOW_KEY_SIZE, 8, FLOWS_REMEMBERED, name="dsec_flows"
    )
    fds[_GUEST_PROGRAM] = bpf.load_program(
        bpf.PROG_SCHED_CLS,
        guest_program(
            (fds["trie4a"], fds["trie4b"]),
            fds["ctl"],
            fds["stats"],
            fds["flows"],
            guest.mac,
            guest.address,
        ),
        name="dsec_guest",
    )

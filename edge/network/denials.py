"""Counting Landlock denials per sandbox, with one fentry program on the node.

Landlock (ABI 7) calls `landlock_log_denial()` on every access it refuses -- files, ptrace and
/proc of other domains, signals and abstract sockets out of scope -- whether or not the audit
subsystem is on (it only returns early before logging). An fentry program on that function
counts calls per cgroup v2 id (`bpf_get_current_cgroup_id`); a sandbox's cgroup2 directory
inode is that id. So the edge reports ViolationCounters.denied_file_accesses without enabling
audit on the host (a host-wide change this machine kind does not want).

Lives with the other eBPF code (assembled here, loaded with raw bpf(2)); the program's target is
found by name in the kernel's BTF (/sys/kernel/btf/vmlinux). On a kernel without that function
(Landlock older than ABI 7) or without BTF, counting is unavailable and the edge says so once.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

from edge.network import bpf
from edge.network.programs import Assembler

log = logging.getLogger(__name__)

TARGET = "landlock_log_denial"
_BTF = Path("/sys/kernel/btf/vmlinux")
_FN_LOOKUP, _FN_UPDATE, _FN_CGROUP_ID = 1, 2, 80

# BTF kinds -> bytes of data following the 12-byte type header (per vlen item where noted)
_FIXED = {1: 4, 3: 12, 14: 4, 17: 4}
_PER_ITEM = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}
_KIND_FUNC = 12


def btf_function_id(name: str, path: Path = _BTF) -> int | None:
    """The BTF type id of kernel function `name` (BTF_KIND_FUNC), or None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    magic, _ver, _flags, hdr_len, type_off, type_len, str_off, _str_len = struct.unpack_from(
        "<HBBIIIII", data
    )
    if magic != 0xEB9F:
        return None
    types = hdr_len + type_off
    strings = hdr_len + str_off
    want = name.encode()
    off, end, tid = types, types + type_len, 1
    while off < end:
        name_off, info, _size = struct.unpack_from("<III", data, off)
        kind = (info >> 24) & 0x1F
        vlen = info & 0xFFFF
        if kind == _KIND_FUNC:
            s = strings + name_off
            if data[s : s + len(want) + 1] == want + b"\0":
                return tid
        off += 12 + _FIXED.get(kind, 0) + _PER_ITEM.get(kind, 0) * vlen
        tid += 1
    return None


def _program(counts_fd: int) -> list[bpf.Insn]:
    a = Assembler()
    a.emit(0x85, imm=_FN_CGROUP_ID)  # r0 = current cgroup v2 id
    a.emit(0x7B, 10, 0, off=-8)  # *(u64 *)(fp-8) = r0
    a.ld_map(1, counts_fd)
    a.emit(0xBF, 2, 10)
    a.emit(0x07, 2, imm=-8)
    a.emit(0x85, imm=_FN_LOOKUP)
    a.jump(0x55, "inc", dst=0, imm=0)  # if r0 != 0 goto inc
    a.emit(0x7A, 10, off=-16, imm=1)  # *(u64 *)(fp-16) = 1
    a.ld_map(1, counts_fd)
    a.emit(0xBF, 2, 10)
    a.emit(0x07, 2, imm=-8)
    a.emit(0xBF, 3, 10)
    a.emit(0x07, 3, imm=-16)
    a.emit(0xB7, 4, imm=0)
    a.emit(0x85, imm=_FN_UPDATE)
    a.emit(0xB7, 0, imm=0)
    a.emit(0x95)
    a.label("inc")
    a.emit(0xB7, 1, imm=1)
    a.emit(0xDB, 0, 1, off=0, imm=0)  # lock *(u64 *)(r0) += 1
    a.emit(0xB7, 0, imm=0)
    a.emit(0x95)
    return a.assemble()


class DenialCounter:
    """Landlock denials per cgroup; `start()` returns False (and logs why) when unavailable."""

    def __init__(self, max_cgroups: int = 65536) -> None:
        self.max_cgroups = max_cgroups
        self._map = -1
        self._prog = -1
        self._link = -1

    def start(self) -> bool:
        btf_id = btf_function_id(TARGET)
        if btf_id is None:
            log.warning("Landlock denials are not counted: kernel function %s not in BTF", TARGET)
            return False
        try:
            self._map = bpf.create_map(bpf.MAP_HASH, 8, 8, self.max_cgroups, name="dsec_denials")
            self._prog = bpf.load_program(
                bpf.PROG_TRACING,
                _program(self._map),
                expected_attach_type=bpf.ATTACH_TRACE_FENTRY,
                attach_btf_id=btf_id,
                name="dsec_denials",
            )
            self._link = bpf.attach_tracing(self._prog)
        except OSError as exc:
            log.warning("Landlock denials are not counted: %s", exc)
            self.close()
            return False
        log.info("counting Landlock denials per sandbox (fentry on %s)", TARGET)
        return True

    def count(self, cgroup_dir: Path) -> int | None:
        """Denials of processes in `cgroup_dir` (cgroup2) since start; None if unknown."""
        if self._map < 0:
            return None
        try:
            cgid = os.stat(cgroup_dir).st_ino
        except OSError:
            return None
        raw = bpf.lookup(self._map, struct.pack("<Q", cgid), 8)
        return struct.unpack("<Q", raw)[0] if raw else 0

    def forget(self, cgroup_dir: Path) -> None:
        if self._map < 0:
            return
        try:
            bpf.delete(self._map, struct.pack("<Q", os.stat(cgroup_dir).st_ino))
        except OSError:
            pass

    def close(self) -> None:
        for fd in (self._link, self._prog, self._map):
            if fd >= 0:
                os.close(fd)
        self._map = self._prog = self._link = -1

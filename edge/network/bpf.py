"""Raw bpf(2) from Python: maps, programs, cgroup attachment, pinning.

Why no libbpf, bcc or clang at run time: bcc cannot compile on this machine kind (no kernel
headers), and a clang + vmlinux.h build step is one more thing every node must have and keep in
step with its kernel. The programs dsec needs are small enough to assemble here
(`edge.network.programs`), and loading them through the syscall is the one code path that works on
every host with cgroup-bpf (measured: load + attach 0.5 ms).

Everything here is blocking and thread-safe (a syscall each); callers on the event loop use
`asyncio.to_thread`.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SYS_BPF = 321  # x86_64

# commands
BPF_MAP_CREATE = 0
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_PROG_LOAD = 5
BPF_OBJ_PIN = 6
BPF_OBJ_GET = 7
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_MAP_GET_FD_BY_ID = 14
BPF_PROG_QUERY = 16
BPF_RAW_TRACEPOINT_OPEN = 17

# map types
MAP_HASH = 1
MAP_ARRAY = 2
MAP_LRU_HASH = 9
MAP_ARRAY_OF_MAPS = 12
MAP_LPM_TRIE = 11

BPF_F_NO_PREALLOC = 1
BPF_ANY = 0

# program types and attach types
PROG_SCHED_CLS = 3
PROG_CGROUP_SOCK_ADDR = 18
PROG_TRACING = 26
ATTACH_CGROUP_INET4_CONNECT = 10
ATTACH_CGROUP_INET6_CONNECT = 11
ATTACH_CGROUP_UDP4_SENDMSG = 14
ATTACH_CGROUP_UDP6_SENDMSG = 15
ATTACH_TRACE_FENTRY = 24
BPF_F_ALLOW_MULTI = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class BpfError(OSError):
    """A bpf(2) call failed; for program loads, `log` is the verifier's explanation."""

    def __init__(self, what: str, err: int, log: str = "") -> None:
        super().__init__(err, f"{what}: {os.strerror(err)}" + (f"\n{log}" if log else ""))
        self.log = log


def _bpf(cmd: int, attr: bytes, what: str) -> int:
    buf = ctypes.create_string_buffer(attr, max(len(attr), 128))
    r = _libc.syscall(SYS_BPF, cmd, buf, len(buf))
    if r < 0:
        raise BpfError(what, ctypes.get_errno())
    return int(r)


def available() -> bool:
    """Whether this process may use bpf(2) at all (root with CAP_BPF/CAP_SYS_ADMIN)."""
    try:
        fd = create_map(MAP_ARRAY, 4, 8, 1, name="dsec_probe")
    except OSError:
        return False
    os.close(fd)
    return True


# ------------------------------------------------------------------------------ maps


def create_map(
    map_type: int,
    key_size: int,
    value_size: int,
    max_entries: int,
    *,
    flags: int = 0,
    inner_map_fd: int = 0,
    name: str = "",
) -> int:
    attr = struct.pack(
        "=IIIIII4x16s",
        map_type,
        key_size,
        value_size,
        max_entries,
        flags,
        inner_map_fd,
        name.encode()[:15],
    )
    return _bpf(BPF_MAP_CREATE, attr, f"map create {name or map_type}")


def _elem_attr(fd: int, key: ctypes.Array[ctypes.c_char], value: int, flags: int) -> bytes:
    return struct.pack("=I4xQQQ", fd, ctypes.addressof(key), value, flags)


def update(fd: int, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
    k = ctypes.create_string_buffer(key, len(key))
    v = ctypes.create_string_buffer(value, len(value))
    _bpf(BPF_MAP_UPDATE_ELEM, _elem_attr(fd, k, ctypes.addressof(v), flags), "map update")


def update_many(fd: int, items: Iterable[tuple[bytes, bytes]], flags: int = BPF_ANY) -> int:
    """update() for many entries, reusing the buffers (a policy of 1,000 rules is ~1,000
    calls: the per-call Python cost is what matters). Returns how many were written."""
    k = v = None
    attr = ctypes.create_string_buffer(128)
    n = 0
    for key, value in items:
        if k is None or len(key) != len(k) or v is None or len(value) != len(v):
            k = ctypes.create_string_buffer(len(key))
            v = ctypes.create_string_buffer(len(value))
            struct.pack_into(
                "=I4xQQQ", attr, 0, fd, ctypes.addressof(k), ctypes.addressof(v), flags
            )
        ctypes.memmove(k, key, len(key))
        ctypes.memmove(v, value, len(value))
        if _libc.syscall(SYS_BPF, BPF_MAP_UPDATE_ELEM, attr, 128) < 0:
            raise BpfError("map update", ctypes.get_errno())
        n += 1
    return n


def delete_many(fd: int, keys: Iterable[bytes]) -> int:
    """delete() for many keys (missing ones are skipped); returns how many were deleted."""
    k = None
    attr = ctypes.create_string_buffer(128)
    n = 0
    for key in keys:
        if k is None or len(key) != len(k):
            k = ctypes.create_string_buffer(len(key))
            struct.pack_into("=I4xQQQ", attr, 0, fd, ctypes.addressof(k), 0, 0)
        ctypes.memmove(k, key, len(key))
        if _libc.syscall(SYS_BPF, BPF_MAP_DELETE_ELEM, attr, 128) < 0:
            err = ctypes.get_errno()
            if err != 2:
                raise BpfError("map delete", err)
        else:
            n += 1
    return n


def delete(fd: int, key: bytes) -> bool:
    k = ctypes.create_string_buffer(key, len(key))
    try:
        _bpf(BPF_MAP_DELETE_ELEM, _elem_attr(fd, k, 0, 0), "map delete")
    except BpfError as exc:
        if exc.errno == 2:  # ENOENT
            return False
        raise
    return True


def lookup(fd: int, key: bytes, value_size: int) -> bytes | None:
    k = ctypes.create_string_buffer(key, len(key))
    v = ctypes.create_string_buffer(value_size)
    try:
        _bpf(BPF_MAP_LOOKUP_ELEM, _elem_attr(fd, k, ctypes.addressof(v), 0), "map lookup")
    except BpfError as exc:
        if exc.errno == 2:
            return None
        raise
    return v.raw


def keys(fd: int, key_size: int) -> list[bytes]:
    """Every key of a hash or LPM map (BPF_MAP_GET_NEXT_KEY from the start)."""
    out: list[bytes] = []
    nxt = ctypes.create_string_buffer(key_size)
    cur: ctypes.Array[ctypes.c_char] | None = None
    while True:
        addr = 0 if cur is None else ctypes.addressof(cur)
        attr = struct.pack("=I4xQQ", fd, addr, ctypes.addressof(nxt))
        try:
            _bpf(BPF_MAP_GET_NEXT_KEY, attr, "map next key")
        except BpfError as exc:
            if exc.errno == 2:
                return out
            raise
        out.append(nxt.raw)
        cur = ctypes.create_string_buffer(nxt.raw, key_size)


def map_fd_by_id(map_id: int) -> int:
    return _bpf(BPF_MAP_GET_FD_BY_ID, struct.pack("=III", map_id, 0, 0), f"map fd of id {map_id}")


def prog_fd_by_id(prog_id: int) -> int:
    return _bpf(
        BPF_PROG_GET_FD_BY_ID, struct.pack("=III", prog_id, 0, 0), f"prog fd of id {prog_id}"
    )


# -------------------------------------------------------------------------- programs


@dataclass(frozen=True)
class Insn:
    code: int
    dst: int = 0
    src: int = 0
    off: int = 0
    imm: int = 0

    def encode(self) -> bytes:
        return struct.pack("<BBhi", self.code, (self.src << 4) | self.dst, self.off, self.imm)


def load_program(
    prog_type: int,
    insns: Iterable[Insn],
    *,
    expected_attach_type: int = 0,
    attach_btf_id: int = 0,
    name: str = "",
    license: str = "GPL",
) -> int:
    code = b"".join(i.encode() for i in insns)
    n = len(code) // 8
    prog = ctypes.create_string_buffer(code, len(code))
    lic = ctypes.create_string_buffer(license.encode())
    log = ctypes.create_string_buffer(1 << 16)

    def attempt(log_level: int) -> int:
        attr = struct.pack(
            "=IIQQIIQII16sII36xI",
            prog_type,
            n,
            ctypes.addressof(prog),
            ctypes.addressof(lic),
            log_level,
            len(log) if log_level else 0,
            ctypes.addressof(log) if log_level else 0,
            0,  # kern_version
            0,  # prog_flags
            name.encode()[:15],
            0,  # prog_ifindex
            expected_attach_type,
            attach_btf_id,
        )
        return _bpf(BPF_PROG_LOAD, attr, f"load program {name}")

    try:
        return attempt(0)
    except BpfError as exc:
        if exc.errno not in (1, 13, 22):  # EPERM/EACCES/EINVAL: the verifier may say why
            raise
        try:
            attempt(1)
        except BpfError:
            pass
        raise BpfError(
            f"load program {name}", exc.errno or 22, log.value.decode(errors="replace")
        ) from None


def attach_cgroup(cgroup_fd: int, prog_fd: int, attach_type: int) -> None:
    attr = struct.pack("=IIIII", cgroup_fd, prog_fd, attach_type, BPF_F_ALLOW_MULTI, 0)
    _bpf(BPF_PROG_ATTACH, attr, "attach to cgroup")


def detach_cgroup(cgroup_fd: int, prog_fd: int, attach_type: int) -> None:
    attr = struct.pack("=IIIII", cgroup_fd, prog_fd, attach_type, 0, 0)
    _bpf(BPF_PROG_DETACH, attr, "detach from cgroup")


def query_cgroup(cgroup_fd: int, attach_type: int, max_progs: int = 64) -> list[int]:
    """Ids of the programs attached to a cgroup for one attach type."""
    ids = (ctypes.c_uint32 * max_progs)()
    attr = bytearray(
        struct.pack("=IIIIQI", cgroup_fd, attach_type, 0, 0, ctypes.addressof(ids), max_progs)
    )
    buf = ctypes.create_string_buffer(bytes(attr), 128)
    r = _libc.syscall(SYS_BPF, BPF_PROG_QUERY, buf, 128)
    if r < 0:
        raise BpfError("query cgroup", ctypes.get_errno())
    count = struct.unpack_from("=I", buf.raw, 24)[0]
    return list(ids[: min(count, max_progs)])


def attach_tracing(prog_fd: int) -> int:
    """Attach an fentry/fexit program (its target came with the load); returns the link fd."""
    return _bpf(BPF_RAW_TRACEPOINT_OPEN, struct.pack("=QI", 0, prog_fd), "attach tracing program")


# --------------------------------------------------------------------------- pinning


def pin(fd: int, path: Path) -> None:
    p = ctypes.create_string_buffer(os.fsencode(path))
    _bpf(BPF_OBJ_PIN, struct.pack("=QII", ctypes.addressof(p), fd, 0), f"pin {path}")


def get_pinned(path: Path) -> int:
    p = ctypes.create_string_buffer(os.fsencode(path))
    return _bpf(BPF_OBJ_GET, struct.pack("=QII", ctypes.addressof(p), 0, 0), f"open pinned {path}")


def is_bpffs(path: Path) -> bool:
    BPF_FS_MAGIC = 0xCAFE4A11
    try:
        buf = (ctypes.c_long * 16)()
        if _libc.statfs(os.fsencode(path), buf) != 0:
            return False
        return (buf[0] & 0xFFFFFFFF) == BPF_FS_MAGIC
    except OSError:
        return False

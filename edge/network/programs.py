"""The eBPF programs of a sandbox's network policy, assembled instruction by instruction.

Four `BPF_PROG_TYPE_CGROUP_SOCK_ADDR` programs per sandbox, attached to its cgroup2 directory:
connect4 and sendmsg4 (one body: IPv4), connect6 and sendmsg6 (another: IPv6, with IPv4-mapped
addresses sent to the IPv4 table). Returning 0 makes connect()/sendto() fail with EPERM before
any packet leaves; every such refusal is counted.

Policy lookup, in the kernel, per connect / unconnected datagram:

    side = ctl[0]                      which of the two tries (A or B) is in force
    trie_side[dst] -> the longest matching prefix's rule list: up to RULES_PER_ENTRY rules of
                      (port_lo, port_hi, protocol, action); first match wins; end = deny

Two tries per family: the edge brings the standby one to the new policy (only the entries that
differ from what it holds: a task switching back and forth between stages writes nothing), then
flips ctl[0] with one 4-byte update. The flip is atomic and needs no RCU grace period (swapping
an inner map of a map-in-map does: measured 10-25 ms here), so a connect made after
UpdateNetworkPolicy returns sees the new policy, whole.

The edge compiles the policy so that first-match over one list is the whole semantics
(`edge.network.policy`): each prefix's list also carries the rules of every shorter prefix that
contains it, ordered platform allows, platform denies, user denies, user allows, mode default.

Registers: r6 ctx, r7 IPv4 address, r8 port (host order), r9 protocol; r1-r5 scratch (clobbered
by helper calls). Stack: fp-8..-1 IPv4 key, fp-20..-1 IPv6 key, fp-32 stats key, fp-36 ctl key,
fp-56..-41 the IPv6 address while the side is looked up.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from edge.network.bpf import Insn

RULES_PER_ENTRY = 16
RULE_SIZE = 8
VALUE_SIZE = RULES_PER_ENTRY * RULE_SIZE
V4_KEY_SIZE = 8  # prefixlen, address
V6_KEY_SIZE = 20

ACTION_END = 0
ACTION_ALLOW = 1
ACTION_DENY = 2

# struct bpf_sock_addr offsets
_USER_IP4 = 4
_USER_IP6 = 8
_USER_PORT = 24
_PROTOCOL = 36

# opcodes
_LDX_W = 0x61
_LDX_H = 0x69
_LDX_B = 0x71
_ST_W = 0x62
_STX_W = 0x63
_STX_ATOMIC_DW = 0xDB
_ALU64_MOV_K = 0xB7
_ALU64_MOV_X = 0xBF
_ALU64_ADD_K = 0x07
_ALU_MOV_K = 0xB4
_ALU_END_BE = 0xDC  # BPF_ALU | BPF_END | BPF_TO_BE
_LD_IMM64 = 0x18
_JA = 0x05
_JEQ_K = 0x15
_JEQ_X = 0x1D
_JNE_K = 0x55
_JNE_X = 0x5D
_JLT_X = 0xAD
_JGT_X = 0x2D
_CALL = 0x85
_EXIT = 0x95
_PSEUDO_MAP_FD = 1
_FN_MAP_LOOKUP = 1
_FP = 10


@dataclass
class _Jump:
    code: int
    dst: int
    src: int
    imm: int
    label: str


@dataclass
class _Label:
    name: str


class Assembler:
    """A tiny two-pass assembler: instructions, labels, jumps to labels."""

    def __init__(self) -> None:
        self._items: list[Insn | _Jump | _Label] = []

    def emit(self, code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> None:
        self._items.append(Insn(code, dst, src, off, imm))

    def jump(self, code: int, label: str, dst: int = 0, src: int = 0, imm: int = 0) -> None:
        self._items.append(_Jump(code, dst, src, imm, label))

    def label(self, name: str) -> None:
        self._items.append(_Label(name))

    def ld_map(self, reg: int, fd: int) -> None:
        self.emit(_LD_IMM64, reg, _PSEUDO_MAP_FD, 0, fd)
        self.emit(0, 0, 0, 0, 0)

    def assemble(self) -> list[Insn]:
        pos: dict[str, int] = {}
        pc = 0
        for item in self._items:
            if isinstance(item, _Label):
                pos[item.name] = pc
            else:
                pc += 1
        out: list[Insn] = []
        for item in self._items:
            if isinstance(item, _Label):
                continue
            if isinstance(item, _Jump):
                off = pos[item.label] - (len(out) + 1)
                out.append(Insn(item.code, item.dst, item.src, off, item.imm))
            else:
                out.append(item)
        return out


def _lookup(a: Assembler, map_fd: int, key_off: int, miss: str) -> None:
    """r0 = lookup(map, fp+key_off); jump to `miss` when absent."""
    a.ld_map(1, map_fd)
    a.emit(_ALU64_MOV_X, 2, _FP)
    a.emit(_ALU64_ADD_K, 2, imm=key_off)
    a.emit(_CALL, imm=_FN_MAP_LOOKUP)
    a.jump(_JEQ_K, miss, dst=0, imm=0)


def _side(a: Assembler, ctl: int) -> None:
    """r1 = ctl[0] (0: trie A in force, else B), or deny."""
    a.emit(_ST_W, _FP, off=-36, imm=0)
    _lookup(a, ctl, -36, "deny")
    a.emit(_LDX_W, 1, 0, off=0)


def _lookup_side(a: Assembler, tries: tuple[int, int], key_off: int, tag: str) -> None:
    """r0 = lookup(tries[side in r1], fp+key_off), or deny."""
    a.jump(_JNE_K, f"side_b_{tag}", dst=1, imm=0)
    a.ld_map(1, tries[0])
    a.jump(_JA, f"lookup_{tag}")
    a.label(f"side_b_{tag}")
    a.ld_map(1, tries[1])
    a.label(f"lookup_{tag}")
    a.emit(_ALU64_MOV_X, 2, _FP)
    a.emit(_ALU64_ADD_K, 2, imm=key_off)
    a.emit(_CALL, imm=_FN_MAP_LOOKUP)
    a.jump(_JEQ_K, "deny", dst=0, imm=0)


def _v4_lookup(a: Assembler, trie4: tuple[int, int], ctl: int) -> None:
    """Key {32, r7} at fp-8; r0 = rule list, or deny."""
    _side(a, ctl)
    a.emit(_ST_W, _FP, off=-8, imm=32)
    a.emit(_STX_W, _FP, 7, off=-4)
    _lookup_side(a, trie4, -8, "v4")
    a.jump(_JA, "scan")


def _scan(a: Assembler) -> None:
    """First match over the rule list at r0 for port r8 and protocol r9: jumps to "allow" or
    "deny"; the end of the list (or of the entry) falls through to what follows, which must be
    the caller's "deny"."""
    a.label("scan")
    for i in range(RULES_PER_ENTRY):
        base = i * RULE_SIZE
        nxt = f"next{i}"
        a.emit(_LDX_B, 1, 0, off=base + 5)  # action
        a.jump(_JEQ_K, "deny", dst=1, imm=ACTION_END)
        a.emit(_LDX_B, 2, 0, off=base + 4)  # protocol, 0 = any
        a.jump(_JEQ_K, f"ports{i}", dst=2, imm=0)
        a.jump(_JNE_X, nxt, dst=2, src=9)
        a.label(f"ports{i}")
        a.emit(_LDX_H, 2, 0, off=base + 0)
        a.jump(_JLT_X, nxt, dst=8, src=2)
        a.emit(_LDX_H, 2, 0, off=base + 2)
        a.jump(_JGT_X, nxt, dst=8, src=2)
        a.jump(_JEQ_K, "allow", dst=1, imm=ACTION_ALLOW)
        a.jump(_JA, "deny")
        a.label(nxt)


def _count(a: Assembler, stats: int, done: str) -> None:
    """stats[0] += 1 (atomic), then on to `done` (also when the lookup fails)."""
    a.emit(_ST_W, _FP, off=-32, imm=0)
    _lookup(a, stats, -32, done)
    a.emit(_ALU64_MOV_K, 1, imm=1)
    a.emit(_STX_ATOMIC_DW, 0, 1, off=0, imm=0)  # lock *(u64 *)(r0) += 1


def _scan_and_verdict(a: Assembler, stats: int) -> None:
    """connect()/sendmsg(): 1 lets it through, 0 refuses it (EPERM), counted."""
    _scan(a)
    a.label("deny")
    _count(a, stats, "ret0")
    a.label("ret0")
    a.emit(_ALU64_MOV_K, 0, imm=0)
    a.emit(_EXIT)
    a.label("allow")
    a.emit(_ALU64_MOV_K, 0, imm=1)
    a.emit(_EXIT)


def _prologue(a: Assembler) -> None:
    a.emit(_ALU64_MOV_X, 6, 1)
    a.emit(_LDX_W, 8, 6, off=_USER_PORT)
    a.emit(_ALU_END_BE, 8, imm=16)
    a.emit(_LDX_W, 9, 6, off=_PROTOCOL)


def ipv4_program(trie4: tuple[int, int], ctl: int, stats: int) -> list[Insn]:
    """connect4 / sendmsg4; `trie4` = the (A, B) tries."""
    a = Assembler()
    _prologue(a)
    a.emit(_LDX_W, 7, 6, off=_USER_IP4)
    _v4_lookup(a, trie4, ctl)
    _scan_and_verdict(a, stats)
    return a.assemble()


def ipv6_program(
    trie4: tuple[int, int], trie6: tuple[int, int], ctl: int, stats: int
) -> list[Insn]:
    """connect6 / sendmsg6; ::ffff:a.b.c.d goes to the IPv4 table."""
    a = Assembler()
    _prologue(a)
    for k in range(4):
        a.emit(_LDX_W, 1 + k, 6, off=_USER_IP6 + 4 * k)
    a.jump(_JNE_K, "v6", dst=1, imm=0)
    a.jump(_JNE_K, "v6", dst=2, imm=0)
    a.emit(_ALU_MOV_K, 5, imm=struct.unpack("<i", bytes([0, 0, 0xFF, 0xFF]))[0])
    a.jump(_JNE_X, "v6", dst=3, src=5)
    a.emit(_ALU64_MOV_X, 7, 4)
    _v4_lookup(a, trie4, ctl)
    a.label("v6")
    for k in range(4):  # the address survives the side lookup on the stack
        a.emit(_STX_W, _FP, 1 + k, off=-56 + 4 * k)
    _side(a, ctl)
    a.emit(_ST_W, _FP, off=-20, imm=128)
    for k in range(4):
        a.emit(_LDX_W, 2, _FP, off=-56 + 4 * k)
        a.emit(_STX_W, _FP, 2, off=-16 + 4 * k)
    _lookup_side(a, trie6, -20, "v6")
    _scan_and_verdict(a, stats)
    return a.assemble()


def encode_rules(rules: list[tuple[int, int, int, int]]) -> bytes:
    """[(port_lo, port_hi, protocol, action)] -> one map value (END-padded)."""
    if len(rules) > RULES_PER_ENTRY:
        raise ValueError(f"at most {RULES_PER_ENTRY} rules per prefix, got {len(rules)}")
    out = b"".join(struct.pack("<HHBBxx", lo, hi, proto, act) for lo, hi, proto, act in rules)
    return out.ljust(VALUE_SIZE, b"\0")


def lpm_key(prefixlen: int, addr: bytes) -> bytes:
    """Key of the LPM tries: prefix length (host order), then the address (network order)."""
    return struct.pack("<I", prefixlen) + addr

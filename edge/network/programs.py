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

A VM guest's traffic never passes a cgroup hook, so for guests one `BPF_PROG_TYPE_SCHED_CLS`
program (`guest_program`, on the ingress of the host end of the guest's link: see
`edge.network.guest`) reads the same tries, ctl and stats per frame the guest sends:

    source MAC != the guest's, a VLAN tag, or an ethertype other than ARP/IPv4   drop
    ARP: only Ethernet/IPv4 with sender MAC and address the guest's own           pass / drop
    IPv4: options, or a source other than the guest's address                    drop
          a later fragment (offset != 0)                                         pass (below)
          destination 0/8 or 127/8 (never on a wire: aimed at the host)          deny
          anything else: the policy lookup above (port 0 for other protocols)    pass / deny

Denied frames are dropped; a denied *new flow* -- a TCP SYN without ACK, a UDP datagram, an
ICMP echo request, any packet of another protocol -- is counted in stats[0] once per flow
(destination, ports or echo id, protocol) while the flow is in a small LRU map, so the guest's
SYN retransmits count as one blocked connect, as a refused connect() does for a container.
Spoofed and malformed frames are dropped uncounted (a freshly cloned guest sends with its
template's MAC until it is told its own). The filter is stateless: every frame of an allowed
flow is checked, so a policy change also stops established flows it no longer allows.

Later fragments carry no ports and pass: Linux reassembles them only with their first fragment,
which was checked with its ports (the host's conntrack defragments everything forwarded or
delivered to it), and fragment offsets are multiples of 8 bytes, so none can overwrite the
ports (bytes 0-3 of the L4 header) the filter checked.

All multi-byte fields are compared as the little-endian words the loads produce (x86_64).
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


# ------------------------------------------------------------------------- the guest's

TC_PASS = 0  # TC_ACT_OK / TCX_PASS
TC_DROP = 2  # TC_ACT_SHOT / TCX_DROP
FLOW_KEY_SIZE = 12  # destination (4), L4 bytes 0-3 (ports; echo id and 0), protocol (4)
_ICMP, _TCP, _UDP = 1, 6, 17  # IP protocol numbers

_SKB_VLAN_PRESENT = 20  # struct __sk_buff
_FN_MAP_UPDATE = 2
_FN_SKB_LOAD_BYTES = 26
_BPF_NOEXIST = 1
_JMP32_JEQ_K = 0x16
_JMP32_JNE_K = 0x56
_ALU64_AND_K = 0x57
_STX_H = 0x6B
_ST_DW = 0x7A

# Stack of the guest program (besides the IPv4 key, stats and ctl keys above). Byte 0 of the
# frame lands at fp-102 so that the words compared (MAC, addresses) are 4-aligned, as the
# verifier requires of stack reads: frame fp-102..-69 (Ethernet + IPv4 header), L4 header
# fp-112..-105, TCP flags fp-120, flow key fp-48..-37, flow value fp-56, counts flag fp-60.
_FRAME = -102
_FRAME_BYTES = 34
_L4 = -112
_TCP_FLAGS = -120
_FLOW = -48
_FLOW_VALUE = -56
_COUNTS = -60


def _imm(value: bytes) -> int:
    """`value` as the 32-bit immediate equal to a little-endian load of those bytes."""
    return struct.unpack("<i", value.ljust(4, b"\0"))[0]


def _load_bytes(a: Assembler, offset: int, stack_off: int, size: int) -> None:
    """bpf_skb_load_bytes(skb, offset, fp+stack_off, size), or drop (a short frame)."""
    a.emit(_ALU64_MOV_X, 1, 6)
    a.emit(_ALU64_MOV_K, 2, imm=offset)
    a.emit(_ALU64_MOV_X, 3, _FP)
    a.emit(_ALU64_ADD_K, 3, imm=stack_off)
    a.emit(_ALU64_MOV_K, 4, imm=size)
    a.emit(_CALL, imm=_FN_SKB_LOAD_BYTES)
    a.jump(_JNE_K, "drop", dst=0, imm=0)


def _expect(a: Assembler, frame_off: int, value: bytes) -> None:
    """Drop unless the frame's bytes at `frame_off` are `value` (1, 2 or 4 bytes)."""
    load = {1: _LDX_B, 2: _LDX_H, 4: _LDX_W}[len(value)]
    a.emit(load, 1, _FP, off=_FRAME + frame_off)
    a.jump(_JMP32_JNE_K, "drop", dst=1, imm=_imm(value))


def _guest_arp(a: Assembler, mac: bytes, address: bytes) -> None:
    """Ethernet/IPv4 ARP whose sender is the guest itself, else drop."""
    a.label("arp")
    _expect(a, 14, b"\x00\x01\x08\x00")  # hardware type Ethernet, protocol IPv4
    _expect(a, 18, b"\x06\x04")  # address lengths
    _expect(a, 22, mac[:4])  # sender hardware address
    _expect(a, 26, mac[4:])
    _expect(a, 28, address[:2])  # sender protocol address (2-aligned only)
    _expect(a, 30, address[2:])
    a.jump(_JA, "allow")


def _guest_flow(a: Assembler) -> None:
    """r8 = the destination port, the flow key's L4 part, and whether the frame starts a flow
    (fp-60; preset to 1) for TCP, UDP and ICMP; then on to "policy"."""
    a.jump(_JEQ_K, "ports", dst=9, imm=_TCP)
    a.jump(_JEQ_K, "ports", dst=9, imm=_UDP)
    a.jump(_JNE_K, "policy", dst=9, imm=_ICMP)
    _load_bytes(a, 34, _L4, 8)
    a.emit(_LDX_B, 1, _FP, off=_L4)
    a.jump(_JEQ_K, "echo", dst=1, imm=8)
    a.emit(_ST_W, _FP, off=_COUNTS, imm=0)  # an ICMP error or reply starts nothing
    a.jump(_JA, "policy")
    a.label("echo")
    a.emit(_LDX_H, 1, _FP, off=_L4 + 4)
    a.emit(_STX_H, _FP, 1, off=_FLOW + 4)
    a.jump(_JA, "policy")
    a.label("ports")
    _load_bytes(a, 34, _L4, 8)
    a.emit(_LDX_W, 1, _FP, off=_L4)
    a.emit(_STX_W, _FP, 1, off=_FLOW + 4)
    a.emit(_LDX_H, 8, _FP, off=_L4 + 2)
    a.emit(_ALU_END_BE, 8, imm=16)
    a.jump(_JNE_K, "policy", dst=9, imm=_TCP)
    _load_bytes(a, 34 + 13, _TCP_FLAGS, 1)
    a.emit(_LDX_B, 1, _FP, off=_TCP_FLAGS)
    a.emit(_ALU64_AND_K, 1, imm=0x12)  # SYN | ACK
    a.jump(_JEQ_K, "policy", dst=1, imm=0x02)
    a.emit(_ST_W, _FP, off=_COUNTS, imm=0)


def _guest_deny(a: Assembler, flows: int, stats: int) -> None:
    """Drop; count it if it starts a flow not counted yet (flows: LRU, insert-if-absent)."""
    a.label("deny")
    a.emit(_LDX_W, 1, _FP, off=_COUNTS)
    a.jump(_JEQ_K, "drop", dst=1, imm=0)
    a.emit(_ST_DW, _FP, off=_FLOW_VALUE, imm=0)
    a.ld_map(1, flows)
    a.emit(_ALU64_MOV_X, 2, _FP)
    a.emit(_ALU64_ADD_K, 2, imm=_FLOW)
    a.emit(_ALU64_MOV_X, 3, _FP)
    a.emit(_ALU64_ADD_K, 3, imm=_FLOW_VALUE)
    a.emit(_ALU64_MOV_K, 4, imm=_BPF_NOEXIST)
    a.emit(_CALL, imm=_FN_MAP_UPDATE)
    a.jump(_JNE_K, "drop", dst=0, imm=0)  # -EEXIST: this flow was counted already
    _count(a, stats, "drop")
    a.label("drop")
    a.emit(_ALU64_MOV_K, 0, imm=TC_DROP)
    a.emit(_EXIT)
    a.label("allow")
    a.emit(_ALU64_MOV_K, 0, imm=TC_PASS)
    a.emit(_EXIT)


def guest_program(
    trie4: tuple[int, int], ctl: int, stats: int, flows: int, mac: bytes, address: bytes
) -> list[Insn]:
    """The tc program of a guest whose NIC has `mac` (6 bytes) and `address` (4, network
    order); `flows` is the LRU map of counted flows (FLOW_KEY_SIZE-byte keys, u64 values)."""
    a = Assembler()
    a.emit(_ALU64_MOV_X, 6, 1)
    a.emit(_LDX_W, 1, 6, off=_SKB_VLAN_PRESENT)  # a tag the receive path took off the frame
    a.jump(_JNE_K, "drop", dst=1, imm=0)
    _load_bytes(a, 0, _FRAME, _FRAME_BYTES)
    _expect(a, 6, mac[:4])  # source MAC
    _expect(a, 10, mac[4:])
    a.emit(_LDX_H, 1, _FP, off=_FRAME + 12)  # ethertype
    a.jump(_JMP32_JEQ_K, "arp", dst=1, imm=_imm(b"\x08\x06"))
    a.jump(_JMP32_JNE_K, "drop", dst=1, imm=_imm(b"\x08\x00"))
    _expect(a, 14, b"\x45")  # IPv4, header without options
    _expect(a, 26, address)  # source address
    a.emit(_LDX_H, 1, _FP, off=_FRAME + 20)
    a.emit(_ALU64_AND_K, 1, imm=_imm(b"\x1f\xff"))  # fragment offset
    a.jump(_JNE_K, "allow", dst=1, imm=0)
    a.emit(_LDX_B, 9, _FP, off=_FRAME + 23)
    a.emit(_LDX_W, 7, _FP, off=_FRAME + 30)
    a.emit(_STX_W, _FP, 7, off=_FLOW)
    a.emit(_ST_W, _FP, off=_FLOW + 4, imm=0)
    a.emit(_STX_W, _FP, 9, off=_FLOW + 8)
    a.emit(_ST_W, _FP, off=_COUNTS, imm=1)
    a.emit(_ALU64_MOV_K, 8, imm=0)
    a.emit(_ALU64_MOV_X, 1, 7)
    a.emit(_ALU64_AND_K, 1, imm=0xFF)  # the destination's first octet
    a.jump(_JEQ_K, "deny", dst=1, imm=0)
    a.jump(_JEQ_K, "deny", dst=1, imm=127)
    _guest_flow(a)
    a.label("policy")
    _v4_lookup(a, trie4, ctl)
    _scan(a)
    _guest_deny(a, flows, stats)
    _guest_arp(a, mac, address)
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

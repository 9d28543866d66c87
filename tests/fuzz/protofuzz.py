"""Hypothesis strategies for any protobuf message, built from its descriptor.

Why from descriptors: a strategy written per message goes stale the day a field is added,
and nobody writes one for the 200th RPC. Walking ``Descriptor.fields`` covers every field
of every message the services accept, today's and tomorrow's, with the values that break
servers rather than the values that make them happy:

- numbers at their type's extremes (int32/int64/uint32/uint64 bounds, -1, 0), NaN and
  infinities for floats;
- strings empty, short, unicode, with NUL bytes, or huge (up to :data:`HUGE` bytes, built by
  repetition so generation stays cheap); bytes likewise;
- ids of every kind from an :class:`IdPool`: malformed ones ("", "..", "sb-"+junk, 10k
  characters) and the real ids of objects the test made (another project's sandbox too),
  so a generated call reaches past the parser into the service's lookups;
- unknown enum values (proto3 enums are open: any int32 parses), every oneof arm or none,
  map fields, repeated fields with many elements, nested messages to a bounded depth
  (recursive messages end at :data:`MAX_DEPTH` with an empty message).

Besides messages: :func:`raw_bytes` (random bytes sent with an identity serializer, so the
server's own parser sees them) and :func:`wrong_type_payloads` (the serialized bytes of a
different message type, which often parse as something odd).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

#: The largest string or bytes value generated (64 KiB): big enough to cross every
#: "reasonable length" a service assumes, small enough that thousands of calls stay cheap.
HUGE = 64 * 1024
#: Nesting depth at which a message field is left empty (recursive messages end there).
MAX_DEPTH = 4
#: Most elements of a repeated or map field ("many" without megabytes of requests).
MANY = 300

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)

T = FieldDescriptor
_SIGNED32 = {T.TYPE_INT32, T.TYPE_SINT32, T.TYPE_SFIXED32}
_SIGNED64 = {T.TYPE_INT64, T.TYPE_SINT64, T.TYPE_SFIXED64}
_UNSIGNED32 = {T.TYPE_UINT32, T.TYPE_FIXED32}
_UNSIGNED64 = {T.TYPE_UINT64, T.TYPE_FIXED64}

#: Malformed ids: every kind a parser or a path join could choke on.
BAD_IDS: tuple[str, ...] = (
    "",
    "x",
    "..",
    "../..",
    "../../etc/passwd",
    "/",
    "sb-",
    "sb-" + "0" * 40,
    "sb-../../x",
    "sb-\x00",
    "sb-zzzzzzzzzzzz",
    "prj-",
    "tok-",
    "exec-",
    " ",
    "\x00",
    "a\x00b",
    "%s%s%n",
    "*",
    "ñandú-∂-😀",
    "\ud7ff\ue000",
    "-1",
    "0",
    "18446744073709551616",
    "x" * 10_000,
)


#: What a string field holds, by its name: a field named like one of these gets the real
#: ids of that kind half of the time (a sandbox_id that names a live sandbox gets past the
#: lookup to the code behind it).
KINDS = ("sandbox", "project", "edge", "node", "token", "exec", "session", "watcher", "task")


def id_kind(field_name: str) -> str:
    """The kind of id a field named ``field_name`` holds ("" = none in particular)."""
    name = field_name.lower()
    if not (name.endswith(("_id", "_ids", "id")) or name in KINDS):
        return ""
    return next((k for k in KINDS if k in name), "")


class IdPool:
    """Ids to put in string fields: :data:`BAD_IDS` plus the real ids a test registers,
    each under a kind (:data:`KINDS`).

    Real ids are added while a test runs (a recreated sandbox, a new token), so the pool is
    read at draw time, not when the strategy is built.
    """

    def __init__(self, real: Sequence[str] = ()) -> None:
        self.by_kind: dict[str, list[str]] = {}
        self.add(*real)

    @property
    def real(self) -> list[str]:
        return [i for ids in self.by_kind.values() for i in ids]

    def add(self, *ids: str, kind: str = "") -> None:
        bucket = self.by_kind.setdefault(kind, [])
        for i in ids:
            if i and i not in bucket:
                bucket.append(i)

    def strategy(self, kind: str = "") -> st.SearchStrategy[str]:
        bad = st.sampled_from(BAD_IDS)

        @st.composite
        def real(draw: st.DrawFn) -> str:
            own = self.by_kind.get(kind, []) if kind else []
            every = self.real
            pool = own if own and draw(st.sampled_from([True, False])) else every
            return draw(st.sampled_from(list(pool))) if pool else draw(bad)

        return st.one_of(real(), bad)


def _big_ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, lo + 1, -1 if lo < 0 else 0, 0, 1, hi - 1, hi})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(max(lo, -3), 1000))


def _floats(width: int) -> st.SearchStrategy[float]:
    specials = [math.nan, math.inf, -math.inf, -0.0, 0.0, -1.0, 1e-300 if width == 64 else 1e-38]
    specials.append(1.7e308 if width == 64 else 3.4e38)
    return st.one_of(st.sampled_from(specials), st.floats(width=width))  # type: ignore[arg-type]


def _huge(alphabet: Sequence[Any], join: Callable[[Any, int], Any]) -> st.SearchStrategy[Any]:
    # Repetition, not drawing 64 KiB of characters: the suite stays fast.
    return st.builds(join, st.sampled_from(list(alphabet)), st.integers(1000, HUGE))


def strings(
    ids: IdPool | None = None, *, small: bool = False, kind: str = ""
) -> st.SearchStrategy[str]:
    """Empty, short, huge (unless ``small``) strings and ids (``kind``: an id field's)."""
    parts: list[st.SearchStrategy[str]] = [st.just(""), st.text(max_size=24)]
    if not small:
        parts.append(_huge(["a", "é", "\x00", "/", "😀"], lambda c, n: c * (n // len(c.encode()))))
    if ids is not None:
        parts.insert(0, ids.strategy(kind))
        if kind:  # an id field: mostly ids
            return st.one_of(ids.strategy(kind), st.one_of(*parts))
    return st.one_of(*parts)


def raw_bytes() -> st.SearchStrategy[bytes]:
    """Random bytes to send as a request body (most do not parse; some parse as junk)."""
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"\xff" * 10, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 11]),
        _huge([b"\x00", b"\xff", b"\x0a"], lambda c, n: c * n),
    )


def _bytes_values(small: bool) -> st.SearchStrategy[bytes]:
    if small:
        return st.binary(max_size=32)
    return st.one_of(
        st.just(b""), st.binary(max_size=32), _huge([b"\x00", b"\xff"], lambda c, n: c * n)
    )


def _enum_values(enum: EnumDescriptor) -> st.SearchStrategy[int]:
    known = st.sampled_from([v.number for v in enum.values])
    if getattr(enum, "is_closed", False):
        return known  # proto2 closed enums reject unknown numbers at assignment
    return st.one_of(known, st.integers(*INT32), st.sampled_from([-1, 999, INT32[0], INT32[1]]))


def scalar(
    field: FieldDescriptor, ids: IdPool | None, *, small: bool = False
) -> st.SearchStrategy[Any]:
    """Values for one non-message field (``small``: no huge strings or bytes)."""
    t = field.type
    if t in _SIGNED32:
        return _big_ints(*INT32)
    if t in _SIGNED64:
        return _big_ints(*INT64)
    if t in _UNSIGNED32:
        return _big_ints(*UINT32)
    if t in _UNSIGNED64:
        return _big_ints(*UINT64)
    if t == T.TYPE_DOUBLE:
        return _floats(64)
    if t == T.TYPE_FLOAT:
        return _floats(32)
    if t == T.TYPE_BOOL:
        return st.booleans()
    if t == T.TYPE_STRING:
        return strings(ids, small=small, kind=id_kind(field.name))
    if t == T.TYPE_BYTES:
        return _bytes_values(small)
    if t == T.TYPE_ENUM:
        assert field.enum_type is not None
        return _enum_values(field.enum_type)
    raise TypeError(f"{field.full_name}: not a scalar field (type {t})")


def _is_map(field: FieldDescriptor) -> bool:
    mt = field.message_type
    return mt is not None and mt.GetOptions().map_entry


def _repeated(field: FieldDescriptor) -> bool:
    # `label` is deprecated in newer protobuf releases in favour of `is_repeated`.
    rep = getattr(field, "is_repeated", None)
    return bool(rep) if rep is not None else getattr(field, "label") == T.LABEL_REPEATED  # noqa: B009


def _lists(
    elem: st.SearchStrategy[Any], many: st.SearchStrategy[Any] | None
) -> st.SearchStrategy[list[Any]]:
    """A few elements of ``elem``, or up to :data:`MANY` copies of one ``many`` element (a
    small one: 300 copies of a 64 KiB string would make 19 MB requests)."""
    few = st.lists(elem, max_size=3)
    if many is None:
        return few
    # One drawn element repeated: 300 distinct drawn values are slow to generate.
    return st.one_of(few, st.builds(lambda e, n: [e] * n, many, st.integers(50, MANY)))


def messages(
    desc: Descriptor, ids: IdPool | None = None, *, max_depth: int = MAX_DEPTH
) -> st.SearchStrategy[Message]:
    """Messages of type ``desc`` with generated values in a random subset of its fields."""
    return _message(desc, ids, max_depth)


def _message(
    desc: Descriptor, ids: IdPool | None, depth: int, small: bool = False
) -> st.SearchStrategy[Message]:
    cls = message_factory.GetMessageClass(desc)
    if depth <= 0:
        return st.just(cls())

    oneof_fields = {f.name for o in desc.oneofs for f in o.fields}

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        for oneof in desc.oneofs:
            # A synthetic oneof (proto3 `optional`) has one field: set it or not.
            choice = draw(st.sampled_from([None, *oneof.fields]))
            if choice is not None:
                _fill(draw, msg, choice, ids, depth, small)
        for field in desc.fields:
            if field.name in oneof_fields:
                continue
            if draw(st.booleans()):
                _fill(draw, msg, field, ids, depth, small)
        return msg

    return build()


def _fill(
    draw: st.DrawFn,
    msg: Message,
    field: FieldDescriptor,
    ids: IdPool | None,
    depth: int,
    small: bool,
) -> None:
    target = getattr(msg, field.name)
    mt = field.message_type
    if _is_map(field):
        assert mt is not None
        key_f = mt.fields_by_name["key"]
        val_f = mt.fields_by_name["value"]
        keys = draw(st.lists(scalar(key_f, ids, small=small), max_size=4, unique=True))
        for k in keys:
            if val_f.type == T.TYPE_MESSAGE:
                vt = val_f.message_type
                assert vt is not None
                target[k].CopyFrom(draw(_message(vt, ids, depth - 1, small)))
            else:
                target[k] = draw(scalar(val_f, ids, small=small))
        return
    if field.type == T.TYPE_MESSAGE:
        assert mt is not None
        sub = _message(mt, ids, depth - 1, small)
        if _repeated(field):
            # many elements only of shallow messages (depth 1: scalars, no nested lists)
            many = _message(mt, ids, 1, True) if depth == MAX_DEPTH else None
            for m in draw(_lists(sub, many)):
                target.add().CopyFrom(m)
        else:
            target.CopyFrom(draw(sub))
        return
    if _repeated(field):
        elem = scalar(field, ids, small=small)
        target.extend(draw(_lists(elem, None if small else scalar(field, ids, small=True))))
        return
    setattr(msg, field.name, draw(scalar(field, ids, small=small)))


def wrong_type_payloads(
    desc: Descriptor, others: Sequence[Descriptor], ids: IdPool | None = None
) -> st.SearchStrategy[bytes]:
    """The serialized bytes of a message of another type than ``desc`` (from ``others``)."""
    candidates = [o for o in others if o.full_name != desc.full_name]
    if not candidates:
        raise ValueError(f"no message type other than {desc.full_name} to send")
    return st.sampled_from(candidates).flatmap(
        lambda o: messages(o, ids, max_depth=2).map(lambda m: m.SerializeToString())
    )

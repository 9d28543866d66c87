"""Display input (computer use), checked before any of it reaches a screen.

A DisplayInput call carries a list of actions (move, click, scroll, drag, button, type,
press) that a backend delivers as real input events (the vm backend: QMP, see
edge/backends/vm/input.py). The whole list is checked here, first, against the screen's size:
a half-delivered list (a click sent, then a bad key refused) would leave the guest in a state
the caller did not ask for and cannot see, so nothing is sent unless everything is valid.

The checks name what is wrong (InvalidArgument with a reason and ``metadata["field"]``): a
coordinate off the screen, a click or scroll with one coordinate of two, a count or a wheel
distance out of range, a character that cannot be typed, a key name nobody knows. Key names
are read case-insensitively, in our spelling ("ctrl+shift+t", "page_down", "enter") and in the
X keysym spelling the e2b-desktop SDK sends to xdotool ("Control_L+t", "Page_Down",
"Return"), and reduced to one canonical name per key (:data:`KEYS`), so a backend translates
one vocabulary.

Backend-neutral: no gRPC, no generated code (the actions arrive as the protobuf messages, read
by their fields only).
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from libdsec.errors import InvalidArgument

#: A single Click: 1 click, 2 a double click, 3 a triple click (count 0 means 1).
MAX_CLICK_COUNT = 3
#: Wheel notches of one Scroll, each way.
MAX_SCROLL_NOTCHES = 100
#: Characters of one Type.
MAX_TYPE_CHARS = 4096
#: What a Type may hold: printable ASCII, newline and tab (the US keyboard types them all).
TYPEABLE = frozenset(string.printable) - frozenset("\r\x0b\x0c")

#: MouseButton (dsec.types.v1) by number.
BUTTONS = ("left", "middle", "right")

# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Move:
    x: int
    y: int


@dataclass(frozen=True, slots=True)
class Click:
    """At (x, y), or where the pointer is when both are None."""

    x: int | None
    y: int | None
    button: str = "left"
    count: int = 1


@dataclass(frozen=True, slots=True)
class Scroll:
    """Wheel notches: dy > 0 down, dx > 0 right; at (x, y) or where the pointer is."""

    x: int | None
    y: int | None
    dy: int
    dx: int = 0


@dataclass(frozen=True, slots=True)
class Drag:
    from_x: int
    from_y: int
    to_x: int
    to_y: int
    button: str = "left"


@dataclass(frozen=True, slots=True)
class Button:
    """A press (down) or a release alone."""

    button: str
    down: bool


@dataclass(frozen=True, slots=True)
class Type:
    """Text typed character by character (only :data:`TYPEABLE` characters)."""

    text: str


@dataclass(frozen=True, slots=True)
class Press:
    """A chord, keys by canonical name (:data:`KEYS`), pressed in order, released in reverse."""

    keys: tuple[str, ...]


Action = Move | Click | Scroll | Drag | Button | Type | Press

# ------------------------------------------------------------------------------- keys

_NAMED = {
    "enter": "enter",
    "return": "enter",
    "tab": "tab",
    "esc": "escape",
    "escape": "escape",
    "backspace": "backspace",
    "delete": "delete",
    "del": "delete",
    "insert": "insert",
    "home": "home",
    "end": "end",
    "page_up": "page_up",
    "pageup": "page_up",
    "prior": "page_up",  # X keysym
    "page_down": "page_down",
    "pagedown": "page_down",
    "next": "page_down",  # X keysym
    "up": "up",
    "down": "down",
    "left": "left",
    "right": "right",
    "space": "space",
    "ctrl": "ctrl",
    "control": "ctrl",
    "ctrl_left": "ctrl",
    "control_left": "ctrl",
    "control_l": "ctrl",
    "ctrl_right": "ctrl_right",
    "control_right": "ctrl_right",
    "control_r": "ctrl_right",
    "shift": "shift",
    "shift_left": "shift",
    "shift_l": "shift",
    "shift_right": "shift_right",
    "shift_r": "shift_right",
    "alt": "alt",
    "alt_left": "alt",
    "alt_l": "alt",
    "alt_right": "alt_right",
    "alt_r": "alt_right",
    "altgr": "alt_right",
    "iso_level3_shift": "alt_right",
    "meta": "meta",
    "meta_left": "meta",
    "meta_l": "meta",
    "super": "meta",
    "super_left": "meta",
    "super_l": "meta",
    "win": "meta",
    "windows": "meta",
    "cmd": "meta",
    "command": "meta",
    "meta_right": "meta_right",
    "meta_r": "meta_right",
    "super_right": "meta_right",
    "super_r": "meta_right",
    "menu": "menu",
    "caps_lock": "caps_lock",
    "num_lock": "num_lock",
    "scroll_lock": "scroll_lock",
    "print": "print",
    "pause": "pause",
    "break": "pause",
    **{f"f{i}": f"f{i}" for i in range(1, 13)},
}

#: X keysym names of the punctuation characters (xdotool's spelling), lower case.
_KEYSYM_CHARS = {
    "minus": "-",
    "equal": "=",
    "bracketleft": "[",
    "bracketright": "]",
    "semicolon": ";",
    "apostrophe": "'",
    "grave": "`",
    "backslash": "\\",
    "comma": ",",
    "period": ".",
    "slash": "/",
    "exclam": "!",
    "at": "@",
    "numbersign": "#",
    "dollar": "$",
    "percent": "%",
    "asciicircum": "^",
    "ampersand": "&",
    "asterisk": "*",
    "parenleft": "(",
    "parenright": ")",
    "underscore": "_",
    "plus": "+",
    "braceleft": "{",
    "braceright": "}",
    "colon": ":",
    "quotedbl": '"',
    "asciitilde": "~",
    "bar": "|",
    "less": "<",
    "greater": ">",
    "question": "?",
}

#: Every key a Press may name, canonical: a character key is its (lower-case) character.
KEYS = frozenset(_NAMED.values()) | frozenset(
    c for c in string.printable if c.isprintable() and c != " " and not c.isupper()
)


def key_name(name: str) -> str | None:
    """The canonical name (:data:`KEYS`) of a key as a caller spells it, or None."""
    if len(name) == 1:
        c = name.lower()
        return c if c in KEYS else None
    lower = name.lower()
    return _NAMED.get(lower) or _KEYSYM_CHARS.get(lower)


def parse_keys(keys: str) -> tuple[str, ...]:
    """A chord ("ctrl+shift+t", "Control_L+Return", "ctrl++") as canonical key names."""
    if keys.endswith("++"):
        parts = [*keys[:-2].split("+"), "+"] if len(keys) > 2 else ["+", "+"]
    elif keys == "+":
        parts = ["+"]
    else:
        parts = keys.split("+")
    out = []
    for part in parts:
        name = key_name(part.strip()) if part.strip() else None
        if name is None:
            raise InvalidArgument(
                f"unknown key {part!r} in {keys!r} (names: a letter, digit or punctuation "
                "character, f1..f12, enter, tab, escape, backspace, delete, insert, home, end, "
                "page_up, page_down, up, down, left, right, space, ctrl, shift, alt, meta, menu, "
                "caps_lock, num_lock, scroll_lock, print, pause; or an X keysym name)",
                reason="UNKNOWN_KEY",
                metadata={"field": "keys", "key": part},
            )
        out.append(name)
    return tuple(out)


# ------------------------------------------------------------------------------ checks


def _coordinate(field: str, value: int, size: tuple[int, int], where: str) -> int:
    limit = size[0] if field.endswith("x") else size[1]
    if value >= limit:
        raise InvalidArgument(
            f"{where}: {field}={value} is off the screen ({size[0]}x{size[1]}: "
            f"{field} must be below {limit})",
            reason="OFF_SCREEN",
            metadata={"field": field, "value": str(value), "screen": f"{size[0]}x{size[1]}"},
        )
    return value


def _point(msg: Any, size: tuple[int, int], where: str) -> tuple[int | None, int | None]:
    """An optional (x, y) of a click or scroll: both or neither."""
    has_x, has_y = msg.HasField("x"), msg.HasField("y")
    if has_x != has_y:
        missing = "y" if has_x else "x"
        raise InvalidArgument(
            f"{where}: give both x and y, or neither (where the pointer is); {missing} is missing",
            reason="INCOMPLETE_POINT",
            metadata={"field": missing},
        )
    if not has_x:
        return None, None
    return _coordinate("x", msg.x, size, where), _coordinate("y", msg.y, size, where)


def _button(value: int, where: str) -> str:
    if not 0 <= value < len(BUTTONS):
        raise InvalidArgument(
            f"{where}: unknown mouse button {value}",
            reason="UNKNOWN_BUTTON",
            metadata={"field": "button"},
        )
    return BUTTONS[value]


def _notches(field: str, value: int, where: str) -> int:
    if abs(value) > MAX_SCROLL_NOTCHES:
        raise InvalidArgument(
            f"{where}: {field}={value} wheel notches; at most {MAX_SCROLL_NOTCHES} each way",
            reason="SCROLL_TOO_FAR",
            metadata={"field": field},
        )
    return value


def check_text(text: str, where: str = "type") -> str:
    if len(text) > MAX_TYPE_CHARS:
        raise InvalidArgument(
            f"{where}: {len(text)} characters; at most {MAX_TYPE_CHARS} in one action",
            reason="TEXT_TOO_LONG",
            metadata={"field": "text"},
        )
    for i, c in enumerate(text):
        if c not in TYPEABLE:
            raise InvalidArgument(
                f"{where}: character {c!r} at position {i} cannot be typed (printable ASCII, "
                "newline and tab only)",
                reason="UNTYPEABLE_CHARACTER",
                metadata={"field": "text", "position": str(i)},
            )
    return text


def _one(msg: Any, size: tuple[int, int], where: str) -> Action:
    kind = msg.WhichOneof("action")
    if kind == "move":
        m = msg.move
        return Move(_coordinate("x", m.x, size, where), _coordinate("y", m.y, size, where))
    if kind == "click":
        c = msg.click
        if c.count > MAX_CLICK_COUNT:
            raise InvalidArgument(
                f"{where}: count={c.count}; 0..{MAX_CLICK_COUNT} (0 = 1, 2 = a double click)",
                reason="BAD_CLICK_COUNT",
                metadata={"field": "count"},
            )
        x, y = _point(c, size, where)
        return Click(x, y, _button(c.button, where), c.count or 1)
    if kind == "scroll":
        s = msg.scroll
        dy, dx = _notches("dy", s.dy, where), _notches("dx", s.dx, where)
        x, y = _point(s, size, where)
        return Scroll(x, y, dy, dx)
    if kind == "drag":
        d = msg.drag
        return Drag(
            _coordinate("from_x", d.from_x, size, where),
            _coordinate("from_y", d.from_y, size, where),
            _coordinate("to_x", d.to_x, size, where),
            _coordinate("to_y", d.to_y, size, where),
            _button(d.button, where),
        )
    if kind == "button":
        return Button(_button(msg.button.button, where), msg.button.down)
    if kind == "type":
        return Type(check_text(msg.type.text, where))
    if kind == "press":
        return Press(parse_keys(msg.press.keys))
    raise InvalidArgument(
        f"{where}: no action set (move, click, scroll, drag, button, type or press)",
        reason="EMPTY_ACTION",
        metadata={"field": "action"},
    )


def parse(request_actions: Iterable[Any], size: tuple[int, int]) -> list[Action]:
    """Every action of a DisplayInputRequest (``dsec.types.v1.DisplayAction`` messages),
    checked against the screen's ``size`` (width, height), or InvalidArgument naming the
    first thing wrong and the action's index; nothing is sent before this returns."""
    out = [_one(msg, size, f"action {i}") for i, msg in enumerate(request_actions)]
    if not out:
        raise InvalidArgument(
            "no actions to send", reason="NO_ACTIONS", metadata={"field": "actions"}
        )
    return out

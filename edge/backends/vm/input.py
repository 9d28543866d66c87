"""Display actions (edge/display.py) as QMP ``input-send-event`` commands.

The host delivers input to the guest as real devices would (a USB tablet and a keyboard), so
nothing inside the VM has to cooperate: a :class:`Step` is one ``input-send-event`` command's
``events`` list and the pause to keep after it. One command per state change, because QEMU
syncs the devices once per command: a button's press and release in the same command reach a
USB tablet as no click at all (its report carries only the final state). The pauses
(:data:`KEY_PAUSE_S`) let the guest's X server read each report before the next one, so no
key of a typed text is lost.

Pointer positions are absolute: QEMU's axes run 0..32767 over the screen, so a pixel x is
``round(x * 32767 / (width - 1))``. Keys are QEMU QKeyCode names (qapi/ui.json) for a US
keyboard layout; a character that needs shift gets it pressed around it.

Pure (no QMP connection here): the backend sends the steps and counts their events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from edge.display import Action, Button, Click, Drag, Move, Press, Scroll, Type

#: QEMU's absolute pointer axis range (INPUT_EVENT_ABS_MAX).
ABS_MAX = 32767
#: After each key or button state change: the guest reads one report before the next.
KEY_PAUSE_S = 0.01
#: After each wheel notch. To the USB tablet a notch is motion, not a button: QEMU merges it
#: with the next motion the guest has not read yet, and X then reports the notch where the
#: pointer went next (a drag after a scroll). The guest polls every ~10 ms, slower under TCG on
#: a busy host: a notch waits longer than a key.
WHEEL_PAUSE_S = 0.05
#: Intermediate pointer positions of a drag (applications that watch the motion see it).
DRAG_STEPS = 10

#: Canonical key names (edge.display.KEYS) that are not characters, as QKeyCodes.
NAMED_QCODES = {
    "enter": "ret",
    "tab": "tab",
    "escape": "esc",
    "backspace": "backspace",
    "delete": "delete",
    "insert": "insert",
    "home": "home",
    "end": "end",
    "page_up": "pgup",
    "page_down": "pgdn",
    "up": "up",
    "down": "down",
    "left": "left",
    "right": "right",
    "space": "spc",
    "ctrl": "ctrl",
    "ctrl_right": "ctrl_r",
    "shift": "shift",
    "shift_right": "shift_r",
    "alt": "alt",
    "alt_right": "alt_r",
    "meta": "meta_l",
    "meta_right": "meta_r",
    # The PC keyboard's menu (application) key; QEMU's "menu" is another key (KEY_MENU).
    "menu": "compose",
    "caps_lock": "caps_lock",
    "num_lock": "num_lock",
    "scroll_lock": "scroll_lock",
    "print": "print",
    "pause": "pause",
    **{f"f{i}": f"f{i}" for i in range(1, 13)},
}

#: A US keyboard: each printable character (and newline, tab) as (QKeyCode, with shift).
_UNSHIFTED = {
    "-": "minus",
    "=": "equal",
    "[": "bracket_left",
    "]": "bracket_right",
    ";": "semicolon",
    "'": "apostrophe",
    "`": "grave_accent",
    "\\": "backslash",
    ",": "comma",
    ".": "dot",
    "/": "slash",
    " ": "spc",
    "\n": "ret",
    "\t": "tab",
}
_SHIFTED = {
    "!": "1",
    "@": "2",
    "#": "3",
    "$": "4",
    "%": "5",
    "^": "6",
    "&": "7",
    "*": "8",
    "(": "9",
    ")": "0",
    "_": "minus",
    "+": "equal",
    "{": "bracket_left",
    "}": "bracket_right",
    ":": "semicolon",
    '"': "apostrophe",
    "~": "grave_accent",
    "|": "backslash",
    "<": "comma",
    ">": "dot",
    "?": "slash",
}
CHAR_QCODES: dict[str, tuple[str, bool]] = {
    **{c: (c, False) for c in "abcdefghijklmnopqrstuvwxyz0123456789"},
    **{c: (c.lower(), True) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"},
    **{c: (q, False) for c, q in _UNSHIFTED.items()},
    **{c: (q, True) for c, q in _SHIFTED.items()},
}

#: Wheel buttons of a scroll: (notches > 0, notches < 0) per axis.
_WHEEL = {"dy": ("wheel-down", "wheel-up"), "dx": ("wheel-right", "wheel-left")}


class Step(NamedTuple):
    """One ``input-send-event`` command: its events, and the pause to keep after it."""

    events: list[dict[str, Any]]
    pause_s: float


def _abs(value: int, extent: int) -> int:
    return round(value * ABS_MAX / max(1, extent - 1))


def move_events(x: int, y: int, size: tuple[int, int]) -> list[dict[str, Any]]:
    return [
        {"type": "abs", "data": {"axis": "x", "value": _abs(x, size[0])}},
        {"type": "abs", "data": {"axis": "y", "value": _abs(y, size[1])}},
    ]


def _btn(button: str, down: bool) -> dict[str, Any]:
    return {"type": "btn", "data": {"down": down, "button": button}}


def _key(qcode: str, down: bool) -> dict[str, Any]:
    return {"type": "key", "data": {"down": down, "key": {"type": "qcode", "data": qcode}}}


def _chord(qcodes: Sequence[str]) -> list[Step]:
    """Keys pressed in order (one command), released in reverse (another)."""
    return [
        Step([_key(q, True) for q in qcodes], KEY_PAUSE_S),
        Step([_key(q, False) for q in reversed(qcodes)], KEY_PAUSE_S),
    ]


def key_qcodes(keys: Sequence[str]) -> list[str]:
    """Canonical key names (edge.display.KEYS) as QKeyCodes; a shifted character adds shift
    before it unless the chord holds shift already."""
    out: list[str] = []
    for name in keys:
        named = NAMED_QCODES.get(name)
        if named is not None:
            out.append(named)
            continue
        qcode, shift = CHAR_QCODES[name]
        if shift and "shift" not in out:
            out.append("shift")
        out.append(qcode)
    return out


def _click(button: str, pause_s: float = KEY_PAUSE_S) -> list[Step]:
    return [Step([_btn(button, True)], pause_s), Step([_btn(button, False)], pause_s)]


def _steps(action: Action, size: tuple[int, int]) -> list[Step]:
    if isinstance(action, Move):
        return [Step(move_events(action.x, action.y, size), 0.0)]
    if isinstance(action, Click):
        out = [] if action.x is None else [Step(move_events(action.x, action.y or 0, size), 0.0)]
        for _ in range(action.count):
            out += _click(action.button)
        return out
    if isinstance(action, Scroll):
        out = [] if action.x is None else [Step(move_events(action.x, action.y or 0, size), 0.0)]
        for field, notches in (("dy", action.dy), ("dx", action.dx)):
            button = _WHEEL[field][0 if notches > 0 else 1]
            for _ in range(abs(notches)):
                out += _click(button, WHEEL_PAUSE_S)
        return out
    if isinstance(action, Drag):
        out = [Step(move_events(action.from_x, action.from_y, size), 0.0)]
        out.append(Step([_btn(action.button, True)], KEY_PAUSE_S))
        for i in range(1, DRAG_STEPS):
            x = action.from_x + round((action.to_x - action.from_x) * i / DRAG_STEPS)
            y = action.from_y + round((action.to_y - action.from_y) * i / DRAG_STEPS)
            out.append(Step(move_events(x, y, size), KEY_PAUSE_S))
        out.append(Step(move_events(action.to_x, action.to_y, size), KEY_PAUSE_S))
        out.append(Step([_btn(action.button, False)], KEY_PAUSE_S))
        return out
    if isinstance(action, Button):
        return [Step([_btn(action.button, action.down)], KEY_PAUSE_S)]
    if isinstance(action, Type):
        out = []
        for c in action.text:
            qcode, shift = CHAR_QCODES[c]
            out += _chord(["shift", qcode] if shift else [qcode])
        return out
    if isinstance(action, Press):
        return _chord(key_qcodes(action.keys))
    raise TypeError(f"not a display action: {action!r}")


def to_qmp(actions: Sequence[Action], size: tuple[int, int]) -> list[Step]:
    """The ``input-send-event`` commands for ``actions`` (checked already by
    edge.display.parse against the same ``size``), in order."""
    return [step for action in actions for step in _steps(action, size)]


def event_count(steps: Sequence[Step]) -> int:
    """The input events of ``steps`` (DisplayInputResponse.events)."""
    return sum(len(s.events) for s in steps)

"""Display input: the checks of edge/display.py (everything before anything is sent) and the
QMP events of edge/backends/vm/input.py, exactly."""

from __future__ import annotations

import pytest

from dsec.types.v1 import types_pb2 as t
from edge import display
from edge.backends.vm.input import KEY_PAUSE_S, Step, event_count, to_qmp
from libdsec.errors import InvalidArgument

SIZE = (1024, 768)


def key(qcode: str, down: bool) -> dict[str, object]:
    return {"type": "key", "data": {"down": down, "key": {"type": "qcode", "data": qcode}}}


def btn(button: str, down: bool) -> dict[str, object]:
    return {"type": "btn", "data": {"down": down, "button": button}}


def at(vx: int, vy: int) -> list[dict[str, object]]:
    return [
        {"type": "abs", "data": {"axis": "x", "value": vx}},
        {"type": "abs", "data": {"axis": "y", "value": vy}},
    ]


def parsed(*actions: t.DisplayAction) -> list[display.Action]:
    return display.parse(actions, SIZE)


# ------------------------------------------------------------------ edge/display.py


def test_actions_are_parsed_into_their_dataclasses() -> None:
    out = parsed(
        t.DisplayAction(move=t.PointerMove(x=1, y=2)),
        t.DisplayAction(click=t.PointerClick(x=3, y=4, button=t.MOUSE_BUTTON_RIGHT, count=2)),
        t.DisplayAction(click=t.PointerClick()),
        t.DisplayAction(scroll=t.PointerScroll(dy=-3)),
        t.DisplayAction(drag=t.PointerDrag(from_x=1, from_y=2, to_x=3, to_y=4)),
        t.DisplayAction(button=t.PointerButton(button=t.MOUSE_BUTTON_MIDDLE, down=True)),
        t.DisplayAction(type=t.KeyType(text="Hi!\n")),
        t.DisplayAction(press=t.KeyPress(keys="Control_L+Shift+T")),
    )
    assert out == [
        display.Move(1, 2),
        display.Click(3, 4, "right", 2),
        display.Click(None, None, "left", 1),
        display.Scroll(None, None, -3, 0),
        display.Drag(1, 2, 3, 4, "left"),
        display.Button("middle", True),
        display.Type("Hi!\n"),
        display.Press(("ctrl", "shift", "t")),
    ]


@pytest.mark.parametrize(
    ("action", "field"),
    [
        (t.DisplayAction(move=t.PointerMove(x=1024, y=0)), "x"),
        (t.DisplayAction(move=t.PointerMove(x=0, y=768)), "y"),
        (t.DisplayAction(click=t.PointerClick(x=5, y=9000)), "y"),
        (t.DisplayAction(scroll=t.PointerScroll(x=2000, y=1, dy=1)), "x"),
        (t.DisplayAction(drag=t.PointerDrag(to_x=5000)), "to_x"),
    ],
)
def test_a_coordinate_off_the_screen_is_named(action: t.DisplayAction, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parsed(action)
    assert err.value.reason == "OFF_SCREEN"
    assert err.value.metadata["field"] == field
    assert "1024x768" in str(err.value)


def test_nothing_is_accepted_when_a_later_action_is_bad() -> None:
    good = t.DisplayAction(click=t.PointerClick(x=1, y=1))
    with pytest.raises(InvalidArgument, match="action 1") as err:
        parsed(good, t.DisplayAction(move=t.PointerMove(x=99999, y=0)))
    assert err.value.metadata["field"] == "x"


def test_a_click_with_one_coordinate_is_refused() -> None:
    with pytest.raises(InvalidArgument) as err:
        parsed(t.DisplayAction(click=t.PointerClick(x=5)))
    assert (err.value.reason, err.value.metadata["field"]) == ("INCOMPLETE_POINT", "y")
    with pytest.raises(InvalidArgument) as err:
        parsed(t.DisplayAction(scroll=t.PointerScroll(y=5, dy=1)))
    assert err.value.metadata["field"] == "x"


@pytest.mark.parametrize(
    ("action", "field"),
    [
        (t.DisplayAction(click=t.PointerClick(count=4)), "count"),
        (t.DisplayAction(scroll=t.PointerScroll(dy=101)), "dy"),
        (t.DisplayAction(scroll=t.PointerScroll(dx=-101)), "dx"),
        (t.DisplayAction(type=t.KeyType(text="x" * 4097)), "text"),
        (t.DisplayAction(type=t.KeyType(text="caf\u00e9")), "text"),
        (t.DisplayAction(), "action"),
    ],
)
def test_out_of_range_input_is_refused(action: t.DisplayAction, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parsed(action)
    assert err.value.metadata["field"] == field


def test_an_untypeable_character_is_named_with_its_position() -> None:
    with pytest.raises(InvalidArgument, match="'\\\\r' at position 2") as err:
        parsed(t.DisplayAction(type=t.KeyType(text="ab\rc")))
    assert (err.value.reason, err.value.metadata["position"]) == ("UNTYPEABLE_CHARACTER", "2")


@pytest.mark.parametrize("keys", ["ctrl+banana", "hyper", "ctrl+", "", "ctrl+é"])
def test_an_unknown_key_is_named(keys: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parsed(t.DisplayAction(press=t.KeyPress(keys=keys)))
    assert err.value.reason == "UNKNOWN_KEY"
    assert err.value.metadata["field"] == "keys"
    if keys == "ctrl+banana":
        assert err.value.metadata["key"] == "banana"
        assert "'banana'" in str(err.value)


@pytest.mark.parametrize(
    ("keys", "canonical"),
    [
        ("ctrl+shift+t", ("ctrl", "shift", "t")),
        ("CTRL+L", ("ctrl", "l")),
        ("alt+f4", ("alt", "f4")),
        ("Return", ("enter",)),
        ("BackSpace", ("backspace",)),
        ("Page_Up", ("page_up",)),
        ("pagedown", ("page_down",)),
        ("Super_L", ("meta",)),
        ("cmd+space", ("meta", "space")),
        ("Control_R+Alt_R+Delete", ("ctrl_right", "alt_right", "delete")),
        ("esc", ("escape",)),
        ("del", ("delete",)),
        ("break", ("pause",)),
        ("ctrl++", ("ctrl", "+")),
        ("+", ("+",)),
        ("ctrl+minus", ("ctrl", "-")),
        ("shift+/", ("shift", "/")),
    ],
)
def test_key_names_in_our_spelling_and_as_x_keysyms(keys: str, canonical: tuple[str, ...]) -> None:
    assert display.parse_keys(keys) == canonical


# --------------------------------------------------------- edge/backends/vm/input.py


def test_a_click_at_a_point_moves_then_presses_and_releases_in_two_commands() -> None:
    steps = to_qmp(parsed(t.DisplayAction(click=t.PointerClick(x=1023, y=384))), SIZE)
    assert steps == [
        Step(at(32767, round(384 * 32767 / 767)), 0.0),
        Step([btn("left", True)], KEY_PAUSE_S),
        Step([btn("left", False)], KEY_PAUSE_S),
    ]
    assert event_count(steps) == 4


def test_a_double_right_click_where_the_pointer_is() -> None:
    action = t.DisplayAction(click=t.PointerClick(button=t.MOUSE_BUTTON_RIGHT, count=2))
    assert [s.events for s in to_qmp(parsed(action), SIZE)] == [
        [btn("right", True)],
        [btn("right", False)],
        [btn("right", True)],
        [btn("right", False)],
    ]


def test_a_chord_is_pressed_in_order_and_released_in_reverse() -> None:
    steps = to_qmp(parsed(t.DisplayAction(press=t.KeyPress(keys="ctrl+shift+t"))), SIZE)
    assert steps == [
        Step([key("ctrl", True), key("shift", True), key("t", True)], KEY_PAUSE_S),
        Step([key("t", False), key("shift", False), key("ctrl", False)], KEY_PAUSE_S),
    ]


def test_typed_text_presses_shift_where_the_us_layout_needs_it() -> None:
    steps = to_qmp(parsed(t.DisplayAction(type=t.KeyType(text="aB!\n"))), SIZE)
    assert [s.events for s in steps] == [
        [key("a", True)],
        [key("a", False)],
        [key("shift", True), key("b", True)],
        [key("b", False), key("shift", False)],
        [key("shift", True), key("1", True)],
        [key("1", False), key("shift", False)],
        [key("ret", True)],
        [key("ret", False)],
    ]
    assert all(s.pause_s == KEY_PAUSE_S for s in steps)


def test_every_typeable_character_has_a_key() -> None:
    text = "".join(sorted(display.TYPEABLE))
    steps = to_qmp(parsed(t.DisplayAction(type=t.KeyType(text=text))), SIZE)
    assert len(steps) == 2 * len(text)


def test_a_pressed_shifted_character_gets_shift_once() -> None:
    steps = to_qmp(parsed(t.DisplayAction(press=t.KeyPress(keys="ctrl+shift+?"))), SIZE)
    assert steps[0].events == [key("ctrl", True), key("shift", True), key("slash", True)]
    steps = to_qmp(parsed(t.DisplayAction(press=t.KeyPress(keys="ctrl+?"))), SIZE)
    assert steps[0].events == [key("ctrl", True), key("shift", True), key("slash", True)]


def test_scroll_sends_one_wheel_click_per_notch() -> None:
    action = t.DisplayAction(scroll=t.PointerScroll(x=0, y=0, dy=-2, dx=1))
    assert [s.events for s in to_qmp(parsed(action), SIZE)] == [
        at(0, 0),
        [btn("wheel-up", True)],
        [btn("wheel-up", False)],
        [btn("wheel-up", True)],
        [btn("wheel-up", False)],
        [btn("wheel-right", True)],
        [btn("wheel-right", False)],
    ]


def test_a_drag_moves_presses_moves_through_and_releases() -> None:
    action = t.DisplayAction(drag=t.PointerDrag(from_x=0, from_y=0, to_x=1023, to_y=767))
    steps = to_qmp(parsed(action), SIZE)
    assert steps[0].events == at(0, 0)
    assert steps[1].events == [btn("left", True)]
    assert steps[-2].events == at(32767, 32767)
    assert steps[-1].events == [btn("left", False)]
    xs = [s.events[0]["data"]["value"] for s in steps[2:-1]]
    assert xs == sorted(xs) and len(set(xs)) == len(xs) >= 5

"""Computer use on a real desktop VM: screenshots taken by the host, pointer and keys delivered
by the host as USB tablet and keyboard events (nothing inside the guest helps), the errors of
bad input, a display call on a sandbox without a display, and pause/resume with the desktop
intact. One desktop VM (tests/vm/conftest.py, desktop_sandbox) serves the module; each test
leaves it as it found it."""

from __future__ import annotations

import io
import re
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageChops

from dsecctl.cluster import LocalCluster
from libdsec import Client, Sandbox
from libdsec.errors import BackendCapabilityMissing, InvalidArgument
from tests.helpers import wait_for
from tests.integration.test_cli import cli_env, dsec
from tests.vm.conftest import VM_SHAPE

USER = {"user": "user"}  # the desktop session's user; DISPLAY=:0 is in every command's env


def image(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB")


def changed(before: bytes, after: bytes, box: tuple[int, int, int, int]) -> int:
    """Pixels that differ between two screenshots inside `box` (left, top, right, bottom)."""
    diff = ImageChops.difference(image(before).crop(box), image(after).crop(box))
    return sum(1 for px in diff.get_flattened_data() if px != (0, 0, 0))


def test_a_screenshot_is_the_whole_screen_as_png(desktop_sandbox: Sandbox) -> None:
    png = desktop_sandbox.display.screenshot()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    img = image(png)
    assert img.size == desktop_sandbox.display.size() == (1024, 768)
    colours = img.getcolors(maxcolors=1 << 16)  # None: more than that
    assert colours is None or len(colours) > 64, "the screen is blank: no desktop"


def test_the_pointer_goes_where_the_host_moves_it(desktop_sandbox: Sandbox) -> None:
    for x, y in ((100, 100), (1023, 767), (512, 300)):
        desktop_sandbox.display.move(x, y)
        r = desktop_sandbox.run("xdotool getmouselocation", **USER)
        assert re.search(rf"x:{x} y:{y} ", r.text), r.text


def test_a_click_reaches_a_window_at_its_coordinates(desktop_sandbox: Sandbox) -> None:
    sb = desktop_sandbox
    xev = sb.start(
        "xev -geometry 400x300+200+150 -name dsec-xev -event button > /tmp/xev.log", **USER
    )
    try:
        wait_for(lambda: "dsec-xev" in sb.run("xdotool search --name dsec-xev getwindowname %@",
                                               **USER).text, timeout_s=60)  # fmt: skip
        sb.display.click(300, 250)  # inside the window
        wait_for(lambda: "ButtonRelease" in sb.files.read("/tmp/xev.log").decode(), timeout_s=30)
        log = sb.files.read("/tmp/xev.log").decode()
        press = re.search(
            r"ButtonPress event.*?\((\d+),(\d+)\), root:\((\d+),(\d+)\).*?button (\d)", log, re.S
        )
        assert press, log
        wx, wy, rx, ry, button = map(int, press.groups())
        assert (rx, ry, button) == (300, 250, 1)  # where the host clicked, the left button
        # inside xev's window (where the window manager put it: a title bar shifts it)
        assert 0 <= wx < 400 and 0 <= wy < 300

        # a scroll is wheel buttons 4 (up) / 5 (down); a drag presses at one point and
        # releases at the other (the events after the click's, in order)
        def events() -> list[tuple[str, str, str, str]]:
            return re.findall(
                r"(ButtonPress|ButtonRelease) event.*?root:\((\d+),(\d+)\).*?button (\d)",
                sb.files.read("/tmp/xev.log").decode(errors="replace"),
                re.S,
            )

        seen = len(events())
        sb.display.scroll(2, x=300, y=250)
        sb.display.drag((250, 200), (350, 300))
        wait_for(lambda: len(events()) >= seen + 6, timeout_s=30)
        new = events()[seen:]
        assert [e for e in new if e[3] == "5"] == [
            ("ButtonPress", "300", "250", "5"),
            ("ButtonRelease", "300", "250", "5"),
        ] * 2
        assert [e for e in new if e[3] == "1"] == [
            ("ButtonPress", "250", "200", "1"),
            ("ButtonRelease", "350", "300", "1"),
        ]
    finally:
        xev.kill()


def test_a_right_click_on_the_desktop_opens_its_menu_in_the_next_screenshot(
    desktop_sandbox: Sandbox,
) -> None:
    sb = desktop_sandbox
    before = sb.display.screenshot()
    sb.display.click(700, 400, button="right")
    box = (700, 400, 900, 600)  # the menu opens below and right of the pointer
    wait_for(lambda: changed(before, sb.display.screenshot(), box) > 2000, timeout_s=30)
    sb.display.press("escape")
    wait_for(lambda: changed(before, sb.display.screenshot(), box) < 200, timeout_s=30)


def test_typed_text_and_keys_reach_a_terminal(desktop_sandbox: Sandbox) -> None:
    sb = desktop_sandbox
    sb.run("rm -f /tmp/typed.txt")
    term = sb.start("xfce4-terminal --disable-server --title dsec-term --geometry 80x20+100+100",
                    **USER)  # fmt: skip
    try:
        wait_for(lambda: sb.run("xdotool search --name dsec-term", **USER).exit_code == 0,
                 timeout_s=90)  # fmt: skip
        sb.display.click(300, 200)  # focus it

        def focused() -> bool:
            r = sb.run("xdotool getactivewindow getwindowname", **USER)
            return "dsec-term" in r.text

        wait_for(focused, timeout_s=60)
        sb.display.type("echo 'Hello, VM! #1' > /tmp/typed.txt")
        sb.display.press("enter")
        wait_for(lambda: sb.run("test -s /tmp/typed.txt").exit_code == 0, timeout_s=120)
        assert sb.files.read("/tmp/typed.txt") == b"Hello, VM! #1\n"
        # a chord: ctrl+d ends the shell, and the terminal window with it
        sb.display.press("ctrl+d")
        wait_for(lambda: sb.run("xdotool search --name dsec-term", **USER).exit_code != 0,
                 timeout_s=60)  # fmt: skip
    finally:
        term.kill()


def test_a_click_off_the_screen_names_the_coordinate(desktop_sandbox: Sandbox) -> None:
    with pytest.raises(InvalidArgument) as err:
        desktop_sandbox.display.click(1024, 10)
    assert err.value.metadata.get("field") == "x"
    assert "1024" in err.value.message
    with pytest.raises(InvalidArgument) as err:
        desktop_sandbox.display.move(5, 5000)
    assert err.value.metadata.get("field") == "y"


def test_an_unknown_key_is_named(desktop_sandbox: Sandbox) -> None:
    with pytest.raises(InvalidArgument) as err:
        desktop_sandbox.display.press("ctrl+hyperspace")
    assert "hyperspace" in err.value.message


def test_display_calls_on_a_vm_without_a_display_are_unimplemented(client: Client) -> None:
    sb = client.create(backend="vm", image="bookworm", ttl_s=600, **VM_SHAPE)
    try:
        with pytest.raises(BackendCapabilityMissing) as err:
            sb.display.screenshot()
        assert "display" in err.value.message
    finally:
        sb.stop(grace_s=1)


def test_pause_and_resume_keep_the_desktop(desktop_sandbox: Sandbox) -> None:
    sb = desktop_sandbox
    sleeper = sb.start("sleep 100000", **USER)
    before = image(sb.display.screenshot())
    assert sb.pause().state == "PAUSED"
    after_png = sb.display.screenshot()  # resumes it first
    assert sb.refresh().state == "RUNNING"
    after = image(after_png)
    diff = ImageChops.difference(before, after)
    same = sum(1 for px in diff.resize((64, 48)).get_flattened_data() if px == (0, 0, 0))
    assert same > 64 * 48 * 0.8, "the desktop did not come back as it was"
    assert sb.run(f"kill -0 {sleeper.pid}").exit_code == 0
    sleeper.kill()


def test_the_cli_takes_a_screenshot_and_prints_the_viewer_url(
    desktop_sandbox: Sandbox, vm_cluster: LocalCluster, tmp_path: Path
) -> None:
    env = cli_env(vm_cluster.apiserver, vm_cluster.token, tmp_path)
    shot = tmp_path / "shot.png"
    r = dsec("sandbox", "screenshot", desktop_sandbox.id, "-o", str(shot), env=env, timeout=120)
    assert r.returncode == 0, r
    assert image(shot.read_bytes()).size == (1024, 768)
    r = dsec("sandbox", "view", desktop_sandbox.id, env=env, timeout=120)
    assert r.returncode == 0, r
    url = r.stdout.strip()
    assert f"/view/{desktop_sandbox.id}?token=" in url
    with httpx.Client(timeout=30, follow_redirects=True) as http:
        page = http.get(url)
    assert page.status_code == 200 and "noVNC" in page.text

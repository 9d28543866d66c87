"""The stock e2b-desktop SDK (PyPI, pinned) against a dsec desktop VM through the E2B front end.

The SDK is pointed at dsec by environment variables only (``e2b_desktop_env``, from
tests/vm/conftest.py: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY), as a user's unchanged code
would be. ``Sandbox.create()`` asks for its default template, "desktop", which the front end
maps to the desktop image on the vm backend (DSEC_COMPAT_TEMPLATE_BACKENDS). The SDK then
drives the desktop with commands inside the guest (xdotool, scrot, xrandr, x11vnc, noVNC):
what it needs of dsec is commands, files and HTTP into port 6080.

One desktop for the module (a boot under TCG costs a minute or more), killed by the last test;
the tests run in file order and each builds on the state the previous one left (a text
editor open and focused, then the stream started).

``e2b_desktop_env`` must be module- or session-scoped (the desktop fixture is module-scoped).
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import shlex
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from e2b import CommandExitException
from e2b_desktop import Sandbox as Desktop
from PIL import Image

from libdsec import Client
from libdsec.errors import SandboxNotFound
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(900)

E2B_DESKTOP = "2.7.2"
WIDTH, HEIGHT = 1024, 768
TEXT_FILE = "/home/user/e2b-desktop.txt"


def test_the_sdk_is_the_pinned_release() -> None:
    assert importlib.metadata.version("e2b-desktop") == E2B_DESKTOP
    assert Desktop.default_template == "desktop"


@pytest.fixture(scope="module")
def sdk_env(e2b_desktop_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """The SDK's variables set for the module, then restored."""
    saved = {k: os.environ.get(k) for k in e2b_desktop_env}
    os.environ.update(e2b_desktop_env)
    try:
        yield e2b_desktop_env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def desktop(sdk_env: dict[str, str]) -> Iterator[Desktop]:
    sb = Desktop.create(metadata={"test": "e2b-desktop"}, timeout=1800)
    try:
        yield sb
    finally:
        try:
            sb.kill()  # a no-op answer (404) when test_kill already did
        except Exception:
            pass


def _text_editor(desktop: Desktop) -> str:
    """mousepad on TEXT_FILE as the desktop's user (its own D-Bus session); its window id."""
    desktop.commands.run(f": > {TEXT_FILE} && chown user:user {TEXT_FILE}")
    desktop.commands.run(
        f"dbus-launch --exit-with-session mousepad {shlex.quote(TEXT_FILE)}",
        background=True,
        user="user",
        timeout=0,
    )

    def window() -> str:
        try:
            ids = desktop.get_application_windows("mousepad")
        except CommandExitException:  # xdotool search found none yet
            return ""
        return ids[0] if ids else ""

    return str(wait_for(window, timeout_s=120, interval_s=1))


def _geometry(desktop: Desktop, window_id: str) -> dict[str, int]:
    out = desktop.commands.run(f"xdotool getwindowgeometry --shell {window_id}").stdout
    return {k: int(v) for k, v in (line.split("=", 1) for line in out.split()) if k != "SCREEN"}


def _active_window(desktop: Desktop) -> str:
    return desktop.commands.run("xdotool getactivewindow").stdout.strip()


def _saved_text(desktop: Desktop) -> str:
    return desktop.files.read(TEXT_FILE)


def _save_until(desktop: Desktop, expected: str) -> None:
    """Ctrl+S, until the file holds ``expected`` (three tries of 10 s: under a loaded TCG guest
    a keystroke sent while the editor is still busy can be lost; the typed text cannot)."""
    for _ in range(3):
        desktop.press(["ctrl", "s"])
        try:
            wait_for(lambda: _saved_text(desktop).rstrip("\n") == expected, timeout_s=10)
            return
        except AssertionError:
            continue
    raise AssertionError(f"the saved file holds {_saved_text(desktop)!r}, not {expected!r}")


def test_create_gives_a_desktop_on_a_vm(desktop: Desktop, client: Client) -> None:
    info = client.get(desktop.sandbox_id).info
    assert info.backend.lower() == "vm"
    assert info.image == "desktop"
    assert desktop.get_screen_size() == (WIDTH, HEIGHT)
    # No key autorepeat once the session is up (Xfce's settings daemon would turn it on): a
    # key whose release reaches a slow guest late is still one character.
    assert "auto repeat:  off" in desktop.commands.run("xset q").stdout


def test_screenshot_is_a_png_of_the_screen(desktop: Desktop) -> None:
    png = bytes(desktop.screenshot())
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    assert image.size == (WIDTH, HEIGHT)
    # A desktop, not a blank frame: the Xfce panel and wallpaper have more than one colour.
    colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 1


def test_move_mouse_and_the_cursor_position(desktop: Desktop) -> None:
    desktop.move_mouse(300, 200)
    assert desktop.get_cursor_position() == (300, 200)
    desktop.move_mouse(WIDTH - 1, HEIGHT - 1)
    assert desktop.get_cursor_position() == (WIDTH - 1, HEIGHT - 1)


def test_left_click_focuses_a_window_and_write_types_into_it(desktop: Desktop) -> None:
    window_id = _text_editor(desktop)
    g = _geometry(desktop, window_id)
    # The middle of the editor's window: its text area.
    x, y = g["X"] + g["WIDTH"] // 2, g["Y"] + g["HEIGHT"] // 2
    desktop.move_mouse(x, y)
    desktop.left_click()
    assert desktop.get_cursor_position() == (x, y)
    wait_for(lambda: _active_window(desktop) == window_id, timeout_s=30)

    desktop.write("hello")
    _save_until(desktop, "hello")
    # The title shows the file (no unsaved-changes mark once saved).
    title = desktop.get_window_title(window_id)
    assert "e2b-desktop.txt" in title and not title.startswith("*")


def test_press_enter_then_more_text(desktop: Desktop) -> None:
    desktop.press("enter")
    desktop.write("world")
    _save_until(desktop, "hello\nworld")


def test_the_stream_url_serves_novnc_through_the_front_end(
    desktop: Desktop, sdk_env: dict[str, str]
) -> None:
    desktop.stream.start()
    url = desktop.stream.get_url()
    parts = urlsplit(url)
    # https://6080-<sandboxID>.<domain>/vnc.html?autoconnect=true&resize=scale
    assert parts.netloc.startswith(f"6080-{desktop.sandbox_id}.")
    assert parts.path == "/vnc.html" and "autoconnect=true" in parts.query
    # The front end here is plain HTTP at E2B_API_URL (no TLS, no wildcard DNS): the URL's
    # Host and path are sent to it, with the traffic access token dsec always asks for.
    with httpx.Client(base_url=sdk_env["E2B_API_URL"], timeout=60) as http:

        def get() -> httpx.Response:
            return http.get(
                f"{parts.path}?{parts.query}",
                headers={
                    "Host": parts.netloc,
                    "e2b-traffic-access-token": sdk_env["E2B_API_KEY"],
                },
            )

        page = wait_for(lambda: (r := get()).status_code == 200 and r, timeout_s=60)
        assert "noVNC" in page.text
        assert _x11vnc_running(desktop)

        desktop.stream.stop()
        wait_for(lambda: not _x11vnc_running(desktop), timeout_s=30)
        # noVNC's proxy is gone with it: the port is closed (the front end's 502).
        wait_for(lambda: get().status_code == 502, timeout_s=30)


def _x11vnc_running(desktop: Desktop) -> bool:
    try:
        desktop.commands.run("pgrep -x x11vnc")
    except CommandExitException:  # pgrep: exit 1, none
        return False
    return True


def test_kill_ends_the_vm(desktop: Desktop, client: Client) -> None:
    sandbox_id = desktop.sandbox_id
    desktop.kill()

    def ended() -> bool:
        try:
            return client.get(sandbox_id).info.terminated
        except SandboxNotFound:
            return True

    assert wait_for(ended, timeout_s=120)
    assert not desktop.is_running()

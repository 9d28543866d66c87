"""The live view of a real desktop VM in headless Chromium: the page shows the desktop, and a
click on the page reaches the VM (issue 33, item 3).

Fixtures from tests/vm/conftest.py: ``client`` (the cluster's admin) and ``desktop_sandbox``
(a running sandbox of the vm backend with the ``desktop`` image, its desktop up). The page's URL
is the one GetDisplayInfo answers (``viewer_url``), opened with a token of the sandbox's project.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from PIL import Image, ImageChops

from common.auth import auth_metadata
from dsec.apiserver.v1 import apiserver_pb2_grpc
from dsec.types.v1 import types_pb2
from libdsec import Client, Sandbox

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: A desktop under TCG draws slowly: how long the page may take to show it, and a click to
#: show its effect.
SHOWN_WITHIN_S = 120.0
EFFECT_WITHIN_S = 30.0


@pytest.fixture
def page_url(client: Client, desktop_sandbox: Sandbox) -> Iterator[tuple[str, int, int]]:
    """The viewer page of the sandbox with a fresh token of its project, and the screen size."""
    project = desktop_sandbox.refresh().project_id
    token = client.create_token("viewer-test", project=project)
    with grpc.insecure_channel(client.target) as channel:
        info = apiserver_pb2_grpc.DisplayServiceStub(channel).GetDisplayInfo(
            types_pb2.DisplayInfoRequest(sandbox_id=desktop_sandbox.id),
            metadata=auth_metadata(token.secret),
            timeout=30,
        )
    assert info.viewer_url.endswith(f"/view/{desktop_sandbox.id}")
    try:
        yield f"{info.viewer_url}?token={token.secret}", info.width, info.height
    finally:
        client.revoke_token(token.info.token_id)


def uniform(png: bytes) -> bool:
    """Every pixel the same (a blank or not yet drawn screen)."""
    return Image.open(io.BytesIO(png)).convert("RGB").getcolors(maxcolors=1) is not None


def changed_near(before: bytes, after: bytes, x: int, y: int, reach: int = 300) -> bool:
    """Some pixel within ``reach`` right of and below (x, y) differs (a menu opens there)."""
    a = Image.open(io.BytesIO(before)).convert("RGB")
    b = Image.open(io.BytesIO(after)).convert("RGB")
    box = (max(0, x - 10), max(0, y - 10), min(a.width, x + reach), min(a.height, y + reach))
    return ImageChops.difference(a.crop(box), b.crop(box)).getbbox() is not None


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (scripts/setup.sh)")
def test_page_shows_the_desktop_and_a_click_reaches_the_vm(
    desktop_sandbox: Sandbox, page_url: tuple[str, int, int]
) -> None:
    from playwright.sync_api import sync_playwright

    url, width, height = page_url
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            canvas = page.locator("#noVNC_container canvas")
            canvas.wait_for(state="visible", timeout=SHOWN_WITHIN_S * 1000)
            deadline = time.monotonic() + SHOWN_WITHIN_S
            while uniform(canvas.screenshot()):
                assert time.monotonic() < deadline, "the page never showed the desktop"
                time.sleep(1.0)

            # A right click on the empty desktop, at its centre, opens Xfce's desktop menu
            # there: seen by the host's screenshot, not by the page.
            before = desktop_sandbox.display.screenshot()
            box = canvas.bounding_box()
            assert box is not None
            page.mouse.click(
                box["x"] + box["width"] / 2, box["y"] + box["height"] / 2, button="right"
            )
            deadline = time.monotonic() + EFFECT_WITHIN_S
            while not changed_near(
                before, desktop_sandbox.display.screenshot(), width // 2, height // 2
            ):
                assert time.monotonic() < deadline, "the click on the page did not reach the VM"
                time.sleep(0.5)
            page.keyboard.press("Escape")  # the menu closes: the desktop as the test found it
        finally:
            browser.close()

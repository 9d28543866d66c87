"""The live view's HTTP side against a real API server (apiserver/viewer.py): the noVNC page
and its assets load, the websocket is refused without the owner's token exactly as a gRPC call
is, and headless Chromium renders noVNC's page pointed at the sandbox's websocket.

The desktop itself (the page shows it, a click on it reaches the VM) needs the vm backend:
tests/vm/test_viewer.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from dsecctl.cluster import LocalCluster
from libdsec import Client, Sandbox
from libdsec.errors import DSecError, SandboxNotFound, Unauthenticated

pytestmark = pytest.mark.images("busybox")

NOVNC = Path("/usr/share/novnc")
CHROMIUM = Path("/usr/bin/chromium")
#: Chromium without a sandbox of its own (root in a container), no GPU, nothing fetched.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def http(container_cluster: LocalCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=container_cluster.viewer_url, timeout=30) as c:
        yield c


@pytest.fixture
def other_token(client: Client, request: pytest.FixtureRequest) -> str:
    """A token of a project that is not the sandbox's (nor its parent)."""
    name = f"viewer{abs(hash(request.node.nodeid)) % 10**8}"
    project = client.create_project(name, exist_ok=True)
    return client.create_token("viewer", project=project.project_id).secret


def ws_url(cluster: LocalCluster, sandbox_id: str, token: str | None) -> str:
    base = cluster.viewer_url.replace("http://", "ws://", 1)
    query = f"?token={token}" if token is not None else ""
    return f"{base}/view/{sandbox_id}/websockify{query}"


async def _refusal(url: str) -> tuple[int, str]:
    """The HTTP status and body a websocket upgrade is refused with."""
    with pytest.raises(InvalidStatus) as info:
        async with connect(url, open_timeout=30):
            pass
    response = info.value.response
    return response.status_code, response.body.decode() if response.body else ""


def test_page_redirects_to_novnc_with_the_websocket_path(
    container_cluster: LocalCluster, http: httpx.Client, sandbox: Sandbox
) -> None:
    token = container_cluster.token
    r = http.get(f"/view/{sandbox.id}", params={"token": token})
    assert r.status_code == 303, r.text
    location = urlsplit(r.headers["location"])
    assert location.path == "novnc/vnc.html"  # relative to /view/<id>
    query = parse_qs(location.query)
    assert query["autoconnect"] == ["1"] and query["resize"] == ["scale"]
    assert query["path"] == [f"view/{sandbox.id}/websockify?token={token}"]
    page = http.get(f"/view/{sandbox.id}", params={"token": token}, follow_redirects=True)
    assert page.status_code == 200
    assert str(page.url).startswith(f"{container_cluster.viewer_url}/view/novnc/vnc.html?")
    assert "noVNC_control_bar" in page.text and "app/ui.js" in page.text


def test_novnc_assets_are_served(http: httpx.Client) -> None:
    for asset, marker in [
        ("app/ui.js", "UI"),
        ("core/rfb.js", "class RFB"),
        ("app/styles/base.css", "noVNC"),
    ]:
        r = http.get(f"/view/novnc/{asset}")
        assert r.status_code == 200, asset
        assert marker in r.text, asset
        assert r.content == (NOVNC / asset).read_bytes()
    assert http.get("/view/novnc/no-such-file.js").status_code == 404


def grpc_refusal(cluster: LocalCluster, sandbox_id: str, token: str) -> DSecError:
    """What the gRPC API answers ``token`` for a GetSandbox of ``sandbox_id``."""
    with Client(cluster.apiserver, token=token) as caller:
        with pytest.raises(DSecError) as info:
            caller.get(sandbox_id)
    return info.value


def test_page_refuses_as_the_grpc_api_does(
    container_cluster: LocalCluster, http: httpx.Client, sandbox: Sandbox, other_token: str
) -> None:
    missing = http.get(f"/view/{sandbox.id}")
    assert missing.status_code == 401 and missing.text.startswith("NO_TOKEN: "), missing.text
    for token, status, error in [
        ("not-a-token", 401, Unauthenticated),
        (other_token, 404, SandboxNotFound),  # another project's sandbox: as a missing one
    ]:
        expected = grpc_refusal(container_cluster, sandbox.id, token)
        assert isinstance(expected, error)
        r = http.get(f"/view/{sandbox.id}", params={"token": token})
        assert r.status_code == status and r.text.startswith(f"{expected.reason}: "), r.text
        assert "location" not in r.headers


def test_websocket_refused_as_the_grpc_api_does(
    container_cluster: LocalCluster, sandbox: Sandbox, other_token: str
) -> None:
    async def refusals() -> list[tuple[int, str]]:
        return [
            await _refusal(ws_url(container_cluster, sandbox.id, None)),
            await _refusal(ws_url(container_cluster, sandbox.id, "not-a-token")),
            await _refusal(ws_url(container_cluster, sandbox.id, other_token)),
        ]

    missing, bad, other = asyncio.run(refusals())
    assert missing[0] == 401 and missing[1].startswith("NO_TOKEN: "), missing[1]
    bad_grpc = grpc_refusal(container_cluster, sandbox.id, "not-a-token")
    assert bad[0] == 401 and bad[1].startswith(f"{bad_grpc.reason}: ")
    other_grpc = grpc_refusal(container_cluster, sandbox.id, other_token)
    assert isinstance(other_grpc, SandboxNotFound)
    assert other[0] == 404 and other[1].startswith(f"{other_grpc.reason}: ")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (scripts/setup.sh)")
def test_chromium_renders_novnc_pointed_at_the_sandbox(
    container_cluster: LocalCluster, sandbox: Sandbox
) -> None:
    from playwright.sync_api import sync_playwright

    token = container_cluster.token
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            with page.expect_websocket(timeout=30_000) as opened:
                page.goto(f"{container_cluster.viewer_url}/view/{sandbox.id}?token={token}")
            # noVNC's own UI is on screen, and it dialled this sandbox's websocket.
            assert page.title() == "noVNC"
            page.locator("#noVNC_control_bar").wait_for(state="attached", timeout=30_000)
            socket = opened.value
            assert socket.url == f"{ws_url(container_cluster, sandbox.id, None)}?token={token}"
            # A container has no screen: the API server closes the websocket with the error's
            # code and reason (4501: UNIMPLEMENTED), which noVNC reports and shows as an error.
            page.locator("#noVNC_status.noVNC_status_error").wait_for(
                state="visible", timeout=30_000
            )
            assert any("(code: 4501, reason: " in e for e in errors), errors
        finally:
            browser.close()

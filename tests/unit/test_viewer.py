"""The live view's pieces without a cluster (apiserver/viewer.py): its configuration, the URL
DisplayInfo carries, close reasons, and the 503 naming noVNC when it is not installed.

Its HTTP side against a real API server: tests/integration/test_viewer.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from apiserver.config import ApiServerConfig
from apiserver.viewer import MAX_CLOSE_REASON_BYTES, Viewer, close_reason, viewer_url
from common.config import ConfigError, load
from libdsec.errors import BackendCapabilityMissing, SandboxNotFound


def test_viewer_url_is_the_page_without_a_token() -> None:
    assert (
        viewer_url(ApiServerConfig(), "sb-e0-abcdef") == "http://127.0.0.1:7104/view/sb-e0-abcdef"
    )
    behind_proxy = ApiServerConfig(viewer_url="https://dsec.example.com/")
    assert viewer_url(behind_proxy, "sb-e0-abcdef") == "https://dsec.example.com/view/sb-e0-abcdef"
    v6 = ApiServerConfig(viewer_addr="[::1]:8000")
    assert viewer_url(v6, "sb-e0-abcdef") == "http://[::1]:8000/view/sb-e0-abcdef"
    assert viewer_url(ApiServerConfig(viewer_addr="off"), "sb-e0-abcdef") == ""


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"DSEC_APISERVER_VIEWER_ADDR": "7104"}, "DSEC_APISERVER_VIEWER_ADDR"),
        ({"DSEC_APISERVER_VIEWER_ADDR": "127.0.0.1:http"}, "DSEC_APISERVER_VIEWER_ADDR"),
        ({"DSEC_APISERVER_VIEWER_URL": "dsec.example.com"}, "DSEC_APISERVER_VIEWER_URL"),
    ],
)
def test_bad_viewer_settings_name_their_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        load(ApiServerConfig, "APISERVER", env)


def test_viewer_off_and_novnc_dir_are_read() -> None:
    cfg = load(
        ApiServerConfig,
        "APISERVER",
        {"DSEC_APISERVER_VIEWER_ADDR": "off", "DSEC_APISERVER_NOVNC_DIR": "/opt/novnc"},
    )
    assert cfg.viewer_addr == "off" and cfg.novnc_dir == Path("/opt/novnc")


def test_close_reason_names_the_reason_and_fits_a_close_frame() -> None:
    err = BackendCapabilityMissing("sandbox sb-e0-abc has no display (backend container)")
    assert (
        close_reason(err)
        == "BACKEND_CAPABILITY: sandbox sb-e0-abc has no display (backend container)"
    )
    long = close_reason(SandboxNotFound("é" * 200))
    assert long.startswith("SANDBOX_NOT_FOUND: é") and long.endswith("...")
    assert len(long.encode()) <= MAX_CLOSE_REASON_BYTES


def test_missing_novnc_answers_503_naming_the_package(tmp_path: Path) -> None:
    """Fails closed: the page and every asset answer 503 naming the Debian package; no token is
    looked at (so no gateway is needed to answer)."""
    viewer = Viewer(ApiServerConfig(novnc_dir=tmp_path / "none"), gw=None)  # type: ignore[arg-type]

    async def get(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=viewer.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://viewer") as c:
            return await c.get(path)

    for path in ("/view/sb-e0-abcdef?token=t", "/view/novnc/vnc.html", "/view/novnc/app/ui.js"):
        r = asyncio.run(get(path))
        assert r.status_code == 503, path
        assert "'novnc'" in r.text and str(tmp_path / "none" / "vnc.html") in r.text

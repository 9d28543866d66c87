"""E2B templates that choose a backend (compat/e2b/mapping.py, DSEC_COMPAT_TEMPLATE_BACKENDS):
e2b-desktop's default template "desktop" asks for dsec's desktop image on the vm backend;
on this cluster (container edges only) that create is refused with placement's
BACKEND_NOT_OFFERED, which the front end answers 409 naming the template and the vm backend
— through the raw API and through the stock e2b-desktop SDK. Other templates are unchanged
(base: bookworm in a container).

And what e2b-desktop's stream URL needs: it is ``https://{sandbox.get_host(6080)}/vnc.html``,
i.e. ``6080-<sandboxID>.<domain>`` with the domain create returns (DSEC_COMPAT_DOMAIN). The
front end routes that Host into port 6080 of the sandbox when the request carries the traffic
token; here a page served on 6080 inside a container sandbox stands in for noVNC.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from libdsec import Client
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith, container_edge
from tests.integration.e2b_support import E2bTarget, e2b_environment

pytestmark = pytest.mark.images("busybox", "bookworm", "e2b-base")

DOMAIN = "dsec.test"


@pytest.fixture(scope="module")
def target(cluster_with: ClusterWith) -> Iterator[E2bTarget]:
    with cluster_with(
        "e2btpl", edges=[container_edge("e2btpl")], extra_env={"DSEC_COMPAT_DOMAIN": DOMAIN}
    ) as c:
        with Client(c.apiserver, token=c.token) as admin:
            key = admin.create_token("e2b-templates", agent=True).secret
        t = E2bTarget(c, c.compat_url, key)
        with e2b_environment(t):
            yield t


@pytest.fixture(scope="module")
def container_cluster(target: E2bTarget):  # type: ignore[no-untyped-def]
    """(So a failing test prints the services' log tails: see tests/conftest.py.)"""
    return target.cluster


def test_the_desktop_template_asks_for_the_vm_backend(target: E2bTarget) -> None:
    with httpx.Client(base_url=target.url, timeout=60) as http:
        r = http.post(
            "/sandboxes", json={"templateID": "desktop"}, headers={"X-API-Key": target.key}
        )
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["code"] == 409
    assert body["message"].startswith("template 'desktop' runs on dsec's vm backend: ")
    assert "no edge of the cluster offers backend vm" in body["message"]


def test_the_stock_e2b_desktop_sdk_gets_that_refusal(target: E2bTarget) -> None:
    from e2b_desktop import Sandbox as Desktop

    assert importlib.metadata.version("e2b-desktop") == "2.7.2"
    assert Desktop.default_template == "desktop"
    with pytest.raises(SandboxException, match="offers backend vm") as exc:
        Desktop.create()
    assert "409" in str(exc.value)
    with Client(target.cluster.apiserver, token=target.key) as c:
        assert c.list() == []  # nothing was made


def test_other_templates_are_unchanged_and_the_stream_url_reaches_port_6080(
    target: E2bTarget,
) -> None:
    sb = Sandbox.create(template="base", metadata={"test": "templates"})
    try:
        with Client(target.cluster.apiserver, token=target.key) as c:
            info = c.get(sb.sandbox_id).info
        assert (info.backend.lower(), info.image) == ("container", "e2b-base")

        # e2b-desktop's _VNCServer: f"https://{desktop.get_host(6080)}/vnc.html"
        url = f"https://{sb.get_host(6080)}/vnc.html?autoconnect=true&resize=scale"
        parts = urlsplit(url)
        assert parts.netloc == f"6080-{sb.sandbox_id}.{DOMAIN}"
        sb.commands.run(
            "mkdir -p /tmp/novnc && echo '<title>noVNC</title>' > /tmp/novnc/vnc.html"
            " && cd /tmp/novnc && python3 -m http.server 6080",
            background=True,
            timeout=0,
        )
        # The front end speaks plain HTTP here: the URL's path and Host, sent to its address.
        with httpx.Client(base_url=target.url, timeout=60) as http:

            def fetch(**headers: str) -> httpx.Response:
                return http.get(
                    f"{parts.path}?{parts.query}", headers={"Host": parts.netloc, **headers}
                )

            # What a browser opening the URL sends (no token) is refused ...
            assert fetch().status_code == 401
            # ... with the traffic access token (the API key) it is the page inside.
            r = wait_for(
                lambda: (
                    (x := fetch(**{"e2b-traffic-access-token": target.key})).status_code == 200
                    and x
                ),
                timeout_s=30,
            )
        assert "<title>noVNC</title>" in r.text
    finally:
        sb.kill()

"""The E2B front end on the wire: raw HTTP for what the SDK never sends (malformed Connect
messages, missing keys, another project's key, Host-routed traffic), and an older e2b
2.x (the newest that still creates through ``POST /sandboxes``) run from its own venv."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from libdsec import Client
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith
from tests.integration.e2b_support import E2bTarget, e2b_cluster, e2b_environment

pytestmark = pytest.mark.images("busybox", "bookworm")

ROOT = Path(__file__).resolve().parents[2]
OLD_SDK_PYTHON = ROOT / ".venv-e2b-old" / "bin" / "python"
OLD_SDK = "2.50.0"
MISSING = "sb-e2b0-0000000000000000"


@pytest.fixture(scope="module")
def target(cluster_with: ClusterWith) -> Iterator[E2bTarget]:
    with e2b_cluster(cluster_with, "e2bwire") as t, e2b_environment(t):
        yield t


@pytest.fixture(scope="module")
def container_cluster(target: E2bTarget):  # type: ignore[no-untyped-def]
    return target.cluster


@pytest.fixture
def http(target: E2bTarget) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=target.url, timeout=60) as c:
        yield c


@pytest.fixture
def sandbox_id(target: E2bTarget, http: httpx.Client) -> Iterator[str]:
    """A sandbox made through the deprecated v1 create (``POST /sandboxes``)."""
    r = http.post(
        "/sandboxes",
        json={"templateID": "base", "metadata": {"test": "wire"}},
        headers={"X-API-Key": target.key},
    )
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["envdAccessToken"] == target.key == body["trafficAccessToken"]
    assert body["envdVersion"] == "0.6.1"
    yield body["sandboxID"]
    http.delete(f"/sandboxes/{body['sandboxID']}", headers={"X-API-Key": target.key})


def envd_headers(target: E2bTarget, sandbox_id: str) -> dict[str, str]:
    return {
        "E2b-Sandbox-Id": sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": target.key,
    }


def test_a_malformed_connect_message_is_invalid_argument_and_serving_goes_on(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    headers = {**envd_headers(target, sandbox_id), "Content-Type": "application/json"}
    for body in (b"{not json", b'{"path": 42}', b"[1, 2]"):
        r = http.post("/filesystem.Filesystem/Stat", content=body, headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["code"] == "invalid_argument"
    r = http.post(
        "/filesystem.Filesystem/Stat",
        content=b"\xff\xff\xff",
        headers={**headers, "Content-Type": "application/proto"},
    )
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    # the same service, the same connection: still serving
    r = http.post("/filesystem.Filesystem/Stat", content=b'{"path": "/"}', headers=headers)
    assert r.status_code == 200 and r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"


def test_envd_needs_the_access_token(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    headers = envd_headers(target, sandbox_id)
    del headers["X-Access-Token"]
    r = http.post(
        "/process.Process/List",
        content=b"{}",
        headers={**headers, "Content-Type": "application/json"},
    )
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = http.get("/files", params={"path": "/etc/hostname"}, headers=headers)
    assert r.status_code == 401 and r.json()["code"] == 401
    r = http.get(
        "/files", params={"path": "/etc/hostname"}, headers=envd_headers(target, sandbox_id)
    )
    assert r.status_code == 200 and r.content.strip()


def test_another_projects_sandbox_looks_exactly_like_a_missing_one(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    with Client(target.cluster.apiserver, token=target.cluster.token) as admin:
        other = admin.create_project("e2b-other")
        key = admin.create_token("e2b-other", project=other.project_id, agent=True).secret
    mine = http.get(f"/sandboxes/{sandbox_id}", headers={"X-API-Key": key})
    missing = http.get(f"/sandboxes/{MISSING}", headers={"X-API-Key": key})
    assert mine.status_code == missing.status_code == 404
    assert mine.json()["message"].replace(sandbox_id, "X") == missing.json()["message"].replace(
        MISSING, "X"
    )
    assert http.delete(f"/sandboxes/{sandbox_id}", headers={"X-API-Key": key}).status_code == 404
    listed = http.get("/v2/sandboxes", headers={"X-API-Key": key}).json()
    assert sandbox_id not in [s["sandboxID"] for s in listed]
    # envd: the same answer as for a sandbox that does not exist (E2B's proxy: 502)
    h = {**envd_headers(target, sandbox_id), "X-Access-Token": key}
    r1 = http.get("/health", headers=h)
    r2 = http.get("/health", headers={**h, "E2b-Sandbox-Id": MISSING})
    assert r1.status_code == r2.status_code == 502
    # ... and the owner still has it
    assert (
        http.get(f"/sandboxes/{sandbox_id}", headers={"X-API-Key": target.key}).status_code == 200
    )


def test_host_routing_envd_and_a_port_with_the_traffic_token(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    from e2b import Sandbox

    sb = Sandbox.connect(sandbox_id)
    sb.commands.run(
        "cd /tmp && echo served > index.html && python3 -m http.server 8000",
        background=True,
        timeout=0,
    )
    host = f"8000-{sandbox_id}.dsec.test"
    get = lambda **h: http.get("/index.html", headers={"Host": host, **h})  # noqa: E731
    assert get().status_code == 401  # dsec never serves a port without the token
    r = wait_for(
        lambda: (x := get(**{"e2b-traffic-access-token": target.key})).status_code == 200 and x,
        timeout_s=20,
    )
    assert r.text == "served\n"
    r = http.get(
        "/health", headers={"Host": f"49983-{sandbox_id}.dsec.test", "X-Access-Token": target.key}
    )
    assert r.status_code == 204


def test_list_pages_with_next_token_headers(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    key = {"X-API-Key": target.key}
    extra = http.post(
        "/v2/sandboxes", json={"templateID": "base", "metadata": {"test": "wire"}}, headers=key
    )
    assert extra.status_code == 201
    try:
        meta = "test=wire"
        r = http.get("/v2/sandboxes", params={"metadata": meta, "limit": 1}, headers=key)
        assert r.status_code == 200 and len(r.json()) == 1
        assert r.headers["X-Total-Running"] == "2"
        r2 = http.get(
            "/v2/sandboxes",
            params={"metadata": meta, "limit": 1, "nextToken": r.headers["X-Next-Token"]},
            headers=key,
        )
        assert len(r2.json()) == 1 and "X-Next-Token" not in r2.headers
        ids = {r.json()[0]["sandboxID"], r2.json()[0]["sandboxID"]}
        assert ids == {sandbox_id, extra.json()["sandboxID"]}
        bad = http.get("/v2/sandboxes", params={"nextToken": "!!"}, headers=key)
        assert bad.status_code == 400 and "nextToken" in bad.json()["message"]
    finally:
        http.delete(f"/sandboxes/{extra.json()['sandboxID']}", headers=key)


def test_unsupported_e2b_features_say_so(target: E2bTarget, http: httpx.Client) -> None:
    key = {"X-API-Key": target.key}
    r = http.get("/templates", headers=key)
    assert r.status_code == 501 and "not supported by dsec" in r.json()["message"]
    r = http.post("/v2/sandboxes", json={"templateID": "base", "autoPause": True}, headers=key)
    assert r.status_code == 400 and "autoPause" in r.json()["message"]
    r = http.post(
        "/v2/sandboxes", json={"templateID": "base", "metadata": {"x" * 64: "v"}}, headers=key
    )
    assert r.status_code == 400 and "x" * 64 in r.json()["message"]
    r = http.post("/v2/sandboxes", json={"templateID": "nope-template"}, headers=key)
    assert r.status_code == 404 and r.json() == {
        "code": 404,
        "message": "template 'nope-template' not found",
    }


OLD_SCENARIO = textwrap.dedent(
    """
    import inspect, json
    import e2b.sandbox_sync.sandbox_api as api
    from e2b import Sandbox, CommandExitException
    src = inspect.getsource(api)
    assert "post_sandboxes.sync_detailed" in src and "post_v2_sandboxes" not in src
    sb = Sandbox.create(metadata={"sdk": "old"})
    out = {"id": sb.sandbox_id}
    out["run"] = sb.commands.run("echo old-sdk").stdout
    try:
        sb.commands.run("exit 4")
    except CommandExitException as e:
        out["exit"] = e.exit_code
    sb.files.write("/tmp/old.txt", "from 2.x")
    out["read"] = sb.files.read("/tmp/old.txt")
    out["listed"] = sb.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
    out["killed"] = sb.kill()
    print(json.dumps(out))
    """
)


def test_an_older_e2b_2x_that_creates_through_post_sandboxes(target: E2bTarget) -> None:
    # scripts/setup.sh (which `make test` runs first) makes this venv: its absence is a
    # broken setup, not a reason to skip
    assert OLD_SDK_PYTHON.exists(), f"no {OLD_SDK_PYTHON}: run scripts/setup.sh"
    env = {
        "PATH": "/usr/bin:/bin",
        "E2B_API_URL": target.url,
        "E2B_SANDBOX_URL": target.url,
        "E2B_API_KEY": target.key,
    }
    version = subprocess.run(
        [str(OLD_SDK_PYTHON), "-c", "import importlib.metadata as m; print(m.version('e2b'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == OLD_SDK
    r = subprocess.run(
        [str(OLD_SDK_PYTHON), "-c", OLD_SCENARIO],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["run"] == "old-sdk\n" and out["exit"] == 4 and out["read"] == "from 2.x"
    assert out["listed"] and out["killed"]
    assert sys.executable != str(OLD_SDK_PYTHON)


def test_fork_refuses_a_bad_count_and_says_which_kind_of_fork_it_made(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    headers = {"X-API-Key": target.key}
    for body in ({"count": 0}, {"count": 21}, {"count": "2"}, {"count": True}):
        r = http.post(f"/sandboxes/{sandbox_id}/fork", json=body, headers=headers)
        assert r.status_code == 400 and "between 1 and 20" in r.json()["message"], r.text
    r = http.post("/sandboxes/sb-nosuch-00000000/fork", json={}, headers=headers)
    assert r.status_code == 404, r.text
    r = http.post(f"/sandboxes/{sandbox_id}/fork", json={}, headers=headers)  # count: 1
    assert r.status_code == 201, r.text
    assert r.headers["x-dsec-fork-kind"] == "files"  # a container template
    [child] = r.json()
    assert child["sandbox"]["sandboxID"] != sandbox_id
    http.delete(f"/sandboxes/{child['sandbox']['sandboxID']}", headers=headers)


def connect_frames(body: bytes) -> list[tuple[int, dict[str, object]]]:
    """A Connect server stream's envelopes: (flags, JSON message); flag 2 is its end."""
    frames, i = [], 0
    while i + 5 <= len(body):
        flags, size = body[i], int.from_bytes(body[i + 1 : i + 5], "big")
        frames.append((flags, json.loads(body[i + 5 : i + 5 + size] or b"{}")))
        i += 5 + size
    return frames


def test_a_process_cut_by_the_requests_deadline_ends_deadline_exceeded(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    """envd kills a process when the request's Connect-Timeout-Ms passes, and the stream
    ends with that deadline's error, not an end event: a client that does not time out on
    its own (this one) still reads a deadline_exceeded."""
    message = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "echo up; sleep 30"]}})
    headers = {
        **envd_headers(target, sandbox_id),
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
        "Connect-Timeout-Ms": "2000",
    }
    body = b"\0" + len(message).to_bytes(4, "big") + message.encode()
    r = http.post("/process.Process/Start", content=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    frames = connect_frames(r.content)
    events = [m["event"] for flags, m in frames if flags == 0]
    assert "start" in events[0] and not any("end" in e for e in events)  # type: ignore[operator]
    flags, end = frames[-1]
    assert flags == 2 and end["error"]["code"] == "deadline_exceeded", frames  # type: ignore[index]

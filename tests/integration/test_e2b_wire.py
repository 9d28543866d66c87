"""The E2B front end on the wire: raw HTTP for what the SDK never sends (malformed Connect
messages, missing keys, another project's key, Host-routed traffic), and an older e2b
2.x (the newest that still creates through ``POST /sandboxes``) run from its own venv."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from libdsec import Client
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith
from tests.integration.e2b_support import E2bTarget, e2b_cluster, e2b_environment

pytestmark = pytest.mark.images("busybox", "bookworm", "e2b-base")

ROOT = Path(__file__).resolve().parents[2]
OLD_SDK_PYTHON = ROOT / ".venv-e2b-old" / "bin" / "python"
OLD_SDK = "2.50.0"
MISSING = "sb-e2b0-0000000000000000"
#: DSEC_COMPAT_MAX_UPLOAD_BYTES of this module's front end (small: a gzip bomb meets it soon).
UPLOAD_LIMIT = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def target(cluster_with: ClusterWith) -> Iterator[E2bTarget]:
    limit = {"DSEC_COMPAT_MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT)}
    with e2b_cluster(cluster_with, "e2bwire", extra_env=limit) as t, e2b_environment(t):
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
    # the caller's key, for envd bound to this sandbox (as E2B's, each sandbox's differs)
    assert body["trafficAccessToken"] == target.key
    assert body["envdAccessToken"] == f"{target.key}.{body['sandboxID']}"
    assert body["envdVersion"] == "0.6.4"
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


def connect_call(
    http: httpx.Client, target: E2bTarget, sandbox_id: str, method: str, body: dict[str, object]
) -> httpx.Response:
    return http.post(
        f"/filesystem.Filesystem/{method}",
        json=body,
        headers={**envd_headers(target, sandbox_id), "Content-Type": "application/json"},
    )


def test_gzip_uploads_are_stored_decoded(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    from e2b import Sandbox

    sb = Sandbox.connect(sandbox_id)
    text = "gzip through the SDK\n" * 1000
    sb.files.write("/tmp/sdk-gz.txt", text, gzip=True)  # octet-stream, Content-Encoding: gzip
    assert sb.files.read("/tmp/sdk-gz.txt") == text
    # multipart (write_files' form) with the whole body gzipped, by hand: the SDK never does
    boundary = "dsecboundary"
    form = (
        f"--{boundary}\r\n"
        'Content-Disposition: form-data; name="file"; filename="/tmp/mp-a.txt"\r\n'
        "Content-Type: application/octet-stream\r\n\r\nalpha\r\n"
        f"--{boundary}\r\n"
        'Content-Disposition: form-data; name="file"; filename="/tmp/mp-b.txt"\r\n'
        "Content-Type: application/octet-stream\r\n\r\nbeta\r\n"
        f"--{boundary}--\r\n"
    ).encode()
    r = http.post(
        "/files",
        content=gzip.compress(form),
        headers={
            **envd_headers(target, sandbox_id),
            "Content-Type": f"multipart/form-data; boundary={boundary}",
            "Content-Encoding": "gzip",
        },
    )
    assert r.status_code == 200, r.text
    assert [f["path"] for f in r.json()] == ["/tmp/mp-a.txt", "/tmp/mp-b.txt"]
    assert sb.files.read("/tmp/mp-a.txt") == "alpha" and sb.files.read("/tmp/mp-b.txt") == "beta"


def test_a_bad_gzip_upload_is_400_another_coding_415_a_bomb_413_and_none_writes(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    headers = {**envd_headers(target, sandbox_id), "Content-Type": "application/octet-stream"}

    def upload(path: str, body: bytes, encoding: str) -> httpx.Response:
        return http.post(
            "/files",
            params={"path": path},
            content=body,
            headers={**headers, "Content-Encoding": encoding},
        )

    def exists(path: str) -> bool:
        r = http.get("/files", params={"path": path}, headers=envd_headers(target, sandbox_id))
        assert r.status_code in (200, 404), r.text
        return r.status_code == 200

    packed = gzip.compress(b"payload " * 4096)
    r = upload("/tmp/bad-gz.txt", b"plainly not gzip", "gzip")
    assert r.status_code == 400, r.text
    assert r.json()["message"].startswith("request body is not valid gzip (Content-Encoding: gzip)")
    r = upload("/tmp/cut-gz.txt", packed[: len(packed) // 2], "gzip")
    assert r.status_code == 400 and "ends before the end of its gzip data" in r.json()["message"]
    r = upload("/tmp/br.txt", b"\x0b\x02\x80hello\x03", "br")
    assert r.status_code == 415 and "Content-Encoding 'br'" in r.json()["message"], r.text
    # 64 MiB of zeros in ~64 KiB: inflated past the front end's limit, refused there
    deflater = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    bomb = b"".join(deflater.compress(bytes(1 << 20)) for _ in range(64)) + deflater.flush()
    r = upload("/tmp/bomb.txt", bomb, "gzip")
    assert r.status_code == 413, r.text
    assert r.json()["message"] == f"upload (decoded) larger than {UPLOAD_LIMIT} bytes"
    # refused before any decoded byte: the upload never started. (One refused once under way,
    # cut or bomb, is aborted, and what had arrived may stay: see compat/e2b/envd/files.py.)
    for path in ("/tmp/bad-gz.txt", "/tmp/br.txt"):
        assert not exists(path), path
    # the same service goes on serving: a good one lands
    assert upload("/tmp/good-gz.txt", packed, "gzip").status_code == 200
    r = http.get(
        "/files", params={"path": "/tmp/good-gz.txt"}, headers=envd_headers(target, sandbox_id)
    )
    assert r.content == b"payload " * 4096


def test_remove_of_a_missing_path_succeeds_and_other_errors_stay(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    for path in ("/tmp/never-was", "/tmp/no-such-dir/deeper/file"):
        r = connect_call(http, target, sandbox_id, "Remove", {"path": path})
        assert r.status_code == 200 and r.json() == {}, r.text
    # a real remove still removes
    r = http.post(
        "/files",
        params={"path": "/tmp/doomed.txt"},
        content=b"x",
        headers={**envd_headers(target, sandbox_id), "Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    assert (
        connect_call(http, target, sandbox_id, "Remove", {"path": "/tmp/doomed.txt"}).json() == {}
    )
    r = connect_call(http, target, sandbox_id, "Stat", {"path": "/tmp/doomed.txt"})
    assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
    # ... and a sandbox that is not there is still an error, not a silent success
    r = connect_call(http, target, MISSING, "Remove", {"path": "/tmp/never-was"})
    assert r.status_code == 503 and r.json() == {
        "code": "unavailable",
        "message": f"The sandbox {MISSING} was not found",
    }


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


def test_a_sandboxs_envd_token_is_its_own(
    target: E2bTarget, http: httpx.Client, sandbox_id: str
) -> None:
    """envdAccessToken is bound to its sandbox (so signed URLs of two sandboxes differ):
    another sandbox refuses it; the bare key still works everywhere."""
    key = {"X-API-Key": target.key}
    other = http.post("/sandboxes", json={"templateID": "base"}, headers=key).json()
    try:
        mine = f"{target.key}.{sandbox_id}"
        for token, sandbox, status in (
            (mine, sandbox_id, 200),
            (mine, other["sandboxID"], 401),
            (other["envdAccessToken"], other["sandboxID"], 200),
            (target.key, other["sandboxID"], 200),
        ):
            headers = {**envd_headers(target, sandbox), "X-Access-Token": token}
            r = http.get("/files", params={"path": "/etc/hostname"}, headers=headers)
            assert r.status_code == status, (token, sandbox, r.text)
            assert ("another sandbox's" in r.text) == (status == 401)
    finally:
        http.delete(f"/sandboxes/{other['sandboxID']}", headers=key)


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


def test_allow_public_traffic_true_creates_but_ports_still_need_the_token(
    target: E2bTarget, http: httpx.Client
) -> None:
    """What SDKs <= 2.50 send with any ``network=`` option: the sandbox is made, and its
    ports are served only with the traffic access token, as without it."""
    from e2b import Sandbox

    key = {"X-API-Key": target.key}
    r = http.post(
        "/v2/sandboxes",
        json={"templateID": "base", "network": {"allowPublicTraffic": True}},
        headers=key,
    )
    assert r.status_code == 201, r.text
    sandbox_id = r.json()["sandboxID"]
    try:
        sb = Sandbox.connect(sandbox_id)
        sb.commands.run(
            "cd /tmp && echo public > index.html && python3 -m http.server 8001",
            background=True,
            timeout=0,
        )
        host = {"Host": f"8001-{sandbox_id}.dsec.test"}
        token = {"e2b-traffic-access-token": target.key}
        r = wait_for(
            lambda: (
                (x := http.get("/index.html", headers={**host, **token})).status_code == 200 and x
            ),
            timeout_s=20,
        )
        assert r.text == "public\n"
        assert http.get("/index.html", headers=host).status_code == 401
    finally:
        http.delete(f"/sandboxes/{sandbox_id}", headers=key)
    for field, value in (
        ("egressProxy", {"url": "http://proxy:3128"}),
        ("rules", {"pypi.org": [{"transform": {}}]}),
        ("maskRequestHost", "example.com"),
    ):
        r = http.post(
            "/v2/sandboxes",
            json={"templateID": "base", "network": {"allowPublicTraffic": True, field: value}},
            headers=key,
        )
        assert r.status_code == 400 and f"network.{field}" in r.json()["message"], r.text


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
    # A filesystem-only auto-pause is resumed by a connect only: not with autoResume on.
    for body, field in (
        (
            {"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}},
            "autoPauseMemory",
        ),
        ({"autoPause": True, "autoResume": {"enabled": "no"}}, "autoResume"),
        ({"autoPause": "yes"}, "autoPause"),
    ):
        r = http.post("/v2/sandboxes", json={"templateID": "base", **body}, headers=key)
        assert r.status_code == 400 and field in r.json()["message"], r.text
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
    sb = Sandbox.create()
    handle = sb.commands.run("sleep 60", background=True)
    sb.kill()
    try:
        handle.wait()
    except Exception as e:  # a connection dropped mid-stream: the SDK probes /health
        out["wait"] = f"{type(e).__name__}: {e}"
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
    # this SDK reads an UNAVAILABLE end as a timeout; the dropped connection it reads as E2B's
    assert out["wait"].startswith("TimeoutException: ")
    assert "killed or reached its end of life while the request was in flight" in out["wait"]
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

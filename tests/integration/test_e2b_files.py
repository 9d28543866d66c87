"""E2B's newer file features through the stock e2b SDK against dsec: file metadata (xattrs),
watch events with entries, watches with network mounts allowed, the envd version that turns
them on, and signed file URLs."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox
from e2b.sandbox.filesystem.filesystem import FileType, WriteEntry
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
from packaging.version import Version

from libdsec import Client
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith
from tests.integration.e2b_support import E2bTarget, e2b_cluster, e2b_environment, sandbox_maker

pytestmark = pytest.mark.images("busybox", "bookworm", "e2b-base")

ROOT = "root"  # file operations as root under /tmp: independent of the image's /home/user


@pytest.fixture(scope="module")
def target(cluster_with: ClusterWith) -> Iterator[E2bTarget]:
    with e2b_cluster(cluster_with, "e2bfiles") as t, e2b_environment(t):
        yield t


@pytest.fixture(scope="module")
def container_cluster(target: E2bTarget):  # type: ignore[no-untyped-def]
    """(So a failing test prints the services' log tails: see tests/conftest.py.)"""
    return target.cluster


@pytest.fixture(scope="module")
def shared(target: E2bTarget, container_cluster: object) -> Iterator[Sandbox]:
    sb = Sandbox.create(metadata={"test": "e2b-files"}, secure=True)
    yield sb
    sb.kill()


@pytest.fixture
def make(target: E2bTarget, request: pytest.FixtureRequest) -> Iterator[Callable[..., Sandbox]]:
    with sandbox_maker(request) as make:
        yield make


def test_the_envd_version_turns_on_every_file_feature(shared: Sandbox) -> None:
    from e2b.envd import versions

    assert shared._envd_version == Version("0.6.4")
    gates = [v for k, v in vars(versions).items() if k.startswith("ENVD_") and "DEBUG" not in k]
    assert max(gates) <= shared._envd_version


def test_metadata_is_written_read_listed_and_kept_by_a_rename(shared: Sandbox) -> None:
    d = "/tmp/meta"
    for octet in (False, True):
        path = f"{d}/a-{octet}.txt"
        info = shared.files.write(
            path, "x", metadata={"author": "ann"}, user=ROOT, use_octet_stream=octet
        )
        assert info.metadata == {"author": "ann"}
        assert shared.files.get_info(path, user=ROOT).metadata == {"author": "ann"}
    # kept as user.e2b.* extended attributes
    out = shared.commands.run(
        f"python3 -c \"import os; print(os.getxattr('{d}/a-True.txt', 'user.e2b.author'))\"",
        user=ROOT,
    )
    assert out.stdout.strip() == "b'ann'"
    listed = {e.name: e.metadata for e in shared.files.list(d, user=ROOT)}
    assert listed == {"a-False.txt": {"author": "ann"}, "a-True.txt": {"author": "ann"}}
    moved = shared.files.rename(f"{d}/a-True.txt", f"{d}/b.txt", user=ROOT)
    assert moved.metadata == {"author": "ann"}
    infos = shared.files.write_files(
        [WriteEntry(path=f"{d}/m1", data="1"), WriteEntry(path=f"{d}/m2", data="2")],
        metadata={"source": "many"},
        user=ROOT,
    )
    assert [i.metadata for i in infos] == [{"source": "many"}] * 2


def test_a_write_without_metadata_clears_it_and_xattrs_set_inside_show(shared: Sandbox) -> None:
    path = "/tmp/meta-over.txt"
    shared.files.write(path, "1", metadata={"author": "ann"}, user=ROOT)
    assert shared.files.write(path, "2", user=ROOT).metadata is None
    assert shared.files.get_info(path, user=ROOT).metadata is None
    shared.commands.run(
        f"python3 -c \"import os; os.setxattr('{path}', 'user.e2b.set', b'inside')\"", user=ROOT
    )
    assert shared.files.get_info(path, user=ROOT).metadata == {"set": "inside"}


def test_bad_metadata_is_400_and_writes_nothing(shared: Sandbox, target: E2bTarget) -> None:
    # Past the SDK's own check: envd's wire, a value with a byte that is not printable ASCII.
    url = f"{target.url}/files"
    headers: dict[str, str | bytes] = {
        "E2b-Sandbox-Id": shared.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": target.key,
        "X-Metadata-Key": "caf\u00e9".encode(),
        "Content-Type": "application/octet-stream",
    }
    r = httpx.post(
        url, params={"path": "/tmp/bad-meta", "username": ROOT}, headers=headers, content=b"x"
    )
    assert r.status_code == 400, r.text
    assert "invalid metadata" in r.json()["message"]
    assert not shared.files.exists("/tmp/bad-meta", user=ROOT)


def test_dsec_api_writes_and_reads_the_same_metadata(shared: Sandbox, target: E2bTarget) -> None:
    with Client(target.cluster.apiserver, token=target.key) as client:
        sb = client.get(shared.sandbox_id)
        info = sb.files.write("/tmp/dsec-meta.txt", "x", metadata={"from": "dsec"})
        assert info.metadata == {"from": "dsec"}
    assert shared.files.get_info("/tmp/dsec-meta.txt", user=ROOT).metadata == {"from": "dsec"}


def test_watch_events_carry_entries_and_network_mounts_may_be_allowed(shared: Sandbox) -> None:
    d = "/tmp/watched"
    shared.files.make_dir(d, user=ROOT)
    shared.files.write(f"{d}/f.txt", "1", user=ROOT)
    with_entry = shared.files.watch_dir(d, include_entry=True, user=ROOT)
    allowed = shared.files.watch_dir(d, allow_network_mounts=True, user=ROOT)
    shared.files.write(f"{d}/f.txt", "2", metadata={"k": "v"}, user=ROOT)

    def write_of(handle):  # type: ignore[no-untyped-def]
        events = handle.get_new_events()
        return next(
            (e for e in events if e.type == FilesystemEventType.WRITE and e.name == "f.txt"), None
        )

    event = wait_for(lambda: write_of(with_entry), timeout_s=10)
    assert event.entry is not None
    assert (event.entry.name, event.entry.path, event.entry.type) == (
        "f.txt",
        f"{d}/f.txt",
        FileType.FILE,
    )
    assert event.entry.metadata == {"k": "v"}
    plain = wait_for(lambda: write_of(allowed), timeout_s=10)
    assert plain.entry is None
    with_entry.stop()
    allowed.stop()


def test_an_async_watch_stream_carries_entries(target: E2bTarget, shared: Sandbox) -> None:
    async def scenario() -> None:
        sb = await AsyncSandbox.connect(shared.sandbox_id)
        seen = asyncio.Event()
        got: list = []

        def on_event(e) -> None:  # type: ignore[no-untyped-def]
            got.append(e)
            if e.name == "async-w.txt" and e.entry is not None:
                seen.set()

        handle = await sb.files.watch_dir("/tmp", on_event=on_event, include_entry=True, user=ROOT)
        await sb.files.write("/tmp/async-w.txt", "x", user=ROOT)
        await asyncio.wait_for(seen.wait(), 10)
        await handle.stop()
        event = next(e for e in got if e.name == "async-w.txt" and e.entry is not None)
        assert event.entry.path == "/tmp/async-w.txt"

    asyncio.run(scenario())


# --------------------------------------------------------------------- signed URLs


def test_signed_download_and_upload_urls(shared: Sandbox, target: E2bTarget) -> None:
    path = "/tmp/signed.txt"
    shared.files.write(path, "signed content", user=ROOT)
    for expiration in (None, 120):
        url = shared.download_url(path, ROOT, use_signature_expiration=expiration)
        assert "signature=v1_" in url
        with urllib.request.urlopen(url) as resp:  # no token: the signature stands for it
            assert resp.read() == b"signed content"
    up = shared.upload_url("/tmp/uploaded.txt", ROOT, use_signature_expiration=60)
    r = httpx.post(up, files={"file": ("uploaded.txt", b"via url")})
    assert r.status_code == 200, r.text
    assert shared.files.read("/tmp/uploaded.txt", user=ROOT) == "via url"
    # a read signature does not upload
    r = httpx.post(shared.download_url("/tmp/uploaded.txt", ROOT), files={"file": b"no"})
    assert r.status_code == 401 and r.json()["message"] == "invalid signature"


def test_expired_or_wrong_signatures_are_401(shared: Sandbox) -> None:
    url = shared.download_url("/tmp/signed.txt", ROOT, use_signature_expiration=-120)
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(url)
    assert exc.value.code == 401
    assert json.loads(exc.value.read()) == {"code": 401, "message": "signature is already expired"}
    good = shared.download_url("/tmp/signed.txt", ROOT)
    for bad in (
        good.replace("signed.txt", "other.txt"),
        good.replace("signature=v1_", "signature=v1_x"),
    ):
        r = httpx.get(bad)
        assert r.status_code == 401 and r.json()["message"] == "invalid signature"


def test_a_signed_url_names_its_sandbox_whatever_the_address(
    make: Callable[..., Sandbox], target: E2bTarget
) -> None:
    # Each sandbox's envd token differs (the key bound to it), so a signature names its
    # sandbox even at a shared address (E2B_SANDBOX_URL); E2B's host form must agree.
    a, b = make(secure=True), make(secure=True)
    for sb, text in ((a, "A"), (b, "B")):
        sb.files.write("/tmp/same.txt", text, user=ROOT)
    url = a.download_url("/tmp/same.txt", ROOT)
    r = httpx.get(url)
    assert (r.status_code, r.text) == (200, "A")
    query = urllib.parse.urlsplit(url).query
    for sb, want in ((a, (200, "A")), (b, (401, None))):
        r = httpx.get(
            f"{target.url}/files?{query}", headers={"Host": f"49983-{sb.sandbox_id}.localhost"}
        )
        assert r.status_code == want[0]
        if want[1] is not None:
            assert r.text == want[1]
        else:
            assert "invalid signature" in r.text

"""The E2B front end's pure parts: routing, the model mapping, stateless list pages, keepalives."""

from __future__ import annotations

import asyncio
import base64
import gzip
import os
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime, timedelta
from typing import cast

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from common.config import ConfigError, load
from compat.config import CompatConfig
from compat.e2b import mapping
from compat.e2b.envd.call import CALL, EnvdCall, mapped
from compat.e2b.envd.filesystem import entry
from compat.e2b.envd.gen.filesystem import filesystem_pb as envd_fs
from compat.e2b.envd.process import end_event, ended
from compat.e2b.envd.streams import KEEPALIVE, with_keepalives
from compat.e2b.http import HttpError, Request, bounded, decoded
from compat.e2b.routing import access_token, api_key, envd_user, route
from compat.http import DECODED_PIECE_BYTES
from dsec.types.v1 import types_pb2
from libdsec import AsyncClient, ExitStatus, FileInfo, SandboxInfo
from libdsec.errors import SandboxTerminated, Unavailable

CONFIG = CompatConfig()


def request(headers: dict[str, str], path: str = "/", query: str = "") -> Request:
    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    return Request(scope, receive)


def info(sid: str, created: datetime, state: str = "RUNNING", **labels: str) -> SandboxInfo:
    return SandboxInfo(
        id=sid,
        project_id="root",
        state=state,
        backend="container",
        image="bookworm",
        edge_id="e0",
        labels=dict(labels),
        task_id="",
        created_at=created,
        expires_at=created + timedelta(seconds=300),
        termination_reason=None,
        termination_message="",
        violations={},
        memory=None,
    )


def test_routing_by_headers_and_by_host() -> None:
    assert route(request({})).kind == "control"
    r = route(request({"E2b-Sandbox-Id": "sb-e0-abcdef12", "E2b-Sandbox-Port": "49983"}))
    assert (r.kind, r.sandbox_id) == ("envd", "sb-e0-abcdef12")
    assert (
        route(request({"E2b-Sandbox-Id": "sb-e0-abcdef12", "E2b-Sandbox-Port": "8000"})).port
        == 8000
    )
    r = route(request({"Host": "8000-sb-e0-abcdef12.sandboxes.example"}))
    assert (r.kind, r.sandbox_id, r.port) == ("port", "sb-e0-abcdef12", 8000)
    assert route(request({"Host": "49983-sb-e0-abcdef12.x"})).kind == "envd"
    assert route(request({"Host": "127.0.0.1:7130"})).kind == "control"


def test_entries_follow_envds_rules_for_symlinks_owners_and_modes() -> None:
    """envd's GetEntryInfo (e2b-dev/infra packages/shared/pkg/filesystem/entry.go): a link's
    own size, owner and Go permission string, its target's type and mode, and the resolved
    target path; a link that does not resolve has no type, mode 0 and itself as target."""
    T = types_pb2
    target = T.FileInfo(path="/srv/real", type=T.FILE_TYPE_DIRECTORY, mode=0o1750, owner="root")
    link = FileInfo.from_pb(
        T.FileInfo(
            path="/home/user/ln",
            type=T.FILE_TYPE_SYMLINK,
            size_bytes=9,
            mode=0o777,
            symlink_target="../../srv/real",
            uid=1000,
            gid=1000,
            owner="user",
            group="user",
            target=target,
        )
    )
    assert (link.uid, link.owner, link.target and link.target.path) == (1000, "user", "/srv/real")
    e = entry(link)
    assert (e.name, e.path, e.size, e.owner, e.group) == ("ln", "/home/user/ln", 9, "user", "user")
    assert (e.type, e.mode, e.permissions) == (envd_fs.FileType.DIRECTORY, 0o750, "Lrwxrwxrwx")
    assert e.symlink_target == "/srv/real"

    dangling = FileInfo.from_pb(
        T.FileInfo(path="/tmp/d", type=T.FILE_TYPE_SYMLINK, mode=0o777, symlink_target="x")
    )
    e = entry(dangling)
    assert (e.type, e.mode, e.symlink_target) == (envd_fs.FileType.UNSPECIFIED, 0, "/tmp/d")

    perms = {
        (T.FILE_TYPE_DIRECTORY, 0o1777): "dtrwxrwxrwx",  # /tmp
        (T.FILE_TYPE_REGULAR, 0o4755): "urwxr-xr-x",  # a setuid program
        (T.FILE_TYPE_DIRECTORY, 0o2750): "dgrwxr-x---",
        (T.FILE_TYPE_REGULAR, 0o640): "-rw-r-----",
    }
    for (kind, mode), want in perms.items():
        e = entry(FileInfo.from_pb(T.FileInfo(path="/f", type=kind, mode=mode, owner="1234")))
        assert (e.permissions, e.mode, e.owner) == (want, mode & 0o777, "1234")
        assert not e.has_field("symlink_target")


def test_keys_and_the_envd_user() -> None:
    assert api_key(request({"X-API-Key": " k1 "})) == "k1"
    assert api_key(request({"Authorization": "Bearer k2"})) == "k2"
    assert api_key(request({})) == ""
    assert access_token(request({"X-Access-Token": "k3"})) == "k3"
    basic = base64.b64encode(b"user:").decode()
    assert envd_user(request({"Authorization": f"Basic {basic}"})) == "user"
    assert envd_user(request({"Authorization": "Basic !!"})) == ""


def test_metadata_becomes_labels_and_bad_keys_are_named() -> None:
    assert mapping.labels_for({"a": "1"}) == {"a": "1"}
    for bad, word in (
        ({"k" * 64: "v"}, "k" * 64),
        ({"e2b.template": "x"}, "reserved"),
        ({"a": 1}, "strings"),
    ):
        with pytest.raises(HttpError) as exc:
            mapping.labels_for(bad)
        assert exc.value.status == 400 and word in exc.value.message
    listed = mapping.listed_json(
        info("sb-e0-1", datetime.now(UTC), **{"a": "1", "e2b.template": "base"})
    )
    assert listed["metadata"] == {"a": "1"} and listed["templateID"] == "base"


def test_templates_timeouts_and_network() -> None:
    assert mapping.target_for("base", CONFIG) == mapping.TemplateTarget("e2b-base", "")
    # E2B's user model for its base template; dsec's own images have root only
    assert (CONFIG.user_for("base"), CONFIG.user_for("bookworm")) == ("user", "root")
    assert mapping.target_for("docker/python:3.11", CONFIG) == mapping.TemplateTarget(
        "docker/python:3.11", ""
    )
    # e2b-desktop's default template: dsec's desktop image on a full VM
    assert mapping.target_for("desktop", CONFIG) == mapping.TemplateTarget("desktop", "vm")
    assert (
        mapping.timeout_for({}, CONFIG) == 300
        and mapping.timeout_for({"timeout": 60}, CONFIG) == 60
    )
    assert mapping.network_for({}, CONFIG) is None  # dsec's default: no network
    assert mapping.network_for({"allow_internet_access": True}, CONFIG).open  # type: ignore[union-attr]
    policy = mapping.network_for({"network": {"allowOut": ["pypi.org"]}}, CONFIG)
    assert policy is not None and policy.allow == ["pypi.org"] and not policy.open


def test_allow_public_traffic_true_is_taken_as_e2bs_default_and_changes_nothing() -> None:
    """SDKs <= 2.50 send ``allowPublicTraffic: true`` with any ``network=`` option: the
    policy is what it would be without it (ports keep needing the token: tests/integration)."""
    for network in ({}, {"allowOut": ["pypi.org"]}, {"denyOut": ["10.0.0.0/8"]}):
        for public in (True, False):
            body = {"network": {**network, "allowPublicTraffic": public}}
            assert mapping.network_for(body, CONFIG) == mapping.network_for(
                {"network": network}, CONFIG
            )
    assert mapping.network_for({"network": {"allowPublicTraffic": True}}, CONFIG) is None
    refused = {
        "allowPublicTraffic": "yes",
        "egressProxy": {"url": "http://proxy:3128"},
        "rules": {"pypi.org": [{"transform": {}}]},
        "maskRequestHost": "example.com",
    }
    for key, value in refused.items():
        with pytest.raises(HttpError) as exc:
            mapping.network_for({"network": {"allowPublicTraffic": True, key: value}}, CONFIG)
        assert exc.value.status == 400 and f"network.{key}" in exc.value.message


def test_list_pages_are_stateless_and_cover_everything_once() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    infos = [info(f"sb-e0-{i:08d}", t0 + timedelta(seconds=i % 3)) for i in range(7)]
    infos.append(info("sb-e0-paused00", t0, state="PAUSED"))
    for order in ("desc", "asc"):
        token, seen = None, []
        while True:
            q = mapping.parse_list_query(
                metadata=None,
                states=["running"],
                template=None,
                started_after=None,
                order=order,
                limit="3",
                next_token=token,
            )
            items, token, running = mapping.page(infos, q)
            assert running == 7 and len(items) <= 3
            seen += [i.id for i in items]
            if not token:
                break
        assert sorted(seen) == sorted(i.id for i in infos if i.state == "RUNNING")
        assert len(seen) == len(set(seen))
    with pytest.raises(HttpError):
        mapping.parse_list_query(
            metadata=None,
            states=["stopped"],
            template=None,
            started_after=None,
            order=None,
            limit=None,
            next_token=None,
        )
    assert mapping.parse_metadata_query(
        "user%3Dabc%26app%3Dprod".replace("%3D", "=").replace("%26", "&")
    ) == {
        "user": "abc",
        "app": "prod",
    }


def test_end_events_read_like_envd() -> None:
    done = end_event(ExitStatus(3, 0, False, 0.1, False, False, ""))
    assert done.event is not None and done.event.value.status == "exit status 3"
    killed = end_event(ExitStatus(-1, 9, False, 0.1, False, False, "")).event
    assert killed is not None and (killed.value.exit_code, killed.value.exited) == (-1, False)
    assert killed.value.status == "signal: killed"


def test_a_process_killed_at_the_requests_deadline_ends_the_stream_deadline_exceeded() -> None:
    timed_out = ExitStatus(-1, 9, True, 1.0, False, False, "")
    with pytest.raises(ConnectError) as exc:
        ended(timed_out, deadline=True)
    assert exc.value.code == Code.DEADLINE_EXCEEDED
    # without a request deadline (a Connect to the process) it is an ordinary end
    end = ended(timed_out, deadline=False).event
    assert end is not None and end.value.status == "signal: killed"
    done = ended(ExitStatus(0, 0, False, 0.1, False, False, ""), deadline=True).event
    assert done is not None and done.value.exit_code == 0


async def test_a_sandbox_ending_mid_stream_is_an_unavailable_the_sdk_probes() -> None:
    """Before the first message: E2B's proxy answer ("was not found"); after it (the
    sandbox gone, or first its channel closed): a message naming neither of the proxy's
    answers, so the SDK probes /health."""

    async def stream(first: bool) -> AsyncIterator[int]:
        if first:
            yield 1
        raise SandboxTerminated("sandbox ended", metadata={"termination_reason": "KILLED"})

    async def channel_closed() -> AsyncIterator[int]:  # what a kill looks like first
        yield 1
        raise Unavailable("channel to sandbox closed: edge closed the channel")

    for first, code_words in ((False, "was not found"), (True, "ended before the stream")):
        call = EnvdCall(cast(AsyncClient, None), "sb-e0-abcdef12", "", CONFIG)
        token = CALL.set(call)
        try:
            got: list[int] = []
            with pytest.raises(ConnectError) as exc:
                async for item in mapped(lambda: stream(first)):  # noqa: B023
                    got.append(item)
            assert exc.value.code == Code.UNAVAILABLE and code_words in exc.value.message
            assert got == ([1] if first else [])
            # under way: the router drops the connection rather than send this end
            assert call.dropped == (["sb-e0-abcdef12"] if first else [])
        finally:
            CALL.reset(token)
    assert "was not found" not in exc.value.message
    assert "port is not open" not in exc.value.message
    call = EnvdCall(cast(AsyncClient, None), "sb-e0-abcdef12", "", CONFIG)
    token = CALL.set(call)
    try:
        with pytest.raises(ConnectError) as exc:
            async for _ in mapped(channel_closed):
                pass
        assert exc.value.code == Code.UNAVAILABLE
        assert "ended before the stream completed" in exc.value.message
    finally:
        CALL.reset(token)


async def test_keepalives_flow_while_the_source_is_quiet_and_it_is_not_cancelled() -> None:
    gate = asyncio.Event()
    closed = asyncio.Event()

    async def source() -> AsyncIterator[int]:
        try:
            yield 1
            await gate.wait()
            yield 2
        finally:
            closed.set()

    got: list[object] = []
    async for item in with_keepalives(source(), 0.05):
        got.append(item)
        if got.count(KEEPALIVE) == 3:
            gate.set()
        if item == 2:
            break
    assert got[0] == 1 and got[-1] == 2 and got.count(KEEPALIVE) >= 3
    await asyncio.wait_for(closed.wait(), 1)  # the source is closed with the iteration


def test_template_backends_are_configurable_and_checked() -> None:
    env = {
        "DSEC_COMPAT_TEMPLATES": "base=bookworm,gui=desktop,py=python",
        "DSEC_COMPAT_TEMPLATE_BACKENDS": "gui=vm,py=microvm",
    }
    config = load(CompatConfig, "compat", env)
    assert mapping.target_for("gui", config) == mapping.TemplateTarget("desktop", "vm")
    assert mapping.target_for("py", config) == mapping.TemplateTarget("python", "microvm")
    assert mapping.target_for("desktop", config) == mapping.TemplateTarget("desktop", "")
    with pytest.raises(ConfigError, match=r"template 'gui' names backend 'qemu'.*container"):
        load(CompatConfig, "compat", {"DSEC_COMPAT_TEMPLATE_BACKENDS": "gui=qemu"})


def test_template_users_are_configurable_and_checked() -> None:
    env = {"DSEC_COMPAT_TEMPLATE_USERS": "base=user,py=1000", "DSEC_COMPAT_DEFAULT_USER": "nobody"}
    config = load(CompatConfig, "compat", env)
    assert [config.user_for(t) for t in ("base", "py", "other")] == ["user", "1000", "nobody"]
    for bad in ("base=Bad User", "base=", "base=../root"):
        with pytest.raises(ConfigError, match="is not a user name"):
            load(CompatConfig, "compat", {"DSEC_COMPAT_TEMPLATE_USERS": bad})
    with pytest.raises(ConfigError, match="DSEC_COMPAT_DEFAULT_USER"):
        load(CompatConfig, "compat", {"DSEC_COMPAT_DEFAULT_USER": "a b"})


def test_the_upload_limit_is_configurable_and_checked() -> None:
    assert CONFIG.max_upload_bytes == 10 << 30  # the edge's default sandbox disk
    config = load(CompatConfig, "compat", {"DSEC_COMPAT_MAX_UPLOAD_BYTES": "4096"})
    assert config.max_upload_bytes == 4096
    with pytest.raises(ConfigError, match="DSEC_COMPAT_MAX_\\*_BYTES must be positive"):
        load(CompatConfig, "compat", {"DSEC_COMPAT_MAX_UPLOAD_BYTES": "0"})


# ------------------------------------------------------- Content-Encoding of uploads


async def chunks(data: Iterable[bytes] | bytes, size: int = 1000) -> AsyncIterator[bytes]:
    if isinstance(data, bytes):
        data = [data[i : i + size] for i in range(0, len(data), size)]
    for chunk in data:
        yield chunk


async def collect(stream: AsyncIterator[bytes]) -> bytes:
    return b"".join([c async for c in stream])


async def test_gzip_bodies_are_inflated_and_identity_ones_kept() -> None:
    data = os.urandom(50_000) + b"a" * 200_000
    packed = gzip.compress(data)
    assert await collect(decoded(chunks(packed), "gzip")) == data
    assert await collect(decoded(chunks(packed, 7), "x-gzip")) == data
    assert await collect(decoded(chunks(data), None)) == data
    assert await collect(decoded(chunks(data), "identity")) == data
    assert await collect(decoded(chunks(gzip.compress(packed)), "gzip, gzip")) == data
    # RFC 1952: members one after another are one body
    two = gzip.compress(b"first ") + gzip.compress(b"second")
    assert await collect(decoded(chunks(two, 5), "GZip")) == b"first second"
    assert await collect(decoded(chunks(gzip.compress(b"")), "gzip")) == b""


async def test_malformed_gzip_is_a_400_that_says_so() -> None:
    packed = gzip.compress(b"hello world " * 1000)
    bad_crc = packed[:-8] + bytes([packed[-8] ^ 0xFF]) + packed[-7:]
    for body in (b"this is not gzip", packed[: len(packed) // 2], bad_crc, b"", packed + b"junk"):
        with pytest.raises(HttpError) as exc:
            await collect(decoded(chunks(body), "gzip"))
        assert exc.value.status == 400, body[:20]
        assert exc.value.message.startswith(
            "request body is not valid gzip (Content-Encoding: gzip): "
        )


async def test_another_coding_is_a_415_naming_it_before_the_body_is_read() -> None:
    async def unread() -> AsyncIterator[bytes]:
        raise AssertionError("the body was read")
        yield b""  # pragma: no cover

    for header, named in (("br", "br"), ("gzip, deflate", "deflate"), ("compress", "compress")):
        with pytest.raises(HttpError) as exc:
            decoded(unread(), header)
        assert exc.value.status == 415 and f"Content-Encoding {named!r}" in exc.value.message


async def test_a_gzip_bomb_stops_at_the_limit_with_413_in_little_memory() -> None:
    """64 MiB of zeros in ~64 KiB of gzip, against a 1 MiB limit: refused with 413 after a
    little of the body, inflated a piece at a time (never the whole)."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    bomb = b"".join(deflater.compress(zeros) for _ in range(64)) + deflater.flush()
    assert len(bomb) < 128 * 1024
    pulled = 0
    pieces: list[int] = []

    async def source() -> AsyncIterator[bytes]:
        nonlocal pulled
        for i in range(0, len(bomb), 16 * 1024):
            pulled += 16 * 1024
            yield bomb[i : i + 16 * 1024]

    tracemalloc.start()
    try:
        with pytest.raises(HttpError) as exc:
            async for piece in bounded(decoded(source(), "gzip"), 1 << 20, "upload (decoded)"):
                pieces.append(len(piece))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert exc.value.status == 413
    assert exc.value.message == f"upload (decoded) larger than {1 << 20} bytes"
    assert max(pieces) <= DECODED_PIECE_BYTES and sum(pieces) <= 1 << 20
    assert pulled <= 16 * 1024  # 1 MiB of zeros is in the first 16 KiB of the body
    assert peak < 4 << 20, peak


def test_a_metrics_window_is_unix_seconds_within_a_datetimes_range() -> None:
    assert mapping.unix_seconds(None, "start") is None and mapping.unix_seconds("", "end") is None
    assert mapping.unix_seconds("1796563644", "start") == 1796563644
    for bad in ("soon", "1.5", "-1", str(253402300800), str(1 << 70)):
        with pytest.raises(HttpError) as exc:
            mapping.unix_seconds(bad, "start")
        assert exc.value.status == 400 and "start" in exc.value.message

"""The SWE-ReX front end's checks that need no cluster: its listener's config, where a zipped
directory's entries may land, and the bounds on what a request may send (a JSON call's body, an
upload), through a real uvicorn server and swe-rex's own ``RemoteRuntime``
(tests/integration/test_swerex.py drives the API on a sandbox).

The limit tests run the front end with a pool that records the token it is asked to lease and
refuses it (401): a request that reaches the pool has passed the front end's own bounds, and one
refused at its bound never reaches dsec.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import aiohttp
import httpx
import pytest
import uvicorn
from swerex.runtime.abstract import UploadRequest, WriteFileRequest
from swerex.runtime.remote import RemoteRuntime

from common.config import ConfigError
from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.swe_rex.app import SweRexApp, _inside
from libdsec.errors import Unauthenticated

#: Small limits, so that the tests send little.
BODY_LIMIT = 64 * 1024
UPLOAD_LIMIT = 2 * 1024 * 1024  # past Starlette's 1 MiB spool: the part is on disk by then
TOKEN = "dsec_test_token"


def test_listener_config() -> None:
    CompatConfig(swerex_listen="127.0.0.1:7132").validate()
    CompatConfig(swerex_listen="").validate()  # not served
    with pytest.raises(ConfigError, match="host:port"):
        CompatConfig(swerex_listen="7132").validate()
    with pytest.raises(ConfigError, match="bad port"):
        CompatConfig(swerex_listen="127.0.0.1:x").validate()
    with pytest.raises(ConfigError, match="differ"):
        CompatConfig(listen="127.0.0.1:7130", swerex_listen="127.0.0.1:7130").validate()
    with pytest.raises(ConfigError, match="differ"):
        CompatConfig(swerex_listen="127.0.0.1:7131").validate()  # SandboxFusion's default
    positive = r"SWEREX_MAX_\*_BYTES must be positive"
    with pytest.raises(ConfigError, match=positive):
        CompatConfig(swerex_listen="127.0.0.1:7132", swerex_max_body_bytes=0).validate()
    with pytest.raises(ConfigError, match=positive):
        CompatConfig(swerex_listen="127.0.0.1:7132", swerex_max_upload_bytes=0).validate()


def test_zip_entries_stay_under_the_target() -> None:
    assert _inside("/work/tree", "sub/x.txt") == "/work/tree/sub/x.txt"
    assert _inside("/work/tree/", "./a") == "/work/tree/a"
    assert _inside("/", "etc/x") == "/etc/x"
    for bad in ("../x", "sub/../../x", "/etc/passwd"):
        with pytest.raises(ValueError, match="leaves /work/tree"):
            _inside("/work/tree", bad)


# ------------------------------------------------------------------ bounded bodies


class _Pool:
    """Records each token it is asked to lease, then refuses it (no API server behind)."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    @contextlib.asynccontextmanager
    async def lease(self, token: str) -> AsyncIterator[object]:
        self.tokens.append(token)
        raise Unauthenticated("no API server in this test")
        yield  # pragma: no cover  (a generator, for asynccontextmanager)


@contextlib.asynccontextmanager
async def _served(pool: _Pool) -> AsyncIterator[str]:
    """The front end with the test's limits on a real uvicorn (httptools, as compat.server
    runs it) on a free loopback port; yields the base URL of sandbox ``sb-1``."""
    config = CompatConfig(swerex_max_body_bytes=BODY_LIMIT, swerex_max_upload_bytes=UPLOAD_LIMIT)
    app = SweRexApp(config, cast(ClientPool, pool))
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, http="httptools")
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not serving.done(), "uvicorn did not start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/sandboxes/sb-1"
    finally:
        server.should_exit = True
        await serving
        sock.close()


def _write_file_body(size: int) -> bytes:
    """A write_file request body of exactly `size` bytes."""
    head, tail = b'{"path": "/work/a.txt", "content": "', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def _temp_files(directory: Path) -> list[str]:
    """This process's open files in `directory` (a spooled part is unlinked at once)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd is gone by now
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{directory}/"):
                found.append(target)
    return found


async def test_a_json_body_is_bounded() -> None:
    """At the limit a call goes on to dsec; one byte more is FastAPI's 413 naming the limit,
    answered before anything reaches dsec, and swe-rex's RemoteRuntime raises aiohttp's
    ClientResponseError with status 413 for it."""
    pool = _Pool()
    async with _served(pool) as url, httpx.AsyncClient() as http:
        headers = {"X-API-Key": TOKEN, "Content-Type": "application/json"}
        r = await http.post(
            f"{url}/write_file", content=_write_file_body(BODY_LIMIT), headers=headers
        )
        assert r.status_code == 401 and pool.tokens == [TOKEN]  # passed the bound, reached dsec
        r = await http.post(
            f"{url}/write_file", content=_write_file_body(BODY_LIMIT + 1), headers=headers
        )
        assert (r.status_code, r.json()) == (
            413,
            {"detail": f"request body larger than {BODY_LIMIT} bytes"},
        )
        runtime = RemoteRuntime(host=url, auth_token=TOKEN, timeout=10)
        big = WriteFileRequest(path="/work/a.txt", content="x" * (4 * BODY_LIMIT))
        with pytest.raises(aiohttp.ClientResponseError) as info:
            await runtime.write_file(big)
        assert info.value.status == 413
        assert pool.tokens == [TOKEN]  # neither refused call reached dsec


async def test_an_upload_is_bounded_as_it_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload past its limit is 413 naming it (RemoteRuntime: ClientResponseError 413),
    reaches no sandbox, and leaves no temporary file; one under it goes on to dsec."""
    spool = tmp_path / "spool"  # where the front end's multipart parser spools file parts
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(UPLOAD_LIMIT + 1))
    pool = _Pool()
    async with _served(pool) as url:
        runtime = RemoteRuntime(host=url, auth_token=TOKEN, timeout=10)
        with pytest.raises(aiohttp.ClientResponseError) as info:
            await runtime.upload(UploadRequest(source_path=str(source), target_path="/work/b"))
        assert info.value.status == 413
        assert pool.tokens == []  # refused before the token or the sandbox was looked at
        assert _temp_files(spool) == [] and list(spool.iterdir()) == []
        async with httpx.AsyncClient() as http:
            form = {"target_path": "/work/b", "unzip": "false"}
            with source.open("rb") as f:
                r = await http.post(
                    f"{url}/upload", data=form, files={"file": f}, headers={"X-API-Key": TOKEN}
                )
            assert (r.status_code, r.json()) == (
                413,
                {"detail": f"upload larger than {UPLOAD_LIMIT} bytes"},
            )
            small = {"file": ("b", b"y" * (UPLOAD_LIMIT - 4096))}
            r = await http.post(
                f"{url}/upload", data=form, files=small, headers={"X-API-Key": TOKEN}
            )
            assert r.status_code == 401 and pool.tokens == [TOKEN]  # under the bound: to dsec
        assert _temp_files(spool) == []  # the accepted upload's part is closed after it too

"""edge.network.namegate on loopback: admitted connections are relayed byte for byte (the
peeked ClientHello included), refused ones are reset and reported with the name. The original
destination is given by the test here (on a node it comes from conntrack after the edge's
nftables redirect: tests/integration covers that path)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import ssl
from collections.abc import AsyncIterator

import pytest

from edge.network.namegate import Attempt, NameGate

pytestmark = pytest.mark.asyncio


def client_hello(name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


class Upstream:
    """A loopback server that hashes what it gets and sends back a fixed payload."""

    def __init__(self, reply: bytes = b"") -> None:
        self.reply = reply
        self.received: list[bytes] = []

    async def start(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[:2]

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        h = hashlib.sha256()
        n = 0
        first = b""
        while chunk := await r.read(1 << 20):
            if not first:
                first = chunk[:4096]
            h.update(chunk)
            n += len(chunk)
        self.received.append(first)
        w.write(self.reply + f"\n{n} {h.hexdigest()}".encode())
        await w.drain()
        w.close()


@pytest.fixture
async def gate() -> AsyncIterator[tuple[NameGate, Upstream, list[tuple[Attempt, str]]]]:
    up = Upstream(reply=b"hello from upstream")
    addr = await up.start()
    refusals: list[tuple[Attempt, str]] = []

    def decide(a: Attempt) -> str | None:
        if a.peeked is None or not a.peeked.name:
            return "no name"
        return None if a.peeked.name == "pypi.org" else f"name {a.peeked.name} not allowed"

    g = NameGate(decide, lambda a, why: refusals.append((a, why)), destination=lambda s: addr,
                 peek_timeout_s=0.5)  # fmt: skip
    g.port = await g.start("127.0.0.1", 0)  # type: ignore[attr-defined]
    try:
        yield g, up, refusals
    finally:
        await g.close()
        up.server.close()


async def _exchange(port: int, payload: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(payload)
    await w.drain()
    w.write_eof()
    try:
        return await r.read()
    finally:
        w.close()


async def test_an_allowed_name_is_relayed_byte_for_byte(gate) -> None:  # type: ignore[no-untyped-def]
    g, up, refusals = gate
    hello = client_hello("pypi.org")
    body = hello + os.urandom(8 << 20)
    answer = await _exchange(g.port, body)
    assert answer.startswith(b"hello from upstream\n")
    n, digest = answer.split(b"\n")[1].split()
    assert int(n) == len(body) and digest.decode() == hashlib.sha256(body).hexdigest()
    assert up.received[0].startswith(hello[:64]) and not refusals


async def test_a_denied_name_and_no_name_are_reset_and_reported(gate) -> None:  # type: ignore[no-untyped-def]
    g, up, refusals = gate
    for payload in (client_hello("registry.npmjs.org"), b"GET / HTTP/1.1\r\nHost: npmjs.org\r\n\r\n",
                    client_hello(None), b"\x00raw tcp\r\n\r\n"):  # fmt: skip
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            answer = await _exchange(g.port, payload)
            assert answer == b"", answer  # a reset may also read as an empty answer
            raise ConnectionResetError
    assert [why for _, why in refusals] == [
        "name registry.npmjs.org not allowed",
        "name npmjs.org not allowed",
        "no name",
        "no name",
    ]
    assert not up.received


async def test_a_client_that_says_nothing_is_refused_after_the_peek_timeout(gate) -> None:  # type: ignore[no-untyped-def]
    g, _, refusals = gate
    s = socket.create_connection(("127.0.0.1", g.port))
    try:
        s.settimeout(5)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises((ConnectionResetError, TimeoutError)):
            data = await loop.run_in_executor(None, s.recv, 10)
            if data == b"":
                raise ConnectionResetError
        assert loop.time() - t0 < 3
    finally:
        s.close()
    assert refusals and refusals[0][0].peeked is None


async def test_many_connections_at_once_each_get_their_own_bytes(gate) -> None:  # type: ignore[no-untyped-def]
    g, _, refusals = gate
    hello = client_hello("pypi.org")
    bodies = [hello + os.urandom(64 << 10) for _ in range(40)]
    answers = await asyncio.gather(*(_exchange(g.port, b) for b in bodies))
    for body, answer in zip(bodies, answers, strict=True):
        n, digest = answer.split(b"\n")[1].split()
        assert int(n) == len(body) and digest.decode() == hashlib.sha256(body).hexdigest()
    assert not refusals
    for _ in range(100):  # each relay ends (its threads exit, its sockets close) on its own
        if g.relaying == 0:
            break
        await asyncio.sleep(0.02)
    assert g.relaying == 0


async def test_closing_the_gate_ends_the_connections_it_relays(gate) -> None:  # type: ignore[no-untyped-def]
    g, _, _ = gate
    r, w = await asyncio.open_connection("127.0.0.1", g.port)
    w.write(client_hello("pypi.org"))  # admitted; the upstream waits for our end, we never send it
    await w.drain()
    for _ in range(100):
        if g.relaying == 1:
            break
        await asyncio.sleep(0.02)
    assert g.relaying == 1
    t0 = asyncio.get_running_loop().time()
    await g.close()
    assert g.relaying == 0
    try:
        assert await asyncio.wait_for(r.read(), 5) == b""  # ended (reset reads as an end too)
    except ConnectionResetError:
        pass
    assert asyncio.get_running_loop().time() - t0 < 5
    w.close()

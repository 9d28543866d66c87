"""edge.network.peek: the name a connection asks for, from real ClientHellos (Python's own TLS
client, through a memory BIO: nothing is sent anywhere) and HTTP/1.x requests."""

from __future__ import annotations

import pytest

from edge.network.peek import MAX_PEEK_BYTES, NEED_MORE, Peeked, peek
from tests.helpers import client_hello


def test_tls_server_name_of_a_real_client_hello() -> None:
    hello = client_hello("PyPI.org")
    assert peek(hello) == Peeked("tls", name="pypi.org")
    assert peek(client_hello("files.pythonhosted.org")).name == "files.pythonhosted.org"


def test_tls_without_sni_has_no_name() -> None:
    assert peek(client_hello(None)) == Peeked("tls", name="")


def test_a_client_hello_in_pieces_needs_more_until_whole() -> None:
    hello = client_hello("registry.npmjs.org")
    for cut in (1, 5, 9, 60, len(hello) - 1):
        assert peek(hello[:cut]) is NEED_MORE, cut
    assert peek(hello).name == "registry.npmjs.org"


def test_a_client_hello_split_over_two_records() -> None:
    hello = client_hello("pypi.org")
    body = hello[5:]  # the handshake message
    first, second = body[:40], body[40:]
    records = (
        b"\x16\x03\x01" + len(first).to_bytes(2, "big") + first
        + b"\x16\x03\x01" + len(second).to_bytes(2, "big") + second
    )  # fmt: skip
    assert peek(records[:30]) is NEED_MORE
    assert peek(records).name == "pypi.org"


def _with_extension(hello: bytes, ext_type: int, payload: bytes) -> bytes:
    """``hello`` with one more extension appended (lengths fixed up)."""
    body = bytearray(hello[5:])
    ext = ext_type.to_bytes(2, "big") + len(payload).to_bytes(2, "big") + payload
    # locate the extensions block: after random, session id, ciphers, compression
    off = 4 + 2 + 32
    off += 1 + body[off]
    off += 2 + int.from_bytes(body[off : off + 2], "big")
    off += 1 + body[off]
    total = int.from_bytes(body[off : off + 2], "big") + len(ext)
    body[off : off + 2] = total.to_bytes(2, "big")
    body += ext
    body[1:4] = (len(body) - 4).to_bytes(3, "big")
    return b"\x16\x03\x01" + len(body).to_bytes(2, "big") + bytes(body)


def test_an_encrypted_client_hello_is_reported() -> None:
    hello = _with_extension(client_hello("public.example"), 0xFE0D, b"\x00" * 40)
    got = peek(hello)
    assert got is not None and got.ech and got.name == "public.example"


def test_evasions_are_malformed_not_a_name() -> None:
    hello = client_hello("pypi.org")
    sni = b"\x00\x00" + (13).to_bytes(2, "big") + b"\x00\x0b" + b"\x00\x00\x08npmjs.io"
    twice = peek(_with_extension(hello, 0x0000, sni[4:]))  # a second server_name extension
    assert twice is not None and twice.error and "twice" in twice.error
    garbage = b"\x16\x03\x01\x00\x05" + b"\x01\x00\x00\x01\x00"
    bad = peek(garbage)
    assert bad is not None and bad.protocol == "tls" and bad.error
    assert peek(b"\x16\x09\x09\x00\x05hello").error  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("request_bytes", "name"),
    [
        (b"GET / HTTP/1.1\r\nHost: pypi.org\r\nAccept: */*\r\n\r\n", "pypi.org"),
        (b"GET /simple/ HTTP/1.1\r\nhost: PyPI.org:8080\r\n\r\n", "pypi.org"),
        (b"POST /x HTTP/1.1\r\nHost: [::1]:80\r\n\r\nbody", "::1"),
        (
            b"GET http://registry.npmjs.org/x HTTP/1.1\r\nHost: pypi.org\r\n\r\n",
            "registry.npmjs.org",
        ),
        (b"GET / HTTP/1.0\r\n\r\n", ""),
    ],
)
def test_http_host(request_bytes: bytes, name: str) -> None:
    assert peek(request_bytes) == Peeked("http", name=name)


def test_http_needs_the_whole_header_block() -> None:
    req = b"GET / HTTP/1.1\r\nHost: pypi.org\r\n\r\n"
    for cut in (1, 3, 4, 20, len(req) - 1):
        assert peek(req[:cut]) is NEED_MORE, cut


def test_http_evasions() -> None:
    two = peek(b"GET / HTTP/1.1\r\nHost: pypi.org\r\nHost: npmjs.org\r\n\r\n")
    assert two is not None and "several Host" in two.error
    spaced = peek(b"GET / HTTP/1.1\r\nHost : npmjs.org\r\n\r\n")
    assert spaced is not None and spaced.error
    connect = peek(b"CONNECT npmjs.org:443 HTTP/1.1\r\nHost: npmjs.org\r\n\r\n")
    assert connect is not None and "CONNECT" in connect.error
    huge = peek(b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_PEEK_BYTES)
    assert huge is not None and huge.error


def test_raw_tcp_is_unknown() -> None:
    assert peek(b"\x00\x01binary") == Peeked("unknown")
    assert peek(b"SSH-2.0-OpenSSH_9.2\r\n") == Peeked("unknown")
    assert peek(b"") is NEED_MORE

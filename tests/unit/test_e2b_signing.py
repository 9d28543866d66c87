"""Signed file URLs (compat.e2b.signing): the SDK's signature, checked as envd checks it."""

from __future__ import annotations

import pytest
from e2b.sandbox.signature import get_signature

from compat.e2b.signing import (
    SandboxTokens,
    SignatureAmbiguous,
    SignatureRefused,
    SignedRequest,
    signature,
    signed_request,
)


def test_the_signature_is_the_sdks() -> None:
    sdk = get_signature("/tmp/a", "read", "user", "tok", 60)
    assert signature("/tmp/a", "read", "user", "tok", sdk["expiration"]) == sdk["signature"]
    assert (
        signature("/tmp/a", "write", "", "tok", None)
        == get_signature("/tmp/a", "write", None, "tok")["signature"]
    )


def test_verify_finds_the_token_and_refuses_as_envd() -> None:
    tokens = SandboxTokens()
    tokens.seen("sb-1", "tok")
    sig = signature("/f", "read", "", "tok", 100)
    assert tokens.verify("sb-1", SignedRequest("/f", "read", "", sig, 100), now=50) == (
        "sb-1",
        "tok",
    )
    assert tokens.verify("", SignedRequest("/f", "read", "", sig, 100), now=50)[0] == "sb-1"
    with pytest.raises(SignatureRefused, match="already expired"):
        tokens.verify("sb-1", SignedRequest("/f", "read", "", sig, 100), now=101)
    for bad in (
        SignedRequest("/g", "read", "", sig, 100),
        SignedRequest("/f", "write", "", sig, 100),
        SignedRequest("/f", "read", "user", sig, 100),
    ):
        with pytest.raises(SignatureRefused, match="invalid signature"):
            tokens.verify("sb-1", bad, now=50)
    with pytest.raises(SignatureRefused, match="invalid signature"):
        tokens.verify("sb-2", SignedRequest("/f", "read", "", sig, 100), now=50)
    tokens.seen("sb-2", "tok")
    with pytest.raises(SignatureAmbiguous):
        tokens.verify("", SignedRequest("/f", "read", "", sig, 100), now=50)
    tokens.forget("sb-2")
    assert tokens.verify("", SignedRequest("/f", "read", "", sig, 100), now=50)[0] == "sb-1"


def test_signed_request_reads_the_query() -> None:
    req = signed_request("POST", {"path": "/f", "signature": "v1_x", "signature_expiration": "7"})
    assert req == SignedRequest("/f", "write", "", "v1_x", 7)
    with pytest.raises(SignatureRefused, match="missing signature"):
        signed_request("GET", {"path": "/f"})
    with pytest.raises(SignatureRefused, match="not an integer"):
        signed_request("GET", {"signature": "v1_x", "signature_expiration": "soon"})

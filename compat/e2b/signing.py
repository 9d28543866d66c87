"""Signed file URLs: ``GET``/``POST /files`` without an access token, as envd serves them.

The SDK's ``download_url``/``upload_url`` sign ``path:operation:username:token[:expiration]``
(operation ``read`` for a download, ``write`` for an upload; username "" for the default user;
expiration Unix seconds) with SHA-256, unpadded base64, prefixed ``v1_``, and put it in the
query as ``signature`` (and ``signature_expiration``); ``token`` is the sandbox's envd access
token. envd compares the signature in constant time (401 "invalid signature"), then the
expiration (401 "signature is already expired"); a request with no signature and no token is
401 "missing signature query parameter".

In dsec the envd access token is the caller's own dsec token bound to the sandbox (see
``routing``), which the signed request does not carry, so this front end keeps, per sandbox,
the tokens it has seen
for it: the ones it returned as ``envdAccessToken`` (create, connect, get, fork) and the ones
that authenticated an envd call. A signature made with one of them is honoured, and the call
acts with that token. Known limit: they are held in memory, so a front end that restarted (or
another behind the same address) honours a URL only once it has seen that token for that
sandbox again (any SDK call to the sandbox, or a connect).

A URL names its sandbox in its host (``49983-<id>.<domain>``, E2B's form). With a shared
``E2B_SANDBOX_URL`` the SDK's URL cannot name one; such a request is matched against every
remembered sandbox: one match is served (a sandbox's own envd token signs for it alone),
several (a bare dsec token, used for more than one sandbox, signed the same path, user and
expiration for several) are 409, none 401. A sandbox killed through this
front end is forgotten.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass

#: Sandboxes whose tokens are remembered (the least recently used are forgotten first).
MAX_SANDBOXES = 10_000
#: Tokens remembered per sandbox (its callers': usually one).
MAX_TOKENS_PER_SANDBOX = 8


def signature(path: str, operation: str, username: str, token: str, expiration: int | None) -> str:
    """envd's v1 signature of a file URL."""
    parts = [path, operation, username, token]
    if expiration is not None:
        parts.append(str(expiration))
    digest = hashlib.sha256(":".join(parts).encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


class SignatureRefused(Exception):
    """401 with envd's message."""


class SignatureAmbiguous(Exception):
    """409: a request naming no sandbox whose signature fits several."""


@dataclass(frozen=True)
class SignedRequest:
    path: str
    operation: str  # "read" or "write"
    username: str
    signature: str
    expiration: int | None


class SandboxTokens:
    """The access tokens seen per sandbox (in memory, bounded)."""

    def __init__(self) -> None:
        self._tokens: OrderedDict[str, list[str]] = OrderedDict()

    def seen(self, sandbox_id: str, token: str) -> None:
        if not token:
            return
        tokens = self._tokens.pop(sandbox_id, [])
        if token in tokens:
            tokens.remove(token)
        tokens.insert(0, token)
        self._tokens[sandbox_id] = tokens[:MAX_TOKENS_PER_SANDBOX]
        while len(self._tokens) > MAX_SANDBOXES:
            self._tokens.popitem(last=False)

    def forget(self, sandbox_id: str) -> None:
        self._tokens.pop(sandbox_id, None)

    def verify(
        self, sandbox_id: str, req: SignedRequest, now: float | None = None
    ) -> tuple[str, str]:
        """(sandbox id, token) whose signature ``req`` carries; ``sandbox_id`` "" = any
        remembered sandbox. SignatureRefused as envd refuses; SignatureAmbiguous."""
        ids = [sandbox_id] if sandbox_id else list(self._tokens)
        matches = []
        for sid in ids:
            for token in self._tokens.get(sid, ()):
                want = signature(req.path, req.operation, req.username, token, req.expiration)
                if hmac.compare_digest(want.encode(), req.signature.encode()):
                    matches.append((sid, token))
                    break
        if not matches:
            raise SignatureRefused("invalid signature")
        if len(matches) > 1:
            raise SignatureAmbiguous(
                f"the signature matches {len(matches)} sandboxes; use the sandbox's own"
                " address (49983-<sandboxID>.<domain>) or a signature expiration"
            )
        if req.expiration is not None and req.expiration < int(time.time() if now is None else now):
            raise SignatureRefused("signature is already expired")
        return matches[0]


def signed_request(method: str, query: dict[str, str]) -> SignedRequest:
    """The signature fields of a ``/files`` request's query; SignatureRefused when there is
    none, or a bad expiration (not an integer)."""
    sig = query.get("signature")
    if not sig:
        raise SignatureRefused("missing signature query parameter")
    raw = query.get("signature_expiration")
    try:
        expiration = int(raw) if raw else None
    except ValueError:
        raise SignatureRefused(f"signature_expiration is not an integer: {raw!r}") from None
    return SignedRequest(
        query.get("path", ""),
        "read" if method == "GET" else "write",
        query.get("username", ""),
        sig,
        expiration,
    )

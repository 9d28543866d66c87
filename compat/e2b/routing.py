"""Which part of the E2B API a request is for, and whose key it carries.

One listener serves everything, so ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` may be the same
address. A request is for a sandbox when it names one: the ``E2b-Sandbox-Id`` and
``E2b-Sandbox-Port`` headers (what the SDK sends when ``E2B_SANDBOX_URL`` is set), or a
Host of the form ``{port}-{sandboxID}.{domain}`` (E2B's sandbox URLs). Port 49983 is envd
(the Connect services and ``/files``, ``/health``); any other port is HTTP into that port
inside the sandbox. Everything else is the control API.

Keys: the control API takes ``X-API-Key`` (or ``Authorization: Bearer``); envd takes
``X-Access-Token``; port traffic ``e2b-traffic-access-token`` (or ``X-Access-Token``). In
dsec each of them is the caller's dsec token: create returns it as ``trafficAccessToken``, and
as ``envdAccessToken`` bound to the sandbox (``<token>.<sandboxID>``, :func:`envd_token`), so
that, as on E2B, each sandbox's envd token differs (signed file URLs are signed with it) and
works for that sandbox only. envd also takes the bare dsec token. envd's
``Authorization: Basic <user>:`` names the user to act as.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from compat.e2b.http import Request

ENVD_PORT = 49983
_HOST = re.compile(r"^(\d{1,5})-([a-z0-9-]+)\.")


@dataclass(frozen=True)
class Target:
    kind: str  # "control", "envd" or "port"
    sandbox_id: str = ""
    port: int = 0


def route(request: Request) -> Target:
    sandbox_id = request.headers.get("e2b-sandbox-id", "")
    if sandbox_id:
        port_text = request.headers.get("e2b-sandbox-port", "") or str(ENVD_PORT)
        port = int(port_text) if port_text.isdigit() else -1
        return Target("envd" if port == ENVD_PORT else "port", sandbox_id, port)
    m = _HOST.match(request.headers.get("host", "").lower())
    if m:
        port = int(m.group(1))
        return Target("envd" if port == ENVD_PORT else "port", m.group(2), port)
    return Target("control")


def api_key(request: Request) -> str:
    key = request.headers.get("x-api-key", "")
    if key:
        return key.strip()
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return ""


def access_token(request: Request) -> str:
    return request.headers.get("x-access-token", "").strip()


def envd_token(key: str, sandbox_id: str) -> str:
    """Sandbox ``sandbox_id``'s envd access token for the caller whose dsec token is ``key``."""
    return f"{key}.{sandbox_id}"


def key_of(token: str, sandbox_id: str) -> str | None:
    """The dsec token in envd access token ``token`` for sandbox ``sandbox_id`` ("" = any):
    a bare dsec token as it is; one bound to another sandbox: None."""
    key, dot, bound = token.rpartition(".")
    if not dot or not bound.startswith("sb-"):
        return token
    return key if not sandbox_id or bound == sandbox_id else None


def traffic_token(request: Request) -> str:
    return (
        request.headers.get("e2b-traffic-access-token", "").strip()
        or request.headers.get("x-access-token", "")
    ).strip()


def envd_user(request: Request) -> str:
    """The user of ``Authorization: Basic base64("<user>:")``; "" when none is named."""
    auth = request.headers.get("authorization", "")
    if auth[:6].lower() != "basic ":
        return ""
    try:
        decoded = base64.b64decode(auth[6:].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return ""
    return decoded.split(":", 1)[0]

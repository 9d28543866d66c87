"""Reading the caller's credentials from gRPC metadata."""

from __future__ import annotations

from typing import Any

AUTH_HEADER = "authorization"


def bearer_token(context: Any) -> str:
    """The token of ``authorization: Bearer <token>``, or "" when absent."""
    for key, value in context.invocation_metadata() or ():
        if key == AUTH_HEADER:
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()

"""Identifiers shared across services.

A sandbox id encodes its owning edge (``sb-<edge_id>-<random>``), so any API
server can route any request without a lookup table.
"""

from __future__ import annotations

import re
import secrets

EDGE_ID = re.compile(r"^[a-z0-9]{1,16}$")
SANDBOX_ID = re.compile(r"^sb-([a-z0-9]{1,16})-([a-z0-9]{6,32})$")


def new_sandbox_id(edge_id: str) -> str:
    return f"sb-{edge_id}-{secrets.token_hex(8)}"


def edge_of(sandbox_id: str) -> str | None:
    """The edge id encoded in a sandbox id, or None if it is not a sandbox id."""
    m = SANDBOX_ID.match(sandbox_id)
    return m.group(1) if m else None

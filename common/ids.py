"""Identifiers shared across services.

A sandbox id encodes its owning edge (``sb-<edge_id>-<random>``), so any API
server can route any request without a lookup table. A create waiting in the queue has
an id of the reserved edge ``queued``; IAM maps it to the placed sandbox.
"""

from __future__ import annotations

import re
import secrets

#: The edge part of a queued create's id (``sb-queued-<random>``): no edge may take it.
QUEUE_EDGE = "queued"
EDGE_ID = re.compile(r"^(?!queued$)[a-z0-9]{1,16}$")
SANDBOX_ID = re.compile(r"^sb-([a-z0-9]{1,16})-([a-z0-9]{6,32})$")


def new_sandbox_id(edge_id: str) -> str:
    return f"sb-{edge_id}-{secrets.token_hex(8)}"


def edge_of(sandbox_id: str) -> str | None:
    """The edge id encoded in a sandbox id, or None if it is not a sandbox id."""
    m = SANDBOX_ID.match(sandbox_id)
    return m.group(1) if m else None


def new_queue_id() -> str:
    """The id of a create waiting in the queue; once placed it names the placed sandbox."""
    return f"sb-{QUEUE_EDGE}-{secrets.token_hex(8)}"


def is_queue_id(sandbox_id: str) -> bool:
    return edge_of(sandbox_id) == QUEUE_EDGE

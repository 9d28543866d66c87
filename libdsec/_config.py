"""Where the SDK connects by default, and with which token.

Order: explicit arguments, then ``DSEC_TARGET`` / ``DSEC_TOKEN``, then the
local cluster that ``dsec up`` wrote into ``$DSEC_HOME`` (default ``~/.dsec``):
``cluster.json`` names the API server, ``token`` holds the bootstrap admin
token (mode 0600).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from libdsec.errors import Unauthenticated, Unavailable

DEFAULT_TARGET = "127.0.0.1:7100"


def dsec_home() -> Path:
    return Path(os.environ.get("DSEC_HOME") or Path.home() / ".dsec")


@dataclass(frozen=True)
class Connection:
    target: str
    token: str


def resolve(target: str | None = None, token: str | None = None) -> Connection:
    home = dsec_home()
    if target is None:
        target = os.environ.get("DSEC_TARGET")
    if target is None:
        cluster = home / "cluster.json"
        if cluster.exists():
            try:
                target = json.loads(cluster.read_text())["apiserver"]
            except (ValueError, KeyError) as exc:
                raise Unavailable(
                    f"{cluster} is unreadable: {exc}", reason="BAD_CLUSTER_FILE"
                ) from None
        else:
            target = DEFAULT_TARGET
    if token is None:
        token = os.environ.get("DSEC_TOKEN")
    if token is None:
        path = home / "token"
        if path.exists():
            token = path.read_text().strip()
        else:
            raise Unauthenticated(
                f"no token: pass token=..., set DSEC_TOKEN, or start a local cluster with `dsec up` (writes {path})",
                reason="NO_TOKEN",
            )
    return Connection(target=target, token=token)

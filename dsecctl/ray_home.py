"""Where the caller's ``$DSEC_HOME`` points after ``dsec deploy --ray``.

``cluster.json`` names the deployment's API server (and ``token`` holds its admin token), so
`dsec sandbox ...` and ``libdsec.Client()`` work unchanged; its ``ray`` entry says that the
cluster is a Ray deployment, not a local one (`dsec up/down/restart` leave it alone). Kept
apart from :mod:`dsecctl.ray_deploy` so that the local commands never import Ray.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_home(home: Path, address: str, st: dict[str, Any]) -> None:
    """Points ``home``'s cluster.json (and token, 0600) at the deployment: `dsec sandbox ...`
    and ``libdsec.Client()`` then use it unchanged."""
    home.mkdir(parents=True, exist_ok=True)
    token = home / "token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(st["token"] + "\n")
    os.chmod(token, 0o600)
    state: dict[str, Any] = {
        "apiserver": st["apiserver"],
        **{k: st[k] for k in ("e2b_api_url", "sandbox_fusion_url") if k in st},
        "ray": {"address": address, "created_at": st["created_at"]},
    }
    (home / "cluster.json").write_text(json.dumps(state, indent=2))


def recorded_deployment(home: Path) -> str:
    """The Ray address ``home``'s cluster.json points at ("" = none, or a local cluster)."""
    try:
        state = json.loads((home / "cluster.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(state.get("ray", {}).get("address", ""))


def forget_home(home: Path, address: str) -> bool:
    """Removes ``home``'s cluster.json and token when they point at ``address``."""
    if recorded_deployment(home) != address:
        return False
    (home / "cluster.json").unlink(missing_ok=True)
    (home / "token").unlink(missing_ok=True)
    return True

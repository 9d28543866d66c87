"""pack_diff's part that every backend shares: what a sandbox's diff is stacked on, and the new
environment's config.

A container and a microVM keep the same thing as their writable layer, an overlay upper
directory over the image's layers (in the guest: on its writable disk, edge/backends/microvm/
init.sh); they differ only in how the edge reaches a consistent copy of it. What the diff is
stacked on (the layers the sandbox started from, its image's environment variables and working
directory) is recorded at the sandbox's start, because the image's name may point elsewhere by
the time it is packed (packing under the name it started from moves that name).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from edge.images import ResolvedImage
from edge.layers import LayerRef, PackResult
from edge.layers.model import ENV_PREFIX, WORKDIR_KEY
from edge.model import SandboxRecord
from libdsec.errors import FailedPrecondition

log = logging.getLogger(__name__)


def image_record(image: ResolvedImage) -> dict[str, Any]:
    """The entries of a sandbox's runtime record that pack_diff builds on."""
    return {
        "image": image.name,
        "layers": [ref.to_dict() for ref in image.layers],
        "image_env": image.env,
        "image_workdir": image.workdir,
    }


def check_packable(rec: SandboxRecord) -> None:
    if rec.state not in ("RUNNING", "PAUSED"):
        raise FailedPrecondition(
            f"sandbox {rec.sandbox_id} is {rec.state}: pack_diff needs it RUNNING or PAUSED"
        )
    if rec.paused_files_only:
        raise FailedPrecondition(
            f"sandbox {rec.sandbox_id} is paused with its files only: resume it first",
            reason="SANDBOX_PAUSED_FILES_ONLY",
        )


def recorded_layers(rec: SandboxRecord) -> list[LayerRef]:
    """The layers the sandbox started from (bottom first); FailedPrecondition when its record
    has none (a sandbox started before the layer store)."""
    layers = [LayerRef.from_dict(d) for d in rec.runtime.get("layers") or []]
    if not layers:
        raise FailedPrecondition(
            f"sandbox {rec.sandbox_id} predates the layer store: its layers are not recorded",
            reason="NO_LAYERS_RECORDED",
        )
    return layers


#: Provenance keys of a packed environment's config.
SANDBOX_KEY = "sandbox"
LABEL_PREFIX = "label."


def environment_config(rec: SandboxRecord) -> dict[str, str]:
    """The packed environment's config: the image's environment variables and working
    directory, the image it was made from, and the sandbox (its id and labels)."""
    config = {ENV_PREFIX + k: v for k, v in (rec.runtime.get("image_env") or {}).items()}
    if rec.runtime.get("image_workdir"):
        config[WORKDIR_KEY] = str(rec.runtime["image_workdir"])
    config["parent"] = str(rec.runtime.get("image", ""))
    # Provenance: which sandbox it was packed from, and that sandbox's labels (a snapshot's
    # maker reads them back: the E2B front end's template and user, compat/e2b/snapshots.py).
    config[SANDBOX_KEY] = rec.sandbox_id
    config.update({LABEL_PREFIX + k: v for k, v in rec.spec.labels.items()})
    return config


def log_packed(rec: SandboxRecord, result: PackResult, t0: float, **extra: Any) -> None:
    log.info(
        "sandbox %s packed as %s in %.1f ms (%d files, %d bytes, %d excluded)",
        rec.sandbox_id,
        result.environment.name,
        (time.perf_counter() - t0) * 1000,
        result.stats.files,
        result.stats.bytes,
        len(result.stats.excluded),
        extra={"sandbox_id": rec.sandbox_id, **extra},
    )

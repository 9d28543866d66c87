"""GPU pools: which GPUs this node has, and which container of a GPU pool gets which.

A GPU environment's pool is planned against the node's GPUs (``nvidia-smi``): *exclusive* gives
each container one whole GPU (so the pool is at most as large as the GPU count), *shared* puts
up to ``share`` containers on each GPU, round-robin. A container sees only its GPU
(``NVIDIA_VISIBLE_DEVICES``/``CUDA_VISIBLE_DEVICES``); the device nodes and driver libraries
are injected into the started container by ``nvidia-container-cli configure --pid`` (what the
NVIDIA OCI hook runs), before the runner preloads anything.

Without ``nvidia-smi`` (or without ``nvidia-container-cli``) GPU pools are not started and the
edge says why; CPU pools are unaffected.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str


def detect(nvidia_smi: str = "nvidia-smi") -> tuple[list[Gpu], str]:
    """(GPUs, "") or ([], why there are none usable)."""
    exe = shutil.which(nvidia_smi)
    if exe is None:
        return [], "no NVIDIA GPU: nvidia-smi not found"
    try:
        r = subprocess.run(
            [exe, "--query-gpu=index,uuid,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"nvidia-smi failed: {exc}"
    if r.returncode != 0:
        return [], f"nvidia-smi failed: {r.stderr.strip() or r.stdout.strip()}"
    gpus = parse_query(r.stdout)
    return gpus, "" if gpus else "nvidia-smi lists no GPU"


def parse_query(text: str) -> list[Gpu]:
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            out.append(Gpu(int(parts[0]), parts[1], ",".join(parts[2:])))
    return out


def assign(pool_size: int, gpus: list[Gpu], mode: str, share: int = 4) -> list[Gpu]:
    """The GPU of each container of a pool (len = the pool size actually usable)."""
    if not gpus:
        return []
    if mode == "exclusive":
        return gpus[: min(pool_size, len(gpus))]
    if mode == "shared":
        n = min(pool_size, len(gpus) * max(share, 1))
        return [gpus[i % len(gpus)] for i in range(n)]
    raise ValueError(f"unknown GPU mode {mode!r}")


def visible_env(gpu: Gpu) -> dict[str, str]:
    return {"NVIDIA_VISIBLE_DEVICES": gpu.uuid, "CUDA_VISIBLE_DEVICES": "0"}


def inject_command(
    gpu: Gpu, pid: int, rootfs: Path, cli: str = "nvidia-container-cli"
) -> list[str]:
    """The command that gives a started container (its init `pid`) access to `gpu`."""
    return [
        cli,
        "--load-kmods",
        "configure",
        f"--device={gpu.uuid}",
        "--compute",
        "--utility",
        f"--pid={pid}",
        str(rootfs),
    ]

"""The null backend: admits and tracks sandboxes, starts nothing.

With it, the control plane (IAM, placement, watcher, API servers, edge admission and
bookkeeping) can be measured at a scale this machine could never run real sandboxes at. It
claims only that: it serves container specs (so control-plane tests and benchmarks use the
same requests as real callers) and offers no capability — not even commands, which answer
UNIMPLEMENTED (BACKEND_CAPABILITY, capability exec). `dsec up` never starts it.
"""

from __future__ import annotations

from collections.abc import Sequence

from edge.backends.contract import BackgroundLoop, Capability, ExitCallback
from edge.model import SandboxRecord, SandboxSpec


class NullBackend:
    name = "null"
    serves: tuple[str, ...] = ("CONTAINER",)
    persistent = False
    starts_inline = True
    capabilities: frozenset[Capability] = frozenset()

    def __init__(self) -> None:
        self._on_exit: ExitCallback | None = None

    def set_exit_callback(self, callback: ExitCallback) -> None:
        self._on_exit = callback

    def validate(self, spec: SandboxSpec) -> None:
        return None

    async def start(self, rec: SandboxRecord) -> None:
        rec.runtime = {"kind": "null"}

    async def stop(self, rec: SandboxRecord, grace_s: float) -> None:
        return None

    async def destroy(self, rec: SandboxRecord) -> None:
        return None

    async def adopt(self, rec: SandboxRecord) -> bool:
        return False

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        return []

    def background_loops(self) -> Sequence[BackgroundLoop]:
        return ()

    async def close(self) -> None:
        return None

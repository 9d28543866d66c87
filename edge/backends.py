"""The interface between the edge's sandbox manager and a runtime backend.

A backend starts and stops the actual isolation (runc containers, QEMU
microVMs, libvirt VMs, or nothing at all for the ``null`` backend) and gives
the manager a channel into the sandbox. The manager owns records, admission,
TTL/idle enforcement and events; a backend owns only its runtime's resources.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from edge.model import SandboxRecord
from libdsec.errors import FailedPrecondition

#: Called by a backend when a sandbox ends on its own: (sandbox_id, reason, message).
ExitCallback = Callable[[str, str, str], Awaitable[None]]


class SandboxChannel(Protocol):
    """A call into the sandbox (edge -> aether -> chronus), messages as dicts or protos."""

    async def call(self, request: Any, timeout_s: float | None = None) -> Any: ...


class SandboxBackend(Protocol):
    #: Config name, e.g. "container", "null".
    name: str
    #: dsec backends it serves, by enum name without prefix: "CONTAINER", "FNCALL", ...
    serves: tuple[str, ...]
    #: Whether records of its sandboxes are kept on disk for re-adoption.
    persistent: bool

    def set_exit_callback(self, callback: ExitCallback) -> None: ...
    async def start(self, rec: SandboxRecord) -> None: ...
    async def stop(self, rec: SandboxRecord, grace_s: float) -> None: ...
    async def destroy(self, rec: SandboxRecord) -> None: ...
    async def pause(self, rec: SandboxRecord) -> None: ...
    async def resume(self, rec: SandboxRecord) -> None: ...
    async def adopt(self, rec: SandboxRecord) -> bool: ...
    async def cleanup_orphans(self, keep: set[str]) -> list[str]: ...
    def channel(self, rec: SandboxRecord) -> Any: ...
    async def close(self) -> None: ...


class NullBackend:
    """A test and benchmark runtime: admits and tracks sandboxes, starts nothing.

    With it, the control plane (IAM, placement, watcher, API servers, edge
    admission and bookkeeping) can be measured at a scale this machine could
    never run real sandboxes at. Calls into a null sandbox fail with
    FAILED_PRECONDITION (reason NULL_RUNTIME).
    """

    name = "null"
    serves: tuple[str, ...] = ("CONTAINER", "FNCALL", "MICROVM", "VM")
    persistent = False
    #: start() never waits: the manager starts a batch of these in one task.
    starts_inline = True

    def __init__(self) -> None:
        self._on_exit: ExitCallback | None = None

    def set_exit_callback(self, callback: ExitCallback) -> None:
        self._on_exit = callback

    async def start(self, rec: SandboxRecord) -> None:
        rec.runtime = {"kind": "null"}

    async def stop(self, rec: SandboxRecord, grace_s: float) -> None:
        return None

    async def destroy(self, rec: SandboxRecord) -> None:
        return None

    async def pause(self, rec: SandboxRecord) -> None:
        return None

    async def resume(self, rec: SandboxRecord) -> None:
        return None

    async def adopt(self, rec: SandboxRecord) -> bool:
        return False

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        return []

    def channel(self, rec: SandboxRecord) -> Any:
        raise FailedPrecondition(
            f"sandbox {rec.sandbox_id} runs on the null runtime, which starts nothing",
            reason="NULL_RUNTIME",
        )

    async def close(self) -> None:
        return None

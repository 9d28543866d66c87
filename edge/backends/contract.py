"""The contract between the edge's sandbox manager and a runtime backend.

A backend starts and stops the actual isolation (runc containers, QEMU microVMs, libvirt VMs,
or nothing at all for the ``null`` backend). The manager owns records, admission, TTL/idle
enforcement and events; a backend owns only its runtime's resources.

Every backend implements :class:`SandboxBackend`. What only some backends can do is an
optional *capability*: a small protocol below, declared by the backend in ``capabilities``
and checked once when the manager is built (:func:`check_declared`). Callers reach a
capability only through :func:`require`, which answers a missing one in one place:
UNIMPLEMENTED, reason ``BACKEND_CAPABILITY``, naming the backend and the capability.

A new runtime plugs in here: one package under ``edge/backends/`` implementing the contract,
one line in ``edge.backends.registry.REGISTRY`` (its factory receives the node's services,
``edge.node.NodeServices``), its settings in ``edge.config``, and one entry in
``tests/backends/targets.py`` so the conformance suite runs against it (docs/ARCHITECTURE.md,
"Adding a backend").
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from edge.model import SandboxRecord, SandboxSpec
from edge.usage import UsageSamples
from libdsec.errors import BackendCapabilityMissing

#: Called by a backend when a sandbox ends on its own: (sandbox_id, reason, message).
ExitCallback = Callable[[str, str, str], Awaitable[None]]
#: A background loop the edge's server runs for the backend (supervised, cancelled at stop).
BackgroundLoop = Callable[[], Coroutine[Any, Any, None]]


class SandboxChannel(Protocol):
    """A call into the sandbox (edge -> aether -> chronus): unary, server stream, client and
    bidirectional streams (see edge.aether_client.AetherConnection)."""

    async def call(self, request: Any, timeout_s: float | None = None) -> Any: ...


@runtime_checkable
class SandboxBackend(Protocol):
    #: Config name, e.g. "container", "null".
    name: str
    #: dsec backends it serves, by enum name without prefix: "CONTAINER", "MICROVM", ...
    serves: tuple[str, ...]
    #: Whether records of its sandboxes are kept on disk for re-adoption.
    persistent: bool
    #: start() never waits: the manager starts a batch of these in one task.
    starts_inline: bool
    #: What it offers beyond this contract (see Capability).
    capabilities: frozenset[Capability]

    def set_exit_callback(self, callback: ExitCallback) -> None: ...

    def validate(self, spec: SandboxSpec) -> None:
        """Before admission, blocking (run in a thread): a spec this backend cannot start
        (unknown image, bad network policy, a limit it cannot enforce) fails here, fast."""

    async def start(self, rec: SandboxRecord) -> None: ...
    async def stop(self, rec: SandboxRecord, grace_s: float) -> None: ...

    async def destroy(self, rec: SandboxRecord) -> None:
        """Remove everything of the sandbox. Must work on a full disk: it writes nothing."""

    async def adopt(self, rec: SandboxRecord) -> bool:
        """After an edge restart: take a recorded sandbox back (True) or report it lost."""

    async def cleanup_orphans(self, keep: set[str]) -> list[str]: ...
    def background_loops(self) -> Sequence[BackgroundLoop]: ...
    async def close(self) -> None: ...


class Capability(enum.Enum):
    """Optional capabilities, by the name callers see in BACKEND_CAPABILITY errors."""

    EXEC = "exec"  # commands, files, HTTP through aether/chronus
    PAUSE = "pause"
    PACK_DIFF = "pack_diff"
    TRUSTED_EXEC = "trusted_exec"
    NETWORK_POLICY = "network_policy"
    MODIFIED_FILES = "modified_files"
    WARM_CLAIM = "warm_claim"
    DISK_USAGE = "disk_usage"
    #: Whole GPUs attached to a sandbox (resources.gpu_count). No backend offers it yet: a
    #: container or microVM create asking for GPUs is refused, not admitted without them.
    #: (FnCall's GPU pools are separate: edge/fncall/gpu.py.)
    GPUS = "gpus"
    #: A screen: screenshots, input events, a VNC stream (the vm backend's desktop images).
    DISPLAY = "display"
    #: Copies of a running or paused sandbox at one instant (ForkSandbox).
    FORK = "fork"
    #: Samples of a sandbox's CPU, memory and disk use (GetSandboxMetrics).
    METRICS = "metrics"
    #: `sudo` for the accounts of SandboxSpec.sudo_users (chronus.sudo; dsec-sudo).
    SUDO = "sudo"
    #: A pause that keeps the files only and boots the sandbox afresh on resume
    #: (PauseSandboxRequest.files_only).
    FILES_ONLY_PAUSE = "files_only_pause"


@runtime_checkable
class Executes(Protocol):
    def channel(self, rec: SandboxRecord) -> Any:
        """The live channel to the sandbox's aether (UNAVAILABLE while reconnecting)."""


@dataclass(frozen=True)
class MemoryUsage:
    """A sandbox's memory as its backend measured it."""

    #: In the node's RAM, charged to the sandbox (anonymous, page cache, kernel; a microVM's
    #: QEMU process).
    resident_bytes: int
    #: Given back and kept elsewhere: pages in the edge's swap area (a paused container), the
    #: guest's memory saved to local disk (a paused microVM).
    swapped_bytes: int


@dataclass(frozen=True)
class PauseOutcome:
    """What a pause gave back to the node."""

    before: MemoryUsage
    after: MemoryUsage
    seconds: float
    #: "" when the memory was reclaimed; otherwise why the sandbox was only frozen (no swap
    #: area, ...): its memory stays resident and keeps counting toward admission.
    frozen_only: str = ""

    @property
    def freed_bytes(self) -> int:
        return max(0, self.before.resident_bytes - self.after.resident_bytes)


class ResumeFailed(Exception):
    """A paused sandbox cannot come back (its saved memory is gone or corrupt, it cannot be
    thawed, it does not answer after the thaw). Retrying would fail the same way: the manager
    ends the sandbox (RESUME_FAILED) with this message."""


@runtime_checkable
class Pausable(Protocol):
    async def pause(self, rec: SandboxRecord) -> PauseOutcome:
        """Stop everything in the sandbox, keep its state, and give its memory back to the
        node where the backend can (the outcome says how much, or why not)."""

    async def resume(self, rec: SandboxRecord) -> None:
        """Bring the sandbox back with everything it held; its channel answers afterwards.
        Raises ResumeFailed when that cannot happen, any other error when it may on a
        retry (the sandbox then stays PAUSED)."""

    async def memory_usage(self, rec: SandboxRecord) -> MemoryUsage | None:
        """Measured now; None when the backend cannot tell (the sandbox is gone)."""


@runtime_checkable
class PausesFilesOnly(Protocol):
    async def pause_files_only(self, rec: SandboxRecord) -> PauseOutcome:
        """Stop every process of the sandbox and give back all of its memory, keeping its
        writable layer (and the record: id, spec, tokens). Nothing of it runs afterwards."""

    async def resume_files_only(self, rec: SandboxRecord) -> None:
        """Boot the sandbox afresh on its image with the kept writable layer (a new init,
        new agents); its channel answers afterwards. ResumeFailed as for Pausable.resume."""


@runtime_checkable
class RunsSudo(Protocol):
    #: Where dsec-sudo is in the sandbox (also at /usr/bin/sudo when the image has a sudo).
    sudo_program: str


@runtime_checkable
class PacksDiffs(Protocol):
    async def pack_diff(
        self,
        rec: SandboxRecord,
        name: str,
        *,
        exclude: Sequence[str],
        default_excludes: bool,
        config: Mapping[str, str] | None = None,
    ) -> Any: ...


@runtime_checkable
class TrustedExecution(Protocol):
    async def trusted_channel(self, rec: SandboxRecord) -> Any: ...


@runtime_checkable
class NetworkPolicies(Protocol):
    async def update_network_policy(self, rec: SandboxRecord, policy: dict[str, Any]) -> None: ...


@runtime_checkable
class ModifiedFiles(Protocol):
    async def modified_files(self, rec: SandboxRecord) -> list[tuple[str, bool]]: ...


@runtime_checkable
class UsageMetrics(Protocol):
    def usage_samples(self, rec: SandboxRecord, start: float, end: float) -> UsageSamples:
        """The sandbox's samples taken between `start` and `end` (Unix time)."""


@runtime_checkable
class WarmClaims(Protocol):
    def warm_status(self) -> dict[str, tuple[int, int, int, int]]:
        """Per image: (target, ready, claimed, missed)."""


@runtime_checkable
class DiskUsage(Protocol):
    def disk_paths(self) -> list[Path]:
        """Directories the backend writes to on the node's disks (the reserve watches them)."""

    def disk_allocations(self) -> dict[str, tuple[int, int]]:
        """Per live sandbox: (st_dev of the filesystem its writable storage is on, bytes it
        allocated there). Blocking (a stat per sandbox): run in a thread."""


@runtime_checkable
class AttachesGpus(Protocol):
    def gpu_capacity(self) -> int:
        """Whole GPUs this backend can give its sandboxes on this node (each sandbox gets
        resources.gpu_count of them, exclusive, at start)."""


@runtime_checkable
class Displays(Protocol):
    """A sandbox's screen, driven from the host (computer use). Each method raises
    BackendCapabilityMissing for a sandbox of this backend that has no display (an image
    without one), UNAVAILABLE while it is not running. `actions` are checked already
    (edge/display.py: coordinates on the screen, known key names)."""

    async def display_size(self, rec: SandboxRecord) -> tuple[int, int]:
        """(width, height) of the screen now, pixels."""

    async def screenshot(self, rec: SandboxRecord) -> tuple[bytes, int, int]:
        """The whole screen as PNG bytes, with its width and height."""

    async def send_input(self, rec: SandboxRecord, actions: Sequence[Any]) -> int:
        """Deliver `actions` (edge.display.Action) as real input events, in order; returns
        the number of input events sent."""

    async def open_vnc(self, rec: SandboxRecord) -> tuple[Any, Any]:
        """An (asyncio.StreamReader, asyncio.StreamWriter) connected to the screen's VNC
        server; the caller closes the writer."""


class ForkKind(enum.Enum):
    """What a fork's child gets (dsec.types.v1.ForkKind)."""

    MEMORY = "memory"  # memory, devices and disk: every process continues in every child
    FILES = "files"  # the files and dsec's session state (cwd, env), not the processes


@dataclass
class ForkOutcome:
    """Per child (in the order given) None when it runs, or why it does not; and how long
    the source stood still while its state was captured."""

    errors: list[Exception | None]
    stall_s: float


@runtime_checkable
class Forks(Protocol):
    #: What its children get.
    fork_kind: ForkKind

    async def fork(self, source: SandboxRecord, children: Sequence[SandboxRecord]) -> ForkOutcome:
        """Start every record of `children` as a copy of `source` at one instant.

        The manager has admitted the children (their records exist, STARTING, each with a copy
        of the source's spec: only labels, task and TTL may differ) and holds the source's
        transition lock: the source is RUNNING or PAUSED and stays as it was. The state is
        captured once for all children. A child that fails is reported in `errors` (the
        manager ends it and calls `destroy` on it); an error raised instead fails them all."""


PROTOCOLS: dict[Capability, type] = {
    Capability.EXEC: Executes,
    Capability.PAUSE: Pausable,
    Capability.PACK_DIFF: PacksDiffs,
    Capability.TRUSTED_EXEC: TrustedExecution,
    Capability.NETWORK_POLICY: NetworkPolicies,
    Capability.MODIFIED_FILES: ModifiedFiles,
    Capability.WARM_CLAIM: WarmClaims,
    Capability.DISK_USAGE: DiskUsage,
    Capability.GPUS: AttachesGpus,
    Capability.DISPLAY: Displays,
    Capability.FORK: Forks,
    Capability.METRICS: UsageMetrics,
    Capability.FILES_ONLY_PAUSE: PausesFilesOnly,
    Capability.SUDO: RunsSudo,
}
_CAPABILITY_OF = {proto: cap for cap, proto in PROTOCOLS.items()}

T = TypeVar("T")


def check_declared(backend: SandboxBackend) -> None:
    """A backend implements the contract and every capability it declares (at edge start)."""
    if not isinstance(backend, SandboxBackend):
        raise TypeError(f"{type(backend).__name__} does not implement SandboxBackend")
    for cap in backend.capabilities:
        if not isinstance(backend, PROTOCOLS[cap]):
            raise TypeError(
                f"backend {backend.name} declares {cap.value} but does not implement "
                f"{PROTOCOLS[cap].__name__}"
            )


def offers(backend: SandboxBackend, proto: type[Any]) -> bool:
    return _CAPABILITY_OF[proto] in backend.capabilities


def require(backend: SandboxBackend, proto: type[T]) -> T:
    """`backend` as the capability `proto`, or BackendCapabilityMissing (UNIMPLEMENTED)."""
    cap = _CAPABILITY_OF[proto]
    if cap not in backend.capabilities:
        raise BackendCapabilityMissing(
            f"the {backend.name} backend does not offer {cap.value}",
            metadata={"backend": backend.name, "capability": cap.value},
        )
    return cast(T, backend)

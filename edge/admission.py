"""The edge's admission: whether a sandbox may start here, and what the live ones hold.

Decided locally, never waiting on the control plane: a create is refused for bad input (a
sandbox id of another edge, a backend this edge does not offer, reserved env names), or for
want of room (this node's capacity, with overcommit; the disk reserve; a draining edge). What
an admitted sandbox holds (cpu, memory, GPUs, and one count per backend, project, principal and
task) is taken at admission and released once, when it ends: a second release is a bug,
refused (AccountingError), never clamped. A pause gives memory back to admission; a resume
takes it back only if it still fits.

:class:`Admission` is one of :class:`edge.manager.SandboxManager`'s collaborators; the manager
decides when (create, pause, resume, the one ending), this module what fits and what is held.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from edge.backends.contract import (
    AttachesGpus,
    Pausable,
    PausesFilesOnly,
    RunsSudo,
    SandboxBackend,
    require,
)
from edge.disk_guard import DiskGuard
from edge.model import SANDBOX_ID, SandboxRecord, SandboxSpec
from libdsec.errors import EdgeCapacity, InvalidArgument, NodeDiskLow, NodeMemoryFull

#: An account name as useradd takes it (or a uid as digits), as SandboxSpec.sudo_users lists it.
SUDO_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}|[0-9]{1,10}")
MAX_SUDO_USERS = 16


def check_sudo_users(users: list[str]) -> None:
    """InvalidArgument INVALID_SUDO_USER unless every entry is an account name or a uid."""
    bad = [u for u in users if not SUDO_USER.fullmatch(u)]
    if bad or len(users) > MAX_SUDO_USERS:
        what = f"{bad[0]!r} is no account name or uid" if bad else f"more than {MAX_SUDO_USERS}"
        raise InvalidArgument(
            f"sudo_users: {what}",
            reason="INVALID_SUDO_USER",
            metadata={"field": "sudo_users"},
        )


class AccountingError(RuntimeError):
    """A release the edge's accounting cannot take (it would go below zero): a bug."""


#: The oldest free-space sample admission decides on (see Admission.fresh_disk_sample).
DISK_SAMPLE_MAX_AGE_S = 0.02


@dataclass(frozen=True)
class Capacity:
    cpu_millis: int
    memory_mb: int
    max_sandboxes: int
    gpus: int = 0


@dataclass(frozen=True)
class Load:
    sandboxes: int
    cpu_millis: int
    memory_mb: int
    gpus: int
    by_backend: dict[str, int]


class Admission:
    """This edge's capacity, what its live sandboxes hold of it, and the rules of a create."""

    def __init__(
        self,
        edge_id: str,
        capacity: Capacity,
        backends: Mapping[str, SandboxBackend],
        disk_guard: DiskGuard | None = None,
    ) -> None:
        self.edge_id = edge_id
        self.capacity = capacity
        #: Backend kind -> backend (the manager's table, read here).
        self.backends = backends
        #: Free-space reserve of the filesystems the edge writes (None: not watched).
        self.disk_guard = disk_guard
        self.draining = False
        self._alloc_cpu = 0
        self._alloc_mem = 0
        self._alloc_gpu = 0
        self._live = 0  # admitted and not yet terminated
        # Live sandboxes per backend, project, principal and task.
        self._counts: dict[str, dict[str, int]] = {
            "backend": {},
            "project": {},
            "principal": {},
            "task": {},
        }

    # ------------------------------------------------------------- queries

    def load(self) -> Load:
        by_backend = dict(self._counts["backend"])
        return Load(self._live, self._alloc_cpu, self._alloc_mem, self._alloc_gpu, by_backend)

    def live_counts(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Live sandboxes per project, per principal and per task (kept as they
        change: the watcher asks twice a second, and an edge may hold thousands)."""
        c = self._counts
        return dict(c["project"]), dict(c["principal"]), dict(c["task"])

    # ------------------------------------------------------------ a create

    def validate(self, sandbox_id: str, spec: SandboxSpec) -> None:
        self.check_id(sandbox_id)
        self.check_spec(spec)

    def check_id(self, sandbox_id: str) -> None:
        m = SANDBOX_ID.match(sandbox_id)
        if not m or m.group(1) != self.edge_id:
            raise InvalidArgument(
                f"sandbox id {sandbox_id!r} does not belong to edge {self.edge_id}"
            )

    def check_spec(self, spec: SandboxSpec) -> None:
        """The spec's own rules (the same for every sandbox of a batch's group)."""
        if spec.backend not in self.backends:
            raise InvalidArgument(
                f"edge {self.edge_id} does not offer backend {spec.backend}",
                reason="BACKEND_NOT_OFFERED",
            )
        if spec.cpu_millis <= 0 or spec.memory_mb <= 0:
            raise InvalidArgument("cpu_millis and memory_mb must be positive")
        if spec.gpu_count:
            # Admitted, GPUs would only be counted, never attached: refused until the backend
            # offers them (UNIMPLEMENTED BACKEND_CAPABILITY, capability gpus).
            require(self.backends[spec.backend], AttachesGpus)
        if spec.pause_at_ttl:
            # A pause at the TTL the backend cannot do would end the sandbox instead: refused
            # at create (UNIMPLEMENTED BACKEND_CAPABILITY, capability pause).
            require(self.backends[spec.backend], Pausable)
            if spec.pause_at_ttl_files_only:
                require(self.backends[spec.backend], PausesFilesOnly)
        if spec.sudo_users:
            check_sudo_users(spec.sudo_users)
            require(self.backends[spec.backend], RunsSudo)
        reserved = sorted(k for k in spec.env if k.startswith("DSEC_"))
        if reserved:
            # aether and chronus take their settings (Landlock on, the channel's fd, ...) from
            # DSEC_* variables: a caller must not be able to turn a control off through them.
            raise InvalidArgument(
                f"env {', '.join(reserved)}: names beginning with DSEC_ are reserved",
                reason="RESERVED_ENV",
                metadata={"field": "env"},
            )

    def admit(self, spec: SandboxSpec) -> None:
        self.check_disk()
        self.check_capacity(spec)

    def check_capacity(self, spec: SandboxSpec) -> None:
        """Room for one more sandbox of ``spec`` (admit without the disk check)."""
        cap = self.capacity
        live = self._live
        short = []
        if self.draining:
            short.append("edge is draining")
        if live + 1 > cap.max_sandboxes:
            short.append(f"sandboxes {live}+1 > {cap.max_sandboxes}")
        if self._alloc_cpu + spec.cpu_millis > cap.cpu_millis:
            short.append(f"cpu_millis {self._alloc_cpu}+{spec.cpu_millis} > {cap.cpu_millis}")
        if self._alloc_mem + spec.memory_mb > cap.memory_mb:
            short.append(f"memory_mb {self._alloc_mem}+{spec.memory_mb} > {cap.memory_mb}")
        if self._alloc_gpu + spec.gpu_count > cap.gpus:
            short.append(f"gpus {self._alloc_gpu}+{spec.gpu_count} > {cap.gpus}")
        if short:
            raise EdgeCapacity(
                f"edge {self.edge_id} is full: " + "; ".join(short), metadata={"edge": self.edge_id}
            )

    async def fresh_disk_sample(self) -> None:
        """Admission decides on free space at most DISK_SAMPLE_MAX_AGE_S old (the guard's loop
        samples every 0.25 s: a disk filled in between would admit a create that then fails
        to start with ENOSPC). One statvfs per watched filesystem, in a thread."""
        if self._disk_sample_due():
            await asyncio.to_thread(self.refresh_disk_sample)

    def refresh_disk_sample(self) -> None:
        """:meth:`fresh_disk_sample` for a caller already in a thread (blocking)."""
        if self._disk_sample_due():
            assert self.disk_guard is not None
            self.disk_guard.sample()

    def _disk_sample_due(self) -> bool:
        guard = self.disk_guard
        return guard is not None and time.monotonic() - guard.sampled_at > DISK_SAMPLE_MAX_AGE_S

    def check_disk(self) -> None:
        guard = self.disk_guard
        fs = guard.low() if guard is not None else None
        if guard is not None and fs is not None:
            reserve_mb = guard.reserve_bytes >> 20
            raise NodeDiskLow(
                f"edge {self.edge_id}: {fs.path} has {fs.free_mb} MiB free, below the "
                f"reserve of {reserve_mb} MiB",
                metadata={
                    "edge": self.edge_id,
                    "path": str(fs.path),
                    "free_mb": str(fs.free_mb),
                    "reserve_mb": str(reserve_mb),
                },
            )

    # ---------------------------------------------------------- accounting

    def account(self, rec: SandboxRecord, sign: int) -> None:
        """A sandbox starts (+1) or stops (-1) holding capacity: allocation and counts. A
        paused sandbox holds the memory its pause did not give back (released_mb)."""
        spec = rec.spec
        live = self._live + sign
        cpu = self._alloc_cpu + sign * spec.cpu_millis
        mem = self._alloc_mem + sign * (spec.memory_mb - rec.released_mb)
        gpu = self._alloc_gpu + sign * spec.gpu_count
        keys = [
            (kind, key)
            for kind, key in (
                ("backend", spec.backend),
                ("project", rec.project_id),
                ("principal", rec.principal_id),
                ("task", spec.task_id),
            )
            if key or kind != "task"
        ]
        c = self._counts
        counts = [c[kind].get(key, 0) + sign for kind, key in keys]
        if min(live, cpu, mem, gpu, *counts) < 0:
            # Only a sandbox released twice gets here (a bug): nothing is changed, and the
            # caller counts it (accounting_errors in GetNodeStatus, 0 in every test).
            raise AccountingError(
                f"releasing {rec.sandbox_id} would take the edge's accounting below zero "
                f"(live {live}, cpu {cpu}, memory {mem}, gpus {gpu}, counts {counts})"
            )
        self._live, self._alloc_cpu, self._alloc_mem, self._alloc_gpu = live, cpu, mem, gpu
        for (kind, key), left in zip(keys, counts, strict=True):
            if left:
                c[kind][key] = left
            else:
                c[kind].pop(key, None)

    def give_back(self, rec: SandboxRecord, released_mb: int) -> None:
        """A paused sandbox gave ``released_mb`` of its memory back to the node: it stops
        counting toward admission (and is what a resume must find room for)."""
        self._alloc_mem -= released_mb
        rec.released_mb = released_mb

    def take_back(self, rec: SandboxRecord) -> int:
        """The memory a paused sandbox's pause gave back, taken again for its resume (before
        the backend call, so concurrent resumes of others see it); the MiB taken. If it does
        not fit the node's admission now: NodeMemoryFull, and nothing changes."""
        need = rec.released_mb
        free = self.capacity.memory_mb - self._alloc_mem
        if need > free:
            raise NodeMemoryFull(
                f"sandbox {rec.sandbox_id} cannot resume on edge {self.edge_id} now: it needs "
                f"{need} MiB of memory back and the node's admission has {max(free, 0)} "
                f"MiB free; it stays PAUSED (nothing is lost)",
                metadata={
                    "edge": self.edge_id,
                    "need_mb": str(need),
                    "free_mb": str(max(free, 0)),
                },
            )
        self._alloc_mem += need
        rec.released_mb = 0
        return need

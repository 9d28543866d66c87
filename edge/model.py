"""What the edge knows about a sandbox, independent of gRPC.

States and termination reasons use the names of the dsec.types.v1 enums
(``"RUNNING"``, ``"TTL"``) so the servicer converts them by name.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from common.ids import EDGE_ID, SANDBOX_ID, edge_of

__all__ = [
    "EDGE_ID",
    "LIVE_STATES",
    "SANDBOX_ID",
    "TERMINAL",
    "SandboxRecord",
    "SandboxSpec",
    "edge_of",
]

LIVE_STATES = ("PENDING", "STARTING", "RUNNING", "PAUSED", "STOPPING")
TERMINAL = "TERMINATED"


@dataclass
class SandboxSpec:
    backend: str = "CONTAINER"  # FNCALL, CONTAINER, MICROVM, VM
    image: str = ""
    cpu_millis: int = 1000
    memory_mb: int = 512
    pids_max: int = 512
    disk_mb: int = 0
    gpu_count: int = 0
    ttl_s: int = 3600
    idle_timeout_s: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    task_id: str = ""
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    network: dict[str, Any] = field(default_factory=dict)  # NetworkPolicy as a dict
    qos: str = "LATENCY_SENSITIVE"
    node_selector: dict[str, str] = field(default_factory=dict)
    toolkits: list[str] = field(default_factory=list)
    #: At its TTL it is paused, not ended (edge/reaper.py).
    pause_at_ttl: bool = False
    #: A paused sandbox comes back only on an explicit resume, never on a call (touch).
    manual_resume: bool = False
    #: The pause at the TTL keeps the files only (a cold pause).
    pause_at_ttl_files_only: bool = False
    #: Accounts that may `sudo` (chronus.sudo); none: no sudo service in the sandbox.
    sudo_users: list[str] = field(default_factory=list)


@dataclass
class SandboxRecord:
    sandbox_id: str
    project_id: str
    principal_id: str
    spec: SandboxSpec
    edge_id: str
    state: str = "PENDING"
    termination_reason: str = ""
    termination_message: str = ""
    terminated_at: float | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    last_active_at: float = field(default_factory=time.time)
    runtime: dict[str, Any] = field(default_factory=dict)  # backend-owned facts (pid, paths)
    violations: dict[str, int] = field(default_factory=dict)
    #: The name gate's refusals by the name asked for (ViolationCounters.blocked_names).
    blocked_names: dict[str, int] = field(default_factory=dict)
    #: Memory as last measured (resident_bytes, swapped_bytes, at; after a pause also
    #: freed_bytes, pause_s and frozen_only), see edge.backends.contract.PauseOutcome.
    memory: dict[str, Any] = field(default_factory=dict)
    #: MiB of spec.memory_mb a pause gave back to the node: not counted toward its memory
    #: admission while the sandbox stays paused (a resume must find room for them again).
    released_mb: int = 0
    #: When the sandbox ends (TTL), if SetSandboxTimeout moved it; else created_at + ttl_s.
    deadline_at: float | None = None
    #: A fork's child: the sandbox it was copied from.
    forked_from: str = ""
    #: Paused by its TTL (spec.pause_at_ttl): a resume gives it a fresh TTL; until then its
    #: deadline is the edge's keep period.
    paused_at_ttl: bool = False
    #: Paused with its files only (a cold pause): nothing runs, its resume boots it afresh.
    paused_files_only: bool = False

    @property
    def expires_at(self) -> float:
        if self.deadline_at is not None:
            return self.deadline_at
        return self.created_at + self.spec.ttl_s if self.spec.ttl_s else float("inf")

    @property
    def expires(self) -> bool:
        return self.deadline_at is not None or bool(self.spec.ttl_s)

    @property
    def live(self) -> bool:
        return self.state != TERMINAL

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> SandboxRecord:
        d = json.loads(raw)
        d["spec"] = SandboxSpec(**d["spec"])
        return cls(**d)

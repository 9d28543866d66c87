"""Typed results of the SDK (dataclasses, not protobuf messages)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any, Generic, TypeVar

from dsec.iam.v1 import iam_pb2
from dsec.types.v1 import types_pb2
from libdsec.errors import DSecError, item_error

#: A child of ForkResult: AsyncSandbox (libdsec.aio) or Sandbox (libdsec.sync).
SandboxT = TypeVar("SandboxT")


def _dt(ts: Any) -> datetime | None:
    if ts is None or (ts.seconds == 0 and ts.nanos == 0):
        return None
    return datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, tz=UTC)


@cache
def _enum(enum: Any, value: int, prefix: str) -> str:
    return str(enum.Name(value)).removeprefix(prefix)


# Empty repeated and map fields are the rule in a sandbox's description: skipping their
# copy saves a third of converting one (a burst's create_many converts tens of thousands).
def _dict(field: Any) -> dict[str, Any]:
    """A protobuf map as a dict of its own."""
    return dict(field) if field else {}


def _list(field: Any) -> list[Any]:
    """A protobuf repeated scalar field as a list of its own."""
    return list(field) if field else []


@dataclass(frozen=True)
class Principal:
    principal_id: str
    name: str
    kind: str  # HUMAN, AGENT, SERVICE
    role: str  # ADMIN, MEMBER
    project_id: str
    expires_at: datetime | None = None

    @classmethod
    def from_pb(cls, p: iam_pb2.Principal) -> Principal:
        return cls(
            p.principal_id,
            p.name,
            _enum(iam_pb2.PrincipalKind, p.kind, "PRINCIPAL_KIND_"),
            _enum(iam_pb2.Role, p.role, "ROLE_"),
            p.project_id,
            _dt(p.expires_at),
        )


@dataclass(frozen=True)
class Quota:
    """Limits of a project subtree; 0 = no limit of its own. ``share_weight``: the
    project's weight in the create queue's fair share (0 = 1), set by its parent like the
    limits."""

    cpu_millis: int = 0
    memory_mb: int = 0
    sandboxes: int = 0
    sandboxes_by_backend: dict[str, int] = field(default_factory=dict)
    share_weight: float = 0.0

    def to_pb(self) -> iam_pb2.Quota:
        return iam_pb2.Quota(
            cpu_millis=self.cpu_millis,
            memory_mb=self.memory_mb,
            sandboxes=self.sandboxes,
            sandboxes_by_backend={_backend_key(k): v for k, v in self.sandboxes_by_backend.items()},
            share_weight=self.share_weight,
        )

    @classmethod
    def from_pb(cls, q: Any) -> Quota:
        return cls(
            q.cpu_millis,
            q.memory_mb,
            q.sandboxes,
            {k.removeprefix("BACKEND_").lower(): v for k, v in q.sandboxes_by_backend.items()},
            getattr(q, "share_weight", 0.0),
        )


def _backend_key(name: str) -> str:
    return "BACKEND_" + name.upper().removeprefix("BACKEND_")


@dataclass(frozen=True)
class Project:
    project_id: str
    parent_id: str
    quota: Quota
    usage: Quota
    created_at: datetime | None

    @classmethod
    def from_pb(cls, p: iam_pb2.Project) -> Project:
        return cls(
            p.project_id,
            p.parent_id,
            Quota.from_pb(p.quota),
            Quota.from_pb(p.usage),
            _dt(p.created_at),
        )


@dataclass(frozen=True)
class TokenInfo:
    token_id: str
    name: str
    project_id: str
    kind: str
    role: str
    created_at: datetime | None
    expires_at: datetime | None
    revoked: bool

    @classmethod
    def from_pb(cls, t: iam_pb2.TokenInfo) -> TokenInfo:
        return cls(
            t.token_id,
            t.name,
            t.project_id,
            _enum(iam_pb2.PrincipalKind, t.kind, "PRINCIPAL_KIND_"),
            _enum(iam_pb2.Role, t.role, "ROLE_"),
            _dt(t.created_at),
            _dt(t.expires_at),
            t.revoked,
        )


@dataclass(frozen=True)
class NewToken:
    """A freshly created token: ``secret`` is shown only once."""

    info: TokenInfo
    secret: str


@dataclass(frozen=True)
class NetworkPolicy:
    """Egress policy. Rules are ``"host[:port[-port]][/tcp|/udp]"`` strings;
    a host is an IP, a CIDR, or a domain name. Deny wins over allow.

    ``NetworkPolicy()`` = no network; ``NetworkPolicy(allow=["pypi.org:443"])``
    = only that; ``NetworkPolicy(open=True, deny=["registry.npmjs.org"])`` =
    everything but that. Domain names are resolved by the edge and kept current;
    ``"*.example.com"`` matches the names below example.com. A domain rule is
    TCP only and means the name: a connection it allows goes on only if it asks
    for an allowed name (TLS server name, HTTP Host); others are reset and
    counted, by name, in ``SandboxInfo.violations.blocked_names``. With
    ``max_blocked_connects=N`` the sandbox ends (``POLICY_VIOLATION``) once more
    than N connects were blocked; by default blocked connects are only counted
    (``SandboxInfo.violations["blocked_connects"]``).
    """

    allow: list[str] = field(default_factory=list)
    deny: list[str] = field(default_factory=list)
    open: bool = False
    max_blocked_connects: int = 0

    def to_pb(self) -> types_pb2.NetworkPolicy:
        if self.open:
            mode = types_pb2.NETWORK_MODE_OPEN
        elif self.allow:
            mode = types_pb2.NETWORK_MODE_ALLOWLIST
        else:
            mode = types_pb2.NETWORK_MODE_NONE
        return types_pb2.NetworkPolicy(
            mode=mode,
            allow=[parse_rule(r) for r in self.allow],
            deny=[parse_rule(r) for r in self.deny],
            max_blocked_connects=self.max_blocked_connects,
        )

    @classmethod
    def from_pb(cls, p: types_pb2.NetworkPolicy) -> NetworkPolicy:
        """The policy as the SDK writes it (rules as ``"host[:port[-port]][/tcp|/udp]"``)."""
        return cls(
            allow=[rule_text(r) for r in p.allow] if p.allow else [],
            deny=[rule_text(r) for r in p.deny] if p.deny else [],
            open=p.mode == types_pb2.NETWORK_MODE_OPEN,
            max_blocked_connects=p.max_blocked_connects,
        )


def rule_text(rule: types_pb2.NetworkRule) -> str:
    """NetworkRule -> ``"pypi.org:443/tcp"``: the inverse of :func:`parse_rule`."""
    host = f"[{rule.target}]" if ":" in rule.target and rule.port_min else rule.target
    text = host
    if rule.port_min:
        text += f":{rule.port_min}"
        if rule.port_max and rule.port_max != rule.port_min:
            text += f"-{rule.port_max}"
    if rule.protocol == types_pb2.PROTOCOL_TCP:
        text += "/tcp"
    elif rule.protocol == types_pb2.PROTOCOL_UDP:
        text += "/udp"
    return text


def parse_rule(text: str) -> types_pb2.NetworkRule:
    """``"pypi.org:443/tcp"`` -> NetworkRule. Validation happens on the server."""
    proto = types_pb2.PROTOCOL_UNSPECIFIED
    body = text.strip()
    if body.endswith("/tcp"):
        proto, body = types_pb2.PROTOCOL_TCP, body[:-4]
    elif body.endswith("/udp"):
        proto, body = types_pb2.PROTOCOL_UDP, body[:-4]
    host, port_min, port_max = body, 0, 0
    if body.startswith("["):  # [v6]:port
        end = body.find("]")
        host, rest = body[1:end], body[end + 1 :]
        ports = rest[1:] if rest.startswith(":") else ""
    elif body.count(":") == 1:
        host, ports = body.split(":")
    else:
        ports = ""
    if ports:
        lo, _, hi = ports.partition("-")
        port_min = int(lo) if lo.isdigit() else 0
        port_max = int(hi) if hi.isdigit() else port_min
        if not lo.isdigit():
            port_min = port_max = 100_000  # out of range on purpose: the server names the bad rule
    return types_pb2.NetworkRule(target=host, port_min=port_min, port_max=port_max, protocol=proto)


@dataclass(frozen=True)
class SandboxSpecInfo:
    """What a sandbox was created with (the options of ``create``, with the platform's
    defaults filled in where the edge chose them; 0 = none/never/the default, as in the
    request)."""

    cpu: float
    memory_mb: int
    pids_max: int
    disk_mb: int
    gpus: int
    ttl_s: int
    idle_timeout_s: int
    env: dict[str, str]
    network: NetworkPolicy
    workdir: str
    best_effort: bool
    node_selector: dict[str, str]
    toolkits: list[str]
    #: accounts that may ``sudo`` (default none; older servers: none)
    sudo_users: list[str] = field(default_factory=list)

    @classmethod
    def from_pb(cls, s: types_pb2.SandboxSpec) -> SandboxSpecInfo:
        r = s.resources
        return cls(
            cpu=r.cpu_millis / 1000,
            memory_mb=r.memory_mb,
            pids_max=r.pids_max,
            disk_mb=r.disk_mb,
            gpus=r.gpu_count,
            ttl_s=s.ttl_s,
            idle_timeout_s=s.idle_timeout_s,
            env=_dict(s.env),
            network=NetworkPolicy.from_pb(s.network),
            workdir=s.workdir,
            best_effort=s.qos == types_pb2.QOS_CLASS_BEST_EFFORT,
            node_selector=_dict(s.node_selector),
            toolkits=_list(s.toolkits),
            sudo_users=_list(s.sudo_users),
        )


@dataclass(frozen=True)
class ModifiedFile:
    """A file of the sandbox's read-only layers that it changed (or deleted)."""

    path: str
    deleted: bool


@dataclass(frozen=True)
class SandboxMetric:
    """One sample of a sandbox's resource use (:meth:`AsyncSandbox.metrics`)."""

    at: datetime
    #: its CPU limit, in cores, and the share of it used since the sample before
    cpu_count: float
    cpu_used_pct: float
    #: memory in use (page cache it could give back excluded), page cache, its limit
    mem_used_bytes: int
    mem_cache_bytes: int
    mem_total_bytes: int
    #: its writable layer: used, and its disk limit
    disk_used_bytes: int
    disk_total_bytes: int

    @classmethod
    def from_pb(cls, m: Any) -> SandboxMetric:
        return cls(
            m.at.ToDatetime(tzinfo=UTC),
            m.cpu_count,
            m.cpu_used_pct,
            m.mem_used_bytes,
            m.mem_cache_bytes,
            m.mem_total_bytes,
            m.disk_used_bytes,
            m.disk_total_bytes,
        )


@dataclass(frozen=True)
class MemoryInfo:
    """A sandbox's memory as its edge measured it (``get`` measures; ``list`` and ``watch``
    carry the last measurement). A pause gives memory back: a container's pages go to the
    edge's swap area, a microVM's guest is saved to local disk."""

    resident_bytes: int  # in the node's RAM now
    swapped_bytes: int  # given back: in swap, or saved on local disk
    measured_at: datetime | None
    #: From the last pause, while PAUSED: what it freed, how long it took, how much of
    #: memory_mb stopped counting toward the node's admission, why it only froze ("" if not).
    freed_bytes: int
    pause_s: float
    released_mb: int
    frozen_only: str

    @classmethod
    def from_pb(cls, m: types_pb2.SandboxMemory) -> MemoryInfo:
        return cls(
            resident_bytes=m.resident_bytes,
            swapped_bytes=m.swapped_bytes,
            measured_at=_dt(m.measured_at),
            freed_bytes=m.freed_bytes,
            pause_s=m.pause_s,
            released_mb=m.released_mb,
            frozen_only=m.frozen_only,
        )


class Violations(dict[str, int]):
    """A sandbox's counters of contained misbehaviour, by name: ``blocked_connects``,
    ``denied_file_accesses``, ``output_truncations``, ``oom_kills``, ``pids_limit_hits``,
    ``dns_refusals``; and :attr:`blocked_names`, the connections the edge's name gate refused
    (also counted in ``blocked_connects``) by the name they asked for: a TLS server name or
    HTTP Host, ``"(no name)"`` for none (raw TCP, no SNI, an encrypted ClientHello), at most
    64 names and then ``"(other names)"``."""

    def __init__(self, counters: dict[str, int], blocked_names: dict[str, int] | None = None):
        super().__init__(counters)
        self.blocked_names: dict[str, int] = dict(blocked_names or {})

    def __repr__(self) -> str:
        return f"Violations({dict(self)!r}, blocked_names={self.blocked_names!r})"


@dataclass(frozen=True)
class SandboxInfo:
    id: str
    project_id: str
    state: str  # PENDING, STARTING, RUNNING, PAUSED, STOPPING, TERMINATED
    backend: str
    image: str
    edge_id: str
    labels: dict[str, str]
    task_id: str
    created_at: datetime | None
    expires_at: datetime | None
    termination_reason: (
        str | None
    )  # STOPPED, PREEMPTED, TTL, IDLE, OOM, CHANNEL_CLOSED, EDGE_LOST, RESUME_FAILED, ...
    termination_message: str
    violations: Violations
    memory: MemoryInfo | None  # None: not measured (terminated, or a backend that cannot)
    #: What it was created with (resources, network policy, env, ...).
    spec: SandboxSpecInfo | None = None
    started_at: datetime | None = None
    last_active_at: datetime | None = None  # the last call into it (the idle timer's start)
    principal_id: str = ""  # the token that created it
    forked_from: str = ""  # a fork's child: the sandbox it was copied from
    paused_files_only: bool = False  # PAUSED with its files only (pause(memory=False))
    #: A create that waited in the queue (``wait_s``): where it is, or was.
    queue: QueueInfo | None = None
    terminated_at: datetime | None = None  # when it ended (None while it lives)

    @classmethod
    def from_pb(cls, s: types_pb2.Sandbox) -> SandboxInfo:
        reason = None
        if s.HasField("termination") and s.termination.reason:
            reason = _enum(types_pb2.TerminationReason, s.termination.reason, "TERMINATION_REASON_")
        spec, v = s.spec, s.violations
        return cls(
            id=s.id,
            project_id=s.project_id,
            state=_enum(types_pb2.SandboxState, s.state, "SANDBOX_STATE_"),
            backend=_enum(types_pb2.Backend, spec.backend, "BACKEND_").lower(),
            image=spec.image,
            edge_id=s.edge_id,
            labels=_dict(spec.labels),
            task_id=spec.task_id,
            created_at=_dt(s.created_at),
            expires_at=_dt(s.expires_at),
            termination_reason=reason,
            termination_message=s.termination.message,
            violations=Violations(
                {
                    "blocked_connects": v.blocked_connects,
                    "denied_file_accesses": v.denied_file_accesses,
                    "output_truncations": v.output_truncations,
                    "oom_kills": v.oom_kills,
                    "pids_limit_hits": v.pids_limit_hits,
                    "dns_refusals": v.dns_refusals,
                },
                _dict(v.blocked_names),
            ),
            memory=MemoryInfo.from_pb(s.memory) if s.HasField("memory") else None,
            spec=SandboxSpecInfo.from_pb(spec),
            started_at=_dt(s.started_at),
            last_active_at=_dt(s.last_active_at),
            principal_id=s.principal_id,
            forked_from=s.forked_from,
            paused_files_only=s.paused_files_only,
            queue=QueueInfo.from_pb(s.queue) if s.HasField("queue") else None,
            terminated_at=_dt(s.termination.at) if reason else None,
        )

    @property
    def terminated(self) -> bool:
        return self.state == "TERMINATED"


@dataclass(frozen=True)
class QueueInfo:
    """A create's place in the create queue (``wait_s``). While it waits, the sandbox's id is
    ``queue_id`` (``sb-queued-...``) and its state PENDING; once placed, ``placed_sandbox_id``
    is the sandbox (get and stop accept either id)."""

    queue_id: str
    position: int  # 1 = served next; 0 = not waiting (placed or ended)
    reason: str  # why it could not be placed yet (the last refusal)
    enqueued_at: datetime | None
    deadline: datetime | None
    placed_sandbox_id: str
    priority: int

    @classmethod
    def from_pb(cls, q: types_pb2.QueueStatus) -> QueueInfo:
        return cls(
            queue_id=q.queue_id,
            position=q.position,
            reason=q.reason,
            enqueued_at=_dt(q.enqueued_at),
            deadline=_dt(q.deadline),
            placed_sandbox_id=q.placed_sandbox_id,
            priority=q.priority,
        )


@dataclass(frozen=True)
class QueueGroup:
    """Creates waiting in the queue for one project and task (``Client.queue()``)."""

    project_id: str
    task_id: str
    waiting: int
    oldest_wait_s: float
    share_weight: float


@dataclass(frozen=True)
class QueueSummary:
    """The create queue of the caller's project subtree (``Client.queue()``)."""

    waiting: int
    groups: list[QueueGroup]
    entries: list[SandboxInfo]  # PENDING, in serving order (with include_entries)
    dispatcher: str  # the API server instance serving the queue

    @classmethod
    def from_pb(cls, r: Any) -> QueueSummary:
        return cls(
            waiting=r.waiting,
            groups=[
                QueueGroup(g.project_id, g.task_id, g.waiting, g.oldest_wait_s, g.share_weight)
                for g in r.groups
            ],
            entries=[SandboxInfo.from_pb(e) for e in r.entries],
            dispatcher=r.dispatcher,
        )


@dataclass(frozen=True)
class ForkResult(Generic[SandboxT]):
    """What :meth:`AsyncSandbox.fork` made: per child, in order, a sandbox or the error that
    child got (never a silently short list); how the backend copies (``kind``: ``"memory"``,
    every process continues in every child, microVMs; ``"files"``, the files and the
    sessions' cwd and environment, containers); and how long the source stood still while
    its state was captured (``stall_s``)."""

    children: list[SandboxT | DSecError]
    kind: str
    stall_s: float

    @property
    def sandboxes(self) -> list[SandboxT]:
        """The children that run."""
        return [c for c in self.children if not isinstance(c, DSecError)]

    @property
    def errors(self) -> list[DSecError]:
        return [c for c in self.children if isinstance(c, DSecError)]

    def __iter__(self) -> Iterator[SandboxT | DSecError]:
        return iter(self.children)

    def __len__(self) -> int:
        return len(self.children)


@dataclass(frozen=True)
class TaskSandboxResult:
    """One sandbox's outcome of a task-level operation (:meth:`AsyncClient.pause_task`,
    ``resume_task``, ``stop_task``): the sandbox as the operation left it (``info``), or the
    error it got (``error``: e.g. :class:`~libdsec.errors.SandboxTerminated` for a pause of an
    ended sandbox, ``metadata["state"]`` naming its state)."""

    sandbox_id: str
    edge_id: str
    info: SandboxInfo | None
    error: DSecError | None

    @classmethod
    def from_pb(cls, r: Any) -> TaskSandboxResult:
        if r.error.code:
            return cls(r.sandbox_id, r.edge_id, None, item_error(r.error))
        return cls(r.sandbox_id, r.edge_id, SandboxInfo.from_pb(r.sandbox), None)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def state(self) -> str | None:
        """PAUSED, RUNNING, TERMINATED, ... as the operation left it; None on an error."""
        return self.info.state if self.info is not None else None


@dataclass(frozen=True)
class TaskEdgeError:
    """An edge that did not answer a task-level operation: its sandboxes of the task are not
    in the results (they may or may not have been acted on; ask again)."""

    edge_id: str
    error: DSecError

    @classmethod
    def from_pb(cls, e: Any) -> TaskEdgeError:
        return cls(e.edge_id, item_error(e.error))


@dataclass(frozen=True)
class TaskResult:
    """What a task-level operation did: one :class:`TaskSandboxResult` per sandbox of the task
    (iterate over it), one :class:`TaskEdgeError` per edge that did not answer. A task with
    no sandboxes gives an empty result, not an error::

        r = await dsec.pause_task("job-42")
        if not r.ok:
            for f in r.failed:
                print(f.sandbox_id, f.error.reason, f.error.metadata.get("state"))
    """

    results: list[TaskSandboxResult]
    edge_errors: list[TaskEdgeError] = field(default_factory=list)

    @classmethod
    def from_pb(cls, resp: Any) -> TaskResult:
        return cls(
            [TaskSandboxResult.from_pb(r) for r in resp.results],
            [TaskEdgeError.from_pb(e) for e in resp.edge_errors],
        )

    @property
    def ok(self) -> bool:
        """Every sandbox succeeded and every edge answered."""
        return not self.edge_errors and all(r.ok for r in self.results)

    @property
    def failed(self) -> list[TaskSandboxResult]:
        return [r for r in self.results if not r.ok]

    @property
    def sandboxes(self) -> list[SandboxInfo]:
        """The sandboxes the operation succeeded on, as it left them."""
        return [r.info for r in self.results if r.info is not None]

    def __iter__(self) -> Iterator[TaskSandboxResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)


@dataclass(frozen=True)
class ExitStatus:
    exit_code: int
    signal: int
    timed_out: bool
    duration_s: float
    stdout_truncated: bool
    stderr_truncated: bool
    error: str

    @classmethod
    def from_pb(cls, e: types_pb2.ExitStatus) -> ExitStatus:
        return cls(
            e.exit_code,
            e.signal,
            e.timed_out,
            e.duration_s,
            e.stdout_truncated,
            e.stderr_truncated,
            e.error,
        )

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class ExecResult:
    """Outcome of :meth:`Sandbox.run`. A timeout is ``timed_out=True``, never an exception."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_s: float
    timed_out: bool
    truncated: bool
    signal: int
    exec_id: str
    error: str = ""

    @classmethod
    def from_pb(cls, r: types_pb2.ExecResult) -> ExecResult:
        e = r.exit
        return cls(
            e.exit_code,
            r.stdout,
            r.stderr,
            e.duration_s,
            e.timed_out,
            e.stdout_truncated or e.stderr_truncated,
            e.signal,
            r.exec_id,
            e.error,
        )

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (errors replaced)."""
        return self.stdout.decode(errors="replace")


@dataclass(frozen=True)
class Started:
    exec_id: str
    pid: int


@dataclass(frozen=True)
class Output:
    stream: str  # "stdout" or "stderr"
    data: bytes
    offset: int


@dataclass(frozen=True)
class Exited:
    status: ExitStatus


ExecEvent = Started | Output | Exited


def event_from_pb(ev: types_pb2.ExecEvent) -> ExecEvent | None:
    kind = ev.WhichOneof("event")
    if kind == "started":
        return Started(ev.started.exec_id, ev.started.pid)
    if kind in ("stdout", "stderr"):
        chunk = getattr(ev, kind)
        return Output(kind, chunk.data, chunk.offset)
    if kind == "exit":
        return Exited(ExitStatus.from_pb(ev.exit))
    return None  # keepalive


@dataclass(frozen=True)
class ExecInfo:
    """A command of :meth:`AsyncSandbox.processes` or :meth:`AsyncProcess.wait`. ``argv`` is
    what ran (a command string is ``["/bin/sh", "-c", command]``), ``cwd`` the effective
    working directory, ``env`` only what the request added, ``user`` as requested ("" =
    the sandbox's default user), ``operation_id`` the operation that started it."""

    exec_id: str
    command: str
    running: bool
    pid: int
    exit: ExitStatus | None
    session_id: str
    labels: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    pty: bool = False
    user: str = ""
    operation_id: str = ""

    @classmethod
    def from_pb(cls, i: types_pb2.ExecInfo) -> ExecInfo:
        running = i.status == types_pb2.EXEC_STATUS_RUNNING
        return cls(
            i.exec_id,
            i.command,
            running,
            i.pid,
            None if running else ExitStatus.from_pb(i.exit),
            i.session_id,
            dict(i.labels),
            list(i.argv),
            i.cwd,
            dict(i.env),
            i.pty,
            i.user,
            i.operation_id,
        )


@dataclass(frozen=True)
class FileInfo:
    """A file, directory or symlink in a sandbox, as one stat saw it.

    ``type`` is ``REGULAR``, ``DIRECTORY``, ``SYMLINK`` or ``OTHER``; ``mode`` the permission
    bits (``0o644``, with setuid/setgid/sticky); ``owner``/``group`` the names of ``uid``/``gid``
    in the sandbox's /etc/passwd and /etc/group, or the number as a string. For a symlink
    (a stat that did not follow it) ``symlink_target`` is the link's text and ``target`` what
    it finally resolves to (``target.path`` absolute), None when it dangles::

        info = sb.files.stat("/usr/bin/python3", follow_symlinks=False)
        info.symlink_target, info.target and info.target.path  # "python3.11", "/usr/bin/python3.11"
    """

    path: str
    type: str  # REGULAR, DIRECTORY, SYMLINK, OTHER
    size: int
    mode: int
    modified_at: datetime | None
    symlink_target: str
    uid: int = 0
    gid: int = 0
    owner: str = ""
    group: str = ""
    target: FileInfo | None = None
    #: User metadata: the ``user.e2b.*`` extended attributes, prefix stripped (see
    #: :meth:`AsyncFiles.write`'s ``metadata``).
    metadata: dict[str, str] = field(default_factory=dict, hash=False)

    @classmethod
    def from_pb(cls, f: types_pb2.FileInfo) -> FileInfo:
        return cls(
            f.path,
            _enum(types_pb2.FileType, f.type, "FILE_TYPE_"),
            f.size_bytes,
            f.mode,
            _dt(f.modified_at),
            f.symlink_target,
            f.uid,
            f.gid,
            f.owner,
            f.group,
            cls.from_pb(f.target) if f.HasField("target") else None,
            dict(f.metadata),
        )

    @property
    def is_dir(self) -> bool:
        return self.type == "DIRECTORY"


@dataclass(frozen=True)
class FileEvent:
    """A change in a watched directory: ``name`` is the path relative to it (``"a/b.txt"``),
    ``type`` one of ``"create"``, ``"write"``, ``"remove"``, ``"rename"``, ``"chmod"``;
    ``entry`` (a watch with ``include_entry``) the entry at that path when the event was
    delivered, for create, write and chmod while it is still there."""

    name: str
    type: str
    entry: FileInfo | None = None

    @classmethod
    def from_pb(cls, e: types_pb2.FileEvent) -> FileEvent:
        return cls(
            e.name,
            _enum(types_pb2.FileEventType, e.type, "FILE_EVENT_TYPE_").lower(),
            FileInfo.from_pb(e.entry) if e.HasField("entry") else None,
        )


@dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    truncated: bool

    @classmethod
    def from_pb(cls, r: types_pb2.HttpResponse) -> HttpResponse:
        return cls(r.status, [(h.name, h.value) for h in r.headers], r.body, r.truncated)

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


# ------------------------------------------------------------------ fncall


@dataclass(frozen=True)
class FunctionJob:
    """One short stateless job for a warm pool (see :meth:`libdsec.Client.fncall`).

    ``language`` is "python", "cpp", "c", "bash" or "sh" (with ``code``), or "" with a
    ``command``; ``files`` maps relative paths to contents (written next to the program);
    limits default on the server: wall 10 s, CPU = wall, memory 256 MiB, 1 MiB per stream;
    ``compile_time_limit_s`` is the compile step's wall clock (C, C++; 0 = 30 s).
    ``fetch_files`` (relative paths, at most 64) come back in the result's ``files`` after the
    run, whatever the verdict: regular files only (a symlink is not followed), 32 MiB in all;
    the others are in ``fetch_errors`` with the reason.
    """

    language: str = ""
    code: str = ""
    stdin: bytes | str = b""
    time_limit_s: float = 0.0
    cpu_limit_s: float = 0.0
    memory_mb: int = 0
    max_output_bytes: int = 0
    files: dict[str, bytes | str] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    environment: str = ""
    job_id: str = ""
    compile_time_limit_s: float = 0.0
    fetch_files: list[str] = field(default_factory=list)

    def to_pb(self) -> types_pb2.FunctionJob:
        if isinstance(self.fetch_files, str):  # list("out.txt") would ask for 7 files
            raise TypeError("fetch_files takes a list of paths, not one string")
        return types_pb2.FunctionJob(
            language=self.language,
            code=self.code,
            files=[
                types_pb2.SourceFile(path=p, content=c.encode() if isinstance(c, str) else c)
                for p, c in self.files.items()
            ],
            command=list(self.command),
            stdin=self.stdin.encode() if isinstance(self.stdin, str) else self.stdin,
            time_limit_s=self.time_limit_s,
            cpu_limit_s=self.cpu_limit_s,
            memory_mb=self.memory_mb,
            max_output_bytes=self.max_output_bytes,
            environment=self.environment,
            job_id=self.job_id,
            compile_time_limit_s=self.compile_time_limit_s,
            fetch_files=list(self.fetch_files),
        )


@dataclass(frozen=True)
class CompileInfo:
    """The compile step of a compiled language (C, C++), as it ran or as the edge's compile
    cache remembers it. ``verdict``: OK; COMPILE_ERROR (the compiler failed); TIME_LIMIT,
    MEMORY_LIMIT or OUTPUT_LIMIT (the compile step's own limits); SYSTEM_ERROR."""

    verdict: str
    exit_code: int  # the compiler's; -1 if it was killed
    wall_time_s: float  # of the compile that produced this outcome (also when cached)
    cached: bool  # the edge's compile cache answered (same source, same compiler)

    @classmethod
    def from_pb(cls, c: types_pb2.CompileInfo) -> CompileInfo:
        return cls(
            _enum(types_pb2.Verdict, c.verdict, "VERDICT_"), c.exit_code, c.wall_time_s, c.cached
        )


@dataclass(frozen=True)
class FunctionResult:
    """What a job did. ``verdict``: OK, TIME_LIMIT, MEMORY_LIMIT, OUTPUT_LIMIT,
    RUNTIME_ERROR, COMPILE_ERROR or SYSTEM_ERROR (the platform failed: retry).

    ``compile`` (compiled languages): the compile step; a COMPILE_ERROR whose
    ``compile.verdict`` is TIME_LIMIT ran out of ``compile_time_limit_s``. ``files``: the
    job's ``fetch_files`` that were regular files after the run (path -> content),
    ``fetch_errors``: the others (path -> why)."""

    verdict: str
    exit_code: int
    signal: int
    stdout: bytes
    stderr: bytes
    wall_time_s: float
    cpu_time_s: float
    peak_memory_bytes: int
    compile_output: str = ""
    message: str = ""
    index: int = 0
    job_id: str = ""
    edge_id: str = ""
    compile: CompileInfo | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    fetch_errors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, r: types_pb2.FunctionResult) -> FunctionResult:
        return cls(
            _enum(types_pb2.Verdict, r.verdict, "VERDICT_"),
            r.exit_code,
            r.signal,
            r.stdout,
            r.stderr,
            r.wall_time_s,
            r.cpu_time_s,
            r.peak_memory_bytes,
            r.compile_output,
            r.message,
            r.index,
            r.job_id,
            r.edge_id,
            CompileInfo.from_pb(r.compile) if r.HasField("compile") else None,
            {f.path: f.content for f in r.files},
            dict(r.fetch_errors),
        )

    @property
    def ok(self) -> bool:
        return self.verdict == "OK"

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stdout.decode(errors="replace")


@dataclass(frozen=True)
class Layer:
    """One read-only EROFS layer of the layer store (content-addressed)."""

    digest: str  # "sha256:<hex>"
    kind: str  # BASE, WORKSPACE, TOOLKIT, DIFF
    size_bytes: int  # metadata + data blob
    meta_bytes: int  # the part a node copies to its local disk
    source: str  # where it came from (docker image, directory, sandbox id)
    created_at: datetime | None = None

    @classmethod
    def from_pb(cls, layer: types_pb2.Layer) -> Layer:
        return cls(
            layer.digest,
            _enum(types_pb2.LayerKind, layer.kind, "LAYER_KIND_"),
            layer.size_bytes,
            layer.meta_bytes,
            layer.source,
            _dt(layer.created_at),
        )


@dataclass(frozen=True)
class Environment:
    """A named stack of layers (``name:tag``), bottom first: base, workspace, toolkits, diffs.

    Create a sandbox from it with ``client.create(image=env.name)``.
    """

    name: str
    layers: list[Layer]
    config: dict[str, str] = field(default_factory=dict)
    created_at: datetime | None = None

    @classmethod
    def from_pb(cls, env: types_pb2.Environment) -> Environment:
        return cls(
            env.name,
            [Layer.from_pb(x) for x in env.layers],
            dict(env.config),
            _dt(env.created_at),
        )

    @property
    def size_bytes(self) -> int:
        return sum(x.size_bytes for x in self.layers)

"""The keyword options of the SDK's calls, defined once for both clients.

A sandbox create first (below), then the calls into a sandbox (run, stream, files, ...) and
the client's other calls (further down, "call options").

:class:`SandboxOptions` is what a sandbox is (its environment, resources, lifetime, labels,
...); :class:`CreateOptions` adds the per-item idempotency key. ``Client.create`` and
``AsyncClient.create`` take ``**CreateOptions`` as typed keyword-only arguments,
``create_many`` takes ``**SandboxOptions`` (one template for ``count`` sandboxes) or
``specs=[CreateOptions, ...]``; a type checker checks every keyword::

    from libdsec import Client, CreateOptions

    small: CreateOptions = {"image": "busybox", "cpu": 0.5, "memory_mb": 256, "ttl_s": 600}
    with Client() as dsec:
        with dsec.create(**small, labels={"stage": "eval"}) as sb:
            print(sb.run("echo hi").text)
        many = dsec.create_many(specs=[{**small, "idempotency_key": f"k{i}"} for i in range(4)])

Every option may be left out; its default is noted. ``None`` is the same as left out.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, Required, TypedDict, Unpack, cast

from dsec.types.v1 import types_pb2
from libdsec.errors import InvalidArgument
from libdsec.types import NetworkPolicy, Quota

#: Where a sandbox runs: a container (default), a warm FnCall pool, a microVM, a full VM.
Backend = Literal["container", "fncall", "microvm", "vm"]

_BACKENDS = {
    "fncall": types_pb2.BACKEND_FNCALL,
    "container": types_pb2.BACKEND_CONTAINER,
    "microvm": types_pb2.BACKEND_MICROVM,
    "vm": types_pb2.BACKEND_VM,
}


class SandboxOptions(TypedDict, total=False):
    """What a sandbox is (every keyword of ``create`` but the idempotency key)."""

    #: default ``"container"``
    backend: Backend
    #: environment name, e.g. ``"bookworm"``, ``"busybox"``, ``"docker/python:3.11"``;
    #: default: the edge's default image (``bookworm``)
    image: str
    #: cores (fractions allowed, > 0); default 1
    cpu: float | None
    #: memory limit in MiB; default 512
    memory_mb: int | None
    #: processes and threads at most; default 512
    pids_max: int | None
    #: writable-layer limit in MB; default: the edge's (``DSEC_EDGE_DEFAULT_DISK_MB``)
    disk_mb: int | None
    #: whole GPUs, exclusive; default 0. No container or microVM backend attaches GPUs yet:
    #: a create asking for any is refused (``BackendCapabilityMissing``, capability ``gpus``).
    #: GPU work runs in FnCall's GPU pools (``dsec fncall``), where the node has GPUs.
    gpus: int | None
    #: ended (reason TTL) this many seconds after creation; default 3600
    ttl_s: int | None
    #: paused at its TTL instead of ended; the next call (or a resume) brings it back with a
    #: fresh TTL (E2B's autoPause); one left paused past the edge's keep period ends TTL
    pause_at_ttl: bool
    #: with ``pause_at_ttl``: that pause keeps the files only (see ``pause(memory=False)``)
    pause_at_ttl_files_only: bool
    #: a paused sandbox comes back only on ``resume()``: a call into it raises
    #: ``FailedPrecondition`` (reason ``SANDBOX_PAUSED``) instead of resuming it
    manual_resume: bool
    #: accounts of the sandbox that may ``sudo`` any command as anyone, without a password
    #: (``sudo_users=["user"]``); root always may. Containers only (else
    #: ``BackendCapabilityMissing``, capability ``sudo``); see the README's "sudo" section
    sudo_users: Sequence[str] | None
    #: ended (reason IDLE) after this many seconds without a call; default: never
    idle_timeout_s: int | None
    #: free-form labels, to list, watch or stop by (``labels={"stage": "train"}``)
    labels: Mapping[str, str] | None
    #: the RL task it belongs to, to list, watch or stop by; default none
    task_id: str
    #: environment variables of every command
    env: Mapping[str, str] | None
    #: egress policy (:class:`NetworkPolicy`); default: no network
    network: NetworkPolicy | None
    #: working directory of commands (and the trusted step's workspace); default: the image's
    workdir: str
    #: best-effort QoS class (may be throttled first) instead of latency-sensitive
    best_effort: bool
    #: only edges whose labels match all of these
    node_selector: Mapping[str, str] | None
    #: toolkit environments mounted read-only beside the image
    toolkits: Iterable[str]


class CreateOptions(SandboxOptions, total=False):
    """Every keyword of ``create``, and each item of ``create_many(specs=...)``."""

    #: a retried create with the same key (per project, kept 24 h) returns the first
    #: attempt's sandbox instead of making another; default: a fresh key per sandbox
    #: (:func:`new_idempotency_key`), so the SDK's own retries (an API server restarting)
    #: never create twice
    idempotency_key: str


#: The names of the options.
SANDBOX_KEYS = SandboxOptions.__optional_keys__ | SandboxOptions.__required_keys__
CREATE_KEYS = CreateOptions.__optional_keys__ | CreateOptions.__required_keys__


def check_options(options: Mapping[str, object], allowed: frozenset[str] = SANDBOX_KEYS) -> None:
    """Raises TypeError naming an option that is not one (as a misspelt keyword would)."""
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(
            f"unexpected option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
            f" (options: {', '.join(sorted(allowed))})"
        )


def new_idempotency_key() -> str:
    """A fresh idempotency key, for a create whose caller gave none: ``sdk-<time><random>``
    (nanoseconds since the epoch in 16 hex digits, then 80 random bits). Keys made later sort
    later, so IAM's index of keys grows at its end: a burst of random keys (uuid4) dirtied
    a page of that index per key, which made keyed creates cost twice as much in IAM."""
    return f"sdk-{time.time_ns():016x}{secrets.token_hex(10)}"


def split_key(options: CreateOptions) -> tuple[str, SandboxOptions]:
    """The idempotency key (the caller's, else a fresh one) and the sandbox's options of
    ``options`` (checked)."""
    check_options(options, CREATE_KEYS)
    rest = {k: v for k, v in options.items() if k != "idempotency_key"}
    return options.get("idempotency_key") or new_idempotency_key(), cast(SandboxOptions, rest)


def make_spec(**options: Unpack[SandboxOptions]) -> types_pb2.SandboxSpec:
    """The protobuf ``SandboxSpec`` of the options (what ``create`` and ``create_many`` send).

    A bad value raises :class:`~libdsec.errors.InvalidArgument` before anything is sent::

        spec = make_spec(image="busybox", cpu=0.5, labels={"stage": "eval"})
    """
    check_options(options)
    backend = options.get("backend") or "container"
    if backend not in _BACKENDS:
        raise InvalidArgument(
            f"backend must be one of {sorted(_BACKENDS)}, not {backend!r}", reason="INVALID_BACKEND"
        )
    cpu = options.get("cpu")
    if cpu is not None and cpu <= 0:
        raise InvalidArgument(f"cpu must be > 0, not {cpu}", reason="INVALID_RESOURCES")
    spec = types_pb2.SandboxSpec(
        backend=_BACKENDS[backend],
        image=options.get("image") or "",
        resources=types_pb2.Resources(
            cpu_millis=round((cpu or 0) * 1000),
            memory_mb=options.get("memory_mb") or 0,
            pids_max=options.get("pids_max") or 0,
            disk_mb=options.get("disk_mb") or 0,
            gpu_count=options.get("gpus") or 0,
        ),
        ttl_s=options.get("ttl_s") or 0,
        idle_timeout_s=options.get("idle_timeout_s") or 0,
        labels=dict(options.get("labels") or {}),
        task_id=options.get("task_id") or "",
        env=dict(options.get("env") or {}),
        workdir=options.get("workdir") or "",
        qos=types_pb2.QOS_CLASS_BEST_EFFORT
        if options.get("best_effort")
        else types_pb2.QOS_CLASS_LATENCY_SENSITIVE,
        node_selector=dict(options.get("node_selector") or {}),
        toolkits=list(options.get("toolkits") or ()),
        pause_at_ttl=bool(options.get("pause_at_ttl")),
        pause_at_ttl_files_only=bool(options.get("pause_at_ttl_files_only")),
        manual_resume=bool(options.get("manual_resume")),
        sudo_users=list(options.get("sudo_users") or ()),
    )
    network = options.get("network")
    if network is not None:
        spec.network.CopyFrom(network.to_pb())
    return spec


# ------------------------------------------------------------------ call options
#
# The options of the other calls, one TypedDict per option set. The async client and its
# handles spell each option set out as keyword-only parameters (their defaults are there);
# the sync client and its handles take ``**options: Unpack[<the set>]`` and pass them on, so
# a type checker checks every keyword of both (mypy checks the passing on against the async
# signature) and a keyword left out keeps the async side's default. A misspelt keyword is a
# type error, and a TypeError at run time, in both clients.


class ExecOptions(TypedDict, total=False):
    """What ``run``, ``stream`` and ``start`` share (see :meth:`AsyncSandbox.run`)."""

    #: the command's wall clock (its process group is killed after it)
    timeout_s: float | None
    #: working directory; default: the sandbox's
    cwd: str | None
    #: environment variables added to the sandbox's
    env: Mapping[str, str] | None
    #: the command's whole input (a str is UTF-8)
    stdin: bytes | str | None
    #: output kept per stream (head and tail beyond it)
    max_output_bytes: int | None
    #: run as this user of the sandbox's ``/etc/passwd`` (name or uid)
    user: str
    #: tags of the command (:attr:`ExecInfo.labels`)
    labels: Mapping[str, str] | None
    #: this operation's id in the sandbox's operation log: a call with an id already logged
    #: returns that operation's result and never runs again (default: a new one per call,
    #: kept across the SDK's own retries)
    operation_id: str | None


class SessionRunOptions(ExecOptions, total=False):
    """The keywords of ``Session.run``: those of ``Sandbox.run`` but ``session``."""

    #: run under a terminal
    pty: bool
    #: the evaluation step: from the image's read-only layers, unseen by the agent
    trusted: bool


class RunOptions(SessionRunOptions, total=False):
    """The keywords of ``Sandbox.run``."""

    #: the id of a persistent shell session to run in
    session: str


class SessionStreamOptions(ExecOptions, total=False):
    """The keywords of ``Session.stream``: those of ``Sandbox.stream`` but ``session``."""

    #: run under a terminal, True (24x80) or ``(rows, cols)``
    pty: bool | tuple[int, int]
    #: the evaluation step (see :class:`SessionRunOptions`)
    trusted: bool
    #: the command outlives the stream (reattach with ``sb.process(exec_id)``)
    background: bool
    #: keep its stdin open for ``send_stdin``
    stdin_open: bool


class StreamOptions(SessionStreamOptions, total=False):
    """The keywords of ``Sandbox.stream``."""

    #: the id of a persistent shell session to run in
    session: str


class StartOptions(ExecOptions, total=False):
    """The keywords of ``Sandbox.start`` (a background command)."""

    #: the id of a persistent shell session to run in
    session: str
    #: keep its stdin open for ``send_stdin``
    stdin_open: bool
    #: run under a terminal, True (24x80) or ``(rows, cols)``; its input stays open
    pty: bool | tuple[int, int]


class AttachOptions(TypedDict, total=False):
    """The keywords of ``Process.attach``."""

    #: replay stdout from this byte offset; default 0
    stdout_offset: int
    #: replay stderr from this byte offset; default 0
    stderr_offset: int
    #: then follow live output to the exit (default) or end with what is held now
    follow: bool


class SessionOptions(TypedDict, total=False):
    """The keywords of ``Sandbox.session`` (a persistent shell)."""

    #: the shell; default: the sandbox's
    shell: str
    #: its first working directory
    cwd: str
    #: environment variables added to the sandbox's
    env: Mapping[str, str] | None


class HttpOptions(TypedDict, total=False):
    """The keywords of ``Sandbox.http``."""

    #: default ``"GET"``
    method: str
    headers: Mapping[str, str] | None
    #: the request body (a str is UTF-8)
    body: bytes | str
    #: the request's deadline; default 30
    timeout_s: float
    #: first wait this long for the server to listen; default 0 (send at once)
    wait_s: float


class WaitForPortOptions(TypedDict, total=False):
    """The keywords of ``Sandbox.wait_for_port``."""

    #: give up after this long; default 30
    timeout_s: float


class StopOptions(TypedDict, total=False):
    """The keywords of ``Sandbox.stop``."""

    #: SIGTERM, then SIGKILL after this long; default 2
    grace_s: float


class ForkOptions(TypedDict, total=False):
    """The keywords of ``Sandbox.fork``."""

    #: set on every child, over the source's labels
    labels: Mapping[str, str] | None
    #: the children's task ("" = the source's)
    task_id: str
    #: the children's TTL (0 = the source's)
    ttl_s: int
    #: refuse a files-only fork (containers) instead of making one
    require_memory: bool
    #: the call's deadline; default 900
    timeout: float


class PackDiffOptions(TypedDict, total=False):
    """The keywords of ``Sandbox.pack_diff``."""

    #: absolute path globs left out besides the default ones
    exclude: Iterable[str]
    #: leave out build residue (``/tmp``, caches, ...); default True
    default_excludes: bool
    #: entries added to the environment's config (``env.NAME``, ``workdir``, your own keys)
    config: Mapping[str, str] | None
    #: the call's deadline; default 1800
    timeout: float


class ReadOptions(TypedDict, total=False):
    """The keywords of ``Files.read``: a slice (default: the whole file)."""

    offset: int
    #: 0: to the end
    length: int


class WriteOptions(TypedDict, total=False):
    """The keywords of ``Files.write``."""

    #: permission bits; 0 (default): the server's
    mode: int
    append: bool
    #: create missing parent directories; default True
    make_parents: bool
    #: its id in the sandbox's operation log (see :class:`ExecOptions`)
    operation_id: str | None
    #: the owner of what it creates (a user of the sandbox's /etc/passwd); default root
    user: str
    #: the file's whole metadata after the write (``user.e2b.*`` extended attributes)
    metadata: dict[str, str] | None


class ListDirOptions(TypedDict, total=False):
    """The keywords of ``Files.list``."""

    #: 0: all
    max_entries: int


class StatOptions(TypedDict, total=False):
    """The keywords of ``Files.stat``."""

    #: default True
    follow_symlinks: bool


class MkdirOptions(TypedDict, total=False):
    """The keywords of ``Files.mkdir``."""

    #: permission bits; 0 (default): the server's
    mode: int
    #: create missing parents; default True
    parents: bool

    #: its id in the sandbox's operation log (see :class:`ExecOptions`)
    operation_id: str | None
    #: the owner of what it creates (a user of the sandbox's /etc/passwd); default root
    user: str


class RemoveOptions(TypedDict, total=False):
    """The keywords of ``Files.remove``."""

    #: a directory with what it holds; default False
    recursive: bool

    #: its id in the sandbox's operation log (see :class:`ExecOptions`)
    operation_id: str | None


class MoveOptions(TypedDict, total=False):
    """The keywords of ``Files.move``."""

    #: replace an existing destination; default False
    overwrite: bool

    #: its id in the sandbox's operation log (see :class:`ExecOptions`)
    operation_id: str | None


class UploadOptions(TypedDict, total=False):
    """The keywords of ``Files.upload``."""

    #: permission bits; 0 (default): the server's
    mode: int
    #: create missing parent directories; default True
    make_parents: bool
    #: bytes per message; default 1 MiB
    chunk_bytes: int

    #: its id in the sandbox's operation log (see :class:`ExecOptions`)
    operation_id: str | None
    #: the owner of what it creates (a user of the sandbox's /etc/passwd); default root
    user: str
    #: the file's metadata (as :class:`WriteOptions`')
    metadata: dict[str, str] | None


class DownloadOptions(TypedDict, total=False):
    """The keywords of ``Files.iter_download``."""

    #: start at this byte; default 0
    offset: int
    #: bytes per message; default 1 MiB
    chunk_bytes: int


class ListOptions(TypedDict, total=False):
    """The keywords of ``Client.list``."""

    task_id: str
    #: all must match
    labels: Mapping[str, str] | None
    #: e.g. ``["running", "paused"]``; default: any
    states: Iterable[str]
    include_subprojects: bool
    timeout: float | None


class StopAllOptions(TypedDict, total=False):
    """The keywords of ``Client.stop_all``."""

    task_id: str
    labels: Mapping[str, str] | None
    #: default 120
    timeout: float | None


class FunctionOptions(TypedDict, total=False):
    """The keywords of ``Client.fncall`` (see :meth:`AsyncClient.fncall`)."""

    language: str
    code: str
    stdin: bytes | str
    time_limit_s: float
    cpu_limit_s: float
    memory_mb: int
    max_output_bytes: int
    files: Mapping[str, bytes | str] | None
    command: Iterable[str]
    environment: str
    job_id: str
    compile_time_limit_s: float
    fetch_files: Iterable[str]
    timeout: float | None


class FunctionBatchOptions(TypedDict, total=False):
    """The keywords of ``Client.fncall_many``."""

    #: jobs run at once; 0: the server's choice
    parallelism: int


class ImportOptions(TypedDict, total=False):
    """The keywords of ``Client.import_image``."""

    #: the layer's kind for a ``dir:`` or ``tar:`` source: base, workspace or toolkit
    kind: str
    #: the environment it goes on top of
    base: str
    all_root: bool
    #: default 3600
    timeout: float | None


class ComposeOptions(TypedDict, total=False):
    """The keywords of ``Client.compose_environment`` (``base`` is required)."""

    base: Required[str]
    workspace: str
    toolkits: Iterable[str]
    timeout: float | None


class ProjectOptions(TypedDict, total=False):
    """The keywords of ``Client.create_project``."""

    #: default: this token's project
    parent: str
    quota: Quota | None
    #: return an existing project of that name as it is
    exist_ok: bool
    timeout: float | None


class ListProjectsOptions(TypedDict, total=False):
    """The keywords of ``Client.list_projects``."""

    recursive: bool
    timeout: float | None


class TokenOptions(TypedDict, total=False):
    """The keywords of ``Client.create_token``."""

    #: default: this token's project
    project: str
    agent: bool
    admin: bool
    #: 0: never expires
    ttl_s: int
    #: shaped as an E2B API key (``e2b_<hex>``)
    e2b: bool
    timeout: float | None


class ListTokensOptions(TypedDict, total=False):
    """The keywords of ``Client.list_tokens``."""

    include_revoked: bool
    timeout: float | None


__all__ = [
    "AttachOptions",
    "Backend",
    "ComposeOptions",
    "CreateOptions",
    "DownloadOptions",
    "ExecOptions",
    "FunctionBatchOptions",
    "FunctionOptions",
    "HttpOptions",
    "ImportOptions",
    "ListDirOptions",
    "ListOptions",
    "ListProjectsOptions",
    "ListTokensOptions",
    "MkdirOptions",
    "MoveOptions",
    "PackDiffOptions",
    "ProjectOptions",
    "ReadOptions",
    "RemoveOptions",
    "RunOptions",
    "SandboxOptions",
    "SessionOptions",
    "SessionRunOptions",
    "SessionStreamOptions",
    "StartOptions",
    "StatOptions",
    "StopAllOptions",
    "StopOptions",
    "StreamOptions",
    "TokenOptions",
    "UploadOptions",
    "WaitForPortOptions",
    "WriteOptions",
    "make_spec",
]

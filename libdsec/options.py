"""The options of a sandbox create, defined once for both clients.

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

import uuid
from collections.abc import Iterable, Mapping
from typing import Literal, TypedDict, Unpack, cast

from dsec.types.v1 import types_pb2
from libdsec.errors import InvalidArgument
from libdsec.types import NetworkPolicy

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
    """A fresh idempotency key (``sdk-<uuid4>``), for a create whose caller gave none."""
    return f"sdk-{uuid.uuid4()}"


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
    )
    network = options.get("network")
    if network is not None:
        spec.network.CopyFrom(network.to_pb())
    return spec


__all__ = ["Backend", "CreateOptions", "SandboxOptions", "make_spec"]

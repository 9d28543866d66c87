"""Conversions between edge domain records and dsec.types.v1 messages."""

from __future__ import annotations

from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from common.convert import enum_name, ts
from dsec.types.v1 import types_pb2
from edge.model import SandboxRecord, SandboxSpec

_DEFAULTS = SandboxSpec()


def backend_name(value: int) -> str:
    return enum_name(types_pb2.Backend, value, "backend", "BACKEND_")


def _rule_dict(rule: types_pb2.NetworkRule) -> dict[str, Any]:
    d: dict[str, Any] = {"target": rule.target}
    if rule.port_min:
        d["port_min"] = rule.port_min
    if rule.port_max:
        d["port_max"] = rule.port_max
    if rule.protocol:
        d["protocol"] = enum_name(types_pb2.Protocol, rule.protocol, "network.protocol")
    return d


def network_from_pb(policy: types_pb2.NetworkPolicy) -> dict[str, Any]:
    """A NetworkPolicy as the dict the edge keeps (what MessageToDict gives, field names kept),
    built by hand: json_format takes ~20 ms for a 1,000-rule policy, which alone would spend the
    10 ms an update may take to reach the kernel."""
    d: dict[str, Any] = {}
    if policy.mode:
        d["mode"] = enum_name(types_pb2.NetworkMode, policy.mode, "network.mode")
    if policy.allow:
        d["allow"] = [_rule_dict(r) for r in policy.allow]
    if policy.deny:
        d["deny"] = [_rule_dict(r) for r in policy.deny]
    if policy.max_blocked_connects:
        d["max_blocked_connects"] = policy.max_blocked_connects
    return d


def network_to_pb(d: dict[str, Any], out: types_pb2.NetworkPolicy) -> None:
    """The inverse of network_from_pb (enums by name or number)."""
    mode = d.get("mode") or 0
    out.mode = types_pb2.NetworkMode.Value(mode) if isinstance(mode, str) else mode  # type: ignore[assignment]
    for key, rules in (("allow", out.allow), ("deny", out.deny)):
        for r in d.get(key) or ():
            proto = r.get("protocol") or 0
            rules.add(
                target=r.get("target", ""),
                port_min=int(r.get("port_min") or 0),
                port_max=int(r.get("port_max") or 0),
                protocol=types_pb2.Protocol.Value(proto) if isinstance(proto, str) else proto,  # type: ignore[arg-type]
            )
    out.max_blocked_connects = int(d.get("max_blocked_connects") or 0)


def spec_from_pb(spec: types_pb2.SandboxSpec) -> SandboxSpec:
    r = spec.resources
    network = network_from_pb(spec.network) if spec.HasField("network") else {}
    qos = enum_name(types_pb2.QosClass, spec.qos, "spec.qos", "QOS_CLASS_")
    return SandboxSpec(
        backend=backend_name(spec.backend) if spec.backend else "CONTAINER",
        image=spec.image,
        cpu_millis=r.cpu_millis or _DEFAULTS.cpu_millis,
        memory_mb=r.memory_mb or _DEFAULTS.memory_mb,
        pids_max=r.pids_max or _DEFAULTS.pids_max,
        disk_mb=r.disk_mb,
        gpu_count=r.gpu_count,
        ttl_s=spec.ttl_s or _DEFAULTS.ttl_s,
        idle_timeout_s=spec.idle_timeout_s,
        labels=dict(spec.labels),
        task_id=spec.task_id,
        env=dict(spec.env),
        workdir=spec.workdir,
        network=network,
        qos="LATENCY_SENSITIVE" if qos == "UNSPECIFIED" else qos,
        node_selector=dict(spec.node_selector),
        toolkits=list(spec.toolkits),
        pause_at_ttl=spec.pause_at_ttl,
        manual_resume=spec.manual_resume,
        pause_at_ttl_files_only=spec.pause_at_ttl_files_only,
        sudo_users=list(spec.sudo_users),
    )


def spec_pb(spec: SandboxSpec) -> types_pb2.SandboxSpec:
    out = types_pb2.SandboxSpec(
        backend=types_pb2.Backend.Value("BACKEND_" + spec.backend),  # type: ignore[arg-type]
        image=spec.image,
        resources=types_pb2.Resources(
            cpu_millis=spec.cpu_millis,
            memory_mb=spec.memory_mb,
            pids_max=spec.pids_max,
            disk_mb=spec.disk_mb,
            gpu_count=spec.gpu_count,
        ),
        ttl_s=spec.ttl_s,
        idle_timeout_s=spec.idle_timeout_s,
        labels=spec.labels,
        task_id=spec.task_id,
        env=spec.env,
        workdir=spec.workdir,
        qos=types_pb2.QosClass.Value("QOS_CLASS_" + spec.qos),  # type: ignore[arg-type]
        node_selector=spec.node_selector,
        toolkits=spec.toolkits,
        pause_at_ttl=spec.pause_at_ttl,
        manual_resume=spec.manual_resume,
        pause_at_ttl_files_only=spec.pause_at_ttl_files_only,
        sudo_users=spec.sudo_users,
    )
    if spec.network:
        network_to_pb(spec.network, out.network)
    return out


def sandbox_pb(rec: SandboxRecord) -> types_pb2.Sandbox:
    out = types_pb2.Sandbox(
        id=rec.sandbox_id,
        project_id=rec.project_id,
        principal_id=rec.principal_id,
        forked_from=rec.forked_from,
        paused_files_only=rec.paused_files_only and rec.state == "PAUSED",
        spec=spec_pb(rec.spec),
        state=types_pb2.SandboxState.Value("SANDBOX_STATE_" + rec.state),  # type: ignore[arg-type]
        edge_id=rec.edge_id,
        created_at=ts(rec.created_at),
        started_at=ts(rec.started_at),
        last_active_at=ts(rec.last_active_at),
        expires_at=ts(rec.expires_at) if rec.expires else None,
        violations=types_pb2.ViolationCounters(**rec.violations, blocked_names=rec.blocked_names),
    )
    if rec.memory and rec.live:
        m = rec.memory
        out.memory.CopyFrom(
            types_pb2.SandboxMemory(
                resident_bytes=m.get("resident_bytes", 0),
                swapped_bytes=m.get("swapped_bytes", 0),
                measured_at=ts(m.get("at")),
                freed_bytes=m.get("freed_bytes", 0),
                pause_s=m.get("pause_s", 0.0),
                released_mb=rec.released_mb,
                frozen_only=m.get("frozen_only", ""),
            )
        )
    if rec.termination_reason:
        out.termination.CopyFrom(
            types_pb2.Termination(
                reason=types_pb2.TerminationReason.Value(
                    "TERMINATION_REASON_" + rec.termination_reason
                ),  # type: ignore[arg-type]
                message=rec.termination_message,
                at=ts(rec.terminated_at),
            )
        )
    return out


def _set_ts(field: Timestamp, seconds: float | None) -> None:
    if seconds is None:
        field.Clear()
    else:
        nanos = int(seconds * 1e9)
        field.seconds, field.nanos = divmod(nanos, 1_000_000_000)


def sandbox_pb_fast(
    rec: SandboxRecord, group: int, templates: dict[int, types_pb2.Sandbox], out: types_pb2.Sandbox
) -> None:
    """Fills ``out`` like :func:`sandbox_pb` for a sandbox just created from group
    ``group`` of a batch (one spec, project and principal), copying what the
    group's sandboxes share from a template kept in ``templates``: converting
    the spec for every sandbox of a burst is the expensive part."""
    if rec.termination_reason or rec.violations or rec.blocked_names:
        out.CopyFrom(sandbox_pb(rec))
        return
    tmpl = templates.get(group)
    if tmpl is None:
        out.CopyFrom(sandbox_pb(rec))
        templates[group] = out
        return
    out.CopyFrom(tmpl)
    out.id = rec.sandbox_id
    out.state = types_pb2.SandboxState.Value("SANDBOX_STATE_" + rec.state)  # type: ignore[assignment]
    _set_ts(out.created_at, rec.created_at)
    _set_ts(out.started_at, rec.started_at)
    _set_ts(out.last_active_at, rec.last_active_at)
    _set_ts(out.expires_at, rec.expires_at if rec.expires else None)

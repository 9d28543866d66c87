"""Conversions between edge domain records and dsec.types.v1 messages."""

from __future__ import annotations

from google.protobuf import json_format

from common.convert import ts
from dsec.types.v1 import types_pb2
from edge.model import SandboxRecord, SandboxSpec

_DEFAULTS = SandboxSpec()


def backend_name(value: int) -> str:
    return types_pb2.Backend.Name(value).removeprefix("BACKEND_")  # type: ignore[arg-type]


def spec_from_pb(spec: types_pb2.SandboxSpec) -> SandboxSpec:
    r = spec.resources
    network = (
        json_format.MessageToDict(spec.network, preserving_proto_field_name=True)
        if spec.HasField("network")
        else {}
    )
    qos = types_pb2.QosClass.Name(spec.qos).removeprefix("QOS_CLASS_")
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
    )
    if spec.network:
        json_format.ParseDict(spec.network, out.network)
    return out


def sandbox_pb(rec: SandboxRecord) -> types_pb2.Sandbox:
    out = types_pb2.Sandbox(
        id=rec.sandbox_id,
        project_id=rec.project_id,
        principal_id=rec.principal_id,
        spec=spec_pb(rec.spec),
        state=types_pb2.SandboxState.Value("SANDBOX_STATE_" + rec.state),  # type: ignore[arg-type]
        edge_id=rec.edge_id,
        created_at=ts(rec.created_at),
        started_at=ts(rec.started_at),
        last_active_at=ts(rec.last_active_at),
        expires_at=ts(rec.expires_at) if rec.spec.ttl_s else None,
        violations=types_pb2.ViolationCounters(**rec.violations),
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

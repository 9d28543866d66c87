"""Sandbox handles made from the API server's description (what ``create_many`` and ``fork``
return, tens of thousands at a time): the id at once, the SandboxInfo converted on the first
read of ``info`` and kept, equal to converting at once; and the keys the SDK makes for creates
without one."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest

from dsec.types.v1 import types_pb2
from libdsec import AsyncSandbox, Sandbox, SandboxInfo
from libdsec.options import new_idempotency_key


def description() -> types_pb2.Sandbox:
    pb = types_pb2.Sandbox(
        id="sb-e1-0123456789abcdef",
        project_id="root/p",
        principal_id="tok-1",
        edge_id="e1",
        state=types_pb2.SANDBOX_STATE_RUNNING,
        spec=types_pb2.SandboxSpec(
            backend=types_pb2.BACKEND_CONTAINER,
            image="busybox",
            task_id="t",
            labels={"k": "v"},
            env={"A": "1"},
            resources=types_pb2.Resources(cpu_millis=250, memory_mb=64),
            toolkits=["py"],
        ),
    )
    pb.created_at.FromSeconds(1_700_000_000)
    pb.violations.blocked_names["example.com"] = 2
    return pb


def test_a_handle_converts_its_description_once_on_first_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pb = description()
    expected = SandboxInfo.from_pb(pb)
    conversions: list[str] = []
    convert = SandboxInfo.from_pb

    def counting(s: types_pb2.Sandbox) -> SandboxInfo:
        conversions.append(s.id)
        return convert(s)

    monkeypatch.setattr(SandboxInfo, "from_pb", counting)
    sb = AsyncSandbox(cast(Any, None), pb)
    assert sb.id == "sb-e1-0123456789abcdef" and sb.files.sandbox_id == sb.id
    assert sb.files is sb.files and sb.display is sb.display
    assert conversions == []  # nothing read yet
    assert sb.info == expected and sb.info is sb.info
    assert sb.info.spec is not None and sb.info.spec.env == {"A": "1"}
    assert sb.info.violations.blocked_names == {"example.com": 2}
    assert conversions == [sb.id]
    newer = dataclasses.replace(sb.info, state="TERMINATED")
    sb.info = newer  # what refresh() and stop() do
    assert sb.info is newer and conversions == [sb.id]

    wrapped = Sandbox(cast(Any, None), sb)  # the sync handle reads through
    assert wrapped.info is newer and wrapped.files is wrapped.files


def test_converted_maps_and_lists_are_each_sandbox_s_own() -> None:
    a, b = (AsyncSandbox(cast(Any, None), description()) for _ in range(2))
    assert a.info.labels is not b.info.labels
    a.info.labels["k"] = "changed"
    assert b.info.labels == {"k": "v"}
    empty = AsyncSandbox(cast(Any, None), types_pb2.Sandbox(id="sb-e1-aaaaaa01"))
    assert empty.info.labels == {} and empty.info.spec is not None
    assert empty.info.spec.toolkits == [] and empty.info.spec.network.allow == []


def test_sdk_keys_are_unique_and_sort_by_when_they_were_made() -> None:
    keys = [new_idempotency_key() for _ in range(2000)]
    assert len(set(keys)) == len(keys)
    assert all(k.startswith("sdk-") and len(k) == 40 for k in keys)
    times = [int(k[4:20], 16) for k in keys]  # nanoseconds, 16 hex digits
    assert times == sorted(times)

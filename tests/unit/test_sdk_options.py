"""The create options, defined once (libdsec/options.py): what they send, what they refuse, and
that a type checker holds both clients to them."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsec.types.v1 import types_pb2
from libdsec import AsyncClient, Client, NetworkPolicy
from libdsec.errors import InvalidArgument
from libdsec.options import CreateOptions, SandboxOptions, make_spec

ROOT = Path(__file__).resolve().parents[2]


def test_the_spec_carries_every_option() -> None:
    spec = make_spec(
        backend="container",
        image="bookworm",
        cpu=1.5,
        memory_mb=1024,
        pids_max=64,
        disk_mb=256,
        gpus=1,
        ttl_s=600,
        idle_timeout_s=60,
        labels={"stage": "eval"},
        task_id="swe-1",
        env={"A": "1"},
        network=NetworkPolicy(allow=["pypi.org:443"]),
        workdir="/repo",
        best_effort=True,
        node_selector={"zone": "a"},
        toolkits=["py-tools"],
    )
    r = spec.resources
    assert (r.cpu_millis, r.memory_mb, r.pids_max, r.disk_mb, r.gpu_count) == (
        1500,
        1024,
        64,
        256,
        1,
    )
    assert (spec.image, spec.ttl_s, spec.idle_timeout_s, spec.task_id) == (
        "bookworm",
        600,
        60,
        "swe-1",
    )
    assert dict(spec.labels) == {"stage": "eval"} and dict(spec.env) == {"A": "1"}
    assert spec.network.mode == types_pb2.NETWORK_MODE_ALLOWLIST
    assert spec.workdir == "/repo" and spec.qos == types_pb2.QOS_CLASS_BEST_EFFORT
    assert dict(spec.node_selector) == {"zone": "a"} and list(spec.toolkits) == ["py-tools"]
    # Left out and None mean the same: the server's defaults.
    assert make_spec() == make_spec(cpu=None, memory_mb=None, labels=None, network=None)
    assert make_spec().backend == types_pb2.BACKEND_CONTAINER
    assert not make_spec().HasField("network")


def test_bad_options_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(InvalidArgument) as info:
        make_spec(backend="lambda")  # type: ignore[typeddict-item]
    assert info.value.reason == "INVALID_BACKEND"
    with pytest.raises(InvalidArgument) as info:
        make_spec(cpu=0)
    assert info.value.reason == "INVALID_RESOURCES"
    with pytest.raises(TypeError, match="'cpus'"):  # as a misspelt keyword would
        make_spec(cpus=1)  # type: ignore[call-arg]


async def test_create_many_refuses_mixed_or_missing_forms() -> None:
    async with AsyncClient("127.0.0.1:1", token="t") as c:  # nothing is sent: no server needed
        with pytest.raises(InvalidArgument, match="count"):
            await c.create_many()
        with pytest.raises(InvalidArgument, match="idempotency"):
            await c.create_many(2, idempotency_key="k")  # type: ignore[call-arg]
        with pytest.raises(InvalidArgument, match="not both"):
            await c.create_many(specs=[{"image": "busybox"}], image="bookworm")
        with pytest.raises(TypeError, match="'imagee'"):
            await c.create_many(specs=[{"imagee": "busybox"}])  # type: ignore[typeddict-unknown-key]
        with pytest.raises(TypeError, match="'imagee'"):
            await c.create(imagee="busybox")  # type: ignore[call-arg]


def test_both_clients_take_the_same_keywords() -> None:
    for name in ("create", "create_many"):
        sync = inspect.signature(getattr(Client, name)).parameters
        aio = inspect.signature(getattr(AsyncClient, name)).parameters
        assert list(sync) == list(aio), name
        for p in sync:
            assert (sync[p].kind, sync[p].default, str(sync[p].annotation)) == (
                aio[p].kind,
                aio[p].default,
                str(aio[p].annotation),
            ), (name, p)
    assert "Unpack[CreateOptions]" in str(inspect.signature(Client.create).parameters["options"])
    assert set(CreateOptions.__optional_keys__) == set(SandboxOptions.__optional_keys__) | {
        "idempotency_key"
    }


def test_a_type_checker_holds_callers_to_the_options(tmp_path: Path) -> None:
    caller = tmp_path / "caller.py"
    caller.write_text(
        textwrap.dedent(
            """
            from libdsec import AsyncClient, Client, NetworkPolicy

            def sync_ok(c: Client) -> None:
                c.create(image="busybox", cpu=0.5, labels={"a": "b"}, idempotency_key="k")
                c.create_many(3, image="busybox", network=NetworkPolicy())
                c.create_many(specs=[{"image": "busybox", "idempotency_key": "k"}])

            def sync_bad(c: Client) -> None:
                c.create(cpus=1)
                c.create(cpu="one")
                c.create_many(2, idempotency_key="k")

            async def async_bad(c: AsyncClient) -> None:
                await c.create(backend="lambda")
                await c.create_many(specs=[{"ttl": 5}])
            """
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", str(caller)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in r.stdout.splitlines() if ": error:" in line]
    lines = sorted({int(line.split(":")[1]) for line in errors})
    assert lines == [10, 11, 12, 15, 16], r.stdout

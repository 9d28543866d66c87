"""`dsec grpc` (dsecctl/grpc_cli.py) as an operator runs it: a subprocess against the real
services of a cluster with one null edge (no containers), over reflection only.

Runs the module (`python -m dsecctl.grpc_cli ...` is `dsec grpc ...`), with $DSEC_HOME the
cluster's, so the default address and token come from its cluster.json and token file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dsec.apiserver.v1 import apiserver_pb2
from dsecctl.cluster import LocalCluster, free_port
from dsecctl.grpc_cli import _split_words
from libdsec import Client

ROOT = Path(__file__).resolve().parents[2]
SANDBOX_SERVICE = "dsec.apiserver.v1.SandboxService"
WHOAMI = "dsec.apiserver.v1.ProjectService/WhoAmI"


def grpc_cli(
    cluster: LocalCluster, *args: str, stdin: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DSEC_TARGET", "DSEC_TOKEN")}
    env["DSEC_HOME"] = str(cluster.home)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "dsecctl.grpc_cli", *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def json_documents(text: str) -> list[Any]:
    """Every JSON document of ``text`` (a stream prints one per message)."""
    decoder, docs, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        at = len(text) - len(text[at:].lstrip())
        doc, at = decoder.raw_decode(text, at)
        docs.append(doc)
    return docs


# --------------------------------------------------------------------- words


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["list"], (None, "list", None)),
        (["unix:/s.sock", "list", "a.B"], ("unix:/s.sock", "list", "a.B")),
        (["127.0.0.1:7100", "describe"], ("127.0.0.1:7100", "describe", None)),
        (["a.B/C"], (None, "call", "a.B/C")),
        (["myhost", "a.B/C"], ("myhost", "call", "a.B/C")),
    ],
)
def test_an_address_is_recognised_before_the_verb_or_method(
    words: list[str], expected: tuple[str | None, str, str | None]
) -> None:
    assert _split_words(words) == expected


# --------------------------------------------------------------------- list, describe


def test_list_shows_the_api_servers_services_by_default(cluster: LocalCluster) -> None:
    r = grpc_cli(cluster, "list")
    assert r.returncode == 0, r.stderr
    services = r.stdout.split()
    assert SANDBOX_SERVICE in services
    assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(services)


def test_list_service_shows_its_methods(cluster: LocalCluster) -> None:
    r = grpc_cli(cluster, cluster.apiserver, "list", SANDBOX_SERVICE)
    assert r.returncode == 0, r.stderr
    ours = apiserver_pb2.DESCRIPTOR.services_by_name["SandboxService"]
    assert r.stdout.split() == [f"{SANDBOX_SERVICE}.{m.name}" for m in ours.methods]


def test_describe_a_message_as_proto_text(cluster: LocalCluster) -> None:
    r = grpc_cli(cluster, "describe", "dsec.apiserver.v1.WatchSandboxesRequest")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        "dsec.apiserver.v1.WatchSandboxesRequest is a message:\n"
        "message WatchSandboxesRequest {\n"
        "  string task_id = 1;\n"
        "  map<string, string> label_selector = 2;\n"
        "  uint32 keepalive_interval_ms = 3;\n"
        "  .google.protobuf.Timestamp changed_since = 4;\n"
        "}\n"
    )
    r = grpc_cli(cluster, "describe", "dsec.apiserver.v1.WatchSandboxesResponse")
    assert "  oneof event {\n    .dsec.types.v1.Sandbox changed = 1;\n" in r.stdout


def test_describe_a_streaming_method(cluster: LocalCluster) -> None:
    r = grpc_cli(cluster, "describe", f"{SANDBOX_SERVICE}/WatchSandboxes")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        f"{SANDBOX_SERVICE}.WatchSandboxes is a method:\n"
        "rpc WatchSandboxes ( .dsec.apiserver.v1.WatchSandboxesRequest ) returns "
        "( stream .dsec.apiserver.v1.WatchSandboxesResponse );\n"
    )


def test_describe_an_unknown_symbol_exits_1_listing_the_services(
    cluster: LocalCluster,
) -> None:
    r = grpc_cli(cluster, "describe", "dsec.apiserver.v1.NoSuchThing")
    assert r.returncode == 1
    assert "'dsec.apiserver.v1.NoSuchThing'" in r.stderr
    assert SANDBOX_SERVICE in r.stderr


# --------------------------------------------------------------------- calls


def test_whoami_with_the_token_is_the_admin(cluster: LocalCluster) -> None:
    r = grpc_cli(cluster, WHOAMI)
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    with Client(cluster.apiserver, token=cluster.token) as c:
        me = c.whoami()
    # lowerCamelCase field names and enum names, as grpcurl prints them
    assert answer["principal"]["principalId"] == me.principal_id
    assert answer["principal"]["role"] == "ROLE_ADMIN"
    assert answer["principal"]["projectId"] == "root"
    # the dotted form of a method name works too
    r = grpc_cli(cluster, WHOAMI.replace("/", "."))
    assert r.returncode == 0 and json.loads(r.stdout) == answer


def test_whoami_without_auth_is_unauthenticated(cluster: LocalCluster) -> None:
    r = grpc_cli(cluster, "--no-auth", WHOAMI)
    assert r.returncode == 64 + 16  # grpcurl's: 64 + the status code
    assert r.stdout == ""
    assert r.stderr.startswith("ERROR:\n  Code: Unauthenticated\n  Message: ")
    assert "  Reason: NO_TOKEN" in r.stderr


def test_a_status_error_exits_64_plus_its_code(cluster: LocalCluster) -> None:
    r = grpc_cli(cluster, f"{SANDBOX_SERVICE}/GetSandbox", "-d", '{"sandboxId": "nope"}')
    assert r.returncode == 64 + 5
    assert r.stderr.startswith("ERROR:\n  Code: NotFound\n  Message: ")
    assert "  Reason: SANDBOX_NOT_FOUND" in r.stderr


def test_health_check_with_json_data(cluster: LocalCluster) -> None:
    placement = cluster.process("placement").address
    body = '{"service": "dsec.placement.v1.ClusterView"}'
    r = grpc_cli(cluster, placement, "grpc.health.v1.Health/Check", "-d", body)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"status": "SERVING"}
    # from stdin, with the flag between the address and the method
    r = grpc_cli(cluster, placement, "-d", "@", "grpc.health.v1.Health/Check", stdin=body + "\n")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"status": "SERVING"}


def test_a_server_stream_prints_one_document_per_message(cluster: LocalCluster) -> None:
    """WatchSandboxes sends a keepalive every 200 ms; the stream never ends on its own, so
    --timeout ends it with DEADLINE_EXCEEDED after the messages it printed."""
    r = grpc_cli(
        cluster,
        f"{SANDBOX_SERVICE}/WatchSandboxes",
        "-d",
        '{"keepaliveIntervalMs": 200}',
        "--timeout",
        "2",
    )
    assert r.returncode == 64 + 4, r.stderr
    assert "  Code: DeadlineExceeded" in r.stderr
    docs = json_documents(r.stdout)
    assert len(docs) >= 2
    assert all(set(d) == {"keepalive"} and "at" in d["keepalive"] for d in docs)


# --------------------------------------------------------------------- bad input


def test_bad_json_exits_2_naming_the_error(cluster: LocalCluster) -> None:
    r = grpc_cli(cluster, WHOAMI, "-d", "{nope")
    assert r.returncode == 2
    assert "not a valid dsec.apiserver.v1.WhoAmIRequest in JSON" in r.stderr
    assert "Expecting property name enclosed in double quotes" in r.stderr
    r = grpc_cli(cluster, WHOAMI, "-d", '{"noSuchField": 1}')
    assert r.returncode == 2
    assert 'has no field named "noSuchField"' in r.stderr


def test_unknown_method_exits_1_listing_the_methods(cluster: LocalCluster) -> None:
    r = grpc_cli(cluster, "dsec.apiserver.v1.ProjectService/WhoAreYou")
    assert r.returncode == 1
    assert "has no method 'WhoAreYou'" in r.stderr
    assert "  dsec.apiserver.v1.ProjectService.WhoAmI\n" in r.stderr
    r = grpc_cli(cluster, "dsec.apiserver.v1.NoService/Call")
    assert r.returncode == 1
    assert "no service 'dsec.apiserver.v1.NoService'" in r.stderr
    assert f"  {SANDBOX_SERVICE}\n" in r.stderr


def test_an_unreachable_address_fails_within_the_timeout(cluster: LocalCluster) -> None:
    start = time.monotonic()
    r = grpc_cli(cluster, f"127.0.0.1:{free_port()}", "list", "--timeout", "1")
    assert r.returncode == 1
    assert "cannot reach 127.0.0.1:" in r.stderr
    assert time.monotonic() - start < 15
    missing = cluster.home / "sock" / "missing.sock"
    r = grpc_cli(cluster, f"unix:{missing}", "list")
    assert r.returncode == 1
    assert f"no socket at {missing}" in r.stderr

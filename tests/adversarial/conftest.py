"""The adversarial suite's cluster: one real container edge with sandbox networking, a private
"internet" (`netlab.NetLab`) that answers for pypi.org and registry.npmjs.org, a witness sandbox
that must keep working through every attack, and a canary file outside every sandbox that must
not change. Everything started here is removed afterwards, also on failure: the cluster's
processes, the test network namespace and veth, the edge's bridge, nftables tables and
DOCKER-USER rules, and its pinned eBPF objects.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, Sandbox
from libdsec.errors import DSecError
from tests.adversarial.netlab import NetLab, remove_bridge
from tests.conftest import IMAGES, require_images, start_cluster
from tests.helpers import client_hello, sandbox_factory

INDEX = 100 + os.getpid() % 100  # keeps parallel runs of the suite apart
PYPI = f"10.199.{INDEX}.3"
NPM = f"10.199.{INDEX}.4"
FILES = f"10.199.{INDEX}.5"
#: Two names on one address, as sites behind one CDN address are (the name gate's tests).
SHARED = f"10.199.{INDEX}.6"
BRIDGE = f"dsa{os.getpid() % 100000}"
SUBNET = f"10.233.{INDEX}.0/24"
PIN_DIR = Path(f"/sys/fs/bpf/dsec-adversarial-{os.getpid()}")
# The toolkit's own Python, present in every sandbox (also images without Python).
TOOLKIT_PY = "/.dsec/lib/ld-linux-x86-64.so.2 --library-path /.dsec/lib /.dsec/bin/python3.11 -I -S"


@dataclass
class Lab:
    cluster: LocalCluster
    net: NetLab
    canary: Path
    canary_digest: str


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_images("busybox")
    net = NetLab(
        INDEX,
        {
            "pypi.org": PYPI,
            "files.pythonhosted.org": FILES,
            "registry.npmjs.org": NPM,
            "cdn-allowed.test": SHARED,
            "cdn-denied.test": SHARED,
        },
    )
    home = tmp_path_factory.mktemp("adversarial")
    canary = home / "canary.txt"
    canary.write_text("outside every sandbox\n")
    cluster = None
    try:
        net.start()
        cluster = start_cluster(
            home,
            edges=[
                EdgeSpec(
                    edge_id="adv0",
                    runtime="container",
                    # Failed creates count in placement's overlay for a while: room for them.
                    cpu_millis=64_000,
                    memory_mb=32_768,
                    extra_env={
                        "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
                        "DSEC_EDGE_NET_BRIDGE": BRIDGE,
                        "DSEC_EDGE_NET_SUBNET": SUBNET,
                        "DSEC_EDGE_DNS_UPSTREAM": net.dns,
                        "DSEC_EDGE_BPF_PIN_DIR": str(PIN_DIR),
                        "DSEC_EDGE_ON_SHUTDOWN": "stop",
                        # Our own cgroup parent: no other edge on this machine takes our
                        # sandboxes for its orphans, nor we theirs.
                        "DSEC_EDGE_CGROUP_PARENT": f"dsec-adversarial-{os.getpid()}",
                        "DSEC_EDGE_WATCH_INTERVAL_S": "0.5",
                        "DSEC_EDGE_PIDS_EXHAUSTED_AFTER_S": "1.5",
                        # Some of the suite's sandboxes are claimed warm ones (busybox, no
                        # network, no quota), the rest start cold: every control must hold
                        # on both.
                        "DSEC_EDGE_WARM_POOL": "busybox=3",
                        # MicroVM guests beside them (test_microvm_network.py).
                        "DSEC_EDGE_MICROVM": "on",
                    },
                )
            ],
        )
        yield Lab(cluster, net, canary, hashlib.sha256(canary.read_bytes()).hexdigest())
    finally:
        if cluster is not None:
            cluster.stop()
        net.close()
        remove_bridge(BRIDGE)
        shutil.rmtree(PIN_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def client(lab: Lab) -> Iterator[Client]:
    with Client(lab.cluster.apiserver, token=lab.cluster.token) as c:
        yield c


@pytest.fixture(scope="session")
def witness(client: Client) -> Iterator[Sandbox]:
    """A bystander sandbox: every test checks it still works after its attack."""
    sb = client.create(image="busybox", cpu=0.2, memory_mb=64, labels={"role": "witness"})
    sb.files.write("/work/witness.txt", "untouched\n")
    try:
        yield sb
    finally:
        try:
            sb.stop(grace_s=0.2)
        except DSecError:
            pass


@pytest.fixture
def make_sandbox(
    client: Client, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Sandbox]]:
    """Factory: sandboxes labelled with the test id, always stopped afterwards."""
    with sandbox_factory(client, request.node.nodeid, memory_mb=128, grace_s=0.2) as make:
        yield make


@pytest.fixture
def contained(lab: Lab, client: Client, witness: Sandbox) -> Iterator[None]:
    """After the test: the platform answers, the witness works and its files are intact, and
    the canary outside every sandbox is unchanged."""
    yield
    assert client.whoami().name
    r = witness.run("cat /work/witness.txt && echo alive", timeout_s=20)
    assert r.exit_code == 0 and r.stdout == b"untouched\nalive\n", r
    assert witness.refresh().state == "RUNNING"
    assert hashlib.sha256(lab.canary.read_bytes()).hexdigest() == lab.canary_digest


@pytest.fixture(autouse=True)
def _log_tails_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed and "lab" in request.fixturenames:
        from tests.conftest import print_log_tails

        print_log_tails(request.getfixturevalue("lab").cluster, request.node.nodeid)


def nc(sb: Sandbox, host: str, port: int, wait_s: int = 3) -> tuple[int, bytes]:
    """Connects with busybox nc and asks for `host` as an HTTP client does (a Host header): a
    connection allowed by a domain rule is admitted on the name it asks for (the name gate);
    returns nc's exit code and what came back (or its error)."""
    request = f"GET / HTTP/1.1\\r\\nHost: {host}\\r\\n\\r\\n"
    r = sb.run(f"printf '{request}' | nc -w {wait_s} {host} {port}", timeout_s=30)
    return r.exit_code, r.stdout + r.stderr


def tls_nc(
    sb: Sandbox, host: str, port: int, name: str | None, wait_s: int = 3
) -> tuple[int, bytes]:
    """Connects with busybox nc and sends a ClientHello asking for `name` (built here, so
    images without a TLS client can send one); returns nc's exit code and what came back."""
    path = f"/tmp/hello-{name or 'none'}.bin"
    sb.files.write(path, client_hello(name))
    r = sb.run(f"nc -w {wait_s} {host} {port} < {path}", timeout_s=30)
    return r.exit_code, r.stdout + r.stderr

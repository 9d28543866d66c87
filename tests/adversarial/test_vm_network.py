"""The network policy of full VMs (libvirt guests), enforced on the host side of their link:
a VM's tap in the edge's namespace is its port on the node bridge, its filter on the tap's
ingress (edge/network/guest.py, create_root_tap). The same rules, resolver and counters as
containers and microVMs; the network survives a pause (libvirt reopens the same tap). All
traffic goes to the test's own network namespace (`netlab`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from libdsec import NetworkPolicy, Sandbox
from tests.adversarial.conftest import NPM, PYPI
from tests.helpers import wait_for

pytestmark = pytest.mark.usefixtures("contained")

#: Connect and ask as an HTTP client does (the lab's servers answer with the name asked for);
#: prints "ok <answer>" or "fail <error>". bookworm VMs have python3, not busybox nc.
CONNECT = """python3 - {host} {port} <<'EOF'
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    s = socket.create_connection((host, port), timeout=3)
    s.sendall(b"GET / HTTP/1.1\\r\\nHost: " + host.encode() + b"\\r\\n\\r\\n")
    print("ok", s.recv(100).decode().strip())
except OSError as exc:
    print("fail", exc)
EOF"""


def _vm(make_sandbox: Callable[..., Sandbox], **kw: object) -> Sandbox:
    return make_sandbox(backend="vm", image="bookworm", cpu=1, memory_mb=768, **kw)


def _connect(vm: Sandbox, host: str, port: int) -> str:
    return vm.run(CONNECT.format(host=host, port=port), timeout_s=60).text.strip()


def test_a_vm_gets_the_paper_example_and_keeps_it_across_a_pause(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    vm = _vm(
        make_sandbox,
        network=NetworkPolicy(allow=["pypi.org:443"], deny=["registry.npmjs.org"]),
    )
    r = vm.run("getent hosts pypi.org registry.npmjs.org", timeout_s=30)
    assert PYPI in r.text and NPM not in r.text  # through the edge's resolver
    assert _connect(vm, "pypi.org", 443) == "ok pypi.org"
    assert _connect(vm, NPM, 443).startswith("fail")  # a hard-coded address: dropped
    assert _connect(vm, "pypi.org", 80).startswith("fail")  # allowed host, other port
    info = wait_for(lambda: (i := vm.refresh()).violations.get("blocked_connects", 0) >= 2 and i)
    assert info.state == "RUNNING"
    vm.pause()
    assert _connect(vm, "pypi.org", 443) == "ok pypi.org"  # resumed: the same tap, the filter


def test_a_vm_without_network_gets_one_live(make_sandbox: Callable[..., Sandbox]) -> None:
    vm = _vm(make_sandbox)
    assert _connect(vm, PYPI, 443).startswith("fail")  # no network at all
    vm.update_network_policy(NetworkPolicy(allow=["pypi.org:443"]))
    assert _connect(vm, "pypi.org", 443) == "ok pypi.org"

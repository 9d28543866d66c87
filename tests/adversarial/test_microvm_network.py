"""The network policy of microVM guests, enforced on the host side of their link: the same
rules, live updates, counters and resolver as containers, through the same SDK calls.

Guest traffic never passes a cgroup hook: a guest's frames are filtered on the host end of its
veth (edge/network/guest.py). So a blocked connect times out instead of failing with EPERM.
All traffic goes to the test's own network namespace (`netlab`) or stays between sandboxes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

from libdsec import NetworkPolicy, Sandbox
from libdsec.errors import DSecError
from tests.adversarial.conftest import NPM, PYPI, SHARED, Lab, nc, tls_nc
from tests.helpers import wait_for

pytestmark = pytest.mark.usefixtures("contained")

PAPER = NetworkPolicy(
    allow=["pypi.org:443", "files.pythonhosted.org:443"], deny=["registry.npmjs.org"]
)


def _vm(make_sandbox: Callable[..., Sandbox], **kw: object) -> Sandbox:
    return make_sandbox(backend="microvm", memory_mb=256, **kw)


def _nc(sb: Sandbox, host: str, port: int) -> tuple[int, bytes]:
    return nc(sb, host, port, wait_s=2)


def test_a_guest_gets_the_paper_example(make_sandbox: Callable[..., Sandbox]) -> None:
    vm = _vm(make_sandbox, network=PAPER)
    r = vm.run("nslookup pypi.org; nslookup registry.npmjs.org", timeout_s=30)
    assert PYPI.encode() in r.stdout  # through the edge's resolver
    assert NPM.encode() not in r.stdout
    assert _nc(vm, "pypi.org", 443) == (0, b"pypi.org\n")
    assert _nc(vm, NPM, 443)[0] != 0  # the hard-coded-IP bypass: dropped on the host side
    assert _nc(vm, "pypi.org", 80)[0] != 0  # allowed host, port not allowed
    info = wait_for(lambda: (i := vm.refresh()).violations.get("blocked_connects", 0) >= 2 and i)
    assert info.state == "RUNNING"


def test_a_guests_names_are_checked_on_the_name_it_asks_for(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    """Two names on one address: the host-side name gate decides for guests as for
    containers, on the TLS server name and the HTTP Host (issue 20)."""
    vm = _vm(
        make_sandbox,
        network=NetworkPolicy(allow=["cdn-allowed.test:443"], deny=["cdn-denied.test"]),
    )
    assert tls_nc(vm, SHARED, 443, "cdn-allowed.test") == (0, b"cdn-allowed.test\n")
    assert b"cdn-" not in tls_nc(vm, SHARED, 443, "cdn-denied.test")[1]
    assert b"cdn-" not in tls_nc(vm, SHARED, 443, None)[1]
    want = {"cdn-denied.test": 1, "(no name)": 1}
    info = wait_for(lambda: (i := vm.refresh()).violations.blocked_names == want and i)
    assert info.violations["blocked_connects"] >= 2 and info.state == "RUNNING"


def test_a_guest_policy_changes_live_and_a_guest_without_network_gets_one(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    vm = _vm(make_sandbox)
    assert _nc(vm, PYPI, 443)[0] != 0  # no network at all
    vm.update_network_policy(NetworkPolicy(allow=["pypi.org:443"]))
    assert _nc(vm, "pypi.org", 443) == (0, b"pypi.org\n")
    vm.update_network_policy(NetworkPolicy(allow=["registry.npmjs.org:443"]))
    assert _nc(vm, "registry.npmjs.org", 443) == (0, b"registry.npmjs.org\n")
    assert _nc(vm, PYPI, 443)[0] != 0
    vm.update_network_policy(NetworkPolicy())
    assert _nc(vm, NPM, 443)[0] != 0


def test_a_guest_reaches_no_other_sandbox_no_outside_resolver_and_survives_pause(
    make_sandbox: Callable[..., Sandbox], lab: Lab
) -> None:
    policy = NetworkPolicy(open=True)
    container = make_sandbox(network=policy)
    container.start("nc -ll -p 8080 -e /bin/echo hello")
    ip = container.run("ip -4 -o addr show eth0 | awk '{print $4}' | cut -d/ -f1").text.strip()
    wait_for(lambda: container.run("nc -w 2 127.0.0.1 8080 </dev/null").stdout == b"hello\n")
    vm = _vm(make_sandbox, network=policy)
    assert _nc(vm, ip, 8080)[0] != 0  # sandbox to sandbox: refused by the platform
    r = vm.run(f"nslookup pypi.org {lab.net.dns}", timeout_s=30)
    assert PYPI.encode() not in r.stdout  # DNS only through the edge
    # The guest's network outlives a pause to disk (a new QEMU reopens the same tap).
    vm.pause()
    assert _nc(vm, "pypi.org", 443) == (0, b"pypi.org\n")


def test_too_many_blocked_connects_end_a_guest(make_sandbox: Callable[..., Sandbox]) -> None:
    vm = _vm(make_sandbox, network=NetworkPolicy(allow=["pypi.org:443"], max_blocked_connects=5))
    # Each blocked connect times out (1 s): the guest is ended during the loop, which then
    # fails with the channel's end rather than returning.
    with contextlib.suppress(DSecError):
        vm.run(f"for p in $(seq 1 12); do nc -w 1 {NPM} $p </dev/null; done", timeout_s=60)
    info = wait_for(lambda: (i := vm.refresh()).state == "TERMINATED" and i, timeout_s=30)
    assert info.termination_reason == "POLICY_VIOLATION"
    assert "blocked" in info.termination_message

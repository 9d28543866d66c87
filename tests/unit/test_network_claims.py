"""edge.network.claims: the edges of one node never get the same bridge, subnet or gate queue.
The claim directory is the test's own; the host's links and addresses are given (no netlink)."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import pytest

from edge.network import claims
from edge.network.claims import NetworkClaimError, claim


def host(
    links: dict[str, tuple[str, bool]] | None = None,
    addresses: list[tuple[str, str]] | None = None,
    queues: set[int] | None = None,
) -> claims._Host:
    return claims._Host(
        links or {},
        [(n, ipaddress.IPv4Interface(a)) for n, a in addresses or []],
        queues or set(),
    )


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> dict[str, claims._Host]:
    """The host as the claims see it: replace ``node["host"]`` to change it."""
    view = {"host": host(addresses=[("lo", "127.0.0.1/8"), ("docker0", "172.17.0.1/16")])}
    monkeypatch.setattr(claims, "_host", lambda: view["host"])
    return view


def test_edges_get_distinct_bridges_subnets_and_queues(tmp_path: Path, node: object) -> None:
    d = tmp_path / "claims"
    got = [claim(tmp_path / f"edge{i}", directory=d) for i in range(3)]
    assert [c.bridge for c in got] == ["dsec0", "dsec1", "dsec2"]
    assert [str(c.subnet) for c in got] == ["10.231.0.0/16", "10.230.0.0/16", "10.229.0.0/16"]
    assert len({c.gate_queue for c in got}) == 3
    record = json.loads((d / "dsec1.json").read_text())
    assert record["state_dir"] == str((tmp_path / "edge1").resolve())
    assert record["subnet"] == "10.230.0.0/16" and record["gate_queue"] == got[1].gate_queue


def test_an_edge_takes_its_own_claim_back_and_a_stale_one_is_reused(
    tmp_path: Path, node: dict[str, claims._Host]
) -> None:
    d = tmp_path / "claims"
    first = claim(tmp_path / "a", directory=d)
    second = claim(tmp_path / "b", directory=d)
    assert (first.bridge, second.bridge) == ("dsec0", "dsec1")
    # a down with its sandboxes kept on dsec0 (ports): its claim stays its own
    first.release(forget=False)
    node["host"] = host(links={"dsec0": ("bridge", True)})
    assert claim(tmp_path / "c", directory=d).bridge == "dsec2"
    again = claim(tmp_path / "a", directory=d)  # a restarts: its bridge, subnet and queue
    assert (again.bridge, again.subnet, again.gate_queue) == (
        first.bridge,
        first.subnet,
        first.gate_queue,
    )
    # a down, nothing left on its bridge: the claim is stale, the next edge takes it
    again.release(forget=False)
    node["host"] = host(links={"dsec0": ("bridge", False)})
    assert claim(tmp_path / "d", directory=d).bridge == "dsec0"
    # released for good (the bridge went): free at once
    second.release(forget=True)
    assert not (d / "dsec1.json").exists()
    assert claim(tmp_path / "e", directory=d).bridge == "dsec1"


def test_what_the_host_uses_is_skipped(tmp_path: Path, node: dict[str, claims._Host]) -> None:
    node["host"] = host(
        links={"dsec0": ("bridge", True), "dsec1": ("veth", False)},
        addresses=[("tun0", "10.229.7.1/24")],
        queues={claims.derived_queue("dsec3")},
    )
    c = claim(tmp_path / "a", directory=tmp_path / "claims")
    # dsec0: an unclaimed bridge with ports (an older edge's); dsec1: not a bridge;
    # 10.229/16: an address of the host
    assert (c.bridge, str(c.subnet)) == ("dsec3", "10.228.0.0/16")
    assert c.gate_queue != claims.derived_queue("dsec3")  # bound by someone: the next one


def test_configured_values_are_checked_and_a_refusal_says_why(tmp_path: Path, node: object) -> None:
    d = tmp_path / "claims"
    mine = claim(
        tmp_path / "a", bridge="dsa1", subnet="10.233.5.0/24", gate_queue=5000, directory=d
    )
    assert (mine.bridge, str(mine.subnet), mine.gate_queue) == ("dsa1", "10.233.5.0/24", 5000)
    who = f"the edge with state dir {(tmp_path / 'a').resolve()}"
    with pytest.raises(NetworkClaimError, match=re.escape(f"bridge dsa1 is claimed by {who}")):
        claim(tmp_path / "b", bridge="dsa1", subnet="10.233.6.0/24", directory=d)
    with pytest.raises(NetworkClaimError, match=re.escape("10.233.0.0/16 overlaps 10.233.5.0/24")):
        claim(tmp_path / "b", bridge="dsa2", subnet="10.233.0.0/16", directory=d)
    with pytest.raises(NetworkClaimError, match="GATE_QUEUE=5000 is used by"):
        claim(tmp_path / "b", bridge="dsa2", subnet="10.233.6.0/24", gate_queue=5000, directory=d)
    with pytest.raises(NetworkClaimError, match="another edge runs with this state dir"):
        claim(tmp_path / "a", directory=d)


def test_none_free_is_an_error_naming_each_candidate(
    tmp_path: Path, node: dict[str, claims._Host]
) -> None:
    node["host"] = host(addresses=[("vpn0", "10.192.0.1/10")])  # 10.192-10.255: every candidate
    with pytest.raises(NetworkClaimError) as info:
        claim(tmp_path / "a", directory=tmp_path / "claims")
    text = str(info.value)
    assert "dsec0 10.231.0.0/16: 10.231.0.0/16 overlaps 10.192.0.1/10 on vpn0" in text
    assert "dsec31 10.200.0.0/16" in text and "DSEC_EDGE_NET_SUBNET" in text

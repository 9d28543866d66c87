"""``dsec node``: the cluster's nodes (edges) for operators, through the API server's
NodeService (an ADMIN token of the root project).

    dsec node list [--json]                  every node the watcher knows: id, address, host,
                                             health and why, version, sandboxes, draining
    dsec node drain NAME [--reason TEXT]     no new sandbox there (kept across its restarts);
                                             prints what still runs there
    dsec node undrain NAME

Both return once the watcher shows the node's new state (placement follows the watcher), or
after WAIT_SEEN_S with a note on stderr.

``dsec status`` prints the same node lines (:func:`node_lines`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import grpc

from dsecctl.cli_common import json_option, print_json
from libdsec._config import resolve
from libdsec.errors import from_rpc_error

TIMEOUT_S = 10.0
#: How long drain and undrain wait for the watcher to show the node's new state.
WAIT_SEEN_S = 15.0


def _call(method: str, request: Any, target: str | None = None) -> Any:
    """One NodeService call with the resolved target and token; errors in our vocabulary."""
    from dsec.apiserver.v1 import apiserver_pb2_grpc

    conn = resolve(target)
    with grpc.insecure_channel(conn.target) as ch:
        stub = apiserver_pb2_grpc.NodeServiceStub(ch)
        try:
            return getattr(stub, method)(
                request,
                metadata=(("authorization", f"Bearer {conn.token}"),),
                timeout=TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None  # type: ignore[arg-type]


def _wait_seen(edge_id: str, draining: bool) -> bool:
    """Whether the watcher (and so placement, which follows it) shows the node's new drain
    state within :data:`WAIT_SEEN_S`: it learns it at its next probe of the node, so that
    when drain returns, no new sandbox goes there, and when undrain returns, they may."""
    deadline = time.monotonic() + WAIT_SEEN_S
    while True:
        node = next((n for n in list_nodes().nodes if n.info.edge_id == edge_id), None)
        if node is not None and node.draining == draining:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def list_nodes(target: str | None = None) -> Any:
    from dsec.apiserver.v1 import apiserver_pb2

    return _call("ListNodes", apiserver_pb2.ListNodesRequest(), target)


def node_row(n: Any) -> dict[str, Any]:
    """A node (watcher_pb2.EdgeStatus) as the CLI shows it."""
    from dsec.watcher.v1 import watcher_pb2

    return {
        "id": n.info.edge_id,
        "address": n.info.address,
        "hostname": n.info.hostname,
        "health": watcher_pb2.EdgeHealth.Name(n.health).removeprefix("EDGE_HEALTH_"),
        "health_reason": n.health_reason,
        "health_detail": n.health_detail,
        "version": n.info.version,
        "sandboxes": n.load.sandboxes,
        "draining": n.draining,
        "drain_reason": n.drain_reason,
        "clock_skew_s": round(n.clock_skew_s, 3),
    }


def node_lines(nodes: list[Any]) -> list[str]:
    """One line per node, then its health's reason and detail when it has one."""
    out = []
    for n in nodes:
        r = node_row(n)
        out.append(
            f"{r['id']:<16} {r['address']:<28} {r['hostname'] or '-':<16} {r['health']:<10} "
            f"v{r['version'] or '?':<8} {r['sandboxes']:>5} sandboxes"
            + ("  draining" if r["draining"] else "")
            + (
                f" ({r['drain_reason']})"
                if r["draining"] and r["health_reason"] != "DRAINING"
                else ""
            )
        )
        if r["health_reason"]:
            detail = f": {r['health_detail']}" if r["health_detail"] else ""
            out.append(f"{'':<16} {r['health_reason']}{detail}")
    return out


def cmd_node(args: argparse.Namespace) -> int:
    from dsec.apiserver.v1 import apiserver_pb2

    if args.action == "list":
        resp = list_nodes()
        if args.json:
            print_json([node_row(n) for n in resp.nodes])
            return 0
        if not resp.nodes:
            print("no nodes are registered with the watcher")
        else:
            print(
                f"{'ID':<16} {'ADDRESS':<28} {'HOST':<16} {'HEALTH':<10} {'VERSION':<9} SANDBOXES"
            )
        for line in node_lines(list(resp.nodes)):
            print(line)
        return 0
    if args.action == "drain":
        node = _call(
            "DrainNode", apiserver_pb2.DrainNodeRequest(edge_id=args.name, reason=args.reason)
        ).node
    else:
        node = _call("UndrainNode", apiserver_pb2.UndrainNodeRequest(edge_id=args.name)).node
    seen = _wait_seen(node.edge_id, node.draining)
    state = {
        "id": node.edge_id,
        "address": node.address,
        "draining": node.draining,
        "reason": node.reason,
        "live_sandboxes": node.live_sandboxes,
        "by_backend": dict(node.sandboxes_by_backend),
        "by_project": dict(node.sandboxes_by_project),
        "by_task": dict(node.sandboxes_by_task),
    }
    if not seen:
        print(
            f"the watcher does not show node {node.edge_id} "
            f"{'draining' if node.draining else 'undrained'} yet (after {WAIT_SEEN_S:g} s); "
            "it will at its next probe of the node",
            file=sys.stderr,
        )
    if args.json:
        print_json(state)
        return 0
    what = "draining" if node.draining else "not draining"
    print(
        f"node {node.edge_id} ({node.address}) is {what}"
        + (f": {node.reason}" if node.reason else "")
    )
    print(f"{node.live_sandboxes} sandboxes still run there")
    for title, counts in (
        ("backend", node.sandboxes_by_backend),
        ("project", node.sandboxes_by_project),
        ("task", node.sandboxes_by_task),
    ):
        for key, n in sorted(counts.items()):
            print(f"  {title} {key}: {n}")
    return 0


def add_parser(sub: Any) -> None:
    node = sub.add_parser("node", help="the cluster's nodes: list, drain, undrain (operators)")
    nsub = node.add_subparsers(dest="action", required=True, metavar="ACTION")
    nl = nsub.add_parser("list", help="every node the watcher knows, with health and why")
    json_option(nl, "print the nodes as one JSON array")
    nd = nsub.add_parser(
        "drain", help="take a node out of placement (kept across its restarts); what runs there"
    )
    nd.add_argument("name", help="the node's edge id")
    nd.add_argument("--reason", default="", help="shown with the node's health")
    json_option(nd)
    nu = nsub.add_parser("undrain", help="put a drained node back into placement")
    nu.add_argument("name", help="the node's edge id")
    json_option(nu)
    node.set_defaults(fn=cmd_node)

"""NodeService: the cluster's nodes (edges) for operators: list them, drain and undrain one.

Operators are the ADMIN tokens of the root project (the bootstrap token is one): a node
serves every project, so an admin of a subproject may not take it out of service. The list is
the watcher's (every node it knows, not only those of a local cluster.json); a drain goes to
the edge itself (EdgeService/SetDraining), which keeps it in its state dir, so it holds across
restarts of the edge and of every control-plane service, and the watcher learns it at its next
probe (placement stops using the node within a probe interval).
"""

from __future__ import annotations

from typing import Any

from apiserver.gateway import Gateway
from apiserver.routing import downstream
from common.auth import bearer_token
from common.channels import DEFAULT_DEADLINE_S
from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2
from dsec.iam.v1 import iam_pb2
from libdsec.errors import NotFound, PermissionDenied

#: IAM's root project: its ADMIN tokens operate the cluster.
ROOT_PROJECT = "root"


def is_operator(principal: iam_pb2.Principal) -> bool:
    return principal.project_id == ROOT_PROJECT and principal.role == iam_pb2.ROLE_ADMIN


def require_operator(principal: iam_pb2.Principal) -> None:
    """PERMISSION_DENIED (OPERATOR_ONLY) unless ``principal`` operates the cluster. The
    dashboard's node panel (apiserver/dashboard.py) asks the same."""
    if not is_operator(principal):
        raise PermissionDenied(
            "managing nodes needs an ADMIN token of the root project "
            f"(this token: {iam_pb2.Role.Name(principal.role)} of {principal.project_id})",
            reason="OPERATOR_ONLY",
        )


class NodeServicer:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def _operator(self, context: Any) -> None:
        require_operator(await self.gw.auth.principal(bearer_token(context)))

    async def ListNodes(
        self, request: apiserver_pb2.ListNodesRequest, context: Any
    ) -> apiserver_pb2.ListNodesResponse:
        await self._operator(context)
        snapshot = await self.gw.edges.snapshot()
        return apiserver_pb2.ListNodesResponse(
            nodes=sorted(snapshot.edges, key=lambda e: e.info.edge_id),
            watcher_uptime_s=snapshot.uptime_s,
        )

    async def DrainNode(
        self, request: apiserver_pb2.DrainNodeRequest, context: Any
    ) -> apiserver_pb2.DrainNodeResponse:
        await self._operator(context)
        node = await self._set_draining(request.edge_id, True, request.reason)
        return apiserver_pb2.DrainNodeResponse(node=node)

    async def UndrainNode(
        self, request: apiserver_pb2.UndrainNodeRequest, context: Any
    ) -> apiserver_pb2.UndrainNodeResponse:
        await self._operator(context)
        node = await self._set_draining(request.edge_id, False, "")
        return apiserver_pb2.UndrainNodeResponse(node=node)

    async def _set_draining(
        self, edge_id: str, draining: bool, reason: str
    ) -> apiserver_pb2.NodeDrainState:
        snapshot = await self.gw.edges.snapshot()
        # The snapshot's address, or (a young watcher not hearing from every edge yet) the
        # one the directory kept.
        address = self.gw.edges.addresses.get(edge_id, "")
        if not address:
            known = ", ".join(sorted(e.info.edge_id for e in snapshot.edges)) or "none"
            raise NotFound(
                f"node {edge_id!r} is not known to the watcher (known: {known})",
                reason="EDGE_NOT_FOUND",
                metadata={"edge": edge_id},
            )
        resp = await downstream(
            self.gw.edges.stub_for_address(address).SetDraining(
                edge_pb2.SetDrainingRequest(draining=draining, reason=reason),
                timeout=DEFAULT_DEADLINE_S,
            ),
            "edge",
        )
        return apiserver_pb2.NodeDrainState(
            edge_id=resp.edge_id or edge_id,
            address=address,
            draining=resp.draining,
            reason=resp.reason,
            since=resp.since if resp.HasField("since") else None,
            live_sandboxes=resp.live_sandboxes,
            sandboxes_by_backend=resp.sandboxes_by_backend,
            sandboxes_by_project=resp.sandboxes_by_project,
            sandboxes_by_task=resp.sandboxes_by_task,
        )

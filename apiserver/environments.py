"""EnvironmentService: the layer store, through any edge that has it.

The store is one shared directory (a shared filesystem in a cluster), so every edge with a
container runtime serves the same environments: a call goes to a random known edge, and to the
next one if that edge is unreachable, has no layer store (a null-runtime edge) or cannot reach
the store or a Docker engine itself. pack_diff is different: it goes to the edge that owns the
sandbox (see SandboxServicer.PackDiff).

Environments are cluster-wide names, not per project: any authenticated caller may list, import
and compose them; deleting one needs an ADMIN token, or the project that packed it (pack_diff
records the caller's project in the environment's config as ``dsec.project``). Except the
``snapshots/<project_id>/`` namespace (apiserver/snapshots.py): those are that project's alone,
invisible to the others, and it deletes its own without ADMIN.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from apiserver import snapshots
from apiserver.gateway import Gateway
from apiserver.routing import downstream
from common.auth import bearer_token
from common.channels import DEFAULT_DEADLINE_S
from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsec.iam.v1 import iam_pb2
from libdsec.errors import DSecError, FailedPrecondition, PermissionDenied, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A Docker import of a multi-GB image takes minutes; building a layer from a big tree too.
IMPORT_DEADLINE_S = 3600.0
QUERY_DEADLINE_S = DEFAULT_DEADLINE_S * 4
#: The environment config key naming the project whose pack_diff made it (its owner).
OWNER_KEY = "dsec.project"


async def any_edge(gw: Gateway, call: Callable[[edge_pb2_grpc.EdgeServiceStub], Awaitable[T]]) -> T:
    """`call` on a random edge with a layer store; the next one on a transient refusal."""
    if not gw.edges.addresses:
        await gw.edges.refresh()
    addresses = list(gw.edges.addresses.values())
    random.shuffle(addresses)
    last: DSecError | None = None
    for address in addresses:
        try:
            return await downstream(call(gw.edges.stub_for_address(address)), "edge")
        except Unavailable as err:
            last = err
        except FailedPrecondition as err:
            if err.reason != "NO_LAYER_STORE":
                raise
            last = err
        log.info("edge %s cannot serve environments (%s); trying another", address, last)
    if isinstance(last, Unavailable):
        raise last
    raise Unavailable(
        "no edge with a layer store is reachable"
        + (f" (last answer: {last.message})" if last is not None else ""),
        reason="NO_LAYER_STORE",
    )


class EnvironmentServicer:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def _edge(self, context: Any, method: str, request: Any, timeout: float) -> Any:
        await self.gw.caller(bearer_token(context))
        return await any_edge(self.gw, lambda s: getattr(s, method)(request, timeout=timeout))

    async def _project(self, context: Any) -> str:
        return (await self.gw.caller(bearer_token(context))).project_id

    async def ListEnvironments(
        self, request: apiserver_pb2.ListEnvironmentsRequest, context: Any
    ) -> apiserver_pb2.ListEnvironmentsResponse:
        project = await self._project(context)
        resp = await self._edge(
            context,
            "ListEnvironments",
            edge_pb2.ListEnvironmentsRequest(prefix=request.prefix),
            QUERY_DEADLINE_S,
        )
        return apiserver_pb2.ListEnvironmentsResponse(
            environments=[e for e in resp.environments if snapshots.visible(project, e.name)]
        )

    async def GetEnvironment(
        self, request: apiserver_pb2.GetEnvironmentRequest, context: Any
    ) -> apiserver_pb2.GetEnvironmentResponse:
        snapshots.check_visible(await self._project(context), request.name)
        resp = await self._edge(
            context,
            "GetEnvironment",
            edge_pb2.GetEnvironmentRequest(name=request.name),
            QUERY_DEADLINE_S,
        )
        return apiserver_pb2.GetEnvironmentResponse(environment=resp.environment)

    async def ListLayers(
        self, request: apiserver_pb2.ListLayersRequest, context: Any
    ) -> apiserver_pb2.ListLayersResponse:
        resp = await self._edge(
            context, "ListLayers", edge_pb2.ListLayersRequest(), QUERY_DEADLINE_S
        )
        return apiserver_pb2.ListLayersResponse(layers=resp.layers)

    async def ImportImage(
        self, request: apiserver_pb2.ImportImageRequest, context: Any
    ) -> apiserver_pb2.ImportImageResponse:
        project = await self._project(context)
        snapshots.check_packable(project, request.name)
        if request.base:
            snapshots.check_visible(project, request.base)
        resp = await self._edge(
            context,
            "ImportImage",
            edge_pb2.ImportImageRequest(
                source=request.source,
                name=request.name,
                kind=request.kind,
                base=request.base,
                all_root=request.all_root,
            ),
            IMPORT_DEADLINE_S,
        )
        return apiserver_pb2.ImportImageResponse(environment=resp.environment)

    async def ComposeEnvironment(
        self, request: apiserver_pb2.ComposeEnvironmentRequest, context: Any
    ) -> apiserver_pb2.ComposeEnvironmentResponse:
        project = await self._project(context)
        snapshots.check_packable(project, request.name)
        for used in (request.base, request.workspace, *request.toolkits):
            if used:
                snapshots.check_visible(project, used)
        resp = await self._edge(
            context,
            "ComposeEnvironment",
            edge_pb2.ComposeEnvironmentRequest(
                name=request.name,
                base=request.base,
                workspace=request.workspace,
                toolkits=request.toolkits,
            ),
            IMPORT_DEADLINE_S,
        )
        return apiserver_pb2.ComposeEnvironmentResponse(environment=resp.environment)

    async def DeleteEnvironment(
        self, request: apiserver_pb2.DeleteEnvironmentRequest, context: Any
    ) -> apiserver_pb2.DeleteEnvironmentResponse:
        principal = await self.gw.auth.principal(bearer_token(context))
        owner = snapshots.owner_of(request.name)
        if owner is not None and owner != principal.project_id:
            return apiserver_pb2.DeleteEnvironmentResponse(deleted=False)  # not theirs to see
        if owner is None and principal.role != iam_pb2.ROLE_ADMIN:
            env = await any_edge(
                self.gw,
                lambda s: s.GetEnvironment(
                    edge_pb2.GetEnvironmentRequest(name=request.name), timeout=QUERY_DEADLINE_S
                ),
            )
            if env.environment.config.get(OWNER_KEY) != principal.project_id:
                raise PermissionDenied(
                    "deleting an environment (a cluster-wide name) needs an ADMIN token or "
                    "the project that packed it"
                )
        resp = await any_edge(
            self.gw,
            lambda s: s.DeleteEnvironment(
                edge_pb2.DeleteEnvironmentRequest(name=request.name), timeout=QUERY_DEADLINE_S
            ),
        )
        return apiserver_pb2.DeleteEnvironmentResponse(deleted=resp.deleted)

"""gRPC adapter of the layer store on the edge: proto in -> Environments (in a thread) -> proto out.

The store is shared by every edge of a cluster, so any edge answers list/get/import/compose/
delete; pack_diff runs on the edge that owns the sandbox (its writable layer is local).
An edge without a container runtime has no layer store and says so (FAILED_PRECONDITION,
NO_LAYER_STORE), which tells an API server to ask another edge.
"""

from __future__ import annotations

import asyncio

from common.convert import enum_name, ts
from dsec.edge.v1 import edge_pb2
from dsec.types.v1 import types_pb2
from edge.backends.contract import PacksDiffs, require
from edge.layers import Environment, Environments, LayerInfo, LayerKind
from edge.manager import SandboxManager
from libdsec.errors import FailedPrecondition, InvalidArgument


def layer_pb(info: LayerInfo) -> types_pb2.Layer:
    return types_pb2.Layer(
        digest=info.digest,
        kind=types_pb2.LayerKind.Value("LAYER_KIND_" + info.kind.value),  # type: ignore[arg-type]
        size_bytes=info.size_bytes,
        meta_bytes=info.meta_bytes,
        source=info.source,
        created_at=ts(info.created_at),
    )


def environment_pb(env: Environment, layers: list[LayerInfo]) -> types_pb2.Environment:
    return types_pb2.Environment(
        name=env.name,
        layers=[layer_pb(i) for i in layers],
        created_at=ts(env.created_at),
        config=env.config,
    )


def _kind(value: int) -> LayerKind | None:
    if value == types_pb2.LAYER_KIND_UNSPECIFIED:
        return None
    return LayerKind.parse(enum_name(types_pb2.LayerKind, value, "kind"))


class LayersAdapter:
    def __init__(self, environments: Environments | None, manager: SandboxManager) -> None:
        self.environments = environments
        self.manager = manager

    def _envs(self) -> Environments:
        if self.environments is None:
            raise FailedPrecondition(
                "this edge has no layer store (it runs no container runtime)",
                reason="NO_LAYER_STORE",
            )
        return self.environments

    async def _env_pb(self, env: Environment) -> types_pb2.Environment:
        infos = await asyncio.to_thread(self._envs().layer_infos, env)
        return environment_pb(env, infos)

    async def import_image(self, req: edge_pb2.ImportImageRequest) -> edge_pb2.ImportImageResponse:
        envs = self._envs()
        env = await asyncio.to_thread(
            envs.import_source,
            req.source,
            req.name,
            kind=_kind(req.kind),
            base=req.base,
            all_root=req.all_root,
        )
        return edge_pb2.ImportImageResponse(environment=await self._env_pb(env))

    async def list_environments(
        self, req: edge_pb2.ListEnvironmentsRequest
    ) -> edge_pb2.ListEnvironmentsResponse:
        envs = self._envs()
        found = await asyncio.to_thread(envs.list_environments, req.prefix)
        out = edge_pb2.ListEnvironmentsResponse()
        for env in found:
            try:
                out.environments.append(await self._env_pb(env))
            except Exception:  # a broken one must not hide the others: list it without sizes
                out.environments.append(types_pb2.Environment(name=env.name, config=env.config))
        return out

    async def get_environment(
        self, req: edge_pb2.GetEnvironmentRequest
    ) -> edge_pb2.GetEnvironmentResponse:
        env = await asyncio.to_thread(self._envs().get_environment, req.name)
        return edge_pb2.GetEnvironmentResponse(environment=await self._env_pb(env))

    async def list_layers(self, req: edge_pb2.ListLayersRequest) -> edge_pb2.ListLayersResponse:
        infos = await asyncio.to_thread(self._envs().list_layers)
        return edge_pb2.ListLayersResponse(layers=[layer_pb(i) for i in infos])

    async def compose(
        self, req: edge_pb2.ComposeEnvironmentRequest
    ) -> edge_pb2.ComposeEnvironmentResponse:
        if not req.base:
            raise InvalidArgument("base is required")
        env = await asyncio.to_thread(
            self._envs().compose,
            req.name,
            base=req.base,
            workspace=req.workspace,
            toolkits=list(req.toolkits),
        )
        return edge_pb2.ComposeEnvironmentResponse(environment=await self._env_pb(env))

    async def delete(
        self, req: edge_pb2.DeleteEnvironmentRequest
    ) -> edge_pb2.DeleteEnvironmentResponse:
        deleted = await asyncio.to_thread(self._envs().delete_environment, req.name)
        return edge_pb2.DeleteEnvironmentResponse(deleted=deleted)

    async def pack_diff(self, req: edge_pb2.PackDiffRequest) -> edge_pb2.PackDiffResponse:
        if not req.sandbox_id or not req.name:
            raise InvalidArgument("sandbox_id and name are required")
        rec = self.manager.get_live(req.sandbox_id)
        result = await require(self.manager.backend_of(rec), PacksDiffs).pack_diff(
            rec,
            req.name,
            exclude=list(req.exclude),
            default_excludes=not req.no_default_excludes,
            config=dict(req.config),
        )
        return edge_pb2.PackDiffResponse(environment=await self._env_pb(result.environment))

"""How an API server finds things without owning state.

- :class:`AuthCache`: token -> principal, cached for at most the TTL IAM
  grants, so authentication costs no round trip on the hot path.
- :class:`EdgeDirectory`: edge id -> address, from the watcher's snapshot;
  refreshed on a miss (a new edge) and periodically.
- :class:`OwnerCache`: sandbox id -> project, an immutable fact learned once
  from the owning edge, so authorizing a call costs no round trip either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc

from common.channels import DEFAULT_DEADLINE_S, open_channel
from common.config import WATCHER_WARMUP_S
from dsec.edge.v1 import edge_pb2_grpc
from dsec.iam.v1 import iam_pb2, iam_pb2_grpc
from dsec.watcher.v1 import watcher_pb2, watcher_pb2_grpc
from libdsec.errors import DSecError, SandboxNotFound, Unauthenticated, Unavailable, from_rpc_error

log = logging.getLogger(__name__)

T = TypeVar("T")
#: How long a call into a sandbox waits for its edge's channel to connect (an edge restarting
#: under supervision serves again within 1-3 s).
EDGE_RECONNECT_WAIT_S = 5.0


async def downstream(call: Awaitable[T], what: str) -> T:
    """Awaits a call to another service, turning its failure into our error vocabulary."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        err = from_rpc_error(exc)
        if exc.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ) and err.reason in (
            "UNAVAILABLE",
            "DEADLINE_EXCEEDED",
        ):
            raise Unavailable(
                f"{what}: {exc.details()}", reason=f"{what.upper()}_UNAVAILABLE"
            ) from exc
        raise err from exc


class AuthCache:
    def __init__(self, iam: iam_pb2_grpc.IamServiceStub, max_ttl_s: float) -> None:
        self.iam = iam
        self.max_ttl_s = max_ttl_s
        self._cache: dict[str, tuple[float, iam_pb2.Principal]] = {}

    async def principal(self, token: str) -> iam_pb2.Principal:
        if not token:
            raise Unauthenticated(
                "no token: send 'authorization: Bearer <token>'", reason="NO_TOKEN"
            )
        hit = self._cache.get(token)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        resp = await downstream(
            self.iam.Authenticate(
                iam_pb2.AuthenticateRequest(token=token), timeout=DEFAULT_DEADLINE_S
            ),
            "iam",
        )
        ttl = min(self.max_ttl_s, resp.cache_ttl_s or self.max_ttl_s)
        if resp.principal.HasField("expires_at"):
            ttl = min(ttl, resp.principal.expires_at.seconds - time.time())
        if len(self._cache) > 100_000:
            self._cache.clear()
        if ttl > 0:
            self._cache[token] = (now + ttl, resp.principal)
        return resp.principal


class EdgeDirectory:
    def __init__(self, watcher_target: str, refresh_s: float = 2.0) -> None:
        self.watcher_target = watcher_target
        self.refresh_s = refresh_s
        self.addresses: dict[str, str] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, edge_pb2_grpc.EdgeServiceStub] = {}
        self._watcher_channel = open_channel(
            watcher_target, "apiserver", retry_services=["dsec.watcher.v1.WatcherService"]
        )
        self._watcher = watcher_pb2_grpc.WatcherServiceStub(self._watcher_channel)
        self._refreshing: asyncio.Task[None] | None = None
        #: When the newest snapshot learned so far was asked for (monotonic): it holds every
        #: edge the watcher knew at that moment.
        self._fresh_since = 0.0
        self.unhealthy: set[str] = set()

    async def refresh(self) -> None:
        await self.snapshot()

    async def snapshot(self) -> watcher_pb2.ClusterSnapshot:
        """The watcher's snapshot now (every edge it knows, with health); refreshes the
        addresses on the way."""
        asked = time.monotonic()
        resp = await downstream(
            self._watcher.GetClusterSnapshot(
                watcher_pb2.GetClusterSnapshotRequest(), timeout=DEFAULT_DEADLINE_S
            ),
            "watcher",
        )
        self._learn_snapshot(resp.snapshot)
        self._fresh_since = max(self._fresh_since, asked)
        return resp.snapshot

    def _learn_snapshot(self, snapshot: watcher_pb2.ClusterSnapshot) -> None:
        addresses = {e.info.edge_id: e.info.address for e in snapshot.edges}
        #: Edges failing their probes: a call to one of their sandboxes asks the watcher
        #: first whether it was declared lost, instead of waiting on the edge (Gateway).
        self.unhealthy = {
            e.info.edge_id
            for e in snapshot.edges
            if e.health == watcher_pb2.EDGE_HEALTH_UNHEALTHY and e.health_reason == "PROBES_FAILING"
        }
        if snapshot.uptime_s < WATCHER_WARMUP_S:
            # A watcher that just (re)started has not heard from every edge again yet: the
            # edges it does not know are not gone, keep their addresses.
            addresses = {**self.addresses, **addresses}
        self.addresses = addresses

    async def lost(
        self,
        *,
        sandbox_ids: list[str] | None = None,
        edge_id: str = "",
        project_prefix: str = "",
        task_id: str = "",
        label_selector: dict[str, str] | None = None,
    ) -> watcher_pb2.ListLostSandboxesResponse:
        """Sandboxes of edges the watcher declared lost (TERMINATED, EDGE_LOST), filtered."""
        return await downstream(
            self._watcher.ListLostSandboxes(
                watcher_pb2.ListLostSandboxesRequest(
                    sandbox_ids=sandbox_ids or [],
                    edge_id=edge_id,
                    project_prefix=project_prefix,
                    task_id=task_id,
                    label_selector=label_selector or {},
                ),
                timeout=DEFAULT_DEADLINE_S,
            ),
            "watcher",
        )

    async def _refresh_since(self, missed_at: float) -> None:
        """Learn a snapshot asked for after ``missed_at``. An edge a sandbox id names may have
        joined after the last snapshot (a sandbox created through another API server a moment
        ago), so a fetch that began before the miss does not answer it; concurrent misses
        share one fetch."""
        while self._fresh_since < missed_at:
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.ensure_future(self.refresh())
            await asyncio.shield(self._refreshing)

    def learn(self, edge_id: str, address: str) -> None:
        """An edge's address as another service just gave it (placement's answer)."""
        self.addresses[edge_id] = address

    async def address(self, edge_id: str) -> str | None:
        addr = self.addresses.get(edge_id)
        if addr is None:
            await self._refresh_since(time.monotonic())
            addr = self.addresses.get(edge_id)
        return addr

    def stub_for_address(self, address: str) -> edge_pb2_grpc.EdgeServiceStub:
        stub = self._stubs.get(address)
        if stub is None:
            ch = self._channels[address] = open_channel(address, "apiserver")
            stub = self._stubs[address] = edge_pb2_grpc.EdgeServiceStub(ch)
        return stub

    async def stub(self, edge_id: str) -> edge_pb2_grpc.EdgeServiceStub | None:
        """The edge's stub; when its channel is not connected (the edge restarting, or idle),
        first waits up to :data:`EDGE_RECONNECT_WAIT_S` for it: a call sent while an edge
        restarts then reaches the new one instead of failing (nothing was sent, so this is
        safe for any call); an edge that stays away fails the call as before, only later."""
        addr = await self.address(edge_id)
        if not addr:
            return None
        stub = self.stub_for_address(addr)
        channel = self._channels[addr]
        if channel.get_state() != grpc.ChannelConnectivity.READY:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(channel.channel_ready(), EDGE_RECONNECT_WAIT_S)
        return stub

    async def run(self) -> None:
        """Periodic refresh so addresses of restarted edges stay current."""
        while True:
            try:
                await self.refresh()
            except DSecError as err:
                log.warning("edge directory refresh failed: %s", err)
            await asyncio.sleep(self.refresh_s)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        await self._watcher_channel.close()


class OwnerCache:
    """sandbox id -> project id (bounded LRU)."""

    def __init__(self, size: int = 200_000) -> None:
        self.size = size
        self._d: OrderedDict[str, str] = OrderedDict()

    def get(self, sandbox_id: str) -> str | None:
        v = self._d.get(sandbox_id)
        if v is not None:
            self._d.move_to_end(sandbox_id)
        return v

    def put(self, sandbox_id: str, project_id: str) -> None:
        self._d[sandbox_id] = project_id
        self._d.move_to_end(sandbox_id)
        while len(self._d) > self.size:
            self._d.popitem(last=False)

    def drop(self, sandbox_id: str) -> None:
        self._d.pop(sandbox_id, None)


def not_found(sandbox_id: str) -> SandboxNotFound:
    return SandboxNotFound(f"sandbox {sandbox_id} not found")


def within(project_id: str, scope: str) -> bool:
    return project_id == scope or project_id.startswith(scope + "/")


def require_any(value: Any, message: str) -> None:
    if not value:
        from libdsec.errors import InvalidArgument

        raise InvalidArgument(message)

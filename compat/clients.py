"""libdsec clients per caller: the front end acts with each caller's own token.

An E2B API key is a dsec token, so every request is made to the API server as the caller
(their project, their quotas, their sandboxes). Opening a gRPC channel per request would
cost more than the request, so clients are kept per token in a bounded LRU; a token is
checked again (``whoami``) once its check is older than the TTL, so a revoked token stops
working within it. Keeping them is a cache, not state: a restart loses nothing.

Callers hold a client through a lease (``async with pool.lease(token) as client``), so an
evicted client is closed only once its last lease ends (a long command stream keeps it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from libdsec import AsyncClient
from libdsec.errors import PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    client: AsyncClient
    checked_at: float = 0.0
    leases: int = 0
    evicted: bool = False
    checking: asyncio.Future[None] | None = field(default=None, repr=False)


class ClientPool:
    """``AsyncClient`` per token, at most ``max_clients``, tokens re-checked every ``ttl_s``."""

    def __init__(self, target: str, *, max_clients: int = 256, ttl_s: float = 30.0) -> None:
        self.target = target
        self.max_clients = max_clients
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    @asynccontextmanager
    async def lease(self, token: str) -> AsyncIterator[AsyncClient]:
        """The caller's client; raises :class:`Unauthenticated` for a missing or bad token."""
        entry = await self._checked(token)
        entry.leases += 1
        try:
            yield entry.client
        finally:
            entry.leases -= 1
            if entry.evicted and entry.leases == 0:
                await entry.client.close()

    async def _checked(self, token: str) -> _Entry:
        if not token:
            raise Unauthenticated("no API key: send X-API-Key (or X-Access-Token for envd)")
        entry = self._entries.get(token)
        if entry is None:
            entry = _Entry(AsyncClient(self.target, token=token))
            self._entries[token] = entry
            await self._evict()
        self._entries.move_to_end(token)
        if time.monotonic() - entry.checked_at < self.ttl_s:
            return entry
        if entry.checking is None:  # one check per token at a time; the others wait for it
            entry.checking = asyncio.get_running_loop().create_future()
            try:
                await entry.client.whoami(timeout=10.0)
                entry.checked_at = time.monotonic()
                entry.checking.set_result(None)
            except BaseException as exc:
                entry.checking.set_exception(exc)
                entry.checking.exception()  # retrieved: no "never retrieved" warning
                if isinstance(exc, Unauthenticated | PermissionDenied):
                    await self._drop(token, entry)
                raise
            finally:
                entry.checking = None
        else:
            await asyncio.shield(entry.checking)
        return entry

    async def _drop(self, token: str, entry: _Entry) -> None:
        if self._entries.get(token) is entry:
            del self._entries[token]
        entry.evicted = True
        if entry.leases == 0:
            await entry.client.close()

    async def _evict(self) -> None:
        while len(self._entries) > self.max_clients:
            _, old = self._entries.popitem(last=False)
            old.evicted = True
            if old.leases == 0:
                await old.client.close()

    async def close(self) -> None:
        entries = list(self._entries.values())
        self._entries.clear()
        for e in entries:
            e.evicted = True
            await e.client.close()

"""Channel keeping shared by every backend that puts aether in the sandbox.

One `ChannelKeeper` per backend holds the live `AetherConnection` of each sandbox and decides
what a closed channel means, through two questions only the runtime can answer
(`ChannelHooks`): is the sandbox still there (then reconnect: the edge can always come back to
aether, after its own restart too), and if not, why did it end (the reason the manager
records: OOM, CHANNEL_CLOSED, later KERNEL_FAULT for a guest panic, ...). It also carries the
manager's exit callback, so every path that ends a sandbox on its own (a dead channel, the
containment watchdog) reports through one place.

The channel itself is the same framed wire whatever carries it: a Unix socket to a container's
aether, later a virtio-serial port (a Unix socket on the host) to a VM's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from edge.aether_client import AetherConnection
from edge.backends.contract import ExitCallback
from libdsec.errors import Unavailable

log = logging.getLogger(__name__)

#: How long a running sandbox whose channel went silent has to answer a new connection's Hello
#: before it is ended (CHANNEL_CLOSED). A merely slow sandbox answers within it.
RECONNECT_S = 30.0
#: One try of that reconnect: a Hello within it, or the runtime is asked whether it still runs.
RECONNECT_TRY_S = 2.0


class ChannelHooks(Protocol):
    async def still_running(self, sandbox_id: str) -> bool:
        """After the channel closed: is the sandbox alive (so the edge reconnects)?"""

    async def why_ended(self, sandbox_id: str, channel_reason: str) -> tuple[str, str]:
        """The sandbox is gone: (termination reason, message) for the manager."""


class ChannelKeeper:
    def __init__(
        self,
        address_of: Callable[[str], str],
        hooks: ChannelHooks,
        ready_timeout_s: float,
        *,
        ask_hello: bool = False,
        reconnect_s: float = RECONNECT_S,
    ) -> None:
        self.address_of = address_of
        self.reconnect_s = reconnect_s
        #: A device channel (VMs): aether cannot see the host connect; the edge asks for Hello.
        self.ask_hello = ask_hello
        self.hooks = hooks
        self.ready_timeout_s = ready_timeout_s
        self.connections: dict[str, AetherConnection] = {}
        #: Paused sandboxes: frozen, or with no VMM at all. Their channel's silence is not a
        #: death, and a channel that closes meanwhile is taken up again at the resume.
        self.held: set[str] = set()
        self.on_exit: ExitCallback | None = None

    def __contains__(self, sandbox_id: str) -> bool:
        return sandbox_id in self.connections

    def get(self, sandbox_id: str) -> AetherConnection | None:
        return self.connections.get(sandbox_id)

    def channel(self, sandbox_id: str) -> AetherConnection:
        """The live channel, or UNAVAILABLE (CHANNEL_CLOSED) while there is none."""
        conn = self.connections.get(sandbox_id)
        if conn is None or conn.closed.is_set():
            raise Unavailable(
                f"no channel to sandbox {sandbox_id} (reconnecting)", reason="CHANNEL_CLOSED"
            )
        return conn

    def on_close_of(self, sandbox_id: str) -> Callable[[str], Awaitable[None]]:
        """The on_close callback for a connection that is (or will be) `sandbox_id`'s."""

        async def closed(reason: str) -> None:
            await self.lost(sandbox_id, reason)

        return closed

    async def connect(self, sandbox_id: str, timeout_s: float | None = None) -> AetherConnection:
        """Connect to the sandbox's aether and wait for its Hello; kept as its channel."""
        conn = self.new_connection(sandbox_id, on_close=self.on_close_of(sandbox_id))
        await conn.connect(timeout_s=timeout_s or self.ready_timeout_s)
        self.connections[sandbox_id] = conn
        return conn

    def new_connection(
        self, sandbox_id: str, on_close: Callable[[str], Awaitable[None]] | None = None
    ) -> AetherConnection:
        """A connection to the sandbox's aether that is not (yet) its kept channel."""
        return AetherConnection(
            self.address_of(sandbox_id), sandbox_id, on_close=on_close, ask_hello=self.ask_hello
        )

    def hold(self, sandbox_id: str) -> None:
        """The sandbox is being paused: from now until `release`, nothing it does not say
        ends it (a frozen aether answers no ping; after an edge restart there is no channel
        at all until the resume)."""
        self.held.add(sandbox_id)
        conn = self.connections.get(sandbox_id)
        if conn is not None:
            conn.hold()

    async def release(self, sandbox_id: str, timeout_s: float | None = None) -> AetherConnection:
        """The sandbox runs again: its channel's keepalive restarts, or, if the channel was
        closed meanwhile (an edge restart, a VMM that exited), a new one is opened. Raises
        Unavailable (AETHER_UNREACHABLE) if the sandbox does not answer."""
        # Held until it answers: a channel that closes meanwhile is this call's to judge (a
        # sandbox killed while it was frozen dies at the thaw), not a lost channel's.
        timeout_s = timeout_s or self.reconnect_s
        try:
            conn = self.connections.get(sandbox_id)
            if conn is not None and not conn.closed.is_set():
                try:
                    await conn.release(timeout_s)
                    return conn
                except Unavailable as exc:
                    log.info(
                        "%s did not answer after its resume (%s); reconnecting",
                        sandbox_id,
                        exc.message,
                    )
                    self.connections.pop(sandbox_id, None)
                    await conn.close()
            self.connections.pop(sandbox_id, None)
            if not await self.hooks.still_running(sandbox_id):
                raise Unavailable(
                    f"sandbox {sandbox_id} is not running after its resume",
                    reason="AETHER_UNREACHABLE",
                )
            return await self.connect(sandbox_id, timeout_s=timeout_s)
        finally:
            self.held.discard(sandbox_id)

    def keep(self, sandbox_id: str, conn: AetherConnection) -> None:
        """Make an already connected channel the sandbox's (a claimed warm sandbox)."""
        self.connections[sandbox_id] = conn

    async def drop(self, sandbox_id: str, *, shutdown_grace_s: float | None = None) -> None:
        """Forget and close the channel (the edge ends it: no exit is reported). With a grace,
        aether is asked to shut the sandbox down first."""
        self.held.discard(sandbox_id)
        conn = self.connections.pop(sandbox_id, None)
        if conn is None:
            return
        if shutdown_grace_s is not None:
            await conn.shutdown(shutdown_grace_s)
        await conn.close()

    async def close_all(self) -> None:
        """The edge goes away, not necessarily the sandboxes: their channels are dropped and
        taken up again by the next edge (adopt)."""
        for sid in list(self.connections):
            conn = self.connections.pop(sid)
            with contextlib.suppress(Exception):
                await conn.close()

    async def report_exit(self, sandbox_id: str, reason: str, message: str) -> None:
        """The sandbox ended on its own (or was ended by the watchdog): tell the manager."""
        if self.on_exit is not None:
            await self.on_exit(sandbox_id, reason, message)

    async def lost(self, sandbox_id: str, reason: str) -> None:
        """The sandbox's channel closed (not by us): reconnect, or report how it ended."""
        if self.connections.get(sandbox_id) is None:
            return  # we closed it ourselves (stop/destroy)
        self.connections.pop(sandbox_id, None)
        if sandbox_id in self.held:
            # Paused: a frozen aether cannot be reconnected to now; the resume does it.
            log.info("channel to paused %s closed (%s); reopened at resume", sandbox_id, reason)
            return
        if await self.hooks.still_running(sandbox_id):
            log.warning(
                "channel to %s lost (%s) but the sandbox runs; reconnecting", sandbox_id, reason
            )
            # A starved sandbox (a tiny cpu quota, a heavy swap-in) answers late: it gets
            # reconnect_s before it is called dead (docs/ARCHITECTURE.md, timers), in tries
            # of RECONNECT_TRY_S between which the runtime is asked again, so one that died
            # meanwhile ends at once rather than after the whole budget.
            deadline = time.monotonic() + self.reconnect_s
            while True:
                left = deadline - time.monotonic()
                try:
                    await self.connect(sandbox_id, timeout_s=max(0.1, min(RECONNECT_TRY_S, left)))
                    return
                except Unavailable as exc:
                    if sandbox_id in self.held:  # paused meanwhile: the resume reconnects
                        return
                    reason = f"reconnect failed: {exc.message}"
                if left <= RECONNECT_TRY_S or not await self.hooks.still_running(sandbox_id):
                    break
        await self.report_exit(sandbox_id, *await self.hooks.why_ended(sandbox_id, reason))

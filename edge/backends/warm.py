"""Warm sandboxes: sandboxes started before anyone asks, handed out at create.

Shared by the backends (beside the contract, not in a backend's folder): the container backend
keeps a `WarmPool` of runc sandboxes, the microVM backend one of restored guests
(`microvm/warm_pool.py` adds its fixed shape). What follows is the container's story.

A cold create is bounded by the runtime: `runc run -d` (~35 ms here), aether's interpreter and
imports (~14 ms) and chronus's fork. A warm sandbox has done all of that: the edge keeps
`targets[image]` of them per image (`DSEC_EDGE_WARM_POOL`, e.g. "busybox=64,bookworm=8"), and a
create that one can serve *claims* it instead of starting a container:

1. the runtime renames it to the new sandbox id (directories, runc state, cgroups, record,
   layer holders; `RuncRuntime.rename`), sets its hostname and /etc files, and rewrites its
   cgroup limits to the request's cpu, memory and pids;
2. the edge renames its socket and log, re-keys its channel, and sends aether a `Claim` with the
   sandbox's environment (image env, the caller's env and workdir): aether, which imported
   chronus's modules but did not fork it, replaces its environment and starts chronus.

From then on it is an ordinary sandbox: same record, same teardown, re-adopted after an edge
restart like any other. Warm sandboxes themselves belong to nobody: no record, no quota, not
listed, not counted in the edge's admission; an edge restart removes them as orphans and the pool
is refilled. Their cost is an idle aether each (~6 MB PSS, `bench/bench_containers.py`).

Which creates a warm sandbox serves: the container backend, an image with a target here, no extra
toolkit layers, no network policy (network needs its veth and eBPF programs before aether runs)
and no disk quota other than the edge's default. Everything else starts cold.

Refill runs one start at a time, in quiet moments: not while cold starts are in flight (a burst
larger than the pool gets the machine for its own starts) and not within `quiet_s` of the last
create unless the pool is below a quarter of its target (a refill's runc start competing with a
claim made the claim several times slower, measured). A warm sandbox whose channel closes is
discarded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edge.model import SandboxRecord, SandboxSpec

if TYPE_CHECKING:
    from edge.aether_client import AetherConnection
    from edge.backends.channels import ChannelKeeper

log = logging.getLogger(__name__)

#: Set in a warm sandbox's pid 1 environment (aether/server.py: WARM_ENV).
WARM_ENV = "DSEC_AETHER_WARM"
#: Prefix of warm sandboxes' runtime ids (never a sandbox id: those start with "sb-").
WARM_PREFIX = "warm-"


@dataclass
class WarmSandbox:
    cid: str  # its runtime id until claimed
    image_name: str
    image: Any  # ResolvedImage: the layers it was started on
    proc: Any  # the runtime's handle: SandboxProcess (runc), microvm.backend.Vm
    conn: AetherConnection
    prep: Any  # containment.Prepared (descriptors already handed over and closed)
    started_at: float


class WarmPool:
    """The warm sandboxes of one backend, per image; `start` and `discard` are the backend's."""

    def __init__(
        self,
        targets: dict[str, int],
        start: Callable[[str], Awaitable[WarmSandbox]],
        discard: Callable[[WarmSandbox], Awaitable[None]],
    ) -> None:
        self.targets = {k: v for k, v in targets.items() if v > 0}
        self._start = start
        self._discard = discard
        self.ready: dict[str, collections.deque[WarmSandbox]] = {
            k: collections.deque() for k in self.targets
        }
        self._wake = asyncio.Event()
        self._cold_starts = 0  # creates starting cold right now: refill waits for them
        self.claimed: collections.Counter[str] = collections.Counter()  # per image
        self.missed: collections.Counter[str] = collections.Counter()  # eligible, none ready
        self._closing = False
        self._tasks: set[asyncio.Future[None]] = set()
        self.quiet_s = 0.5
        self._last_create = 0.0

    def eligible(self, rec: SandboxRecord) -> bool:
        s = rec.spec
        return (
            s.image in self.targets
            and not s.toolkits
            and not s.network
            and not s.disk_mb
            and not s.gpu_count
        )

    def take(self, rec: SandboxRecord) -> WarmSandbox | None:
        """A warm sandbox for `rec`, or None (then it starts cold). Wakes the refill."""
        self._last_create = time.monotonic()
        if not self.eligible(rec):
            return None
        q = self.ready[rec.spec.image]
        while q:
            w = q.popleft()
            if not w.conn.closed.is_set():
                self._wake.set()
                return w
            self._spawn(self._discard(w))  # its channel closed while it waited
        self.missed[rec.spec.image] += 1
        self._wake.set()
        return None

    @contextlib.contextmanager
    def cold_start(self) -> Iterator[None]:
        """Around a create that starts cold: the refill waits until none is left."""
        self._cold_starts += 1
        try:
            yield
        finally:
            self._cold_starts -= 1

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)  # referenced until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    def forget(self, w: WarmSandbox) -> bool:
        """Remove a warm sandbox whose channel closed; True if it was still waiting here."""
        q = self.ready.get(w.image_name)
        if q is not None and w in q:
            q.remove(w)
            self._wake.set()
            return True
        return False

    def status(self) -> dict[str, tuple[int, int, int, int]]:
        """image -> (target, ready, claimed, missed)."""
        return {
            k: (n, len(self.ready[k]), self.claimed[k], self.missed[k])
            for k, n in self.targets.items()
        }

    async def run(self) -> None:
        """Background loop: keep every image at its target, one start at a time."""
        failures = 0
        while not self._closing:
            short = [k for k, n in self.targets.items() if len(self.ready[k]) < n]
            low = [k for k in short if len(self.ready[k]) * 4 < self.targets[k]]
            busy = time.monotonic() - self._last_create < self.quiet_s
            if not short or self._cold_starts > 0 or (busy and not low):
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.quiet_s / 2)
                continue
            image = min(short, key=lambda k: len(self.ready[k]) / self.targets[k])
            try:
                w = await self._start(image)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an image gone, the runtime failing: retry, slowly
                failures += 1
                log.warning("warm sandbox of %s failed to start: %s", image, exc)
                await asyncio.sleep(min(30.0, 0.5 * 2**failures))
                continue
            failures = 0
            if self._closing:
                await self._discard(w)
                return
            self.ready[image].append(w)

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        for q in self.ready.values():
            while q:
                await self._discard(q.popleft())


def on_warm_close(
    channels: ChannelKeeper,
    pool: Callable[[], WarmPool | None],
    discard: Callable[[WarmSandbox], Awaitable[None]],
    holder: list[WarmSandbox],
    kind: str,
) -> Callable[[str], Awaitable[None]]:
    """The on_close of a warm sandbox's channel (`holder` gets the sandbox once it is up):
    claimed since, it is a sandbox like others (the keeper decides); still waiting, it is
    discarded."""

    async def closed(reason: str) -> None:
        if not holder:
            return  # not up yet: its start fails and cleans up
        w = holder[0]
        if channels.get(w.conn.sandbox_id) is w.conn:
            await channels.lost(w.conn.sandbox_id, reason)
        elif (p := pool()) is not None and p.forget(w):
            log.warning("warm %s %s lost its channel (%s)", kind, w.cid, reason)
            await discard(w)

    return closed


def new_warm_id() -> str:
    return WARM_PREFIX + secrets.token_hex(8)


def template(cid: str, image_name: str) -> SandboxRecord:
    """The record a warm sandbox starts from: the image and default limits, no owner."""
    return SandboxRecord(cid, "", "", SandboxSpec(image=image_name), "")

"""SandboxService/WatchSandboxes: the caller's sandboxes as they change, fanned in from the edges.

One edge stream per edge, with the filters pushed down (the caller's project subtree, task,
labels): opened for every edge of the watcher's snapshot when the watch starts, and for edges
that appear later (the directory the API server already refreshes). Each edge stream first
replays what changed since the watch started (or, after a break, since that edge's last
keepalive: its own clock), so a sandbox created on an edge the directory did not list yet, or
during a broken stream, is still reported; a broken stream is reopened with back-off. The
caller's first keepalive comes once every edge known at the start is followed (or has failed
once): a change after it is reported. Changes are at least once (a change near an edge
stream's break may come twice).

Creates waiting in the queue (``wait_s``) are not on any edge: the watch asks IAM for the
subtree's queue entries every :data:`QUEUE_POLL_S` and reports each change of one (joined:
PENDING with ``queue`` set; placed: the same id with ``queue.placed_sandbox_id``, after which
the sandbox is reported under its own id by its edge; ended unplaced: TERMINATED with
QUEUE_TIMEOUT or STOPPED).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from apiserver.creation import Caller
from apiserver.gateway import Gateway
from apiserver.queue import WAITING, pending_view
from apiserver.routing import within
from common.channels import DEFAULT_DEADLINE_S
from common.convert import ts
from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2
from dsec.iam.v1 import iam_pb2
from dsec.types.v1 import types_pb2
from libdsec.errors import DSecError, InvalidArgument

log = logging.getLogger(__name__)

EDGE_LOST = types_pb2.TERMINATION_REASON_EDGE_LOST

#: How far back a resumed watch may ask to replay (edges keep their recent changes).
MAX_REPLAY_S = 3600.0
#: A changed_since this far in the future is a bad clock, not a resume.
MAX_AHEAD_S = 30.0

KEEPALIVE_DEFAULT_MS = 5000
KEEPALIVE_RANGE_MS = (100, 600_000)
#: What the edge streams are asked for: a silent edge stream is dropped after STALL_AFTER of them.
EDGE_KEEPALIVE_MS = 2000
STALL_AFTER = 3
#: An edge stream is renewed this often (every outbound call has a deadline; the replay
#: makes the renewal invisible to the caller).
EDGE_STREAM_S = 600.0
BACKOFF_S = (0.2, 5.0)
#: How often the edge directory is checked for edges that appeared.
DIRECTORY_POLL_S = 1.0
#: Changes buffered for a slow caller; beyond it the edge streams wait (and, far behind,
#: end with WATCH_OVERFLOW and replay).
QUEUE = 10_000
#: How often a watch asks IAM about the subtree's queued creates.
QUEUE_POLL_S = 0.5
#: Queue entries carry IAM's clock: a change this much before the watch's start (by this API
#: server's clock) is still reported (at least once, as the edges' replays are).
QUEUE_SKEW_S = 2.0


def replay_start(request: apiserver_pb2.WatchSandboxesRequest) -> float:
    """When the watch's replay starts (wall clock, s): now, or a resumed watch's changed_since."""
    now = time.time()
    if not request.HasField("changed_since"):
        return now
    since = request.changed_since.ToNanoseconds() / 1e9
    if not now - MAX_REPLAY_S <= since <= now + MAX_AHEAD_S:
        raise InvalidArgument(
            f"changed_since {request.changed_since.ToJsonString()} is not within the last"
            f" {MAX_REPLAY_S:.0f} s",
            reason="BAD_CHANGED_SINCE",
            metadata={"field": "changed_since"},
        )
    return min(since, now)


class _Ready:
    """Queue marker: every edge known at the start is followed."""


def keepalive_interval_s(request: apiserver_pb2.WatchSandboxesRequest) -> float:
    ms = request.keepalive_interval_ms or KEEPALIVE_DEFAULT_MS
    lo, hi = KEEPALIVE_RANGE_MS
    if not lo <= ms <= hi:
        raise InvalidArgument(
            f"keepalive_interval_ms={ms} must be 0 (= {KEEPALIVE_DEFAULT_MS}) or in {lo}..{hi}",
            reason="INVALID_KEEPALIVE",
        )
    return ms / 1000


class SandboxWatch:
    """One caller's WatchSandboxes: a task per edge, fanned into one queue."""

    def __init__(
        self,
        gw: Gateway,
        who: Caller,
        request: apiserver_pb2.WatchSandboxesRequest,
        *,
        recheck_token: bool = True,
    ) -> None:
        self.gw = gw
        self.who = who
        #: A caller's token is checked again at every keepalive; the API server's own watch
        #: (the dashboard's feed, apiserver/dashboard.py) has none.
        self.recheck_token = recheck_token
        self.interval_s = keepalive_interval_s(request)
        self.edge_request = edge_pb2.WatchSandboxesRequest(
            keepalive_interval_ms=EDGE_KEEPALIVE_MS,
            project_prefix=who.project_id,
            task_id=request.task_id,
            label_selector=request.label_selector,
        )
        self.started_at = replay_start(request)
        self.out: asyncio.Queue[types_pb2.Sandbox | _Ready | BaseException] = asyncio.Queue(QUEUE)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        #: per edge, the replay start of its next stream (that edge's clock, once it has sent one)
        self.since: dict[str, Timestamp] = {}
        self._unready: set[str] = set()

    async def events(self) -> AsyncGenerator[apiserver_pb2.WatchSandboxesResponse, None]:
        await self.gw.edges.refresh()
        self._unready = set(self.gw.edges.addresses)
        for edge_id in self._unready.copy():
            self._follow(edge_id)
        if not self._unready:
            self.out.put_nowait(_Ready())
        directory = asyncio.create_task(self._directory())
        queued = asyncio.create_task(self._queue())
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self.out.get(), timeout=self.interval_s)
                except TimeoutError:
                    item = _Ready()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Ready):
                    # A long stream outlives a token: a revoked or expired one ends it.
                    if self.recheck_token:
                        await self.gw.caller(self.who.token)
                    yield apiserver_pb2.WatchSandboxesResponse(
                        keepalive=types_pb2.Keepalive(at=ts(time.time()))
                    )
                elif within(item.project_id, self.who.project_id):  # the edge filtered already
                    yield apiserver_pb2.WatchSandboxesResponse(changed=item)
        finally:
            tasks = [directory, queued, *self.tasks.values()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _follow(self, edge_id: str) -> None:
        self.tasks[edge_id] = asyncio.create_task(self._edge(edge_id))

    def _ready(self, edge_id: str) -> None:
        if edge_id in self._unready:
            self._unready.discard(edge_id)
            if not self._unready:
                self.out.put_nowait(_Ready())

    async def _directory(self) -> None:
        """Follows edges that appear after the start (and ones that come back)."""
        while True:
            await asyncio.sleep(DIRECTORY_POLL_S)
            for edge_id in self.gw.edges.addresses:
                task = self.tasks.get(edge_id)
                if task is None or task.done():
                    self._follow(edge_id)

    async def _queue(self) -> None:
        """The subtree's queued creates, as they join, are placed or end (since the start)."""
        seen: dict[str, tuple[int, str]] = {}
        task_id = self.edge_request.task_id
        labels = dict(self.edge_request.label_selector)
        while True:
            try:
                resp = await self.gw.iam.GetQueued(
                    iam_pb2.GetQueuedRequest(project_prefix=self.who.project_id),
                    timeout=DEFAULT_DEADLINE_S,
                )
            except grpc.aio.AioRpcError as exc:  # IAM away: asked again next round
                log.info("watch: the create queue is unknown: %s", exc.code().name)
                resp = None
            for e in resp.entries if resp is not None else []:
                key = (e.state, e.placed_sandbox_id)
                first = e.queue_id not in seen
                if seen.get(e.queue_id) == key:
                    continue
                seen[e.queue_id] = key
                since = self.started_at - QUEUE_SKEW_S
                if (e.ended_at or e.enqueued_at) < since:
                    continue  # changed before the watch started
                if task_id and e.task_id != task_id:
                    continue
                sb = pending_view(e)
                if any(sb.spec.labels.get(k) != v for k, v in labels.items()):
                    continue
                if first and e.state != WAITING and e.enqueued_at >= since:
                    # It joined and ended between two polls: it was PENDING first.
                    joined = iam_pb2.QueueEntry()
                    joined.CopyFrom(e)
                    joined.state, joined.placed_sandbox_id, joined.ended_at = WAITING, "", 0.0
                    await self.out.put(pending_view(joined))
                await self.out.put(sb)
            await asyncio.sleep(QUEUE_POLL_S)

    async def _edge(self, edge_id: str) -> None:
        try:
            await self._edge_loop(edge_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: end the caller's stream with it, not silently
            self.out.put_nowait(exc)

    async def _edge_loop(self, edge_id: str) -> None:
        backoff = BACKOFF_S[0]
        #: changes delivered since this edge's last keepalive: a replay after a break skips them
        recent: dict[str, tuple[int, int]] = {}
        #: sandboxes of this edge reported lost (EDGE_LOST) by this watch
        lost: set[str] = set()
        while True:
            address = self.gw.edges.addresses.get(edge_id)
            if address is None:  # the watcher forgot the edge
                self._ready(edge_id)
                await self._lost(edge_id, lost)
                return
            request = edge_pb2.WatchSandboxesRequest()
            request.CopyFrom(self.edge_request)
            since = self.since.get(edge_id)
            if since is None:
                request.changed_since.FromNanoseconds(int(self.started_at * 1e9))
            else:
                request.changed_since.CopyFrom(since)
            call = self.gw.edges.stub_for_address(address).WatchSandboxes(
                request, timeout=EDGE_STREAM_S
            )
            renewed = False
            replaying = True  # until the stream's first keepalive
            try:
                while True:
                    msg = await asyncio.wait_for(
                        call.read(), timeout=STALL_AFTER * EDGE_KEEPALIVE_MS / 1000
                    )
                    if msg is grpc.aio.EOF:
                        break
                    if msg.HasField("keepalive"):
                        self.since[edge_id] = msg.keepalive.at
                        recent.clear()
                        replaying = False
                        backoff = BACKOFF_S[0]
                        self._ready(edge_id)
                        continue
                    batch = msg.replayed.sandboxes if msg.HasField("replayed") else [msg.changed]
                    for sb in batch:
                        key = (sb.state, sb.termination.reason)
                        if replaying and recent.get(sb.id) == key:
                            continue  # delivered before the break, after the last keepalive
                        if sb.id in lost and sb.termination.reason == EDGE_LOST:
                            continue  # the edge came back and stopped it as it was reported
                        recent[sb.id] = key
                        await self.out.put(sb)
            except grpc.aio.AioRpcError as exc:
                renewed = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if not renewed:
                    log.info("watch: edge %s stream broke: %s", edge_id, exc.code().name)
            except TimeoutError:
                log.info("watch: edge %s stream stalled", edge_id)
            finally:
                call.cancel()
            self._ready(edge_id)  # the first keepalive waits for no broken edge
            if not renewed:
                await self._lost(edge_id, lost)
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, BACKOFF_S[1])

    async def _lost(self, edge_id: str, reported: set[str]) -> None:
        """An edge that does not answer may have been declared lost: its sandboxes (the
        watcher's last report of them) end with EDGE_LOST, once, if lost since the start."""
        try:
            resp = await self.gw.edges.lost(
                edge_id=edge_id,
                project_prefix=self.who.project_id,
                task_id=self.edge_request.task_id,
                label_selector=dict(self.edge_request.label_selector),
            )
        except DSecError as exc:  # the watcher is down: asked again at the next attempt
            log.info("watch: lost sandboxes of edge %s unknown: %s", edge_id, exc)
            return
        start = self.started_at
        for sb in resp.sandboxes:
            at = sb.termination.at.seconds + sb.termination.at.nanos / 1e9
            if sb.id not in reported and at >= start:
                reported.add(sb.id)
                await self.out.put(sb)

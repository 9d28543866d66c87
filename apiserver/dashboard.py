"""The dashboard: the cluster at a glance in a browser, served by every API server on the
viewer's HTTP listener (``DSEC_APISERVER_VIEWER_ADDR``; ``off`` serves neither).

What it shows a caller, exactly what the gRPC API would show the same token: its project's
sandboxes and those of the projects below it (ListSandboxes with ``include_subprojects``),
grouped per task with state and age; the recent terminations with their reasons; each task's
state changes (pauses, resumes, ends) as this API server observed them; and, to an operator
(an ADMIN token of the root project, as for ListNodes), the nodes with health and load.

Routes, every one behind the caller's token (``?token=`` or ``Authorization: Bearer``; none
or a bad one is HTTP 401 with nothing of any project):

- ``GET /dashboard``: the page (``apiserver/dashboard.html``: inline script and style under
  a per-response CSP nonce, nothing fetched from elsewhere). It reads a ``?token=`` once,
  keeps it in the tab's sessionStorage, takes it out of the address bar, and sends it as an
  ``Authorization`` header from then on; without a token it is a sign-in form (401).
- ``GET /dashboard/api/sandboxes[?task=T]``, ``/dashboard/api/history[?task=T]``,
  ``/dashboard/api/nodes`` (operators; others 403 OPERATOR_ONLY): JSON; an error is
  ``{"error": {"code", "reason", "message"}}`` with the HTTP status of its code.
- ``GET /dashboard/api/events``: Server-Sent Events. First ``snapshot`` (all of the above),
  then ``sandbox`` per change (the sandbox and, when its state changed, the change),
  ``nodes`` every :data:`NODES_EVERY_S` for operators, ``keepalive`` every
  :data:`SSE_KEEPALIVE_S` (the token is checked again: a revoked one ends the stream with an
  ``error`` event), and ``error`` before the stream ends for any other reason. The page
  reconnects (and takes a new snapshot) when the stream ends.

Where the changes come from: one :class:`DashboardFeed` per API server, the API server's own
watch of every sandbox (:class:`~apiserver.watch.SandboxWatch`, the code behind
WatchSandboxes, over the root project, fanned in from every edge), fanned out to each open
event stream by project subtree. It runs only while the dashboard is used: it starts with the
first request and stops ``DSEC_APISERVER_DASHBOARD_IDLE_S`` (:data:`FEED_IDLE_S`) after the
last stream closed and the last request, so an API server nobody looks at keeps no extra edge
streams. The history (apiserver/statelog.py) is in memory, bounded, and starts when the feed
does: it goes back to the feed's start at most (the ``history_since`` of every answer).
Answers carry the newest :data:`LIVE_SHOWN` live and :data:`TERMINATED_SHOWN` ended sandboxes
and how many there are in all.

Timers: the feed's watch has the keepalive of any watch (it notices a stalled edge as
WatchSandboxes does); a paused sandbox changes nothing; a lost node's sandboxes come as
TERMINATED (EDGE_LOST) once the watcher declares it lost. An event stream's keepalive
(:data:`SSE_KEEPALIVE_S`) also keeps proxies from closing an idle connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from apiserver.creation import Caller
from apiserver.gateway import Gateway
from apiserver.nodes import ROOT_PROJECT, is_operator, require_operator
from apiserver.routing import within
from apiserver.statelog import StateLog
from apiserver.viewer import http_status, request_token
from apiserver.watch import SandboxWatch
from dsec.apiserver.v1 import apiserver_pb2
from dsec.iam.v1 import iam_pb2
from dsec.types.v1 import types_pb2
from dsec.watcher.v1 import watcher_pb2
from libdsec.errors import DSecError, InvalidArgument, Unauthenticated, Unavailable

log = logging.getLogger(__name__)

#: The feed stops this long after the last event stream closed and the last request
#: (DSEC_APISERVER_DASHBOARD_IDLE_S).
FEED_IDLE_S = 900.0
#: Keepalive of the feed's own watch (how soon it notices it is idle).
FEED_KEEPALIVE_MS = 5000
#: The feed's watch is opened again after a failure after this long (doubling up to the max).
FEED_RETRY_S = (1.0, 30.0)
#: Changes buffered per event stream; a stream that falls this far behind ends (WATCH_OVERFLOW)
#: and the page reconnects with a new snapshot.
SUBSCRIBER_QUEUE = 2000
#: An event stream's keepalive and token check.
SSE_KEEPALIVE_S = 15.0
#: How often an operator's event stream carries the nodes.
NODES_EVERY_S = 5.0
#: Sandboxes in an answer: the newest live ones and the most recently ended ones (a page of a
#: whole large cluster, an operator's, shows these; the answer says how many there are).
LIVE_SHOWN = 5000
TERMINATED_SHOWN = 500
#: What every answer carries: nothing cached (the token and the data are the caller's), no
#: Referer sent to anything the page links.
COMMON_HEADERS = {
    "cache-control": "no-store",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}
#: The page's template: ``{{nonce}}`` is replaced per response.
PAGE = files("apiserver").joinpath("dashboard.html").read_text()

#: The identity of the feed's watch (no token: it is the API server's own).
FEED_CALLER = Caller("apiserver-dashboard", ROOT_PROJECT, "")


# ---------------------------------------------------------------- JSON views


def _seconds(message: Any, name: str) -> float | None:
    if not message.HasField(name):
        return None
    stamp: Timestamp = getattr(message, name)
    return stamp.seconds + stamp.nanos / 1e9


def _enum_name(enum: Any, value: int, prefix: str) -> str:
    """``value``'s name without ``prefix`` (a value newer than this server's protos: the number)."""
    try:
        return str(enum.Name(value)).removeprefix(prefix)
    except ValueError:
        return str(value)


def sandbox_json(sb: types_pb2.Sandbox) -> dict[str, Any]:
    """A sandbox as the dashboard shows it (the fields of ``dsec sandbox list --json``'s)."""
    ended = sb.HasField("termination") and sb.termination.reason
    return {
        "id": sb.id,
        "project_id": sb.project_id,
        "task_id": sb.spec.task_id,
        "state": _enum_name(types_pb2.SandboxState, sb.state, "SANDBOX_STATE_"),
        "edge_id": sb.edge_id,
        "backend": _enum_name(types_pb2.Backend, sb.spec.backend, "BACKEND_").lower(),
        "image": sb.spec.image,
        "cpu_millis": sb.spec.resources.cpu_millis,
        "memory_mb": sb.spec.resources.memory_mb,
        "labels": dict(sb.spec.labels),
        "created_at": _seconds(sb, "created_at"),
        "started_at": _seconds(sb, "started_at"),
        "terminated_at": _seconds(sb.termination, "at") if ended else None,
        "termination_reason": (
            _enum_name(types_pb2.TerminationReason, sb.termination.reason, "TERMINATION_REASON_")
            if ended
            else None
        ),
        "termination_message": sb.termination.message if ended else "",
        "queue_position": sb.queue.position if sb.HasField("queue") else None,
    }


def node_json(n: watcher_pb2.EdgeStatus) -> dict[str, Any]:
    """A node's health and load, without the per-project, per-task and per-principal counts."""
    return {
        "id": n.info.edge_id,
        "hostname": n.info.hostname,
        "version": n.info.version,
        "health": _enum_name(watcher_pb2.EdgeHealth, n.health, "EDGE_HEALTH_"),
        "health_reason": n.health_reason,
        "health_detail": n.health_detail,
        "draining": n.draining,
        "sandboxes": n.load.sandboxes,
        "sandboxes_by_backend": dict(n.load.sandboxes_by_backend),
        "cpu_millis_allocated": n.load.cpu_millis_allocated,
        "cpu_millis_capacity": n.load.cpu_millis_capacity,
        "memory_mb_allocated": n.load.memory_mb_allocated,
        "memory_mb_capacity": n.load.memory_mb_capacity,
        "last_probe_at": _seconds(n, "last_probe_at"),
    }


def error_json(err: DSecError) -> dict[str, Any]:
    return {"error": {"code": err.code.name, "reason": err.reason, "message": err.message}}


def recent(
    sandboxes: list[dict[str, Any]], live_shown: int, terminated_shown: int
) -> list[dict[str, Any]]:
    """The ``live_shown`` newest live sandboxes and the ``terminated_shown`` most recently
    ended ones, in the order given."""
    ended = [s for s in sandboxes if s["state"] == "TERMINATED"]
    ended.sort(key=lambda s: s["terminated_at"] or 0.0, reverse=True)
    live = [s for s in sandboxes if s["state"] != "TERMINATED"]
    live.sort(key=lambda s: s["created_at"] or 0.0, reverse=True)
    keep = {s["id"] for s in [*live[:live_shown], *ended[:terminated_shown]]}
    return [s for s in sandboxes if s["id"] in keep]


# ---------------------------------------------------------------------- feed


@dataclass(eq=False)
class Subscriber:
    """One event stream's share of the feed: the changes within its caller's project, as
    ``("sandbox", event)``, and ``("live", None)`` when the feed's watch is established."""

    scope: str
    queue: asyncio.Queue[tuple[str, Any]] = field(
        default_factory=lambda: asyncio.Queue(SUBSCRIBER_QUEUE)
    )
    overflowed: bool = False


class DashboardFeed:
    """The API server's own watch of every sandbox while the dashboard is used (module doc)."""

    def __init__(self, gw: Gateway, idle_s: float = FEED_IDLE_S) -> None:
        self.gw = gw
        self.idle_s = idle_s
        self.log = StateLog()
        self.subscribers: set[Subscriber] = set()
        #: Whether the feed runs (from a use until it stops idle) and whether its watch is
        #: established (its first keepalive came): changes are seen.
        self.running = False
        self.watching = False
        self._wanted = asyncio.Event()
        self._last_use = 0.0

    def use(self) -> None:
        """Someone looks: the feed runs. A stopped one starts, with an empty history from
        now (at once, so that this request's answer says so)."""
        self._last_use = time.monotonic()
        if not self.running:
            self.running = True
            self.log.start(time.time())
            self._wanted.set()

    def subscribe(self, scope: str) -> Subscriber:
        self.use()
        sub = Subscriber(scope)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        self.use()  # the idle time counts from the last stream's end

    def idle(self) -> bool:
        return not self.subscribers and time.monotonic() - self._last_use > self.idle_s

    async def run(self) -> None:
        """The API server's background loop: waits to be used, watches until idle, again."""
        if self.running:  # restarted after a crash (the server's supervision): go on
            self._wanted.set()
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            log.info("dashboard feed started")
            try:
                await self._watch_until_idle()
            finally:
                self.watching = False
            if not self.idle():  # used again while the watch was being closed: go on
                self._wanted.set()
                continue
            self.running = False
            log.info("dashboard feed stopped (unused for %.0f s)", self.idle_s)

    async def _watch_until_idle(self) -> None:
        retry = FEED_RETRY_S[0]
        while not self.idle():
            request = apiserver_pb2.WatchSandboxesRequest(keepalive_interval_ms=FEED_KEEPALIVE_MS)
            events = SandboxWatch(self.gw, FEED_CALLER, request, recheck_token=False).events()
            try:
                async with contextlib.aclosing(events):
                    async for item in events:
                        if item.HasField("changed"):
                            self.publish(item.changed)
                        elif not self.watching:
                            await self._seed()
                            self.went_live()
                            retry = FEED_RETRY_S[0]
                        if self.idle():
                            return
            except DSecError as err:  # the watcher or IAM away: the streams say "not live"
                log.warning("dashboard feed: watch failed, again in %.0f s: %s", retry, err)
            self.watching = False
            await asyncio.sleep(retry)
            retry = min(retry * 2, FEED_RETRY_S[1])

    async def _seed(self) -> None:
        """Every sandbox's state as the watch begins, so that its first change has a
        ``previous``. Without it (IAM or an edge away) a first change is "first seen"."""
        try:
            found = await self.gw.list_sandboxes(FEED_CALLER, include_subprojects=True)
        except DSecError as err:
            log.warning("dashboard feed: the states before the watch are unknown: %s", err)
            return
        for sb in found:
            self.log.seed(sb.id, _enum_name(types_pb2.SandboxState, sb.state, "SANDBOX_STATE_"))

    def went_live(self) -> None:
        """The watch is established (every edge followed): every change from now on is seen.
        Each stream takes a new snapshot then: a pause or resume before it may have been missed
        (a watch's replay brings creations and ends, not pauses)."""
        self.watching = True
        for sub in list(self.subscribers):
            self._offer(sub, ("live", None))

    def _offer(self, sub: Subscriber, item: tuple[str, Any]) -> None:
        try:
            sub.queue.put_nowait(item)
        except asyncio.QueueFull:
            sub.overflowed = True
            self.subscribers.discard(sub)

    def publish(self, sb: types_pb2.Sandbox) -> None:
        """One change the watch reported: into the state log and to every stream that may
        see its project."""
        view = sandbox_json(sb)
        change = self.log.observe(
            at=time.time(),
            sandbox_id=sb.id,
            project_id=sb.project_id,
            task_id=sb.spec.task_id,
            state=view["state"],
            reason=view["termination_reason"] or "",
        )
        event = {"sandbox": view, "change": change.as_json() if change else None}
        for sub in list(self.subscribers):
            if within(sb.project_id, sub.scope):
                self._offer(sub, ("sandbox", event))


# ---------------------------------------------------------------------- HTTP


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone. Starlette does not tell a streaming response under
    ASGI 2.4 (uvicorn's) until a write fails, which for an idle stream is the next keepalive:
    its subscription would outlive the page by up to :data:`SSE_KEEPALIVE_S`."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(event: str, data: Any) -> str:
    """One Server-Sent Event (JSON on one line: json.dumps writes no newline)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def csp(nonce: str) -> str:
    """The page may run its own inline script and style and talk to its own origin, nothing
    else (no frames, no forms elsewhere, no base URL games)."""
    return (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    )


SIGN_IN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>dsec dashboard: sign in</title>
<meta name="referrer" content="no-referrer">
<style nonce="{nonce}">body{{font:15px system-ui,sans-serif;margin:3em;color:#222}}
input{{width:28em;padding:.3em}} .err{{color:#a00}}</style></head>
<body><h1>dsec dashboard</h1><p class="err" id="why">{reason}: {message}</p>
<form method="get" action=""><label>Token <input type="password" name="token"
autocomplete="off" autofocus></label> <button>Open</button></form>
<script nonce="{nonce}">
// A reload after the page took the token out of the address bar: it is in this tab's storage.
const stored = sessionStorage.getItem("dsec-token");
if ({retry} && stored) location.replace("?token=" + encodeURIComponent(stored));
else if (!{retry}) sessionStorage.removeItem("dsec-token");
</script></body></html>
"""


class Dashboard:
    """The dashboard's routes (see the module doc); mounted on the viewer's listener."""

    def __init__(self, gw: Gateway, feed: DashboardFeed) -> None:
        self.gw = gw
        self.feed = feed

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/dashboard", self.page, methods=["GET"]),
            Route("/dashboard/api/sandboxes", self.sandboxes, methods=["GET"]),
            Route("/dashboard/api/history", self.history, methods=["GET"]),
            Route("/dashboard/api/nodes", self.nodes, methods=["GET"]),
            Route("/dashboard/api/events", self.events, methods=["GET"]),
        ]

    async def _caller(self, request: Request) -> tuple[Caller, iam_pb2.Principal]:
        """The token's caller and principal: UNAUTHENTICATED without a token or with a bad one."""
        token = request_token(request)
        if not token:
            raise Unauthenticated(
                "no token: open /dashboard?token=<your dsec token>, or send "
                "'authorization: Bearer <token>'",
                reason="NO_TOKEN",
            )
        principal = await self.gw.auth.principal(token)
        return Caller(principal.principal_id, principal.project_id, token), principal

    @staticmethod
    def _task(request: Request) -> str:
        task_id = request.query_params.get("task", "")
        if len(task_id) > 128:
            raise InvalidArgument("task is longer than 128 characters", reason="INVALID_TASK")
        return task_id

    @staticmethod
    def _json(data: Any, status: int = 200) -> JSONResponse:
        return JSONResponse(data, status_code=status, headers=COMMON_HEADERS)

    def _refused(self, err: DSecError) -> JSONResponse:
        response = self._json(error_json(err), http_status(err))
        if http_status(err) == 401:
            response.headers["www-authenticate"] = "Bearer"
        return response

    # ----------------------------------------------------------------- page

    async def page(self, request: Request) -> Response:
        nonce = secrets.token_urlsafe(16)
        headers = {**COMMON_HEADERS, "content-security-policy": csp(nonce)}
        try:
            await self._caller(request)
        except DSecError as err:
            body = SIGN_IN.format(
                nonce=nonce,
                reason=html.escape(err.reason),
                message=html.escape(err.message),
                retry="true" if err.reason == "NO_TOKEN" else "false",
            )
            return HTMLResponse(body, status_code=http_status(err), headers=headers)
        self.feed.use()
        return HTMLResponse(PAGE.replace("{{nonce}}", nonce), headers=headers)

    # ----------------------------------------------------------------- JSON

    async def _sandboxes(self, who: Caller, task_id: str = "") -> dict[str, Any]:
        """``sandboxes`` (see :func:`recent`) and ``sandboxes_total`` (all there are)."""
        found = await self.gw.list_sandboxes(who, task_id=task_id, include_subprojects=True)
        shown = recent([sandbox_json(sb) for sb in found], LIVE_SHOWN, TERMINATED_SHOWN)
        return {"sandboxes": shown, "sandboxes_total": len(found)}

    def _history(self, who: Caller, task_id: str = "") -> list[dict[str, Any]]:
        return [
            c.as_json() for c in self.feed.log.history(lambda p: within(p, who.project_id), task_id)
        ]

    async def _nodes(self) -> list[dict[str, Any]]:
        snapshot = await self.gw.edges.snapshot()
        return [node_json(n) for n in sorted(snapshot.edges, key=lambda e: e.info.edge_id)]

    def _feed_state(self) -> dict[str, Any]:
        return {
            "now": time.time(),
            "history_since": self.feed.log.since,
            "watching": self.feed.watching,
        }

    async def sandboxes(self, request: Request) -> Response:
        try:
            who, _ = await self._caller(request)
            self.feed.use()
            found = await self._sandboxes(who, self._task(request))
        except DSecError as err:
            return self._refused(err)
        return self._json({**self._feed_state(), "project_id": who.project_id, **found})

    async def history(self, request: Request) -> Response:
        try:
            who, _ = await self._caller(request)
            self.feed.use()
            changes = self._history(who, self._task(request))
        except DSecError as err:
            return self._refused(err)
        return self._json({**self._feed_state(), "project_id": who.project_id, "changes": changes})

    async def nodes(self, request: Request) -> Response:
        try:
            _, principal = await self._caller(request)
            require_operator(principal)
            nodes = await self._nodes()
        except DSecError as err:
            return self._refused(err)
        return self._json({"now": time.time(), "nodes": nodes})

    # --------------------------------------------------------------- events

    async def _snapshot(self, who: Caller, principal: iam_pb2.Principal) -> dict[str, Any]:
        nodes: list[dict[str, Any]] | None = None
        nodes_error: dict[str, Any] | None = None
        try:
            require_operator(principal)
            nodes = await self._nodes()
        except DSecError as err:
            nodes_error = error_json(err)["error"]
        return {
            **self._feed_state(),
            "project_id": who.project_id,
            "principal_id": who.principal_id,
            **await self._sandboxes(who),
            "history": self._history(who),
            "nodes": nodes,
            "nodes_error": nodes_error,
        }

    async def events(self, request: Request) -> Response:
        try:
            who, principal = await self._caller(request)
        except DSecError as err:
            return self._refused(err)
        operator = is_operator(principal)
        headers = {**COMMON_HEADERS, "x-accel-buffering": "no"}  # no proxy buffering
        return StreamingResponse(
            self._stream(request, who, principal, operator),
            media_type="text/event-stream",
            headers=headers,
        )

    async def _stream(
        self, request: Request, who: Caller, principal: iam_pb2.Principal, operator: bool
    ) -> AsyncIterator[str]:
        """The event stream; any error ends it with an ``error`` event naming its reason (the
        page shows it and reconnects, or stops for a token refused)."""
        # Subscribed here, inside the stream, so that whatever ends the stream unsubscribes;
        # and before the snapshot is taken, so that no change falls between the two.
        sub = self.feed.subscribe(who.project_id)
        gone = asyncio.ensure_future(_disconnected(request))
        frames = self._frames(who, principal, operator, sub, gone)
        try:
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    yield frame
        except DSecError as err:
            yield sse("error", error_json(err)["error"])
        finally:
            gone.cancel()
            self.feed.unsubscribe(sub)

    async def _frames(
        self,
        who: Caller,
        principal: iam_pb2.Principal,
        operator: bool,
        sub: Subscriber,
        gone: asyncio.Future[None],
    ) -> AsyncGenerator[str, None]:
        """The stream's frames until the client is ``gone`` (or an error)."""
        yield sse("snapshot", await self._snapshot(who, principal))
        clock = time.monotonic
        next_keepalive = clock() + SSE_KEEPALIVE_S
        next_nodes = clock() + NODES_EVERY_S if operator else float("inf")
        getter: asyncio.Future[tuple[str, Any]] | None = None
        try:
            while True:
                if sub.overflowed:
                    raise Unavailable(
                        "this event stream fell too far behind the changes: reconnect",
                        reason="WATCH_OVERFLOW",
                    )
                wait_s = max(0.0, min(next_keepalive, next_nodes) - clock())
                if getter is None:
                    getter = asyncio.ensure_future(sub.queue.get())
                waiting: set[asyncio.Future[Any]] = {getter, gone}
                done, _ = await asyncio.wait(
                    waiting, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
                )
                if gone in done:
                    return
                if getter in done:
                    name, event = getter.result()
                    getter = None
                    if name == "live":  # what changed before the watch was established
                        yield sse("snapshot", await self._snapshot(who, principal))
                    else:
                        yield sse(name, event)
                    continue
                now = clock()
                if now >= next_keepalive:
                    next_keepalive = now + SSE_KEEPALIVE_S
                    # A long stream outlives a token: a revoked or expired one ends it.
                    await self.gw.caller(who.token)
                    self.feed.use()
                    yield sse("keepalive", self._feed_state())
                if now >= next_nodes:
                    next_nodes = now + NODES_EVERY_S
                    yield sse("nodes", await self._nodes_event())
        finally:
            if getter is not None:
                getter.cancel()

    async def _nodes_event(self) -> dict[str, Any]:
        try:
            return {"nodes": await self._nodes(), "nodes_error": None}
        except DSecError as err:  # the watcher away: said on the page, the stream goes on
            return {"nodes": None, "nodes_error": error_json(err)["error"]}

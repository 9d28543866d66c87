"""E2B's control API (the REST API behind ``E2B_API_URL``) on libdsec.

Routes: create (``POST /sandboxes``, ``POST /v2/sandboxes``), ``GET``/``DELETE``
``/sandboxes/{id}``, timeout, pause, resume (deprecated v1), connect (v1 and v2), list
(``GET /v2/sandboxes`` with metadata, state, template and start-time filters and next-token
pagination; the deprecated ``GET /sandboxes``), network updates, ``/health``. Everything
else E2B has (templates, snapshots, forks, volumes, secrets, metrics, logs) answers 501
saying dsec does not do it.

Every call acts with the caller's own dsec token (``X-API-Key``): the caller's project,
quotas and sandboxes. A sandbox of another project is a 404 exactly like a missing one
(the API server says NOT_FOUND for both), and an ended one is gone too, as in E2B.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.e2b import dsec, mapping
from compat.e2b.errors import http_status
from compat.e2b.http import HttpError, Request, Send, send_empty, send_error, send_json
from compat.e2b.routing import api_key
from libdsec import AsyncClient, NetworkPolicy, SandboxInfo
from libdsec.errors import DSecError, ImageNotFound, NotFound, SandboxTerminated

log = logging.getLogger(__name__)

Handler = Callable[[AsyncClient, str, Request, Send, re.Match[str]], Awaitable[None]]

_ID = r"(?P<id>[^/]+)"

#: What E2B has and dsec does not do: answered 501 with the reason.
_UNSUPPORTED = [
    (r"/sandboxes/[^/]+/(fork|snapshots|metrics|logs)", "forks, snapshots, metrics and logs"),
    (r"/v2/sandboxes/[^/]+/logs", "sandbox logs"),
    (r"/sandboxes/metrics", "sandbox metrics"),
    (r"/(v[0-9]/)?templates(/.*)?", "E2B templates (dsec builds environments: dsec env import)"),
    (r"/snapshots(/.*)?", "snapshots"),
    (r"/volumes(/.*)?", "volumes"),
    (r"/secrets(/.*)?", "secrets"),
    (r"/teams(/.*)?", "teams (dsec has projects)"),
]


class ControlApi:
    def __init__(self, config: CompatConfig, pool: ClientPool) -> None:
        self.config = config
        self.pool = pool
        self.routes: list[tuple[str, re.Pattern[str], Handler]] = [
            ("POST", re.compile(r"/(v2/)?sandboxes"), self.create),
            ("GET", re.compile(r"/v2/sandboxes"), self.list_v2),
            ("GET", re.compile(r"/sandboxes"), self.list_v1),
            ("GET", re.compile(rf"/sandboxes/{_ID}"), self.get),
            ("DELETE", re.compile(rf"/sandboxes/{_ID}"), self.kill),
            ("POST", re.compile(rf"/sandboxes/{_ID}/timeout"), self.set_timeout),
            ("POST", re.compile(rf"/sandboxes/{_ID}/refreshes"), self.refresh),
            ("POST", re.compile(rf"/sandboxes/{_ID}/pause"), self.pause),
            ("POST", re.compile(rf"/sandboxes/{_ID}/resume"), self.resume),
            ("POST", re.compile(rf"/(v2/)?sandboxes/{_ID}/connect"), self.connect),
            ("PUT", re.compile(rf"/sandboxes/{_ID}/network"), self.update_network),
        ]

    async def handle(self, request: Request, send: Send) -> None:
        path = request.path.rstrip("/") or "/"
        if path == "/health":
            await send_json(send, 200, {"status": "ok"})
            return
        found = self._match(request.method, path)
        if found is None:
            for pattern_text, what in _UNSUPPORTED:
                if re.fullmatch(pattern_text, path):
                    await send_error(send, 501, f"{what}: not supported by dsec")
                    return
            known = any(p.fullmatch(path) for _, p, _ in self.routes)
            await send_error(send, 405 if known else 404, f"{request.method} {path}: no such route")
            return
        handler, m = found
        key = api_key(request)
        try:
            async with self.pool.lease(key) as client:
                await handler(client, key, request, send, m)
        except HttpError as exc:
            await send_error(send, exc.status, exc.message)
        except DSecError as exc:
            status = http_status(exc)
            if status == 401:
                await send_error(send, 401, f"invalid API key (a dsec token): {exc.message}")
            else:
                await send_error(send, status, exc.message)

    def _match(self, method: str, path: str) -> tuple[Handler, re.Match[str]] | None:
        for route_method, pattern, handler in self.routes:
            m = pattern.fullmatch(path)
            if m and route_method == method:
                return handler, m
        return None

    # ------------------------------------------------------------------ helpers

    async def _live(self, client: AsyncClient, sandbox_id: str) -> SandboxInfo:
        """The sandbox if it has not ended; 404 like E2B otherwise (missing, another
        project's, or ended)."""
        try:
            info = (await client.get(sandbox_id)).info
        except NotFound:
            raise HttpError(404, f"sandbox {sandbox_id!r} not found") from None
        if info.terminated:
            raise HttpError(404, f"sandbox {sandbox_id!r} not found (it has ended)")
        return info

    async def _set_timeout(self, client: AsyncClient, sandbox_id: str, seconds: int) -> None:
        try:
            await dsec.sandbox(client, sandbox_id).set_timeout(seconds)
        except (NotFound, SandboxTerminated):
            raise HttpError(404, f"sandbox {sandbox_id!r} not found") from None

    # ------------------------------------------------------------------- routes

    async def create(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        body = await request.json(self.config.max_json_bytes)
        template = body.get("templateID")
        if not isinstance(template, str):
            raise HttpError(400, "templateID is required")
        if body.get("autoPause"):
            raise HttpError(
                400, "autoPause is not supported: a dsec sandbox ends at its timeout (TTL)"
            )
        for name, what in (("mcp", "MCP gateways"), ("volumeMounts", "volume mounts")):
            if body.get(name):
                raise HttpError(400, f"{name}: {what} are not supported by dsec")
        if (body.get("iam") or {}).get("tokens"):
            raise HttpError(400, "iam: workload identity tokens are not supported by dsec")
        labels = mapping.labels_for(body.get("metadata"))
        labels[mapping.LABEL_TEMPLATE] = template
        labels[mapping.LABEL_CPU] = f"{self.config.cpu:g}"
        labels[mapping.LABEL_MEMORY] = str(self.config.memory_mb)
        options: dict[str, Any] = {
            "image": mapping.image_for(template, self.config),
            "ttl_s": mapping.timeout_for(body, self.config),
            "labels": labels,
            "env": mapping.env_for(body.get("envVars")),
            "cpu": self.config.cpu,
            "memory_mb": self.config.memory_mb,
        }
        network = mapping.network_for(body, self.config)
        if network is not None:
            options["network"] = network
        if request.header("idempotency-key"):
            options["idempotency_key"] = request.header("idempotency-key")
        try:
            sb = await client.create(**options)
        except ImageNotFound:
            raise HttpError(404, f"template {template!r} not found") from None
        await send_json(send, 201, mapping.sandbox_json(sb.info, key, self.config))

    async def get(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        info = await self._live(client, m["id"])
        await send_json(send, 200, mapping.detail_json(info, key, self.config))

    async def kill(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        await self._live(client, m["id"])
        await dsec.sandbox(client, m["id"]).stop(grace_s=0.5)
        await send_empty(send, 204)

    async def set_timeout(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        body = await request.json(self.config.max_json_bytes)
        timeout = body.get("timeout")
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
            raise HttpError(400, "timeout must be a non-negative integer (seconds)")
        await self._live(client, m["id"])
        await self._set_timeout(client, m["id"], timeout)
        await send_empty(send, 204)

    async def refresh(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        body = await request.json(self.config.max_json_bytes)
        duration = body.get("duration", self.config.default_timeout_s)
        if not isinstance(duration, int) or not 0 <= duration <= 3600:
            raise HttpError(400, "duration must be an integer in 0..3600 (seconds)")
        await self._extend(client, await self._live(client, m["id"]), duration)
        await send_empty(send, 204)

    async def _extend(self, client: AsyncClient, info: SandboxInfo, seconds: int) -> None:
        """E2B's connect/refresh semantics: the timeout only ever grows."""
        wanted = datetime.now(UTC) + timedelta(seconds=seconds)
        if info.expires_at is None or wanted > info.expires_at:
            await self._set_timeout(client, info.id, seconds)

    async def pause(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        body = await request.json(self.config.max_json_bytes)
        if body.get("memory") is False:
            raise HttpError(
                400, "memory=false (filesystem-only pause) is not supported: dsec keeps memory"
            )
        info = await self._live(client, m["id"])
        if info.state == "PAUSED":
            raise HttpError(409, f"sandbox {info.id!r} is already paused")
        await dsec.sandbox(client, info.id).pause()
        await send_empty(send, 204)

    async def _resume_if_paused(self, client: AsyncClient, info: SandboxInfo) -> SandboxInfo:
        if info.state == "PAUSED":
            return await dsec.sandbox(client, info.id).resume()
        return info

    async def resume(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        body = await request.json(self.config.max_json_bytes)
        if body.get("autoPause"):
            raise HttpError(400, "autoPause is not supported: a dsec sandbox ends at its timeout")
        info = await self._live(client, m["id"])
        if info.state != "PAUSED":
            raise HttpError(409, f"sandbox {info.id!r} is already running")
        info = await self._resume_if_paused(client, info)
        if body.get("timeout"):
            await self._set_timeout(client, info.id, mapping.timeout_for(body, self.config))
        await send_json(send, 201, mapping.sandbox_json(info, key, self.config))

    async def connect(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        body = await request.json(self.config.max_json_bytes)
        if body.get("memory") is False:
            raise HttpError(400, "memory=false (reboot on resume) is not supported by dsec")
        info = await self._live(client, m["id"])
        was_paused = info.state == "PAUSED"
        info = await self._resume_if_paused(client, info)
        timeout = body.get("timeout")
        if timeout is not None:
            if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
                raise HttpError(400, "timeout must be a non-negative integer (seconds)")
            await self._extend(client, info, timeout)
        await send_json(
            send, 201 if was_paused else 200, mapping.sandbox_json(info, key, self.config)
        )

    async def update_network(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        body = await request.json(self.config.max_json_bytes)
        policy = mapping.network_for({"network": body, **body}, self.config)
        await self._live(client, m["id"])
        await dsec.sandbox(client, m["id"]).update_network_policy(policy or NetworkPolicy())
        await send_empty(send, 204)

    async def list_v2(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        q = mapping.parse_list_query(
            metadata=request.query("metadata"),
            states=request.query_all("state"),
            template=request.query("template"),
            started_after=request.query("startedAfter"),
            order=request.query("order"),
            limit=request.query("limit"),
            next_token=request.query("nextToken"),
        )
        infos = await client.list(labels=q.metadata, states=q.states)
        items, token, running = mapping.page(infos, q)
        headers = [("X-Total-Running", str(running))]
        if token:
            headers.append(("X-Next-Token", token))
        await send_json(send, 200, [mapping.listed_json(i) for i in items], headers=headers)

    async def list_v1(
        self, client: AsyncClient, key: str, request: Request, send: Send, m: re.Match[str]
    ) -> None:
        metadata = mapping.parse_metadata_query(request.query("metadata"))
        infos = await client.list(labels=metadata, states=("RUNNING",))
        await send_json(send, 200, [mapping.listed_json(i) for i in infos])

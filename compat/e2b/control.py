"""E2B's control API (the REST API behind ``E2B_API_URL``) on libdsec.

Routes: create (``POST /sandboxes``, ``POST /v2/sandboxes``), ``GET``/``DELETE``
``/sandboxes/{id}``, timeout, pause, resume (deprecated v1), connect (v1 and v2), fork
(``POST /sandboxes/{id}/fork``: dsec's ForkSandbox), list (``GET /v2/sandboxes`` with
metadata, state, template and start-time filters and next-token pagination; the deprecated
``GET /sandboxes``), network updates, snapshots (compat/e2b/snapshots.py: create, list,
delete through ``DELETE /templates/{id}``, create from one), ``/health``. Everything else
E2B has (templates, volumes, secrets, logs) answers 501 saying dsec does not do it.

Every call acts with the caller's own dsec token (``X-API-Key``): the caller's project,
quotas and sandboxes. A sandbox of another project is a 404 exactly like a missing one
(the API server says NOT_FOUND for both), and an ended one is gone too, as in E2B.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.e2b import dsec, mapping, snapshots
from compat.e2b.errors import http_status
from compat.e2b.http import HttpError, Request, error, internal_error, read_json
from compat.e2b.routing import api_key, envd_token
from compat.e2b.signing import SandboxTokens
from compat.e2b.templates import (
    K_OWNER,
    K_READY,
    K_START,
    K_USER,
    TemplatesApi,
    image_environment,
    start_command,
    wait_ready,
)
from compat.http import Receive, Scope, Send, without_trailing_slash
from libdsec import (
    AsyncClient,
    AsyncSandbox,
    Environment,
    NetworkPolicy,
    SandboxInfo,
    SandboxMetric,
)
from libdsec.errors import (
    BackendCapabilityMissing,
    BackendNotOffered,
    DSecError,
    ImageNotFound,
    NotFound,
    SandboxTerminated,
)

log = logging.getLogger(__name__)
#: The timeout E2B's ``timeout: 0`` becomes (seconds): the smallest dsec takes, "now".
NOW_S = 0.001

#: A route's handler: the leased client, the caller's key, the request.
Handler = Callable[[AsyncClient, str, Request], Awaitable[Response]]

#: What E2B has and dsec does not do: answered 501 with the reason.
_UNSUPPORTED = [
    (r"/sandboxes/[^/]+/logs", "sandbox logs"),
    (r"/v2/sandboxes/[^/]+/logs", "sandbox logs"),
    (r"/(v[0-9]/)?templates(/.*)?", "this E2B template call (dsec builds templates through v3)"),
    (r"/volumes(/.*)?", "volumes"),
    (r"/secrets(/.*)?", "secrets"),
    (r"/teams(/.*)?", "teams (dsec has projects)"),
]

#: Children per fork call: E2B's bound (its SDK refuses more before sending).
E2B_MAX_FORKS = 20

#: Every method: ``/health`` answers whatever it is asked with.
_ANY = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@dataclass(frozen=True)
class _Source:
    """What a create starts from (``ControlApi._source``)."""

    target: mapping.TemplateTarget
    user: str
    cpu: float
    memory_mb: int
    #: a template built here: its environment's config (start/ready commands, workdir)
    built: dict[str, str] = field(default_factory=dict)


class ControlApi:
    def __init__(
        self, config: CompatConfig, pool: ClientPool, tokens: SandboxTokens | None = None
    ) -> None:
        self.config = config
        self.pool = pool
        #: the envd access tokens handed out, per sandbox (signed file URLs)
        self.tokens = tokens or SandboxTokens()
        #: Why this instance must not be given traffic (its virtual IP's route agent failed:
        #: compat/server.py); "" = serving.
        self.not_serving = ""
        self.templates = TemplatesApi(config, pool)
        t = self.templates
        routes = [
            # E2B's template builds (compat.e2b.templates); "aliases" and "tags" before {id}.
            Route("/v3/templates", self._leased(t.request_build), methods=["POST"]),
            Route("/templates/aliases/{alias}", self._leased(t.alias), methods=["GET"]),
            Route("/templates/tags", self._leased(t.assign_tags), methods=["POST"]),
            Route("/templates/tags", self._leased(t.remove_tags), methods=["DELETE"]),
            Route("/templates/{id}/tags", self._leased(t.list_tags), methods=["GET"]),
            Route("/templates/{id}/files/{hash}", self._leased(t.files_link), methods=["GET"]),
            Route(
                "/v2/templates/{id}/builds/{build}", self._leased(t.start_build), methods=["POST"]
            ),
            Route(
                "/templates/{id}/builds/{build}/status",
                self._leased(t.build_status),
                methods=["GET"],
            ),
            Route("/_dsec/e2b/template-files/{token}", t.upload, methods=["PUT"]),
            Route("/health", self.health, methods=_ANY),
            Route("/sandboxes", self._leased(self.create), methods=["POST"]),
            Route("/v2/sandboxes", self._leased(self.create), methods=["POST"]),
            Route("/v2/sandboxes", self._leased(self.list_v2), methods=["GET"]),
            Route("/sandboxes", self._leased(self.list_v1), methods=["GET"]),
            # Before /sandboxes/{id}: "metrics" is not a sandbox id.
            Route("/sandboxes/metrics", self._leased(self.metrics_of_many), methods=["GET"]),
            Route("/sandboxes/{id}", self._leased(self.get), methods=["GET"]),
            Route("/sandboxes/{id}/metrics", self._leased(self.metrics), methods=["GET"]),
            Route("/sandboxes/{id}", self._leased(self.kill), methods=["DELETE"]),
            Route("/sandboxes/{id}/timeout", self._leased(self.set_timeout), methods=["POST"]),
            Route("/sandboxes/{id}/refreshes", self._leased(self.refresh), methods=["POST"]),
            Route("/sandboxes/{id}/pause", self._leased(self.pause), methods=["POST"]),
            Route("/sandboxes/{id}/resume", self._leased(self.resume), methods=["POST"]),
            Route("/sandboxes/{id}/connect", self._leased(self.connect), methods=["POST"]),
            Route("/sandboxes/{id}/fork", self._leased(self.fork), methods=["POST"]),
            Route("/v2/sandboxes/{id}/connect", self._leased(self.connect), methods=["POST"]),
            Route("/sandboxes/{id}/network", self._leased(self.update_network), methods=["PUT"]),
            Route(
                "/sandboxes/{id}/snapshots", self._leased(self.create_snapshot), methods=["POST"]
            ),
            Route("/snapshots", self._leased(self.list_snapshots), methods=["GET"]),
            Route("/templates/{id}", self._leased(self.delete_template), methods=["DELETE"]),
        ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={
                404: self._no_route,
                405: self._no_route,
                HttpError: _http_error,
                DSecError: _dsec_error,
                500: internal_error,
            },
        )

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(without_trailing_slash(scope), receive, send)

    def _leased(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """The route's endpoint: the handler with a client leased for the caller's key."""

        async def endpoint(request: Request) -> Response:
            key = api_key(request)
            async with self.pool.lease(key) as client:
                return await handler(client, key, request)

        return endpoint

    async def _no_route(self, request: Request, exc: Exception) -> Response:
        """501 for what E2B has and dsec does not do, else 405 (a known path) or 404."""
        path = request.url.path
        for pattern_text, what in _UNSUPPORTED:
            if re.fullmatch(pattern_text, path):
                return error(501, f"{what}: not supported by dsec")
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        return error(status, f"{request.method} {path}: no such route")

    async def health(self, request: Request) -> Response:
        """200 while serving; 503 with the reason while its virtual IP cannot be announced.
        ``?scope=instance`` asks only whether this process answers (its route agent's check)."""
        if self.not_serving and request.query_params.get("scope") != "instance":
            return JSONResponse({"status": "not serving", "reason": self.not_serving}, 503)
        return JSONResponse({"status": "ok"})

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

    async def _samples(
        self, client: AsyncClient, sandbox_id: str, start: int | None, end: int | None
    ) -> list[SandboxMetric]:
        sb = dsec.sandbox(client, sandbox_id)
        try:
            return await sb.metrics(
                start=None if start is None else datetime.fromtimestamp(start, UTC),
                end=None if end is None else datetime.fromtimestamp(end, UTC),
            )
        except (NotFound, SandboxTerminated):
            raise HttpError(404, f"sandbox {sandbox_id!r} not found") from None
        except BackendCapabilityMissing as exc:
            raise HttpError(501, f"sandbox metrics: {exc.message}") from None

    async def _snapshot(
        self, client: AsyncClient, key: str, ref: snapshots.SnapshotRef
    ) -> Environment | None:
        """The caller's snapshot ``ref``; None if it has none of that name."""
        try:
            return await client.get_environment(
                ref.environment(await self.templates.project(client, key))
            )
        except NotFound:
            return None

    async def _set_timeout(self, client: AsyncClient, sandbox_id: str, seconds: float) -> None:
        try:
            await dsec.sandbox(client, sandbox_id).set_timeout(seconds)
        except (NotFound, SandboxTerminated):
            raise HttpError(404, f"sandbox {sandbox_id!r} not found") from None

    # ------------------------------------------------------------------- routes

    async def create(self, client: AsyncClient, key: str, request: Request) -> Response:
        body = await read_json(request, self.config.max_json_bytes)
        template = body.get("templateID")
        if not isinstance(template, str):
            raise HttpError(400, "templateID is required")
        auto_pause = mapping.auto_pause_of(body)
        for name, what in (("mcp", "MCP gateways"), ("volumeMounts", "volume mounts")):
            if body.get(name):
                raise HttpError(400, f"{name}: {what} are not supported by dsec")
        if (body.get("iam") or {}).get("tokens"):
            raise HttpError(400, "iam: workload identity tokens are not supported by dsec")
        labels = mapping.labels_for(body.get("metadata"))
        src = await self._source(client, key, template, body.get("metadata"))
        target, built, memory_mb = src.target, src.built, src.memory_mb
        cpu = src.cpu
        if built.get("workdir"):
            labels[mapping.LABEL_WORKDIR] = built["workdir"]
        labels[mapping.LABEL_TEMPLATE] = template
        labels[mapping.LABEL_USER] = src.user
        labels[mapping.LABEL_CPU] = f"{cpu:g}"
        labels[mapping.LABEL_MEMORY] = str(memory_mb)
        options: dict[str, Any] = {
            "image": target.image,
            "ttl_s": mapping.timeout_for(body, self.config),
            "labels": labels,
            "env": mapping.env_for(body.get("envVars")),
            "cpu": cpu,
            "memory_mb": memory_mb,
            "pause_at_ttl": auto_pause.pause,
            "pause_at_ttl_files_only": auto_pause.files_only,
            "manual_resume": auto_pause.manual_resume,
        }
        if target.backend:
            options["backend"] = target.backend
        if target.backend in ("", "container"):
            # E2B's user model: `user` (and a template's own user) may sudo without a password.
            options["sudo_users"] = sorted({mapping.E2B_USER, src.user} - {"root", ""})
        network = mapping.network_for(body, self.config)
        if network is not None:
            options["network"] = network
        if request.headers.get("idempotency-key"):
            options["idempotency_key"] = request.headers.get("idempotency-key")
        try:
            sb = await client.create(**options)
        except ImageNotFound:
            raise HttpError(404, f"template {template!r} not found") from None
        except BackendNotOffered as exc:
            # Retrying cannot help (409, FAILED_PRECONDITION): say which template needs what.
            raise HttpError(
                409, f"template {template!r} runs on dsec's {target.backend} backend: {exc.message}"
            ) from None
        if built.get(K_START) or built.get(K_READY):
            await self._start_template(sb, built, template)
        return JSONResponse(self._sandbox_json(sb.info, key, self.config), 201)

    async def _source(self, client: AsyncClient, key: str, template: str, metadata: Any) -> _Source:
        """What a create starts from, the first that applies: an image its metadata names
        (:meth:`_routed_image`), a template the caller built here, a snapshot of the caller's,
        else the template as configured (or tried as an image name). One lookup at most of
        each kind, none for a configured template."""
        cpu, memory_mb = self.config.cpu, self.config.memory_for(template)
        routed = await self._routed_image(client, metadata)
        if routed is not None:
            env, (cpu, memory_mb) = routed
            user = env.config.get("user") or self.config.default_user
            return _Source(mapping.TemplateTarget(env.name, ""), user, cpu, memory_mb)
        if template not in self.config.templates:
            built = await self.templates.lookup(client, template)
            if built is not None:
                if built.config.get(K_OWNER) != await self.templates.project(client, key):
                    raise HttpError(404, f"template {template!r} not found")
                user = built.config.get(K_USER, self.config.user_for(template))
                target = mapping.TemplateTarget(built.name, "")
                return _Source(target, user, cpu, memory_mb, built.config)
            snapshot = await self._snapshot_of_template(client, key, template)
            if snapshot is not None:
                # Its source's user and memory; its own name as the template.
                source = snapshots.source_labels(snapshot)
                user = source.get(mapping.LABEL_USER) or self.config.user_for(
                    source.get(mapping.LABEL_TEMPLATE, "")
                )
                memory_mb = int(source.get(mapping.LABEL_MEMORY) or memory_mb)
                target = mapping.TemplateTarget(snapshot.name, "")
                return _Source(target, user, cpu, memory_mb)
        target = mapping.target_for(template, self.config)
        return _Source(target, self.config.user_for(template), cpu, memory_mb)

    async def _routed_image(
        self, client: AsyncClient, metadata: Any
    ) -> tuple[Environment, tuple[float, int]] | None:
        """A create that names its image in its metadata (``DSEC_COMPAT_IMAGE_METADATA_KEY``,
        as slime routes task images through an E2B gateway): the image's environment and the
        size named beside it (``<prefix>/size``; the configured resources when none)."""
        key = self.config.image_metadata_key
        if not key or not isinstance(metadata, dict) or key not in metadata:
            return None
        image = metadata[key]
        if not isinstance(image, str) or not image:
            raise HttpError(400, f"metadata {key!r} must name an image")
        size = metadata.get(self.config.size_metadata_key)
        resources = (self.config.cpu, self.config.memory_mb)
        if size is not None:
            try:
                resources = self.config.size_of(size)
            except (KeyError, TypeError):
                sizes = ", ".join(sorted(self.config.sizes))
                raise HttpError(
                    400,
                    f"metadata {self.config.size_metadata_key!r}: no size {size!r} "
                    f"(DSEC_COMPAT_SIZES has {sizes})",
                ) from None
        try:
            return await image_environment(client, image), resources
        except NotFound as exc:
            raise HttpError(404, exc.message) from None

    async def _start_template(self, sb: AsyncSandbox, built: dict[str, str], template: str) -> None:
        """A built template's start command in the background, then its ready command until
        it succeeds (E2B's sandboxes resume from a snapshot taken once it was ready; a dsec
        container starts afresh). A start command without a ready command is not waited for
        (E2B's default then only lets it settle before the snapshot)."""
        user = built.get(K_USER, "root")
        workdir = built.get("workdir", "")
        if built.get(K_START):
            await start_command(sb, built[K_START], user, workdir, {})
        if built.get(K_READY):
            ok, out = await wait_ready(
                sb, built[K_READY], user, workdir, {}, self.config.template_create_ready_timeout_s
            )
            if not ok:
                log.warning(
                    "sandbox %s of template %s: ready command %r did not succeed in %d s: %s",
                    sb.id,
                    template,
                    built[K_READY],
                    self.config.template_create_ready_timeout_s,
                    " | ".join(out),
                )

    async def metrics(self, client: AsyncClient, key: str, request: Request) -> Response:
        """E2B's ``GET /sandboxes/{id}/metrics?start=&end=`` (Unix seconds): the samples the
        sandbox's edge keeps (edge/usage.py), oldest first."""
        start = mapping.unix_seconds(request.query_params.get("start"), "start")
        end = mapping.unix_seconds(request.query_params.get("end"), "end")
        if start is not None and end is not None and end < start:
            raise HttpError(400, f"end ({end}) is before start ({start})")
        samples = await self._samples(client, request.path_params["id"], start, end)
        return JSONResponse([mapping.metric_json(m) for m in samples])

    async def metrics_of_many(self, client: AsyncClient, key: str, request: Request) -> Response:
        """E2B's ``GET /sandboxes/metrics?sandbox_ids=a,b``: each sandbox's latest sample (a
        sandbox not found, or with none yet, is left out)."""
        ids = [s for s in (request.query_params.get("sandbox_ids") or "").split(",") if s]
        if not ids:
            raise HttpError(400, "sandbox_ids is required (comma-separated)")
        if len(ids) > mapping.MAX_METRICS_SANDBOXES:
            raise HttpError(
                400, f"at most {mapping.MAX_METRICS_SANDBOXES} sandbox_ids, got {len(ids)}"
            )
        latest: dict[str, Any] = {}
        for sandbox_id in dict.fromkeys(ids):
            try:
                samples = await self._samples(client, sandbox_id, None, None)
            except HttpError as exc:
                if exc.status == 404:
                    continue
                raise
            if samples:
                latest[sandbox_id] = mapping.metric_json(samples[-1])
        return JSONResponse({"sandboxes": latest})

    def _issued(self, sandbox_id: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` (it returns the sandbox's envd access token, made of ``key``), noted."""
        self.tokens.seen(sandbox_id, envd_token(key, sandbox_id))
        return body

    def _sandbox_json(self, info: SandboxInfo, key: str, config: CompatConfig) -> dict[str, Any]:
        return self._issued(info.id, key, mapping.sandbox_json(info, key, config))

    async def get(self, client: AsyncClient, key: str, request: Request) -> Response:
        info = await self._live(client, request.path_params["id"])
        return JSONResponse(self._issued(info.id, key, mapping.detail_json(info, key, self.config)))

    async def kill(self, client: AsyncClient, key: str, request: Request) -> Response:
        await self._live(client, request.path_params["id"])
        await dsec.sandbox(client, request.path_params["id"]).stop(grace_s=0.5)
        self.tokens.forget(request.path_params["id"])
        return Response(status_code=204)

    async def set_timeout(self, client: AsyncClient, key: str, request: Request) -> Response:
        body = await read_json(request, self.config.max_json_bytes)
        timeout = body.get("timeout")
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
            raise HttpError(400, "timeout must be a non-negative integer (seconds)")
        await self._live(client, request.path_params["id"])
        # E2B's 0 is "time out now"; dsec's timeouts are > 0, and the edge's reaper (every
        # second) then does the timeout's action: a kill, or with autoPause a pause
        await self._set_timeout(client, request.path_params["id"], timeout or NOW_S)
        return Response(status_code=204)

    async def refresh(self, client: AsyncClient, key: str, request: Request) -> Response:
        body = await read_json(request, self.config.max_json_bytes)
        duration = body.get("duration", self.config.default_timeout_s)
        if not isinstance(duration, int) or not 0 <= duration <= 3600:
            raise HttpError(400, "duration must be an integer in 0..3600 (seconds)")
        await self._extend(client, await self._live(client, request.path_params["id"]), duration)
        return Response(status_code=204)

    async def _extend(self, client: AsyncClient, info: SandboxInfo, seconds: int) -> None:
        """E2B's connect/refresh semantics: the timeout only ever grows."""
        wanted = datetime.now(UTC) + timedelta(seconds=seconds)
        if info.expires_at is None or wanted > info.expires_at:
            await self._set_timeout(client, info.id, seconds)

    async def pause(self, client: AsyncClient, key: str, request: Request) -> Response:
        """``{"memory": false}`` is dsec's files-only pause (``pause(memory=False)``): the
        processes stop, the memory is all given back, the resume (connect) boots the sandbox
        afresh on its files; a backend without it answers 501."""
        body = await read_json(request, self.config.max_json_bytes)
        memory = body.get("memory", True)
        if not isinstance(memory, bool):
            raise HttpError(400, "memory must be a boolean")
        info = await self._live(client, request.path_params["id"])
        if info.state == "PAUSED":
            raise HttpError(409, f"sandbox {info.id!r} is already paused")
        await dsec.sandbox(client, info.id).pause(memory=memory)
        return Response(status_code=204)

    async def _resume_if_paused(self, client: AsyncClient, info: SandboxInfo) -> SandboxInfo:
        if info.state == "PAUSED":
            return await dsec.sandbox(client, info.id).resume()
        return info

    async def resume(self, client: AsyncClient, key: str, request: Request) -> Response:
        body = await read_json(request, self.config.max_json_bytes)
        if body.get("autoPause"):
            raise HttpError(400, "autoPause is not supported: a dsec sandbox ends at its timeout")
        info = await self._live(client, request.path_params["id"])
        if info.state != "PAUSED":
            raise HttpError(409, f"sandbox {info.id!r} is already running")
        info = await self._resume_if_paused(client, info)
        if body.get("timeout"):
            await self._set_timeout(client, info.id, mapping.timeout_for(body, self.config))
        return JSONResponse(self._sandbox_json(info, key, self.config), 201)

    async def connect(self, client: AsyncClient, key: str, request: Request) -> Response:
        body = await read_json(request, self.config.max_json_bytes)
        if body.get("memory") is False:
            raise HttpError(400, "memory=false (reboot on resume) is not supported by dsec")
        info = await self._live(client, request.path_params["id"])
        was_paused = info.state == "PAUSED"
        info = await self._resume_if_paused(client, info)
        timeout = body.get("timeout")
        if timeout is not None:
            if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
                raise HttpError(400, "timeout must be a non-negative integer (seconds)")
            await self._extend(client, info, timeout)
        return JSONResponse(self._sandbox_json(info, key, self.config), 201 if was_paused else 200)

    async def fork(self, client: AsyncClient, key: str, request: Request) -> Response:
        """E2B's fork: ``{"count": 1..20, "timeout": s}`` -> 201 with one ``{"sandbox": ...}``
        or ``{"error": {"code", "message"}}`` per child, in order. The children of a container
        template get its files and sessions, not its processes (dsec's files-only fork; the
        response says which in ``X-Dsec-Fork-Kind``); a microVM or VM template's continue
        its processes, as E2B's do."""
        body = await read_json(request, self.config.max_json_bytes)
        count = body.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= E2B_MAX_FORKS:
            raise HttpError(400, f"count must be an integer between 1 and {E2B_MAX_FORKS}")
        info = await self._live(client, request.path_params["id"])
        ttl_s = mapping.timeout_for(body, self.config)
        group = await dsec.sandbox(client, info.id).fork(count, ttl_s=ttl_s)
        out: list[dict[str, Any]] = []
        for child in group:
            if isinstance(child, DSecError):
                out.append({"error": {"code": http_status(child), "message": child.message}})
            else:
                out.append({"sandbox": self._sandbox_json(child.info, key, self.config)})
        return JSONResponse(out, 201, headers={"X-Dsec-Fork-Kind": group.kind})

    async def update_network(self, client: AsyncClient, key: str, request: Request) -> Response:
        body = await read_json(request, self.config.max_json_bytes)
        policy = mapping.network_for({"network": body, **body}, self.config)
        await self._live(client, request.path_params["id"])
        await dsec.sandbox(client, request.path_params["id"]).update_network_policy(
            policy or NetworkPolicy()
        )
        return Response(status_code=204)

    async def _snapshot_of_template(
        self, client: AsyncClient, key: str, template: str
    ) -> Environment | None:
        """The caller's snapshot a create's templateID names."""
        ref = snapshots.parse_ref(template, strict=False)
        return None if ref is None else await self._snapshot(client, key, ref)

    async def create_snapshot(self, client: AsyncClient, key: str, request: Request) -> Response:
        """E2B's snapshot: the sandbox's files (all of them) packed as the caller's project's
        environment ``snapshots/<project>/<name>:default``; 201 with its SnapshotInfo."""
        body = await read_json(request, self.config.max_json_bytes)
        ref = snapshots.new_ref(body.get("name"))
        info = await self._live(client, request.path_params["id"])
        env = ref.environment(await self.templates.project(client, key))
        try:
            await dsec.sandbox(client, info.id).pack_diff(env, default_excludes=False)
        except (NotFound, SandboxTerminated):
            raise HttpError(404, f"sandbox {info.id!r} not found") from None
        except BackendCapabilityMissing as exc:
            raise HttpError(501, f"snapshots of this sandbox: {exc.message}") from None
        return JSONResponse(
            snapshots.info_json(ref), 201, headers={snapshots.KIND_HEADER: snapshots.KIND}
        )

    async def list_snapshots(self, client: AsyncClient, key: str, request: Request) -> Response:
        """``GET /snapshots?sandboxID=&name=&limit=&nextToken=``: the caller's snapshots, by
        name, paginated (``X-Next-Token``)."""
        project = await self.templates.project(client, key)
        envs = await client.list_environments(prefix=f"{snapshots.PREFIX}{project}/")
        # The prefix also matches subprojects' (snapshots/<project>/<sub>/...): not listed.
        mine = [e for e in envs if e.name.count("/") == project.count("/") + 2]
        q = request.query_params
        items, token = snapshots.page(
            mine,
            sandbox_id=q.get("sandboxID") or "",
            name=q.get("name") or "",
            limit=q.get("limit"),
            next_token=q.get("nextToken"),
        )
        headers = {"X-Next-Token": token} if token else {}
        return JSONResponse(
            [snapshots.info_json(snapshots.ref_of(e)) for e in items], headers=headers
        )

    async def delete_template(self, client: AsyncClient, key: str, request: Request) -> Response:
        """``DELETE /templates/{id}``: a snapshot of the caller's is deleted (204; sandboxes
        running from it keep running); a template built here, the caller's, too (its
        environments); the configured templates are not E2B's to delete (501); else 404."""
        template = request.path_params["id"]
        ref = snapshots.parse_ref(template, strict=False)
        if ref is not None:
            project = await self.templates.project(client, key)
            if await client.delete_environment(ref.environment(project)):
                return Response(status_code=204)
        if template in self.config.templates:
            raise HttpError(501, "deleting E2B templates: not supported by dsec")
        return await self.templates.delete(client, key, request)  # a template built here

    async def list_v2(self, client: AsyncClient, key: str, request: Request) -> Response:
        q = mapping.parse_list_query(
            metadata=request.query_params.get("metadata"),
            states=request.query_params.getlist("state"),
            template=request.query_params.get("template"),
            started_after=request.query_params.get("startedAfter"),
            order=request.query_params.get("order"),
            limit=request.query_params.get("limit"),
            next_token=request.query_params.get("nextToken"),
        )
        infos = await client.list(labels=q.metadata, states=q.states)
        items, token, running = mapping.page(infos, q)
        headers = {"X-Total-Running": str(running)}
        if token:
            headers["X-Next-Token"] = token
        return JSONResponse([mapping.listed_json(i) for i in items], headers=headers)

    async def list_v1(self, client: AsyncClient, key: str, request: Request) -> Response:
        metadata = mapping.parse_metadata_query(request.query_params.get("metadata"))
        infos = await client.list(labels=metadata, states=("RUNNING",))
        return JSONResponse([mapping.listed_json(i) for i in infos])


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HttpError)
    return error(exc.status, exc.message)


async def _dsec_error(request: Request, exc: Exception) -> Response:
    """dsec's refusal as E2B's status; a bad key says what the key is."""
    assert isinstance(exc, DSecError)
    status = http_status(exc)
    if status == 401:
        return error(401, f"invalid API key (a dsec token): {exc.message}")
    return error(status, exc.message)

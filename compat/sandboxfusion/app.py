"""SandboxFusion's code-execution API as one ASGI application on dsec's FnCall pools.

Routes (each also under ``/t/<dsec token>/``, see below):

    POST /run_code          one program: compile (C, C++), run with stdin, fetch files
    POST /run_code_batch    dsec's own: one program against many stdin cases, compiled once
                            (``fncall_many``); the answers in case order
    GET  /v1/ping           "pong" (with a token prefix: the token is checked too)
    /run_jupyter, /submit, /get_prompts, ...   501: dsec serves code execution only

Authentication works for clients that send no headers (verl's reward code posts to a bare
URL): the token travels in the path, ``http://host:port/t/<token>/run_code``, so the URL the
operator hands the trainer carries it. ``Authorization: Bearer <token>`` works too, and a
loopback listener may act for a fixed token's project when a request brings none
(``DSEC_COMPAT_SANDBOX_FUSION_TOKEN_FILE``). A missing or wrong token is a 401 whose body
says why. Every job runs as that token in its project: quotas and FnCall's limits apply.
Tokens are never logged.

Errors keep the reference's shapes: a body that does not validate is 422 with FastAPI's
``{"detail": [...]}``; a job dsec could not run (no pool, a broken container, the platform
unavailable) is 200 with ``status: SandboxError`` and the reason, as the reference answers an
exception; a client that goes away cancels its job (FnCall stops it on the edge at once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.http import (
    HttpError,
    Receive,
    Request,
    Scope,
    Send,
    detail,
    http_error,
    read_body,
    serve_http,
    status_detail,
    token_refused,
)
from compat.sandboxfusion import mapping
from compat.sandboxfusion.models import (
    COMPILED,
    RequestInvalid,
    RunCodeBatchRequest,
    RunCodeRequest,
    fetch_paths,
    job_files,
    memory_mb,
    parse,
)
from libdsec import AsyncClient, FunctionJob
from libdsec.errors import (
    DSecError,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
)

log = logging.getLogger(__name__)

#: Reference routes dsec does not serve (datasets, Jupyter): 501 with the reason.
UNSUPPORTED = {
    "/run_jupyter": "Jupyter cells (use /run_code, or a dsec container sandbox)",
    "/submit": "dataset evaluation (submit)",
    "/submit_safe": "dataset evaluation (submit)",
    "/get_prompts": "datasets (get_prompts)",
    "/get_prompt_by_id": "datasets (get_prompt_by_id)",
    "/list_datasets": "datasets",
    "/list_ids": "datasets",
}
#: Added to a job's own limits for the call's deadline: queueing for a container, transfer.
DEADLINE_MARGIN_S = 60.0

#: The token of a ``/t/<token>/...`` path (for logs, which never show it).
_TOKEN = re.compile(r"^/t/[^/]*")
#: A route's handler: the client leased for the request's token, the request.
Handler = Callable[[AsyncClient, Request], Awaitable[Response]]
#: Every method (the 501 routes answer whatever they are asked with).
ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def bearer(request: Request) -> str:
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class SandboxFusionApp:
    def __init__(self, config: CompatConfig, pool: ClientPool, default_token: str = "") -> None:
        self.config = config
        self.pool = pool
        self.default_token = default_token
        routes = [
            Route("/v1/ping", self.ping, methods=["GET", "HEAD"]),
            Route("/run_code", self._with_token(self.run_code), methods=["POST"]),
            Route("/run_code_batch", self._with_token(self.run_code_batch), methods=["POST"]),
            *(
                Route(path, _unsupported(what), methods=ANY_METHOD)
                for path, what in UNSUPPORTED.items()
            ),
        ]
        self.app = Starlette(
            # Each route also under /t/<token>/ (the token in the URL, for header-less clients).
            routes=[Mount("/t/{token}", routes=routes), *routes],
            exception_handlers={
                404: status_detail,
                405: status_detail,
                HttpError: http_error,
                RequestInvalid: _request_invalid,
                Unauthenticated: token_refused,
                PermissionDenied: token_refused,
                500: _internal,
            },
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await serve_http(self.app, scope, receive, send)
        except Exception:  # answered 500 by `_internal` (unless the answer had begun)
            path = _TOKEN.sub("/t/<token>", str(scope["path"]))  # tokens are never logged
            log.exception("sandbox-fusion: %s %s failed", scope["method"], path)

    def _with_token(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """The route's endpoint: the handler with a client leased for the request's token:
        the URL's, else ``Authorization: Bearer``, else the token file's; none is a 401."""

        async def endpoint(request: Request) -> Response:
            token = request.path_params.get("token") or bearer(request) or self.default_token
            if not token:
                return detail(
                    401,
                    "no dsec token: post to http://<host>:<port>/t/<token>/run_code (or send "
                    "Authorization: Bearer <token>); a token comes from `dsec token create NAME`",
                )
            async with self.pool.lease(token) as client:
                return await handler(client, request)

        return endpoint

    # -------------------------------------------------------------- routes

    async def ping(self, request: Request) -> Response:
        """ "pong"; with a token in the URL, once the token has been checked."""
        token = request.path_params.get("token")
        if token:
            async with self.pool.lease(token):
                pass
        return JSONResponse("pong")

    def _job(self, req: RunCodeRequest, stdin: str | None) -> FunctionJob:
        c = self.config
        return FunctionJob(
            language=req.language,
            code=req.code,
            stdin=stdin or "",
            time_limit_s=req.run_timeout,
            compile_time_limit_s=req.compile_timeout if req.language in COMPILED else 0.0,
            memory_mb=memory_mb(
                req, default_mb=c.sandbox_fusion_memory_mb, max_mb=c.sandbox_fusion_max_memory_mb
            ),
            max_output_bytes=c.sandbox_fusion_max_output_bytes,
            files=dict(job_files(req, max_bytes=c.sandbox_fusion_max_files_bytes)),
            fetch_files=fetch_paths(req),
        )

    def _deadline(self, req: RunCodeRequest) -> float:
        compile_s = req.compile_timeout if req.language in COMPILED else 0.0
        return compile_s + req.run_timeout + DEADLINE_MARGIN_S

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.config.sandbox_fusion_max_body_bytes)

    async def run_code(self, client: AsyncClient, request: Request) -> Response:
        req = parse(RunCodeRequest, await self._body(request))
        job = self._job(req, req.stdin)

        async def call() -> dict[str, Any]:
            r = await client.fncall(
                language=job.language,
                code=job.code,
                stdin=job.stdin,
                time_limit_s=job.time_limit_s,
                compile_time_limit_s=job.compile_time_limit_s,
                memory_mb=job.memory_mb,
                max_output_bytes=job.max_output_bytes,
                files=job.files,
                fetch_files=job.fetch_files,
                timeout=self._deadline(req),
            )
            return mapping.run_code_response(r)

        answer = await self._answer(request, call)
        # None: the client went away; uvicorn drops an answer to nobody.
        return JSONResponse(answer) if answer is not None else Response(status_code=499)

    async def run_code_batch(self, client: AsyncClient, request: Request) -> Response:
        req = parse(RunCodeBatchRequest, await self._body(request))
        if len(req.cases) > self.config.sandbox_fusion_max_batch:
            raise HttpError(
                413, f"{len(req.cases)} cases; at most {self.config.sandbox_fusion_max_batch}"
            )
        template = self._job(req, None)
        jobs = [dataclasses.replace(template, stdin=case.stdin or "") for case in req.cases]

        async def call() -> dict[str, Any]:
            answers: list[dict[str, Any] | None] = [None] * len(jobs)
            async for r in client.fncall_many(jobs):
                answers[r.index] = mapping.run_code_response(r)
            results = [
                a if a is not None else mapping.sandbox_error("dsec returned no result")
                for a in answers
            ]
            return {"status": mapping.batch_status(results), "message": "", "results": results}

        answer = await self._answer(request, call)
        # None: the client went away; uvicorn drops an answer to nobody.
        return JSONResponse(answer) if answer is not None else Response(status_code=499)

    async def _answer(
        self, request: Request, call: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any] | None:
        """The call's answer; dsec's errors as the reference answers them; None if the
        client went away (the call is cancelled: FnCall stops the job on the edge)."""
        # One watcher task, which cancels this one if the client hangs up (cheaper than
        # running the call in a task of its own and waiting on both: ~0.2 ms per request).
        current = asyncio.current_task()
        assert current is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            await _disconnected(request)
            gone = True
            current.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            return await call()
        except asyncio.CancelledError:
            if gone and current.uncancel() == 0:
                return None  # the client went away: nobody to answer
            raise
        except InvalidArgument as exc:
            raise RequestInvalid(
                [
                    {
                        "type": "value_error",
                        "loc": ["body"],
                        "msg": f"Value error, {exc.message}",
                        "input": None,
                        "ctx": {"error": exc.message, "reason": exc.reason},
                    }
                ]
            ) from None
        except QuotaExceeded as exc:
            raise HttpError(429, f"{exc.reason}: {exc.message}") from None
        except (Unauthenticated, PermissionDenied):
            raise
        except DSecError as exc:  # the platform could not run it: the reference's exception path
            return mapping.sandbox_error(f"dsec: {exc.reason or type(exc).__name__}: {exc.message}")
        finally:
            watcher.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _unsupported(what: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return detail(501, f"dsec's SandboxFusion front end does not serve {what}")

    return endpoint


async def _request_invalid(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestInvalid)
    return detail(422, exc.detail)


async def _internal(request: Request, exc: Exception) -> Response:
    return detail(500, "internal error in dsec's SandboxFusion front end")

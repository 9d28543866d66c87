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
from collections.abc import Awaitable, Callable
from typing import Any

from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.http import (
    ClientDisconnected,
    HttpError,
    Message,
    Receive,
    Request,
    Scope,
    Send,
    send_json,
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

Handler = Callable[[AsyncClient, Request, Send], Awaitable[None]]


def split_token(path: str) -> tuple[str, str]:
    """``/t/<token>/rest`` -> (token, "/rest"); any other path -> ("", path)."""
    if not path.startswith("/t/"):
        return "", path
    token, _, rest = path[3:].partition("/")
    return token, "/" + rest


def bearer(request: Request) -> str:
    value = request.header("authorization")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def send_detail(send: Send, status: int, detail: Any) -> None:
    """FastAPI's error body, which the reference's clients print."""
    await send_json(send, status, {"detail": detail})


class SandboxFusionApp:
    def __init__(self, config: CompatConfig, pool: ClientPool, default_token: str = "") -> None:
        self.config = config
        self.pool = pool
        self.default_token = default_token
        self.routes: dict[str, tuple[str, Handler]] = {
            "/run_code": ("POST", self.run_code),
            "/run_code_batch": ("POST", self.run_code_batch),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        request = Request(scope, receive)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        path_token, path = split_token(request.path)
        try:
            await self.dispatch(request, path_token, path, tracked)
        except ClientDisconnected:
            return
        except Exception:
            log.exception("sandbox-fusion: %s %s failed", request.method, path)
            if not started:
                await send_detail(tracked, 500, "internal error in dsec's SandboxFusion front end")

    async def dispatch(self, request: Request, path_token: str, path: str, send: Send) -> None:
        path = path.rstrip("/") or "/"
        if path == "/v1/ping" and request.method in ("GET", "HEAD"):
            if path_token:  # with a token: say whether it works
                await self._with_token(path_token, self.ping, request, send)
            else:
                await self.ping(None, request, send)
            return
        if path in UNSUPPORTED:
            await send_detail(
                send, 501, f"dsec's SandboxFusion front end does not serve {UNSUPPORTED[path]}"
            )
            return
        route = self.routes.get(path)
        if route is None:
            await send_detail(send, 404, "Not Found")
            return
        method, handler = route
        if request.method != method:
            await send_detail(send, 405, "Method Not Allowed")
            return
        token = path_token or bearer(request) or self.default_token
        if not token:
            await send_detail(
                send,
                401,
                "no dsec token: post to http://<host>:<port>/t/<token>/run_code (or send "
                "Authorization: Bearer <token>); a token comes from `dsec token create NAME`",
            )
            return
        await self._with_token(token, handler, request, send)

    async def _with_token(self, token: str, handler: Handler, request: Request, send: Send) -> None:
        try:
            async with self.pool.lease(token) as client:
                await handler(client, request, send)
        except (Unauthenticated, PermissionDenied) as exc:
            status = 401 if isinstance(exc, Unauthenticated) else 403
            await send_detail(send, status, f"dsec refused the token: {exc.message}")
        except HttpError as exc:
            await send_detail(send, exc.status, exc.message)
        except RequestInvalid as exc:
            await send_detail(send, 422, exc.detail)

    # -------------------------------------------------------------- routes

    async def ping(self, client: AsyncClient | None, request: Request, send: Send) -> None:
        await send_json(send, 200, "pong")

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
        return await request.body(self.config.sandbox_fusion_max_body_bytes)

    async def run_code(self, client: AsyncClient, request: Request, send: Send) -> None:
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
        if answer is not None:
            await send_json(send, 200, answer)

    async def run_code_batch(self, client: AsyncClient, request: Request, send: Send) -> None:
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
        if answer is not None:
            await send_json(send, 200, answer)

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

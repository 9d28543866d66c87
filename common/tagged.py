"""The server's side of a tagged job stream (``StreamFunctions``; the caller's side is
``libdsec._tagged``).

Every request with a new tag starts its job at once, concurrently with the others; its
answer (a result, or the error that job alone got) is written as soon as it finishes. A
request with ``cancel`` cancels the job of its tag (no answer follows). While jobs run and
nothing else is written, a keepalive (tag 0) goes out every ``keepalive_s`` (also while no job
runs: one may be on its way in), so the caller can tell a stalled stream from a long job. When the caller closes its side, the stream ends
once every job has answered; when the caller goes away (the call is cancelled), every job
still running is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from libdsec.errors import DSecError, InvalidArgument, ResourceExhausted, Unavailable, item_status

log = logging.getLogger(__name__)

KEEPALIVE_S = 5.0
#: Jobs one stream may have in flight; past it a job is refused (RESOURCE_EXHAUSTED).
MAX_IN_FLIGHT = 10_000
_CLOSED = object()


def error_fields(err: DSecError) -> dict[str, Any]:
    """The response fields that carry ``err`` (the per-item status, as in batch results)."""
    return {"error": item_status(err)}


async def serve_tagged(
    requests: AsyncIterator[Any],
    run: Callable[[Any], Awaitable[Any]],
    response: Callable[..., Any],
    *,
    internal: Callable[[BaseException], DSecError],
    keepalive_s: float = KEEPALIVE_S,
    max_in_flight: int = MAX_IN_FLIGHT,
) -> AsyncGenerator[Any, None]:
    """Yields the responses of a StreamFunctions call.

    ``run(request)`` runs one job and returns its ``FunctionResult`` (or raises a
    DSecError); ``response(**fields)`` builds the response message; ``internal(exc)``
    turns an unexpected exception into the INTERNAL error the caller sees (and logs it).
    """
    out: asyncio.Queue[Any] = asyncio.Queue()
    running: dict[int, asyncio.Task[None]] = {}
    loop = asyncio.get_running_loop()

    def answer(tag: int, err: DSecError) -> Any:
        try:
            return response(tag=tag, **error_fields(err))
        except Exception as exc:
            return response(tag=tag, **error_fields(internal(exc)))

    async def one(tag: int, request: Any) -> None:
        me = asyncio.current_task()
        try:
            msg = response(tag=tag, result=await run(request))
        except asyncio.CancelledError:
            if me is not None and me.cancelling():
                return  # cancelled by the caller (or the stream ended): no answer
            # a cancellation from inside the job (a closed channel downstream): answer it,
            # or its caller would wait for its whole deadline
            msg = answer(tag, Unavailable("the job was cancelled downstream", reason="CANCELLED"))
        except DSecError as err:
            msg = answer(tag, err)
        except Exception as exc:
            msg = answer(tag, internal(exc))
        finally:
            if running.get(tag) is me:
                del running[tag]
        out.put_nowait(msg)

    def refuse(tag: int, err: DSecError) -> None:
        out.put_nowait(answer(tag, err))

    async def read() -> None:
        try:
            async for request in requests:
                tag = request.tag
                if request.cancel:
                    task = running.pop(tag, None)
                    if task is not None:
                        task.cancel()
                elif tag == 0:
                    refuse(tag, InvalidArgument("a job's tag must not be 0", reason="BAD_TAG"))
                elif tag in running:
                    refuse(
                        tag,
                        InvalidArgument(f"tag {tag} is already in flight", reason="TAG_IN_USE"),
                    )
                elif len(running) >= max_in_flight:
                    refuse(
                        tag,
                        ResourceExhausted(
                            f"at most {max_in_flight} jobs in flight per stream",
                            reason="TOO_MANY_IN_FLIGHT",
                        ),
                    )
                else:
                    running[tag] = loop.create_task(one(tag, request))
        finally:
            out.put_nowait(_CLOSED)

    reader = loop.create_task(read())
    caller_done = False
    try:
        while True:
            if caller_done and not running and out.empty():
                return
            try:
                async with asyncio.timeout(keepalive_s):
                    msg = await out.get()
            except TimeoutError:
                # Also with nothing running: a job still on its way in (a big upload) must not
                # look like a dead stream to its caller.
                yield response(tag=0)
                continue
            if msg is _CLOSED:
                caller_done = True
                await asyncio.wait({reader})
                broken = None if reader.cancelled() else reader.exception()
                if broken is not None:  # the caller's side broke: stop everything
                    raise broken
                continue
            yield msg
    finally:
        reader.cancel()
        for task in list(running.values()):
            task.cancel()

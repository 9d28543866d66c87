"""Keepalives on idle streams (envd sends them at the SDK's Keepalive-Ping-Interval).

The source stream is read by a task of its own into a small queue, so waiting for the next
event can time out (-> a keepalive) without cancelling the read underneath; the task ends
with the iteration (it is cancelled and awaited in ``finally``: no task outlives its stream).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Final, TypeVar

T = TypeVar("T")


class _Keepalive:
    def __repr__(self) -> str:
        return "KEEPALIVE"


KEEPALIVE: Final = _Keepalive()
_END: Final = object()


async def with_keepalives(
    source: AsyncIterator[T], interval_s: float
) -> AsyncIterator[T | _Keepalive]:
    """The items of ``source``, and KEEPALIVE after every ``interval_s`` without one."""
    queue: asyncio.Queue[tuple[object, BaseException | None]] = asyncio.Queue(maxsize=8)

    async def pump() -> None:
        try:
            async for item in source:
                await queue.put((item, None))
        except Exception as exc:
            await queue.put((_END, exc))
            return
        await queue.put((_END, None))

    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                item, error = await asyncio.wait_for(queue.get(), max(interval_s, 0.05))
            except TimeoutError:
                yield KEEPALIVE
                continue
            if item is _END:
                if error is not None:
                    raise error
                return
            yield item  # type: ignore[misc]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

"""The API server's coalescing of unary creates (no sockets: the pipeline is a stub)."""

from __future__ import annotations

import asyncio

from apiserver.creation import Caller, CreateBatcher, CreateItem
from dsec.types.v1 import types_pb2

WHO = Caller("p", "root", "t")


def item() -> CreateItem:
    return CreateItem(WHO, types_pb2.SandboxSpec())


async def test_a_lone_create_starts_at_once_and_concurrent_ones_coalesce() -> None:
    batches: list[int] = []
    release = asyncio.Event()

    async def run(items: list[CreateItem]) -> None:
        batches.append(len(items))
        if len(batches) == 1:
            await release.wait()  # the first batch is still running ...
        for it in items:
            it.result = types_pb2.Sandbox(id="sb-x-000000")

    b = CreateBatcher(run, max_inflight=1, max_wait_s=10)
    first = asyncio.create_task(b.create(item()))
    await asyncio.sleep(0.01)
    assert batches == [1]  # started without waiting for company
    others = [asyncio.create_task(b.create(item())) for _ in range(20)]
    await asyncio.sleep(0.01)
    assert batches == [1]  # ... so the others queue
    release.set()
    await asyncio.gather(first, *others)
    assert batches == [1, 20]  # and go as one batch


async def test_a_slow_batch_does_not_hold_the_queue_past_the_wait() -> None:
    batches: list[int] = []
    never = asyncio.Event()

    async def run(items: list[CreateItem]) -> None:
        batches.append(len(items))
        if len(batches) == 1:
            await never.wait()
        for it in items:
            it.result = types_pb2.Sandbox()

    b = CreateBatcher(run, max_inflight=1, max_wait_s=0.05)
    slow = asyncio.create_task(b.create(item()))
    await asyncio.sleep(0)
    queued = [asyncio.create_task(b.create(item())) for _ in range(5)]
    await asyncio.wait_for(asyncio.gather(*queued), timeout=2)
    assert batches == [1, 5]
    await b.close()
    await asyncio.gather(slow, return_exceptions=True)

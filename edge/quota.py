"""Gives a sandbox's quota back to IAM when it ends on this edge.

The edge is where sandboxes end (stop, TTL, idle, OOM, crash), so it tells
IAM, in batches, with retries. A release lost anyway (edge crash) is caught
by reconciliation against the edge's live list.
"""

from __future__ import annotations

import asyncio
import logging

from common.channels import DEFAULT_DEADLINE_S, open_channel
from dsec.iam.v1 import iam_pb2, iam_pb2_grpc
from edge.manager import SandboxManager
from edge.model import TERMINAL

log = logging.getLogger(__name__)


class QuotaReleaser:
    def __init__(self, manager: SandboxManager, iam_target: str, batch: int = 512) -> None:
        self.manager = manager
        self.iam_target = iam_target
        self.batch = batch

    async def run(self) -> None:
        channel = open_channel(self.iam_target, "edge", retry_services=["dsec.iam.v1.IamService"])
        stub = iam_pb2_grpc.IamServiceStub(channel)
        q = self.manager.subscribe(maxsize=1_000_000, terminal_only=True)
        pending: list[str] = []
        try:
            while True:
                if pending:  # a failed release is retried even if nothing else happens
                    try:
                        rec = await asyncio.wait_for(q.get(), timeout=1.0)
                    except TimeoutError:
                        rec = None
                else:
                    rec = await q.get()
                if rec is not None and rec.state == TERMINAL:
                    pending.append(rec.sandbox_id)
                while not q.empty() and len(pending) < self.batch:
                    r = q.get_nowait()
                    if r.state == TERMINAL:
                        pending.append(r.sandbox_id)
                if not pending:
                    continue
                try:
                    await stub.ReleaseQuota(
                        iam_pb2.ReleaseQuotaRequest(sandbox_ids=pending), timeout=DEFAULT_DEADLINE_S
                    )
                    pending = []
                except Exception as exc:
                    log.warning(
                        "releasing quota of %d sandboxes failed (retrying): %s", len(pending), exc
                    )
        finally:
            self.manager.unsubscribe(q)
            await channel.close()

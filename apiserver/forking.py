"""ForkSandbox: copies of one sandbox, made on its own node.

A fork is not placed: the source's state (memory, disk, writable layer) is on its node, so
every child is created by the source's edge. What the API server adds is the quota: one IAM
transaction reserves all the children (fresh ids that encode the source's edge) before the
edge makes any; if one does not fit, the others are released and the fork is refused with
the limiting project, nothing made. The edge then admits all of them or none (its capacity)
and reports per child a sandbox or why it does not run; a child that does not run gives its
quota back (the edge releases the quota of a sandbox that ended; one it never admitted is
released here).
"""

from __future__ import annotations

from typing import Any

from apiserver.creation import Caller, release_quota
from apiserver.routing import downstream
from common import forwarding
from common.channels import DEFAULT_DEADLINE_S
from common.ids import edge_of, new_sandbox_id
from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2
from dsec.iam.v1 import iam_pb2
from libdsec.errors import InvalidArgument, item_error

#: Children per call (E2B allows up to 100 per snapshot; each child here is a whole sandbox
#: on the source's node). The edge enforces the same bound (edge.manager.MAX_FORK_CHILDREN).
MAX_FORK_CHILDREN = 64
#: A microVM fork of 64 under TCG: the capture, then every child's restore, in turns.
FORK_DEADLINE_S = 900.0


def check_count(count: int) -> None:
    if not 1 <= count <= MAX_FORK_CHILDREN:
        raise InvalidArgument(
            f"count must be between 1 and {MAX_FORK_CHILDREN}, got {count}",
            reason="FORK_COUNT",
            metadata={"field": "count", "max": str(MAX_FORK_CHILDREN)},
        )


async def fork(
    gw: Any, who: Caller, request: apiserver_pb2.ForkSandboxRequest
) -> apiserver_pb2.ForkSandboxResponse:
    """`gw`: the API server's Gateway (the IAM stub, the edge lookup with its owner check)."""
    check_count(request.count)
    stub = await gw.edge_for(who, request.sandbox_id)  # NOT_FOUND for another project's
    source = await gw.get(who, request.sandbox_id)
    edge_id = edge_of(request.sandbox_id)
    assert edge_id is not None  # edge_for checked it
    child_ids = [new_sandbox_id(edge_id) for _ in range(request.count)]
    await _reserve(gw, source, child_ids)
    try:
        resp: edge_pb2.ForkSandboxResponse = await downstream(
            stub.ForkSandbox(
                edge_pb2.ForkSandboxRequest(
                    sandbox_id=request.sandbox_id,
                    child_ids=child_ids,
                    labels=request.labels,
                    task_id=request.task_id,
                    ttl_s=request.ttl_s,
                    require_memory=request.require_memory,
                    principal_id=who.principal_id,
                ),
                timeout=FORK_DEADLINE_S,
                metadata=((forwarding.PRINCIPAL_METADATA, who.principal_id),),
            ),
            "edge",
        )
    except BaseException:
        # Refused as a whole (capacity, state, backend) or unknown: a child the edge did
        # make ends with its source's edge and is released there; reconciliation covers
        # the rest if the edge made some after all.
        await release_quota(gw.iam, child_ids, not_created=True)
        raise
    out = apiserver_pb2.ForkSandboxResponse(
        fork_kind=resp.fork_kind, source_stall_s=resp.source_stall_s
    )
    for i, r in enumerate(resp.results):
        item = out.results.add(index=i)
        if r.HasField("error") and r.error.code:
            item.error.CopyFrom(r.error)
            out.failed += 1
        else:
            item.sandbox.CopyFrom(r.sandbox)
            gw.owners.put(r.sandbox.id, r.sandbox.project_id)
            out.created += 1
    return out


async def _reserve(gw: Any, source: Any, child_ids: list[str]) -> None:
    """Quota for every child in one transaction, or none of it (the first refusal raised)."""
    spec = source.spec
    req = iam_pb2.ReserveQuotasRequest()
    for cid in child_ids:
        req.items.add(
            project_id=source.project_id,
            sandbox_id=cid,
            backend=spec.backend,
            cpu_millis=spec.resources.cpu_millis,
            memory_mb=spec.resources.memory_mb,
            edge_id=source.edge_id,
        )
    resp = await downstream(gw.iam.ReserveQuotas(req, timeout=DEFAULT_DEADLINE_S), "iam")
    refused = [r for r in resp.results if r.error.code]
    if refused:
        failed = {child_ids[r.index] for r in refused}
        await release_quota(
            gw.iam, [cid for cid in child_ids if cid not in failed], not_created=True
        )
        err = item_error(refused[0].error)
        err.metadata.setdefault("children", str(len(child_ids)))
        raise err

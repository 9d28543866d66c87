"""Task-level operations: pause, resume or stop every sandbox of a task in one call.

What a trainer's preemption handler calls (``PauseTask``, ``ResumeTask``, ``StopTask``; the
older ``StopSandboxes`` takes the same path). One ``EdgeService/ActOnSandboxes`` per edge, all
edges at once, with the selector pushed down (the caller's project prefix, the task, the
labels): each edge acts on its matching sandboxes a few at a time and answers one result per
sandbox, so a task of thousands of sandboxes costs one call per edge, not one per sandbox.
The answers are merged as they are: per sandbox, the sandbox or its error; per edge that did
not answer, its error (the other edges' results stand). Sandboxes of edges the watcher
declared lost are answered from its ledger, TERMINATED with EDGE_LOST, as GetSandbox does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from apiserver.gateway import Caller, Gateway
from common import forwarding
from common.convert import grace_s as checked_grace
from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2
from dsec.types.v1 import types_pb2
from libdsec.errors import DSecError, InvalidArgument, SandboxTerminated, item_status

log = logging.getLogger(__name__)

#: An edge's share of one task operation: thousands of sandboxes, 8 at a time, each a freeze,
#: a thaw or a stop. A stop's grace is added on top.
TASK_EDGE_DEADLINE_S = 600.0

Results = tuple[list[apiserver_pb2.TaskSandboxResult], list[apiserver_pb2.TaskEdgeError]]


class TaskOperations:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def act(
        self,
        who: Caller,
        action: edge_pb2.SandboxAction.ValueType,
        task_id: str,
        label_selector: Mapping[str, str],
        *,
        reason: types_pb2.TerminationReason.ValueType = types_pb2.TERMINATION_REASON_UNSPECIFIED,
        message: str = "",
        grace_s: float = 0.0,
        skip_terminated: bool = False,
    ) -> Results:
        """``action`` on every sandbox of the task (and labels) within the caller's project and
        its subprojects, on every edge: per sandbox (edges by id, each in creation order) the
        sandbox as the action left it or its error, and an error per edge that failed."""
        if not task_id and not label_selector:
            raise InvalidArgument(
                "give a task_id and/or a label_selector (refusing to act on every sandbox)"
            )
        grace_s = checked_grace(grace_s)
        request = edge_pb2.ActOnSandboxesRequest(
            action=action,
            project_prefix=who.project_id,
            task_id=task_id,
            label_selector=label_selector,
            reason=reason,
            message=message,
            grace_s=grace_s,
            skip_terminated=skip_terminated,
        )
        timeout = TASK_EDGE_DEADLINE_S + grace_s
        answers = await self.gw.fan_out_each(
            lambda stub: stub.ActOnSandboxes(
                request,
                timeout=timeout,
                metadata=((forwarding.PRINCIPAL_METADATA, who.principal_id),),
            )
        )
        results: list[apiserver_pb2.TaskSandboxResult] = []
        edge_errors: list[apiserver_pb2.TaskEdgeError] = []
        for edge_id, answer in answers.items():
            if isinstance(answer, DSecError):
                log.warning("task operation: edge %s did not answer: %s", edge_id, answer)
                failed = apiserver_pb2.TaskEdgeError(edge_id=edge_id)
                item_status(answer, failed.error)
                edge_errors.append(failed)
                continue
            for r in answer.results:
                results.append(
                    apiserver_pb2.TaskSandboxResult(
                        sandbox_id=r.sandbox_id,
                        edge_id=edge_id,
                        sandbox=r.sandbox if not r.error.code else None,
                        error=r.error if r.error.code else None,
                    )
                )
                if not r.error.code:
                    self.gw.owners.put(r.sandbox_id, r.sandbox.project_id)
        if not skip_terminated:
            results += await self._lost(who, request, {r.sandbox_id for r in results})
        return results, edge_errors

    async def _lost(
        self, who: Caller, request: edge_pb2.ActOnSandboxesRequest, answered: set[str]
    ) -> list[apiserver_pb2.TaskSandboxResult]:
        """The task's sandboxes of edges declared lost (an edge that answered wins): a stop
        answers each as it ended, a pause or resume fails as for any ended sandbox."""
        try:
            resp = await self.gw.edges.lost(
                project_prefix=who.project_id,
                task_id=request.task_id,
                label_selector=dict(request.label_selector),
            )
        except DSecError as exc:  # the watcher is down: the edges' answers stand
            log.warning("lost-sandbox listing for a task operation failed: %s", exc)
            return []
        out = []
        for sb in resp.sandboxes:
            if sb.id in answered:
                continue
            r = apiserver_pb2.TaskSandboxResult(sandbox_id=sb.id, edge_id=sb.edge_id)
            if request.action == edge_pb2.SANDBOX_ACTION_STOP:
                r.sandbox.CopyFrom(sb)
            else:
                item_status(
                    SandboxTerminated(
                        f"sandbox {sb.id} has terminated (EDGE_LOST: {sb.termination.message})",
                        metadata={"termination_reason": "EDGE_LOST", "state": "TERMINATED"},
                    ),
                    r.error,
                )
            out.append(r)
        return out

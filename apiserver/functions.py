"""FnCall routing in the API server: authenticate, place on an edge offering FNCALL, forward.

Placement is asked like for a sandbox (backend FNCALL), with a node selector on the labels an
edge publishes for the environments and languages its pools run (``fncall.env.<name>``,
``fncall.lang.<language>``), so a job only goes where it can run. If nothing matches, the job is
placed without the selector and the edge gives the precise answer (an unknown language is
INVALID_ARGUMENT there, not "no eligible edge" here).

Jobs travel to an edge on one tagged stream per edge (``StreamFunctions``), shared by every
caller's jobs: a message on an open stream costs a fraction of a unary call's set-up on both
sides. The SDK's fncall reaches us the same way; RunFunction (unary) still works and takes the
same edge streams.

Jobs are short and many; asking placement for each one would cost a round trip per job and
flood its overlay with phantom load (placement records every answer as an allocation). So a
placement answer (its ranked candidates, up to placement's ``max_candidates``) is reused for
``PLACEMENT_TTL_S`` per (project, selector), and each job goes to the candidate with the fewest
of this server's jobs outstanding on it (single jobs, and a batch's jobs until their results
come), ties in placement's order: a burst spreads over the candidates at once instead of
queueing on the first one for the whole TTL while the others idle. An edge that refuses
(EDGE_CAPACITY: its pool queue is full) or is unreachable drops the cached answer and the job
goes to the next candidate. Jobs are not charged to quota: pools are platform capacity,
created before any job, and nothing outlives a job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from apiserver.gateway import Caller, Gateway
from apiserver.routing import downstream
from common.channels import DEFAULT_DEADLINE_S
from dsec.apiserver.v1 import apiserver_pb2
from dsec.edge.v1 import edge_pb2
from dsec.placement.v1 import placement_pb2
from dsec.types.v1 import types_pb2
from libdsec._tagged import TaggedStream
from libdsec.errors import (
    DSecError,
    EdgeCapacity,
    InvalidArgument,
    NoEligibleEdge,
    Unavailable,
    from_rpc_error,
    item_error,
)

log = logging.getLogger(__name__)

PLACEMENT_TTL_S = 1.0
MAX_ATTEMPTS = 3
#: A job's deadline past its own time and compile limits: waiting for a pool container.
JOB_MARGIN_S = 120.0
#: The compile step's limit when the job sets none (the edge's default, edge/fncall/jobs.py).
COMPILE_TIME_LIMIT_S = 30.0
#: The longest time or compile limit the edge accepts (edge/fncall/jobs.py MAX_TIME_LIMIT_S).
MAX_TIME_LIMIT_S = 600.0
MAX_BATCH = 100_000
#: A batch is split over the placement answer's edges only if each gets at least this many jobs.
SPLIT_MIN_JOBS = 32


def job_deadline_s(job: types_pb2.FunctionJob) -> float:
    """How long the API server waits for ``job``: its run and compile limits plus a margin.

    The edge validates the limits (edge/fncall/jobs.py, (0, MAX_TIME_LIMIT_S]); one it will
    refuse (NaN, infinite, negative, huge) must not become this call's deadline (a NaN one
    made asyncio.timeout raise, and the call answered INTERNAL: found by tests/fuzz), so it
    counts as its default here and the edge answers INVALID_ARGUMENT.
    """
    total = JOB_MARGIN_S
    for value, default in (
        (job.time_limit_s, 10.0),
        (job.compile_time_limit_s, COMPILE_TIME_LIMIT_S),
    ):
        limit = value or default
        total += limit if math.isfinite(limit) and 0 < limit <= MAX_TIME_LIMIT_S else default
    return total


def _selector(jobs: list[types_pb2.FunctionJob]) -> dict[str, str]:
    envs = {j.environment for j in jobs}
    langs = {j.language.strip().lower() for j in jobs}
    if len(envs) == 1 and "" not in envs:
        return {f"fncall.env.{envs.pop()}": "ready"}
    if envs == {""} and len(langs) == 1 and "" not in langs:
        return {f"fncall.lang.{langs.pop()}": "ready"}
    return {}


class FunctionRouter:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._placements: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[float, Any]] = {}
        self._streams: dict[str, TaggedStream] = {}  # edge address -> its job stream
        self._outstanding: dict[str, int] = {}  # edge id -> this server's jobs not answered yet

    def _least_busy_first(
        self, cands: list[placement_pb2.Candidate]
    ) -> list[placement_pb2.Candidate]:
        """The candidates by this server's outstanding jobs on each (stable: placement's order
        breaks ties)."""
        return sorted(cands, key=lambda c: self._outstanding.get(c.edge_id, 0))

    def _add_outstanding(self, edge_id: str, n: int) -> None:
        left = self._outstanding.get(edge_id, 0) + n
        if left > 0:
            self._outstanding[edge_id] = left
        else:
            self._outstanding.pop(edge_id, None)

    def _edge_stream(self, address: str) -> TaggedStream:
        stream = self._streams.get(address)
        if stream is None:
            stub = self.gw.edges.stub_for_address(address)
            stream = self._streams[address] = TaggedStream(stub.StreamFunctions)
        return stream

    async def _run_on(
        self, address: str, who: Caller, job: types_pb2.FunctionJob
    ) -> types_pb2.FunctionResult:
        timeout = job_deadline_s(job)
        msg = await self._edge_stream(address).call_if_supported(
            edge_pb2.StreamFunctionsRequest(job=job, project_id=who.project_id), timeout=timeout
        )
        if msg is not None:
            return msg.result
        # an older edge: one call per job
        stub = self.gw.edges.stub_for_address(address)
        resp = await downstream(
            stub.RunFunction(
                edge_pb2.RunFunctionRequest(job=job, project_id=who.project_id), timeout=timeout
            ),
            "edge",
        )
        return resp.result

    async def close(self) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            await stream.aclose()

    async def _candidates(
        self, who: Caller, selector: dict[str, str], exclude: list[str]
    ) -> list[placement_pb2.Candidate]:
        key = (who.project_id, tuple(sorted(selector.items())))
        hit = self._placements.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now and not exclude:
            return list(hit[1])
        spec = types_pb2.SandboxSpec(
            backend=types_pb2.BACKEND_FNCALL,
            # Nominal: pools are pre-created; this only has to fit.
            resources=types_pb2.Resources(cpu_millis=10, memory_mb=16),
            node_selector=selector,
        )
        item = placement_pb2.PlacementItem(
            spec=spec, project_id=who.project_id, exclude_edges=exclude
        )
        resp = await downstream(
            self.gw.placement.PlaceSandbox(
                placement_pb2.PlaceSandboxRequest(item=item), timeout=DEFAULT_DEADLINE_S
            ),
            "placement",
        )
        p = resp.placement
        if p.error.code:
            err = item_error(p.error)
            if isinstance(err, NoEligibleEdge) and selector:
                # Nobody advertises it: let an edge say what is wrong with the job.
                return await self._candidates(who, {}, exclude)
            raise err
        cands = list(p.candidates)
        if len(self._placements) > 10_000:
            self._placements.clear()
        if not exclude:
            self._placements[key] = (now + PLACEMENT_TTL_S, cands)
        return cands

    def _forget(self, who: Caller, selector: dict[str, str]) -> None:
        self._placements.pop((who.project_id, tuple(sorted(selector.items()))), None)

    async def run(self, who: Caller, job: types_pb2.FunctionJob) -> types_pb2.FunctionResult:
        selector = _selector([job])
        tried: list[str] = []
        last: Exception | None = None
        while len(tried) < MAX_ATTEMPTS:
            cands = [
                c for c in await self._candidates(who, selector, tried) if c.edge_id not in tried
            ]
            if not cands:
                break
            for cand in self._least_busy_first(cands):
                if len(tried) >= MAX_ATTEMPTS:
                    break
                tried.append(cand.edge_id)
                self._add_outstanding(cand.edge_id, 1)
                try:
                    return await self._run_on(cand.address, who, job)
                except (EdgeCapacity, Unavailable) as err:
                    last = err
                    self._forget(who, selector)
                    log.info("edge %s refused a fncall job (%s); next", cand.edge_id, err.reason)
                finally:
                    self._add_outstanding(cand.edge_id, -1)
        raise last or NoEligibleEdge("no edge accepted the fncall job")

    async def run_many(
        self, who: Caller, request: apiserver_pb2.RunFunctionsRequest
    ) -> AsyncIterator[apiserver_pb2.RunFunctionsResponse]:
        """A batch on one edge, or split over the placement answer's candidates when it is
        large enough that each gets ``SPLIT_MIN_JOBS`` (every edge then compiles a program
        once for its share). Results stream as they finish, with the batch's own indices."""
        jobs = list(request.jobs)
        if not jobs:
            raise InvalidArgument("give at least one job")
        if len(jobs) > MAX_BATCH:
            raise InvalidArgument(f"at most {MAX_BATCH} jobs per call", reason="BATCH_TOO_LARGE")
        selector = _selector(jobs)
        parts = min(len(await self._candidates(who, selector, [])), len(jobs) // SPLIT_MIN_JOBS)
        if parts <= 1:
            index = list(range(len(jobs)))
            async for msg in self._batch(who, selector, jobs, index, request.parallelism):
                yield msg
            return
        # Strided, so that each edge gets a like mix when the batch is sorted (e.g. by size).
        shares = [(jobs[k::parts], list(range(k, len(jobs), parts))) for k in range(parts)]
        parallelism = -(-request.parallelism // parts) if request.parallelism > 0 else 0
        # Bounded: a caller reading slowly holds the edges back, as on one edge's stream.
        out: asyncio.Queue[apiserver_pb2.RunFunctionsResponse | Exception | None]
        out = asyncio.Queue(maxsize=16)

        async def pump(share: list[types_pb2.FunctionJob], index: list[int]) -> None:
            try:
                async for msg in self._batch(who, selector, share, index, parallelism):
                    await out.put(msg)
                await out.put(None)
            except Exception as exc:  # re-raised by the consumer, which cancels the rest
                await out.put(exc)

        # Each part picks its edge (the least busy) before the next starts: one per edge.
        tasks = [asyncio.create_task(pump(share, index)) for share, index in shares]
        try:
            running = parts
            while running:
                item = await out.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _batch(
        self,
        who: Caller,
        selector: dict[str, str],
        jobs: list[types_pb2.FunctionJob],
        index: list[int],
        parallelism: int,
    ) -> AsyncIterator[apiserver_pb2.RunFunctionsResponse]:
        """`jobs` as one batch on the least busy candidate (the next one if it refuses before
        starting); result i of the edge's batch is job ``index[i]`` of the caller's."""
        tried: list[str] = []
        last: Exception | None = None
        while len(tried) < MAX_ATTEMPTS:
            cands = [
                c for c in await self._candidates(who, selector, tried) if c.edge_id not in tried
            ]
            if not cands:
                break
            cand = self._least_busy_first(cands)[0]
            tried.append(cand.edge_id)
            pending = len(jobs)  # this batch's jobs outstanding on that edge
            self._add_outstanding(cand.edge_id, pending)
            call = self.gw.edges.stub_for_address(cand.address).RunFunctions(
                edge_pb2.RunFunctionsRequest(
                    jobs=jobs, parallelism=parallelism, project_id=who.project_id
                )
            )
            started = False
            try:
                async for msg in call:
                    started = True
                    if msg.WhichOneof("event") == "result":
                        pending -= 1
                        self._add_outstanding(cand.edge_id, -1)
                        msg.result.index = index[msg.result.index]
                        yield apiserver_pb2.RunFunctionsResponse(result=msg.result)
                    else:
                        yield apiserver_pb2.RunFunctionsResponse(keepalive=msg.keepalive)
                return
            except grpc.aio.AioRpcError as exc:
                err = from_rpc_error(exc)
                if started or not isinstance(err, (EdgeCapacity, Unavailable)):
                    raise _in_caller_terms(err, index) from exc
                last = err
                self._forget(who, selector)
            finally:
                call.cancel()
                self._add_outstanding(cand.edge_id, -pending)
        raise last or NoEligibleEdge("no edge accepted the fncall jobs")


def _in_caller_terms(err: DSecError, index: list[int]) -> DSecError:
    """An edge's error about job i of its share, told about the caller's job index[i]."""
    where = err.metadata.get("job_index", "")
    if not where.isdigit() or int(where) >= len(index) or index[int(where)] == int(where):
        return err
    mine = index[int(where)]
    message = err.message.replace(f"jobs[{where}]", f"jobs[{mine}]", 1)
    return type(err)(message, reason=err.reason, metadata={**err.metadata, "job_index": str(mine)})

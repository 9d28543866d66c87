"""gRPC adapter of FnCall on the edge: FunctionJob in -> FnCallService -> FunctionResult out.

The edge servicer delegates RunFunction/RunFunctions/StreamFunctions here, so the service itself
stays free of generated code.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from common.convert import ts
from common.grpc_server import internal_error
from common.tagged import serve_tagged
from dsec.edge.v1 import edge_pb2
from dsec.types.v1 import types_pb2
from edge.fncall.jobs import Job, Result
from edge.fncall.service import FnCallService
from libdsec.errors import FailedPrecondition

KEEPALIVE_S = 5.0


def job_from_pb(pb: types_pb2.FunctionJob) -> Job:
    return Job(
        language=pb.language,
        code=pb.code.encode(),
        files=[(f.path, bytes(f.content)) for f in pb.files],
        command=list(pb.command),
        stdin=bytes(pb.stdin),
        time_limit_s=pb.time_limit_s,
        cpu_limit_s=pb.cpu_limit_s,
        memory_mb=pb.memory_mb,
        max_output_bytes=pb.max_output_bytes,
        environment=pb.environment,
        job_id=pb.job_id,
        compile_time_limit_s=pb.compile_time_limit_s,
        fetch_files=list(pb.fetch_files),
    )


def result_pb(r: Result) -> types_pb2.FunctionResult:
    pb = types_pb2.FunctionResult(
        job_id=r.job_id,
        verdict=types_pb2.Verdict.Value("VERDICT_" + r.verdict),
        exit_code=r.exit_code,
        signal=r.signal,
        stdout=r.stdout,
        stderr=r.stderr,
        wall_time_s=r.wall_time_s,
        cpu_time_s=r.cpu_time_s,
        peak_memory_bytes=r.peak_memory_bytes,
        compile_output=r.compile_output,
        index=r.index,
        message=r.message,
        edge_id=r.edge_id,
    )
    if r.compile is not None:
        pb.compile.CopyFrom(
            types_pb2.CompileInfo(
                verdict=types_pb2.Verdict.Value("VERDICT_" + r.compile.verdict),
                exit_code=r.compile.exit_code,
                wall_time_s=r.compile.wall_time_s,
                cached=r.compile.cached,
            )
        )
    if r.files:
        pb.files.extend(types_pb2.SourceFile(path=path, content=data) for path, data in r.files)
    if r.fetch_errors:
        pb.fetch_errors.update(r.fetch_errors)
    return pb


class FnCallAdapter:
    """RunFunction / RunFunctions of the EdgeService; `service` None = not offered here."""

    def __init__(self, service: FnCallService | None, why_not: str = "") -> None:
        self.service = service
        self.why_not = why_not or "this edge runs no fncall pools"

    def _service(self) -> FnCallService:
        if self.service is None:
            raise FailedPrecondition(self.why_not, reason="FNCALL_NOT_OFFERED")
        return self.service

    def pool_status(self) -> dict[str, edge_pb2.FnCallPoolStatus]:
        """Each pool's containers and jobs now, for GetNodeStatus (none if not offered)."""
        if self.service is None:
            return {}
        return {
            name: edge_pb2.FnCallPoolStatus(**counts)
            for name, counts in self.service.stats().items()
        }

    async def run_function(
        self, request: edge_pb2.RunFunctionRequest
    ) -> edge_pb2.RunFunctionResponse:
        result = await self._service().run(job_from_pb(request.job))
        return edge_pb2.RunFunctionResponse(result=result_pb(result))

    def stream_functions(
        self, requests: AsyncIterator[edge_pb2.StreamFunctionsRequest]
    ) -> AsyncGenerator[edge_pb2.StreamFunctionsResponse, None]:
        """Tagged jobs, each run as soon as it arrives, answered as each finishes (the API
        server keeps one such stream per edge for every caller's jobs)."""
        service = self._service()

        async def run(request: edge_pb2.StreamFunctionsRequest) -> types_pb2.FunctionResult:
            return result_pb(await service.run(job_from_pb(request.job)))

        return serve_tagged(
            requests,
            run,
            edge_pb2.StreamFunctionsResponse,
            internal=lambda exc: internal_error("edge StreamFunctions job", exc),
        )

    async def run_functions(
        self, request: edge_pb2.RunFunctionsRequest
    ) -> AsyncIterator[edge_pb2.RunFunctionsResponse]:
        service = self._service()
        results = service.run_many([job_from_pb(j) for j in request.jobs], request.parallelism)
        # A stream that stays silent while long jobs run must still show it is alive.
        pending: asyncio.Task[Result] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(results))
                done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
                if not done:
                    yield edge_pb2.RunFunctionsResponse(
                        keepalive=types_pb2.Keepalive(at=ts(time.time()))
                    )
                    continue
                try:
                    result = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                yield edge_pb2.RunFunctionsResponse(result=result_pb(result))
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            await _aclose(results)


async def _aclose(gen: Any) -> None:
    with contextlib.suppress(BaseException):
        await gen.aclose()

"""The compat front ends' per-request cost in the process, Starlette routing vs the
hand-written dispatch it replaced (issue 32), same run.

Each front end is driven as uvicorn drives it (an ASGI scope, a receive and a send), with a
client pool whose leases hand out a fake libdsec client that answers at once, so what is
timed is the front end alone: routing, the body read, the handler, the JSON answer. Three
requests: SandboxFusion's ``POST /t/<token>/run_code`` (what verl sends per test case),
``GET /v1/ping``, and E2B's ``GET /sandboxes/{id}`` (the control API's routing table).

The baseline is the ``compat`` package of a git revision (default: the commit before
Starlette, 048d1f9), extracted to a temp dir; each side runs in its own child process and the
rounds alternate (the machine's speed drifts). Each child times its requests in batches; the
table gives the best batch's µs per request over all rounds (a shared machine only ever
slows a batch down) and the ratio to the baseline.

usage: python bench/bench_compat_dispatch.py [--baseline REV] [--requests 5000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import table  # noqa: E402

#: Each child times its requests in this many batches and keeps the fastest.
BATCHES = 10
RUN_CODE = json.dumps({"code": "print(1)", "language": "python"}).encode()


def _child(tree: Path, requests: int) -> dict[str, float]:
    """µs per request of each kind, with `tree`'s compat package (first on sys.path)."""
    sys.path.insert(0, str(tree))
    from compat.config import CompatConfig
    from compat.e2b.app import E2bApp
    from compat.sandboxfusion.app import SandboxFusionApp
    from libdsec import FunctionResult, SandboxInfo

    assert Path(sys.modules["compat"].__file__ or "").is_relative_to(tree)
    now = datetime.now(UTC)
    info = SandboxInfo(
        id="sb-e0-abcdef12",
        project_id="root",
        state="RUNNING",
        backend="container",
        image="bookworm",
        edge_id="e0",
        labels={},
        task_id="",
        created_at=now,
        expires_at=now + timedelta(seconds=300),
        termination_reason=None,
        termination_message="",
        violations={},
        memory=None,
    )
    result = FunctionResult(
        verdict="OK",
        exit_code=0,
        signal=0,
        stdout=b"1\n",
        stderr=b"",
        wall_time_s=0.01,
        cpu_time_s=0.01,
        peak_memory_bytes=1 << 20,
        edge_id="e0",
    )

    class Handle:
        def __init__(self) -> None:
            self.info = info

    class FakeClient:
        async def fncall(self, **kw: Any) -> FunctionResult:
            return result

        async def get(self, sandbox_id: str) -> Handle:
            return Handle()

    class FakePool:
        @contextlib.asynccontextmanager
        async def lease(self, token: str) -> AsyncIterator[FakeClient]:
            yield FakeClient()

    config = CompatConfig()
    fusion = SandboxFusionApp(config, cast(Any, FakePool()), default_token="")
    e2b = E2bApp(config, cast(Any, FakePool()))
    kinds = {
        "SandboxFusion POST /t/<token>/run_code": (fusion, "POST", "/t/tok/run_code", RUN_CODE, []),
        "SandboxFusion GET /v1/ping": (fusion, "GET", "/v1/ping", b"", []),
        "E2B GET /sandboxes/{id}": (
            e2b,
            "GET",
            "/sandboxes/sb-e0-abcdef12",
            b"",
            [(b"x-api-key", b"k")],
        ),
    }

    async def one(app: Any, method: str, path: str, body: bytes, headers: list[Any]) -> int:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"127.0.0.1"), *headers],
            "server": ("127.0.0.1", 7131),
            "client": ("127.0.0.1", 50000),
        }
        sent = False
        never = asyncio.Event()
        status = 0

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()  # the client stays
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(scope, receive, send)
        return status

    async def run() -> dict[str, float]:
        out = {}
        for name, (app, method, path, body, headers) in kinds.items():
            assert await one(app, method, path, body, headers) == 200, name
            best = float("inf")
            for _ in range(BATCHES):  # the best batch: the least disturbed by the machine
                t = time.perf_counter()
                for _ in range(requests // BATCHES):
                    await one(app, method, path, body, headers)
                best = min(best, (time.perf_counter() - t) / (requests // BATCHES) * 1e6)
            out[name] = best
        return out

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="048d1f9", help="git revision of the baseline compat")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(Path(args.child), args.requests)))
        return
    with tempfile.TemporaryDirectory(prefix="dsec-bench-compat-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline, "compat"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        sides = {"baseline": Path(tmp), "now": ROOT}
        samples: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
        for _ in range(args.rounds):
            for side, tree in sides.items():
                child = [sys.executable, __file__, "--child", str(tree)]
                child += ["--requests", str(args.requests)]
                done = subprocess.run(child, check=True, capture_output=True, text=True, cwd=ROOT)
                for name, us in json.loads(done.stdout).items():
                    samples[side].setdefault(name, []).append(us)
    rows: list[list[object]] = []
    for name in samples["now"]:
        base = min(samples["baseline"][name])
        now = min(samples["now"][name])
        rows.append([name, base, now, f"{now / base:.2f}x"])
    table(
        f"compat front ends, µs per request in the process (best batch of {args.rounds} rounds x"
        f" {BATCHES} batches of {args.requests // BATCHES}; baseline {args.baseline})",
        ["request", "hand-written µs", "Starlette µs", "ratio"],
        rows,
    )


if __name__ == "__main__":
    main()

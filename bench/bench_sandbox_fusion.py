"""verl's code reward through the SandboxFusion-compatible API vs dsec's native FnCall, same run.

One program (C++, then Python) against N test cases (default 100), judged:

- native: ``Client.fncall_many`` (one gRPC stream; compiled once), outputs compared here;
- verl: verl's own ``check_correctness`` (``verl.utils.reward_score.sandbox_fusion.utils``,
  loaded without the rest of verl) posting one ``/run_code`` per case from its 32 threads to
  the compat process's SandboxFusion listener, exactly as a trainer does;
- batch: one ``POST /run_code_batch`` with every case (dsec's own extension), outputs
  compared here.

Rounds alternate the three (the machine's speed drifts); the table gives the median wall time
of a whole judgement and its ratio to native. Target (the issue): verl within 1.5x of native.
Every judgement must accept every case (the program is correct), else the bench fails.

A second table splits the machine's CPU per judged case by process: this one (the client:
verl's threads, or the SDK), the compat front end, the API server, the edge, and the rest
(the pools' containers running the jobs, the kernel). On this 2-core machine everything shares
the same cores, so a judgement's wall time follows the machine's CPU per case.

usage: python bench/bench_sandbox_fusion.py [--cases 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import IMAGES, cluster, cpu_snapshot, cpu_split, table
from dsecctl.cluster import EdgeSpec
from libdsec import Client, FunctionJob
from tests.verl_support import load_verl_sandbox_fusion

PROGRAMS = {
    "cpp": '#include <cstdio>\nint main(){long a,b;scanf("%ld %ld",&a,&b);printf("%ld\\n",a+b);}\n',
    "python": "a, b = map(int, input().split())\nprint(a + b)\n",
}
TIME_LIMIT_S = 10
CPU_GROUPS = ("client (this process)", "compat", "apiserver", "edge-sfbench", "jobs and the rest")
MEMORY_MB = 1024  # verl's default memory_limit_mb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    inputs = [f"{i} {i * 7 + 3}\n" for i in range(args.cases)]
    outputs = [str(i + i * 7 + 3) for i in range(args.cases)]
    check_correctness = sys.modules[
        load_verl_sandbox_fusion().__name__ + ".utils"
    ].check_correctness
    edge = EdgeSpec(
        edge_id="sfbench",
        runtime="container",
        extra_env={"DSEC_EDGE_IMAGE_DIR": str(IMAGES)},  # the default pools
    )
    with cluster(edges=[edge]) as c, Client(c.apiserver, token=c.token) as dsec:
        token = dsec.create_token("bench-verl", agent=True).secret
        url = f"{c.sandbox_fusion_url}/t/{token}"
        for lang in PROGRAMS:  # warm: pools up, the program compiled once
            assert dsec.fncall(language=lang, code=PROGRAMS[lang], stdin="1 2").ok

        def native(lang: str) -> int:
            jobs = [
                FunctionJob(
                    language=lang,
                    code=PROGRAMS[lang],
                    stdin=s,
                    time_limit_s=TIME_LIMIT_S,
                    memory_mb=MEMORY_MB,
                )
                for s in inputs
            ]
            return sum(
                r.ok and r.text.rstrip("\n") == outputs[r.index] for r in dsec.fncall_many(jobs)
            )

        def verl(lang: str) -> int:
            results, _ = check_correctness(
                f"{url}/run_code",
                {"inputs": inputs, "outputs": outputs},
                PROGRAMS[lang],
                timeout=TIME_LIMIT_S,
                memory_limit_mb=MEMORY_MB,
                language=lang,
            )
            return sum(r is True for r in results)

        def batch(lang: str) -> int:
            body = {
                "code": PROGRAMS[lang],
                "language": lang,
                "run_timeout": TIME_LIMIT_S,
                "memory_limit_MB": MEMORY_MB,
                "cases": [{"stdin": s} for s in inputs],
            }
            req = urllib.request.Request(
                f"{url}/run_code_batch",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=600) as resp:
                answer: dict[str, Any] = json.loads(resp.read())
            return sum(
                r["status"] == "Success" and r["run_result"]["stdout"].rstrip("\n") == outputs[i]
                for i, r in enumerate(answer["results"])
            )

        ways: dict[str, Callable[[str], int]] = {
            "native fncall_many": native,
            "verl check_correctness": verl,
            "POST /run_code_batch": batch,
        }
        groups = {c.process(n).pid: n for n in ("compat", "apiserver", "edge-sfbench")}
        groups[os.getpid()] = "client (this process)"

        def classify(pid: int, cmd: str, parent: str) -> tuple[str, str]:
            return groups.get(pid, "jobs and the rest"), "jobs and the rest"

        rows, cpu_rows = [], []
        for lang in PROGRAMS:
            times: dict[str, list[float]] = {w: [] for w in ways}
            cpu: dict[str, dict[str, float]] = {w: {} for w in ways}
            for _ in range(args.rounds):
                for name, way in ways.items():
                    before = cpu_snapshot()
                    t0 = time.perf_counter()
                    accepted = way(lang)
                    times[name].append(time.perf_counter() - t0)
                    for group, s in cpu_split(before, cpu_snapshot(), classify).items():
                        cpu[name][group] = cpu[name].get(group, 0.0) + s
                    if accepted != args.cases:
                        raise SystemExit(f"{name} {lang}: {accepted}/{args.cases} accepted")
            per_case = 1000 / (args.rounds * args.cases)
            for name in ways:
                split = {g: v * per_case for g, v in cpu[name].items()}
                split["jobs and the rest"] = split.get("jobs and the rest", 0) + split.pop(
                    "other", 0
                )
                cpu_rows.append(
                    [lang, name] + [split.get(g, 0.0) for g in CPU_GROUPS] + [sum(split.values())]
                )
            base = statistics.median(times["native fncall_many"])
            for name in ways:
                med = statistics.median(times[name])
                rows.append(
                    [
                        lang,
                        name,
                        med * 1000,
                        med * 1000 / args.cases,
                        min(times[name]) * 1000,
                        f"{med / base:.2f}x",
                    ]
                )
    table(
        f"{args.cases} test cases of one correct program, all accepted; median of {args.rounds} "
        "rounds (alternated); target: verl within 1.5x of native",
        ["language", "way", "judgement ms", "ms/case", "best ms", "vs native"],
        rows,
    )
    table(
        f"CPU ms per judged case, by process (mean of {args.rounds} rounds)",
        ["language", "way", *CPU_GROUPS, "machine"],
        cpu_rows,
    )


if __name__ == "__main__":
    main()

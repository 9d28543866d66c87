"""The harness adapters (issue 39) against the harnesses' own Docker backends, same run.

1. SWE-ReX: ``DsecDeployment`` (libdsec/harness/swerex.py: a dsec container sandbox, no server
   in it) vs SWE-ReX's own ``DockerDeployment`` on this machine's Docker engine, alternated:
   - start -> first command: ``start()`` + ``create_session()`` + the first
     ``run_in_session("true")`` (what an agent does first), ``--starts`` times each, p50/p99;
   - ``--runs`` ``run_in_session("true")`` calls on one running deployment of each, p50/p99.
   Same content and limits on both sides: dsec runs its ``bookworm`` image, Docker
   ``dsec/bookworm`` (the same tree, scripts/build-base-images.sh) plus the ``swerex-remote``
   server that DockerDeployment starts in the container (there is no registry here: the image
   ``dsec-bench/swerex:<version>`` is built once with ``docker build`` from the installed
   swe-rex version, ``pip install --target`` from the local package index); 1 CPU, 512 MB each.
2. Harbor: one small task (the bookworm image, the oracle agent writes a file, the verifier checks
   it) as a whole ``harbor run`` (wall time of the command, and the trial's own time from its
   result.json), ``--trials`` times after a warm-up run (the image's first use imports it into
   dsec's layer store), on ``libdsec.harness.harbor:DSecEnvironment`` (``.venv-harbor``) vs
   Harbor's ``docker`` environment. Harbor's docker environment drives ``docker compose`` (the
   v2 CLI plugin, which scripts/setup.sh installs): where the engine has none, its row says
   so and nothing is faked.

Everything started here is stopped, also on failure: the cluster, the deployments and their
containers, the sandboxes; the image tag and the dsec environment of the Harbor task are
removed. ``dsec-bench/swerex:<version>`` stays (a build cache, as dsec's base images do).

usage: python bench/bench_harness.py [--starts 10] [--runs 100] [--trials 3]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.docker import DockerDeployment
from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

from bench.common import IMAGES, cluster, docker_available, pct, table
from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client
from libdsec.harness.swerex import DsecDeployment

ROOT = Path(__file__).resolve().parents[1]
HARBOR = ROOT / ".venv-harbor" / "bin" / "harbor"
SWEREX_VERSION = importlib.metadata.version("swe-rex")
SWEREX_IMAGE = f"dsec-bench/swerex:{SWEREX_VERSION}"
#: The Docker image the SWE-ReX image is built on: the tree of dsec's ``bookworm`` image.
BASE_IMAGE = "dsec/bookworm:latest"
#: The Harbor task's image (a tag of its own per run: its first use is an import). Debian:
#: Harbor's docker environment runs its own commands under bash, which busybox lacks.
HARBOR_BASE = "dsec/bookworm:latest"
CPU, MEMORY_MB = 1, 512
#: The Harbor task's name (without its org: what Harbor names its environments after).
TASK = "answer"

DOCKERFILE = f"""\
FROM {BASE_IMAGE}
COPY site /opt/swerex
ENV PYTHONPATH=/opt/swerex
RUN printf '#!/bin/sh\\nexec python3 -c "import sys; from swerex.server import main; \
sys.exit(main())" "$@"\\n' >/usr/local/bin/swerex-remote && chmod 755 /usr/local/bin/swerex-remote
"""


def build_swerex_image() -> None:
    """``SWEREX_IMAGE``: the base image plus swe-rex (this interpreter's version, the same
    Python 3.11 as the image's) and its dependencies, unless the engine has it already."""
    if (
        subprocess.run(["docker", "image", "inspect", SWEREX_IMAGE], capture_output=True).returncode
        == 0
    ):
        return
    with tempfile.TemporaryDirectory(prefix="dsec-bench-swerex-") as ctx:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "--target", f"{ctx}/site", f"swe-rex=={SWEREX_VERSION}"],
            check=True, capture_output=True,
        )  # fmt: skip
        Path(ctx, "Dockerfile").write_text(DOCKERFILE)
        subprocess.run(
            ["docker", "build", "-q", "-t", SWEREX_IMAGE, ctx], check=True, capture_output=True
        )


async def first_command(deployment: AbstractDeployment) -> float:
    """Seconds from ``start()`` to the end of the first session command."""
    t = time.perf_counter()
    await deployment.start()
    await deployment.runtime.create_session(CreateBashSessionRequest())
    obs = await deployment.runtime.run_in_session(BashAction(command="true", check="raise"))
    elapsed = time.perf_counter() - t
    assert obs.exit_code == 0, obs
    return elapsed


async def swerex_bench(
    c: LocalCluster, starts: int, runs: int
) -> dict[str, dict[str, list[float]]]:
    """{"start": {side: seconds}, "run": {side: seconds}}."""
    makers: dict[str, Callable[[], AbstractDeployment]] = {
        "dsec": lambda: DsecDeployment(
            target=c.apiserver, token=c.token, image="bookworm", cpu=CPU, memory_mb=MEMORY_MB,
            labels={"bench": "harness"},
        ),
        "docker": lambda: DockerDeployment(
            image=SWEREX_IMAGE, pull="never", python_standalone_dir=None,
            docker_args=["--cpus", str(CPU), "--memory", f"{MEMORY_MB}m"], startup_timeout=120,
        ),
    }  # fmt: skip
    out: dict[str, dict[str, list[float]]] = {"start": {s: [] for s in makers}, "run": {}}

    async def once(d: AbstractDeployment) -> float:
        """``first_command`` on a fresh deployment, stopped after."""
        try:
            return await first_command(d)
        finally:
            await d.stop()

    for make in makers.values():  # warm-up: the image's first use, the connections
        await once(make())
    for _ in range(starts):
        for side, make in makers.items():
            out["start"][side].append(await once(make()))
    running = {side: make() for side, make in makers.items()}
    out["run"] = {side: [] for side in running}
    try:
        for d in running.values():
            await first_command(d)
        for _ in range(runs):
            for side, d in running.items():
                t = time.perf_counter()
                await d.runtime.run_in_session(BashAction(command="true", check="raise"))
                out["run"][side].append(time.perf_counter() - t)
    finally:
        for d in running.values():  # stop() of either is a no-op on one never started
            await d.stop()
    return out


TASK_TOML = """\
schema_version = "1.4"

[task]
name = "dsec-bench/{task}"

[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 60.0

[environment]
cpus = 1
memory_mb = 256
docker_image = "{image}"
"""
SOLVE = "#!/bin/sh\nmkdir -p /app && echo 42 > /app/answer.txt\n"
CHECK = """\
#!/bin/sh
if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1; else echo 0; fi \\
    > /logs/verifier/reward.txt
"""


def write_task(tasks: Path, image: str) -> None:
    d = tasks / TASK
    for sub in ("environment", "solution", "tests"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text(TASK_TOML.format(task=TASK, image=image))
    (d / "instruction.md").write_text("Write 42 into /app/answer.txt.\n")
    for path, text in (("solution/solve.sh", SOLVE), ("tests/test.sh", CHECK)):
        (d / path).write_text(text)
        (d / path).chmod(0o755)


def harbor_run(
    root: Path, env_args: list[str], job: str, env: dict[str, str]
) -> tuple[float, float, float]:
    """(wall seconds of ``harbor run``, the trial's own seconds, its environment setup's) of
    one run of the task; the trial must have scored 1."""
    t = time.perf_counter()
    out = subprocess.run(
        [str(HARBOR), "run", "-p", str(root / "tasks"), *env_args, "-a", "oracle",
         "-o", str(root / "jobs"), "--job-name", job, "-n", "1", "-y", "-q"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    wall = time.perf_counter() - t
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (result,) = (root / "jobs" / job).glob("*/result.json")
    trial = json.loads(result.read_text())
    assert trial["exception_info"] is None, trial["exception_info"]
    assert trial["verifier_result"]["rewards"]["reward"] == 1, trial["verifier_result"]
    return wall, seconds(trial), seconds(trial["environment_setup"])


def seconds(timing: dict[str, str]) -> float:
    """The length of one of Harbor's timed spans (its started_at / finished_at)."""
    started, finished = (datetime.fromisoformat(timing[k]) for k in ("started_at", "finished_at"))
    return (finished - started).total_seconds()


def compose_missing() -> str | None:
    """Why Harbor's docker environment cannot run here, or None."""
    r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    return None if r.returncode == 0 else "not run: docker compose v2 missing"


def harbor_bench(c: LocalCluster, trials: int) -> dict[str, list[tuple[float, float, float]] | str]:
    """{environment: [harbor_run's seconds per run] or why it did not run}."""
    assert HARBOR.exists(), f"no {HARBOR}: scripts/setup.sh makes .venv-harbor"
    image = f"dsec-bench/harbor-{os.getpid()}:latest"
    subprocess.run(["docker", "tag", HARBOR_BASE, image], check=True, capture_output=True)
    env = {**os.environ, "DSEC_TARGET": c.apiserver, "DSEC_TOKEN": c.token, "HARBOR_TELEMETRY": "0"}
    sides: dict[str, list[str] | str] = {
        "dsec": ["--env", "libdsec.harness.harbor:DSecEnvironment"],
        "docker": compose_missing() or ["--env", "docker"],
    }
    out: dict[str, list[tuple[float, float, float]] | str] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="dsec-bench-harbor-") as tmp:
            root = Path(tmp)
            write_task(root / "tasks", image)
            for side, args in sides.items():
                if isinstance(args, str):
                    out[side] = args
                    continue
                harbor_run(root, args, f"{side}-warmup", env)
                out[side] = [harbor_run(root, args, f"{side}-{i}", env) for i in range(trials)]
    finally:
        with Client(c.apiserver, token=c.token) as admin:
            admin.stop_all(labels={"harbor.task": TASK})  # DSecEnvironment's label
            for e in admin.list_environments("docker/"):
                if e.name.startswith(f"docker/{image.removesuffix(':latest')}:"):
                    admin.delete_environment(e.name)
        subprocess.run(["docker", "rmi", image], capture_output=True)
    return out


def ms(values: list[float]) -> tuple[float, float]:
    return pct([v * 1000 for v in values], 50), pct([v * 1000 for v in values], 99)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=10)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    assert docker_available(), "the Docker baselines need a reachable Docker engine"
    build_swerex_image()
    edge = EdgeSpec(
        edge_id="bench",
        runtime="container",
        extra_env={
            "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
            "DSEC_EDGE_FNCALL_POOLS": "",
            "DSEC_EDGE_CGROUP_PARENT": f"dsec-bench-harness-{os.getpid()}",
        },
    )
    with cluster(edges=[edge]) as c:
        rex = asyncio.run(swerex_bench(c, args.starts, args.runs))
        harbor = harbor_bench(c, args.trials)

    rows = []
    for what, key in (("start -> first command", "start"), ("run_in_session", "run")):
        (k50, k99), (d50, d99) = ms(rex[key]["docker"]), ms(rex[key]["dsec"])
        rows.append([what, d50, d99, k50, k99, f"{d50 / k50:.2f}x", f"{d99 / k99:.2f}x"])
    table(
        f"SWE-ReX {SWEREX_VERSION}: DsecDeployment vs DockerDeployment "
        f"({args.starts} starts, {args.runs} session calls; dsec/docker)",
        ["", "dsec p50 ms", "dsec p99 ms", "docker p50 ms", "docker p99 ms", "p50", "p99"],
        rows,
    )
    hrows: list[list[object]] = []
    for side, res in harbor.items():
        if isinstance(res, str):
            hrows.append([side, res, "", "", ""])
            continue
        walls, inner, setup = ([r[i] for r in res] for i in range(3))
        hrows.append([side, pct(walls, 50), min(walls), pct(inner, 50), pct(setup, 50)])
    table(
        f"Harbor: one task, oracle agent, `harbor run` ({args.trials} runs after a warm-up)",
        ["environment", "wall p50 s", "wall min s", "trial p50 s", "env setup p50 s"],
        hrows,
    )


if __name__ == "__main__":
    main()

"""Harbor on dsec: the real ``harbor`` (0.26.0, from ``.venv-harbor``: it needs Python >= 3.12)
runs Terminal-Bench-style tasks this module writes with its own runner, ``harbor run --env
libdsec.harness.harbor:DSecEnvironment``, and its oracle agent (the task's solution script as
the agent), against the session's container cluster.

One job of five tasks, shared by the tests (one ``harbor run``, trials concurrent):

- ``solved``: a Docker image of the node's engine (a tag of its own, so its first use imports
  it), a solution that is right -> reward 1;
- ``wrong``: the same image, a wrong solution -> reward 0;
- ``built``: an ``environment/Dockerfile`` instead of an image -> built, imported, reward 1;
- ``slow``: a solution that outlives the agent timeout -> the verifier finds it killed;
- ``badimage``: an image no engine has -> Harbor's SandboxBuildFailedError with dsec's reason.

Then the environment class driven directly from the venv's Python (an exec timeout kills the
command; a host mount is refused), and a job without a dsec token (refused before any trial).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsecctl.cluster import LocalCluster
from libdsec import Client

pytestmark = pytest.mark.images("busybox")

ROOT = Path(__file__).resolve().parents[2]
HARBOR = ROOT / ".venv-harbor" / "bin" / "harbor"
HARBOR_VERSION = "0.26.0"
ENVIRONMENT = "libdsec.harness.harbor:DSecEnvironment"
#: The engine's image the image tasks use (set up by scripts/build-base-images.sh).
ENGINE_IMAGE = "dsec/busybox:latest"

CHECK_ANSWER = """\
#!/bin/sh
if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1; else echo 0; fi \\
    > /logs/verifier/reward.txt
"""
# The verifier of `slow`: reward 1 once no `sleep 1000` of the timed-out agent is left in the
# sandbox (it waits up to 10 s for the kill), 0 if it is still there or never started.
CHECK_KILLED = """\
#!/bin/sh
reward=0
if [ -e /app/started ]; then
    for i in 1 2 3 4 5 6 7 8 9 10; do
        if ! ps | grep -q "[s]leep 1000"; then reward=1; break; fi
        sleep 1
    done
fi
echo $reward > /logs/verifier/reward.txt
"""


# The environment class driven directly, as Harbor's trial drives it: commands start in the
# task's workdir (made at start), whichever the user; output reaches Harbor's
# stream callbacks as well as the result and is not cut at dsec's default cap (1 MiB); a
# directory round-trips; an exec timeout kills the command in the sandbox (Harbor's runner
# races it with its own agent timeout, which the `slow` task covers), and so does a cancelled
# exec (Harbor's asyncio timeouts); a host mount (`--mounts`), which dsec cannot bind, is
# refused at construction.
DIRECT = """\
import asyncio, json, sys
from pathlib import Path

from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from libdsec.harness.harbor import DSecEnvironment


async def main() -> None:
    tmp = Path(sys.argv[3])
    (tmp / "environment").mkdir()
    args = dict(
        environment_dir=tmp / "environment",
        environment_name=sys.argv[2],
        session_id=sys.argv[2],
        trial_paths=TrialPaths(tmp / "trial"),
        task_env_config=EnvironmentConfig(
            docker_image=sys.argv[1], network_mode="no-network", workdir="/srv/task"
        ),
    )
    try:
        DSecEnvironment(**args, mounts=[{"type": "bind", "source": "/tmp", "target": "/mnt"}])
        refused = None
    except ValueError as exc:
        refused = str(exc)
    env = DSecEnvironment(**args)
    await env.start(force_build=False)
    streamed = []

    async def collect(text, stream):
        streamed.append([stream, text])

    try:
        with env.scoped_output_callback(collect):
            echoed = await env.exec("echo out; pwd; echo err >&2; exit 3")
        big = await env.exec("head -c 3000000 /dev/zero | tr '\\\\0' a")
        src, back = tmp / "src", tmp / "back"  # a directory round trip
        (src / "bin").mkdir(parents=True)
        src.chmod(0o700)  # the source directory's own mode is not the target's
        (src / "data.bin").write_bytes(bytes(range(256)) * 1000)
        (src / "bin" / "run.sh").write_text("#!/bin/sh\\necho ran\\n")
        (src / "bin" / "run.sh").chmod(0o755)
        await env.upload_dir(src, "/srv/up")
        ran = await env.exec("/srv/up/bin/run.sh; stat -c %a /srv/up; pwd", user="nobody")
        await env.download_dir("/srv/up", back)
        round_trip = [
            (back / "data.bin").read_bytes() == (src / "data.bin").read_bytes(),
            oct((back / "bin" / "run.sh").stat().st_mode & 0o777),
            ran.stdout,
        ]
        try:
            await env.exec("sleep 1000", timeout_sec=2)
            error = None
        except RuntimeError as exc:
            error = str(exc)
        ps = await env.exec("ps", user="root")
        try:  # Harbor's own timeouts cancel the exec: the command dies with the stream
            await asyncio.wait_for(env.exec("sleep 999"), 2)
        except TimeoutError:
            pass
        for _ in range(50):  # the kill follows the cancel; wait up to 5 s for it
            after_cancel = await env.exec("ps")
            if "sleep 999" not in after_cancel.stdout:
                break
            await asyncio.sleep(0.1)
    finally:
        await env.stop(delete=True)
    print(json.dumps({
        "error": error, "ps": ps.stdout, "refused": refused, "streamed": streamed,
        "after_cancel": after_cancel.stdout, "round_trip": round_trip, "big": len(big.stdout), "big_a": set(big.stdout) == {"a"},
        "echoed": [echoed.stdout, echoed.stderr, echoed.return_code],
    }))


asyncio.run(main())
"""


@dataclass(frozen=True)
class Task:
    solution: str
    test: str
    image: str | None = None
    dockerfile: str | None = None
    agent_timeout_s: float = 120.0


def write_task(root: Path, name: str, task: Task) -> None:
    """A Harbor task directory: task.toml, instruction, environment, solution, tests."""
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "tests").mkdir()
    image = f'docker_image = "{task.image}"\n' if task.image else ""
    (d / "task.toml").write_text(
        textwrap.dedent(
            f"""\
            schema_version = "1.4"

            [task]
            name = "dsec-test/{name}"

            [agent]
            timeout_sec = {task.agent_timeout_s}

            [verifier]
            timeout_sec = 60.0
            environment_mode = "shared"

            [environment]
            network_mode = "no-network"
            cpus = 0.5
            memory_mb = 256
            """
        )
        + image
    )
    (d / "instruction.md").write_text("Write 42 into /app/answer.txt.\n")
    if task.dockerfile:
        (d / "environment" / "Dockerfile").write_text(task.dockerfile)
    for path, text in (("solution/solve.sh", task.solution), ("tests/test.sh", task.test)):
        (d / path).write_text(text)
        (d / path).chmod(0o755)


@dataclass(frozen=True)
class Job:
    trials: dict[str, dict[str, Any]]  # task name -> its trial's result.json
    image: str  # the engine image the image tasks name
    names: dict[str, str]  # short name -> the run's task name
    exec_name: str  # the environment name of the exec test's sandbox
    env: dict[str, str]  # the harbor process's environment (where dsec is)
    edge_logs: str


def _cleanup(client: Client, task_names: list[str], image: str) -> None:
    """Stops what a failed run left behind, forgets the environments and Docker images the run
    made (its engine tag, the built task's image)."""
    for name in task_names:
        client.stop_all(labels={"harbor.task": name})
    made = [image.removesuffix(":latest")] + [f"harbor-dsec/{name}" for name in task_names]
    for env in client.list_environments("docker/"):
        if any(env.name.startswith(f"docker/{repo}:") for repo in made):
            client.delete_environment(env.name)
    for repo in made:
        refs = subprocess.run(
            ["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
        if refs:
            subprocess.run(["docker", "rmi", *refs], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def job(container_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    assert HARBOR.exists(), (
        f"no {HARBOR}: scripts/setup.sh makes .venv-harbor (harbor {HARBOR_VERSION}) where a "
        "Python >= 3.12 exists"
    )
    run = f"{os.getpid()}-{time.time_ns() % 10**6}"
    image = f"dsec-test/harbor-{run}:latest"
    slow = "#!/bin/sh\nmkdir -p /app && touch /app/started\nsleep 1000\n"
    tasks = {
        "solved": Task(
            "#!/bin/sh\nmkdir -p /app && echo 42 > /app/answer.txt\n", CHECK_ANSWER, image
        ),
        "wrong": Task(
            "#!/bin/sh\nmkdir -p /app && echo 41 > /app/answer.txt\n", CHECK_ANSWER, image
        ),
        "built": Task(
            "#!/bin/sh\ncp /app/seed /app/answer.txt\n",
            CHECK_ANSWER,
            dockerfile=f"FROM {ENGINE_IMAGE}\nRUN mkdir -p /app && echo 42 > /app/seed\n",
        ),
        # 8 s: the oracle's upload and chmod come first, and must fit on a loaded machine
        "slow": Task(slow, CHECK_KILLED, image, agent_timeout_s=8.0),
        "badimage": Task("#!/bin/sh\ntrue\n", CHECK_ANSWER, f"dsec-test/absent-{run}:never"),
    }
    names = {short: f"{short}-{run}" for short in tasks}
    root = tmp_path_factory.mktemp("harbor")
    for short, task in tasks.items():
        write_task(root / "tasks", names[short], task)
    env = {
        **os.environ,
        "DSEC_TARGET": container_cluster.apiserver,
        "DSEC_TOKEN": container_cluster.token,
        "HARBOR_TELEMETRY": "0",
    }
    try:
        r = subprocess.run(["docker", "tag", ENGINE_IMAGE, image], capture_output=True, text=True)
        assert r.returncode == 0, (
            f"docker tag {ENGINE_IMAGE} (scripts/setup.sh makes it): {r.stderr}"
        )
        out = subprocess.run(
            [
                str(HARBOR), "run", "-p", str(root / "tasks"), "--env", ENVIRONMENT,
                "-a", "oracle", "-o", str(root / "jobs"), "--job-name", "job",
                "-n", str(len(tasks)), "-y", "-q",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        trials = {}
        for result in (root / "jobs" / "job").glob("*/result.json"):
            data = json.loads(result.read_text())
            trials[data["task_name"].removeprefix("dsec-test/")] = data
        assert sorted(trials) == sorted(names.values()), out.stdout[-3000:]
        edge_logs = "".join(p.read_text() for p in (container_cluster.home / "logs").glob("*.log"))
        yield Job(trials, image, names, f"exec-{run}", env, edge_logs)
    finally:
        with Client(container_cluster.apiserver, token=container_cluster.token) as client:
            _cleanup(client, [*names.values(), f"exec-{run}"], image)


def reward(trial: dict[str, Any]) -> float | None:
    verifier = trial.get("verifier_result") or {}
    return (verifier.get("rewards") or {}).get("reward")


def test_a_solved_task_scores_1_and_its_image_is_imported_once_then_cached(job: Job) -> None:
    trial = job.trials[job.names["solved"]]
    assert trial["exception_info"] is None, trial["exception_info"]["exception_traceback"]
    assert reward(trial) == 1
    # three trials used the engine image; dsec imported it into its layer store once
    imports = [
        line for line in job.edge_logs.splitlines() if f"imported docker:{job.image} " in line
    ]
    assert len(imports) == 1, imports


def test_a_wrong_solution_scores_0(job: Job) -> None:
    trial = job.trials[job.names["wrong"]]
    assert trial["exception_info"] is None, trial["exception_info"]["exception_traceback"]
    assert reward(trial) == 0


def test_a_task_dockerfile_is_built_and_imported(job: Job) -> None:
    trial = job.trials[job.names["built"]]
    assert trial["exception_info"] is None, trial["exception_info"]["exception_traceback"]
    assert reward(trial) == 1
    assert f"imported docker:harbor-dsec/{job.names['built']}:" in job.edge_logs


def test_an_agent_timeout_kills_the_command_in_the_sandbox(job: Job) -> None:
    trial = job.trials[job.names["slow"]]
    info = trial["exception_info"]
    assert info is not None and "timed out" in info["exception_message"], info
    assert reward(trial) == 1  # the verifier saw the solution start and found it gone


def test_an_image_that_cannot_be_imported_is_harbors_build_error_with_dsecs_reason(
    job: Job,
) -> None:
    trial = job.trials[job.names["badimage"]]
    info = trial["exception_info"]
    assert info is not None
    assert info["exception_type"] == "SandboxBuildFailedError", info
    assert "IMAGE_NOT_FOUND" in info["exception_message"], info
    assert "dsec-test/absent-" in info["exception_message"], info
    assert reward(trial) is None  # never graded


def test_every_trials_sandbox_is_stopped_by_harbors_stop(job: Job, client: Client) -> None:
    for short, name in job.names.items():
        made = client.list(labels={"harbor.task": name})
        assert len(made) == (0 if short == "badimage" else 1), made
        assert all(sb.state == "TERMINATED" for sb in made), made


def test_exec_streams_output_timeouts_and_cancels_kill_the_command_mounts_are_refused(
    job: Job, tmp_path: Path
) -> None:
    python = HARBOR.with_name("python")
    r = subprocess.run(
        [str(python), "-c", DIRECT, job.image, job.exec_name, str(tmp_path)],
        env=job.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["error"].startswith("Command timed out after 2 seconds (killed in dsec sandbox")
    assert "sleep 1000" not in out["ps"] and "PID" in out["ps"], out["ps"]
    assert "sleep 999" not in out["after_cancel"], out["after_cancel"]
    assert out["refused"].startswith("the dsec environment cannot bind host directories")
    assert out["echoed"] == ["out\n/srv/task\n", "err\n", 3]  # in the task's workdir
    assert out["big"] == 3_000_000 and out["big_a"]  # 3 MB of output, none of it cut
    # a directory goes in and comes back (bytes, exec bits); the target keeps its own mode, so
    # another user can use it (and that user's commands start in the workdir too)
    assert out["round_trip"] == [True, "0o755", "ran\n755\n/srv/task\n"], out["round_trip"]
    assert "".join(text for stream, text in out["streamed"] if stream == "stdout") == (
        "out\n/srv/task\n"
    )
    assert [text for stream, text in out["streamed"] if stream == "stderr"] == ["err\n"]


def test_without_a_dsec_token_the_job_fails_before_any_trial(tmp_path: Path) -> None:
    assert HARBOR.exists(), f"no {HARBOR}: run scripts/setup.sh"
    (tmp_path / "tasks").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("DSEC_TARGET", "DSEC_TOKEN")}
    r = subprocess.run(
        [str(HARBOR), "run", "-p", str(tmp_path / "tasks"), "--env", ENVIRONMENT, "-a", "oracle",
         "-o", str(tmp_path / "jobs"), "-y", "-q"],
        env={**env, "DSEC_HOME": str(tmp_path / "home"), "HARBOR_TELEMETRY": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode != 0
    assert "dsec environment: NO_TOKEN" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "jobs").exists()  # no trial was started

"""SWE-ReX and mini-swe-agent on dsec, driven through the real pinned packages.

``libdsec.harness.swerex`` (a SWE-ReX deployment and runtime, no server in the sandbox) and
``libdsec.harness.mini_swe_agent`` (mini-swe-agent's environment on top of it) against a real
container sandbox of the shared cluster: session state across calls, a timeout that kills the
command and leaves the session usable, an interrupt, files (text, binary, a few MB, a tree),
SWE-ReX's own error types for bad input, and a mini-swe-agent loop with scripted model answers
(its DeterministicModel, no LLM) that fixes a bug in a repository inside the sandbox.

One sandbox serves the SWE-ReX tests (a module-scoped deployment on one event loop of its own:
the gRPC channel is bound to the loop that made it); the agent run has its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.models.test_models import DeterministicModel, make_output
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

from dsecctl.cluster import LocalCluster, free_port
from libdsec import Client
from libdsec.harness.mini_swe_agent import DsecEnvironment
from libdsec.harness.swerex import DsecDeployment
from tests.integration.conftest import ClusterWith

pytestmark = pytest.mark.images("bookworm")

T = TypeVar("T")

#: Counts the sandbox's processes whose command line is exactly ``sleep 77`` (no pgrep in
#: bookworm): what a timed-out or interrupted ``sleep 77`` must not leave behind.
COUNT_SLEEPS = (
    "n=0; for f in /proc/[0-9]*/cmdline; do"
    ' [ "$(tr "\\0" " " < "$f" 2>/dev/null)" = "sleep 77 " ] && n=$((n+1)); done; echo $n'
)


class Rex:
    """A SWE-ReX runtime and the one event loop every call to it runs on."""

    #: a RemoteRuntime's base URL and key
    url = ""
    token = ""

    def __init__(self, runtime: Callable[[], Coroutine[Any, Any, AbstractRuntime]]) -> None:
        self.loop = asyncio.Runner()
        self.runtime: AbstractRuntime = self.run(runtime())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run(coro)

    def bash(self, command: str, session: str = "default", **kw: Any) -> Any:
        return self.run(
            self.runtime.run_in_session(BashAction(command=command, session=session, **kw))
        )


@pytest.fixture(scope="module")
def deployment(container_cluster: LocalCluster) -> DsecDeployment:
    return DsecDeployment(
        target=container_cluster.apiserver,
        token=container_cluster.token,
        image="bookworm",
        cpu=1,
        memory_mb=512,
        labels={"test": __name__},
    )


@pytest.fixture(scope="module")
def rex(deployment: DsecDeployment) -> Iterator[Rex]:
    """The deployment, started, with a session "default"."""

    async def started() -> AbstractRuntime:
        await deployment.start()
        return deployment.runtime

    r = Rex(started)
    try:
        r.run(r.runtime.create_session(CreateBashSessionRequest(session="default")))
        yield r
    finally:
        try:
            r.run(deployment.stop())
        finally:
            r.loop.close()


def test_session_keeps_cwd_env_and_background_process(rex: Rex) -> None:
    assert rex.run(rex.runtime.is_alive()).is_alive
    first = rex.bash("cd /tmp\nexport REX_VAR=kept\nsleep 1000 &\necho $! > /tmp/bg.pid")
    assert first.exit_code == 0
    obs = rex.bash(
        'pwd; echo "$REX_VAR"; kill -0 "$(cat /tmp/bg.pid)" && echo bg-alive; echo to-stderr >&2'
    )
    assert obs.output.split() == ["/tmp", "kept", "bg-alive", "to-stderr"]
    assert obs.exit_code == 0
    # check: "silent" returns the exit code, "raise" raises swe-rex's error, "ignore" drops it
    assert rex.bash("(exit 3)", check="silent").exit_code == 3
    assert rex.bash("(exit 3)", check="ignore").exit_code is None
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        rex.bash("(exit 3)")
    # a multi-line command with a heredoc and a trailing comment runs as written
    obs = rex.bash("cat <<'EOF'\nline $HOME\nEOF\n# done")
    assert obs.output == "line $HOME\n"


def test_timeout_kills_the_command_and_the_session_stays_usable(rex: Rex) -> None:
    rex.bash("cd /tmp")
    # the probe sees a live `sleep 77` (so its 0s below mean something)
    assert rex.bash(f"sleep 77 &\n{COUNT_SLEEPS}; kill $!").output.strip() == "1"
    t0 = time.monotonic()
    with pytest.raises(CommandTimeoutError, match=r"timeout after 1\.0 seconds"):
        rex.bash("sleep 77; touch /tmp/not-reached", timeout=1.0)
    assert time.monotonic() - t0 < 10
    obs = rex.bash(f"pwd; {COUNT_SLEEPS}; ls /tmp/not-reached 2>/dev/null || echo absent")
    assert obs.output.split() == ["/tmp", "0", "absent"]
    # execute (a one-off command) is killed at its timeout too
    with pytest.raises(CommandTimeoutError):
        rex.run(rex.runtime.execute(Command(command="sleep 77", shell=True, timeout=1.0)))
    assert rex.bash(COUNT_SLEEPS).output.strip() == "0"


def test_interrupt_stops_the_running_command(rex: Rex) -> None:
    async def interrupted() -> tuple[Any, float]:
        t0 = time.monotonic()
        running = asyncio.create_task(
            rex.runtime.run_in_session(BashAction(command="sleep 77", check="silent"))
        )
        await asyncio.sleep(1.0)
        await rex.runtime.run_in_session(BashInterruptAction())
        return await running, time.monotonic() - t0

    obs, elapsed = rex.run(interrupted())
    assert obs.exit_code != 0  # the sleep died of the SIGINT
    assert elapsed < 10
    assert rex.bash(f"echo usable; {COUNT_SLEEPS}").output.split() == ["usable", "0"]
    # with nothing running an interrupt is a no-op, as Ctrl-C at a prompt
    assert rex.run(rex.runtime.run_in_session(BashInterruptAction())).exit_code == 0


def test_files_round_trip(rex: Rex, tmp_path: Path) -> None:
    rt = rex.runtime
    text = "héllo\nwörld ✓\n"
    rex.run(rt.write_file(WriteFileRequest(path="/work/new/dir/a.txt", content=text)))
    assert rex.run(rt.read_file(ReadFileRequest(path="/work/new/dir/a.txt"))).content == text
    # a binary file of a few MB, uploaded and checked inside the sandbox
    blob = os.urandom(3 * 1024 * 1024 + 17)
    (tmp_path / "blob.bin").write_bytes(blob)
    rex.run(
        rt.upload(
            UploadRequest(source_path=str(tmp_path / "blob.bin"), target_path="/work/blob.bin")
        )
    )
    out = rex.run(rt.execute(Command(command=["sha256sum", "/work/blob.bin"], check=True)))
    assert out.stdout.split()[0] == hashlib.sha256(blob).hexdigest()
    # a directory tree
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "top.txt").write_text("top")
    (tmp_path / "tree" / "sub" / "deep.bin").write_bytes(b"\x00\xff" * 10)
    rex.run(rt.upload(UploadRequest(source_path=str(tmp_path / "tree"), target_path="/work/tree")))
    listing = rex.run(
        rt.execute(
            Command(
                command="cd /work/tree && find . -type f | sort && od -An -tx1 sub/deep.bin | head -1",
                shell=True,
            )
        )
    )
    assert listing.stdout.split()[:4] == ["./sub/deep.bin", "./top.txt", "00", "ff"]
    # read_file decodes as asked; a missing file is FileNotFoundError with dsec's reason
    assert (
        rex.run(
            rt.read_file(ReadFileRequest(path="/work/blob.bin", encoding="latin-1"))
        ).content.encode("latin-1")
        == blob
    )
    with pytest.raises(FileNotFoundError, match="PATH_NOT_FOUND"):
        rex.run(rt.read_file(ReadFileRequest(path="/work/missing.txt")))


def test_bad_input_gets_swerex_errors(rex: Rex, deployment: DsecDeployment) -> None:
    rt = rex.runtime
    with pytest.raises(SessionDoesNotExistError, match="'nope'"):
        rex.bash("echo hi", session="nope")
    with pytest.raises(SessionDoesNotExistError):
        rex.run(rt.close_session(CloseBashSessionRequest(session="nope")))
    with pytest.raises(SessionExistsError):
        rex.run(rt.create_session(CreateBashSessionRequest(session="default")))
    # a session gone on dsec's side (closed behind swe-rex's back): dsec's reason in the message
    rex.run(rt.create_session(CreateBashSessionRequest(session="gone")))
    rex.run(deployment.runtime.session("gone").close())
    with pytest.raises(SessionDoesNotExistError, match="SESSION_NOT_FOUND"):
        rex.bash("echo hi", session="gone")
    with pytest.raises(SessionDoesNotExistError, match="SESSION_NOT_FOUND"):
        rex.run(rt.close_session(CloseBashSessionRequest(session="gone")))
    rex.run(rt.create_session(CreateBashSessionRequest(session="gone")))  # the name is free again
    assert rex.bash("echo back", session="gone").output == "back\n"
    with pytest.raises(BashIncorrectSyntaxError):
        rex.bash("if then fi (")
    with pytest.raises(NotImplementedError, match="interactive"):
        rex.bash("python3", is_interactive_command=True)
    with pytest.raises(NotImplementedError, match="expect"):
        rex.bash("echo hi", expect=["hi"])


def test_startup_error_names_dsecs_reason(container_cluster: LocalCluster) -> None:
    deployment = DsecDeployment(
        target=container_cluster.apiserver, token=container_cluster.token, image="no-such-image"
    )
    with pytest.raises(DeploymentStartupError, match="NOT_FOUND"):
        asyncio.run(deployment.start())


REPO = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "test_calc.py": "from calc import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint('tests pass')\n",
}


def test_mini_swe_agent_fixes_a_bug_in_the_sandbox(
    container_cluster: LocalCluster, client: Client
) -> None:
    env = DsecEnvironment(
        target=container_cluster.apiserver,
        token=container_cluster.token,
        image="bookworm",
        cwd="/work/repo",
        timeout=60,
        # no stale .pyc: the fix keeps calc.py's size and lands within the same second
        env={"PYTHONDONTWRITEBYTECODE": "1"},
    )
    try:
        sandbox = client.get(env.deployment.sandbox.id)
        for name, content in REPO.items():
            sandbox.files.write(f"/work/repo/{name}", content)
        model = DeterministicModel(
            outputs=[
                make_output("Run the tests.", [{"command": "python3 test_calc.py"}]),
                make_output(
                    "add subtracts: fix it and rerun.",
                    [{"command": "sed -i 's/a - b/a + b/' calc.py && python3 test_calc.py"}],
                ),
                make_output("Done.", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]),
            ]
        )
        agent_config = get_config_from_spec("default.yaml")["agent"]  # mini's own prompts
        agent = DefaultAgent(model, env, **agent_config)
        result = agent.run("add() in calc.py is wrong; make test_calc.py pass")
        assert result["exit_status"] == "Submitted"
        observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
        assert "<returncode>1</returncode>" in observations[0]
        assert "AssertionError" in observations[0]
        assert "<returncode>0</returncode>" in observations[1]
        assert "tests pass" in observations[1]
        # the fix is in the sandbox, seen through dsec's own API
        assert sandbox.files.read("/work/repo/calc.py") == b"def add(a, b):\n    return a + b\n"
        assert sandbox.run("cd /work/repo && python3 test_calc.py").ok
    finally:
        env.cleanup()
    assert sandbox.refresh().state not in ("RUNNING", "PAUSED")


def test_mini_cli_runs_on_dsec_with_the_environment_class(
    container_cluster: LocalCluster, client: Client, tmp_path: Path
) -> None:
    """The `mini` command itself, its environment named by import path (the one-line change),
    a scripted model from its config: the repository made, the bug fixed, the run submitted."""
    label = {"test": "mini-cli"}
    make_repo = "".join(f"cat > {name} <<'EOF'\n{content}EOF\n" for name, content in REPO.items())
    answers = [
        make_repo + "python3 test_calc.py",
        "sed -i 's/a - b/a + b/' calc.py && python3 test_calc.py",
        "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
    ]
    config = {
        "model": {
            "outputs": [
                {"role": "assistant", "content": "", "extra": {"actions": [{"command": a}]}}
                for a in answers
            ]
        },
        "environment": {
            "target": container_cluster.apiserver,
            "token": container_cluster.token,
            "image": "bookworm",
            "cwd": "/work/repo",
            "labels": label,
            "env": {"PYTHONDONTWRITEBYTECODE": "1"},
        },
    }
    (tmp_path / "dsec.yaml").write_text(json.dumps(config))  # JSON is YAML
    traj = tmp_path / "traj.json"
    root = Path(__file__).resolve().parents[2]
    try:
        r = subprocess.run(
            [
                str(Path(sys.executable).parent / "mini"),
                "--environment-class",
                "libdsec.harness.mini_swe_agent.DsecEnvironment",
                "--model-class",
                "deterministic",
                "-m",
                "scripted",
                "-c",
                "mini.yaml",
                "-c",
                str(tmp_path / "dsec.yaml"),
                "-y",
                "--exit-immediately",
                "-t",
                "add() in calc.py is wrong; make test_calc.py pass",
                "-o",
                str(traj),
            ],
            env={
                **os.environ,
                "PYTHONPATH": str(root),
                "MSWEA_CONFIGURED": "1",
                "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mswea"),
            },
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        saved = json.loads(traj.read_text())
        assert saved["info"]["exit_status"] == "Submitted"
        outputs = [m["content"] for m in saved["messages"] if m["role"] == "user"][1:]
        assert "AssertionError" in outputs[0]
        assert "tests pass" in outputs[1]
        # mini never calls cleanup(): the environment's finalizer stopped the sandbox at exit
        assert [i.state for i in client.list(labels=label)] == ["TERMINATED"]
    finally:
        client.stop_all(labels=label)


# ------------------------------------------------ SWE-ReX's remote-runtime API (compat)


@pytest.fixture(scope="module")
def remote(cluster_with: ClusterWith) -> Iterator[Rex]:
    """A stock RemoteRuntime on a sandbox of a cluster whose compat serves SWE-ReX's API."""
    port = free_port()
    with (
        cluster_with("srx", extra_env={"DSEC_COMPAT_SWEREX_LISTEN": f"127.0.0.1:{port}"}) as c,
        Client(c.apiserver, token=c.token) as client,
    ):
        sandbox = client.create(image="bookworm", memory_mb=512, labels={"test": __name__})

        async def connected() -> AbstractRuntime:
            url = f"http://127.0.0.1:{port}/sandboxes/{sandbox.id}"
            return RemoteRuntime(host=url, auth_token=c.token, timeout=30)  # stock, unchanged

        r = Rex(connected)
        r.url = f"http://127.0.0.1:{port}/sandboxes/{sandbox.id}"
        r.token = c.token
        try:
            yield r
        finally:
            r.loop.close()
            sandbox.stop(grace_s=0.5)


def test_remote_runtime_reaches_a_dsec_sandbox(remote: Rex, tmp_path: Path) -> None:
    rt = remote.runtime
    assert remote.run(rt.is_alive()).is_alive
    remote.run(rt.create_session(CreateBashSessionRequest()))
    remote.bash("cd /tmp && export REMOTE_VAR=kept")  # one request ...
    assert remote.bash('pwd; echo "$REMOTE_VAR"').output.split() == ["/tmp", "kept"]  # ... the next
    # swe-rex's exception classes travel back (HTTP 511), with dsec's words in the message
    with pytest.raises(CommandTimeoutError, match="dsec killed it"):
        remote.bash("sleep 77", timeout=1.0)
    assert remote.bash(COUNT_SLEEPS).output.strip() == "0"
    with pytest.raises(SessionDoesNotExistError, match="'nope'"):
        remote.bash("true", session="nope")
    with pytest.raises(FileNotFoundError, match="PATH_NOT_FOUND"):
        remote.run(rt.read_file(ReadFileRequest(path="/work/none.txt")))
    # files: text, a binary file, a directory (RemoteRuntime zips it, the front end unpacks it)
    remote.run(rt.write_file(WriteFileRequest(path="/work/r/a.txt", content="ä\n")))
    assert remote.run(rt.read_file(ReadFileRequest(path="/work/r/a.txt"))).content == "ä\n"
    blob = os.urandom(1024 * 1024 + 3)
    (tmp_path / "blob.bin").write_bytes(blob)
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "x.txt").write_text("x")
    remote.run(
        rt.upload(UploadRequest(source_path=str(tmp_path / "blob.bin"), target_path="/work/b.bin"))
    )
    remote.run(
        rt.upload(UploadRequest(source_path=str(tmp_path / "tree"), target_path="/work/tree"))
    )
    sha = remote.run(rt.execute(Command(command=["sha256sum", "/work/b.bin"], check=True)))
    assert sha.stdout.split()[0] == hashlib.sha256(blob).hexdigest()
    assert remote.bash("cat /work/tree/sub/x.txt").output == "x"
    # close ends the sessions (not the sandbox)
    remote.run(rt.close())
    with pytest.raises(SessionDoesNotExistError):
        remote.bash("true")
    assert remote.run(rt.is_alive()).is_alive


def test_remote_runtime_refusals(remote: Rex) -> None:
    bad_token = RemoteRuntime(host=remote.url, auth_token="not-a-token", timeout=30)
    alive = remote.run(bad_token.is_alive())
    assert not alive.is_alive
    assert "Status code 401" in alive.message
    missing = remote.url.rsplit("/", 1)[0] + "/sb-missing"
    alive = remote.run(RemoteRuntime(host=missing, auth_token=remote.token).is_alive())
    assert not alive.is_alive
    assert "Status code 404" in alive.message
    assert "NOT_FOUND" in alive.message

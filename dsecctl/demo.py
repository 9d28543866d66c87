"""The `make up` demo: a short tour of what dsec does, through libdsec.

Every step checks what it shows (a command's exit code and output, a state, a verdict), not
only that no exception came: a step that fails is reported (``==> FAILED <step>: ...``), the
tour goes on where it still can (steps that need what a failed one would have made are
counted as not run), and the demo exits 1 when anything failed, with the failed steps listed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from libdsec import Client, Quota, Sandbox
from libdsec.errors import BackendNotOffered, DSecError, FailedPrecondition


def say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


class StepFailed(Exception):
    """A step ran but did not show what it should."""


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise StepFailed(what)


class Step:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ok = False


class Steps:
    """Runs the tour's steps, counting every failure."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.not_run: list[str] = []
        self.passed = 0

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[Step]:
        s = Step(name)
        try:
            yield s
        except Exception as err:  # every failure counts; the tour goes on where it can
            self.fail(name, err)
        else:
            s.ok = True
            self.passed += 1

    def fail(self, name: str, err: BaseException) -> None:
        self.failed.append(name)
        if isinstance(err, DSecError):
            detail = f"{type(err).__name__} [{err.reason}]: {err.message}"
        elif isinstance(err, StepFailed):
            detail = str(err)
        else:
            detail = f"{type(err).__name__}: {err}"
        print(f"==> FAILED {name}: {detail}", flush=True)

    def skip(self, *names: str) -> None:
        self.not_run.extend(names)

    def report(self) -> int:
        if not self.failed and not self.not_run:
            say(f"demo done: all {self.passed} steps passed")
            return 0
        print(
            f"==> demo FAILED: {len(self.failed)} step(s) failed"
            + (f", {len(self.not_run)} not run" if self.not_run else "")
            + f", {self.passed} passed",
            flush=True,
        )
        for name in self.failed:
            print(f"      failed:  {name}", flush=True)
        for name in self.not_run:
            print(f"      not run: {name}", flush=True)
        return 1


#: How long the first call waits for the API server (the SDK retries while it is down).
CONNECT_TIMEOUT_S = 10.0

SANDBOX_STEPS = (
    "run a command",
    "a command past its timeout",
    "write and read a file",
    "stream output",
    "a shell session keeps state",
    "a background command",
    "pause and resume",
    "list the changed image files",
    "pack the sandbox as an environment",
    "start a sandbox from the packed environment",
    "list by task id",
    "stop the sandbox",
)


def run_demo() -> int:
    steps = Steps()
    try:
        _tour(steps)
    except Exception as err:  # outside a step (e.g. a client that fails to close): counts too
        steps.fail("the demo itself", err)
    return steps.report()


def _tour(steps: Steps) -> None:
    with contextlib.ExitStack() as stack:
        with steps.step("connect") as s:
            dsec = stack.enter_context(Client())
            # a cluster that is up answers at once; one restarting, within seconds
            me = dsec.whoami(timeout=CONNECT_TIMEOUT_S)
            say(
                f"connected to {dsec.target} as {me.name} ({me.role.lower()}) in project {me.project_id}"
            )
        if not s.ok:
            steps.skip("create a subproject", "issue an agent token", "the agent's tour")
            return
        with steps.step("create a subproject") as s:
            name = f"demo-{int(time.time())}"
            project = dsec.create_project(
                name, quota=Quota(cpu_millis=4000, memory_mb=4096, sandboxes=8)
            )
            say(
                f"created subproject {project.project_id} with quota 4 cores / 4096 MB / 8 sandboxes"
            )
        if not s.ok:
            steps.skip("issue an agent token", "the agent's tour")
            return
        with steps.step("issue an agent token") as s:
            token = dsec.create_token("demo-agent", project=project.project_id, agent=True)
            say(
                f"issued an agent token {token.info.token_id} for it (secret shown once, stored hashed)"
            )
        if s.ok:
            with Client(token=token.secret) as agent:
                _agent_tour(steps, agent, project.project_id)
        else:
            steps.skip("the agent's tour")
        with steps.step("delete the subproject"):
            _delete_project(dsec, project.project_id)


def _agent_tour(steps: Steps, agent: Client, project_id: str) -> None:
    with steps.step("the agent's identity"):
        seen = agent.whoami().project_id
        expect(seen == project_id, f"the agent token acts in {seen}, not {project_id}")
        say(f"the agent sees itself in {seen}")
    with steps.step("create a container sandbox") as s:
        t0 = time.perf_counter()
        sb = agent.create(
            image="busybox",
            cpu=0.5,
            memory_mb=256,
            ttl_s=600,
            idle_timeout_s=120,
            labels={"demo": "yes"},
            task_id="demo-task",
        )
        took = (time.perf_counter() - t0) * 1000
        say(
            f"created container sandbox {sb.id} on edge {sb.info.edge_id} ({sb.info.state})"
            f" in {took:.0f} ms (a warm sandbox, if the edge had one ready)"
        )
    if s.ok:
        with sb:
            _sandbox_tour(steps, agent, sb)
    else:
        steps.skip(*SANDBOX_STEPS)
    with steps.step("fncall in a warm pool"):
        job = agent.fncall(language="python", code="import numpy; print(numpy.arange(10).sum())")
        expect(
            job.verdict == "OK" and job.text == "45\n",
            f"verdict {job.verdict}, stdout {job.text!r} (expected OK, '45')",
        )
        say(
            f"fncall in a warm pool: verdict {job.verdict}, stdout {job.text.strip()!r}, "
            f"{job.wall_time_s * 1000:.1f} ms"
        )


def _sandbox_tour(steps: Steps, agent: Client, sb: Sandbox) -> None:
    with steps.step("run a command"):
        r = sb.run("echo hello from $(hostname); uname -sr")
        expect(r.exit_code == 0 and "hello from" in r.text, f"exit {r.exit_code}: {r.text!r}")
        say(f"run -> exit {r.exit_code}: {r.text.strip()!r} in {r.duration_s * 1000:.1f} ms")
    with steps.step("a command past its timeout"):
        r = sb.run("sleep 5", timeout_s=0.5)
        expect(r.timed_out, f"sleep 5 with a 0.5 s timeout was not timed out (exit {r.exit_code})")
        say(f"a command past its timeout -> timed_out={r.timed_out}, exit {r.exit_code}")
    with steps.step("write and read a file"):
        sb.files.write("/work/answer.txt", "42\n")
        back = sb.files.read("/work/answer.txt")
        expect(back == b"42\n", f"read back {back!r}")
        say(f"wrote /work/answer.txt; read back {back!r}")
    with steps.step("stream output"):
        events = [
            type(ev).__name__ for ev in sb.stream("for i in 1 2 3; do echo $i; sleep 0.1; done")
        ]
        expect(
            events[:1] == ["Started"] and events[-1:] == ["Exited"] and "Output" in events,
            f"events {events}",
        )
        say(f"streamed output events: {events}")
    with steps.step("a shell session keeps state"):
        with sb.session() as shell:
            shell.run("mkdir -p /work/repo && cd /work/repo && export STAGE=eval")
            kept = shell.run("pwd; echo $STAGE").text.split()
        expect(kept == ["/work/repo", "eval"], f"the session shows {kept}")
        say(f"a shell session keeps state: {kept}")
    with steps.step("a background command"):
        proc = sb.start("sleep 0.3; echo background done")
        done = proc.wait(timeout_s=10)
        code = done.exit.exit_code if done.exit else None
        expect(code == 0, f"exit {code}")
        say(f"background command {proc.exec_id} exited {code}")
    with steps.step("pause and resume"):
        sb.pause()
        state = sb.refresh().state
        expect(state == "PAUSED", f"state {state} after pause")
        say(f"paused (frozen): {state}; the next call resumes it transparently")
        kept_text = sb.run("cat /work/answer.txt").text.strip()
        state = sb.refresh().state
        expect(kept_text == "42" and state == "RUNNING", f"{kept_text!r}, state {state}")
        say(f"after resume: {kept_text!r}, state {state}")
    with steps.step("list the changed image files"):
        sb.run("echo 'intruder:x:0:0::/:/bin/sh' >> /etc/passwd; rm -f /bin/vi")
        changed = [f.path for f in sb.modified_files()]
        expect("/etc/passwd" in changed, f"changed files {changed}")
        say(f"files of the read-only image the agent changed: {changed}")
    with steps.step("pack the sandbox as an environment") as packed:
        env = sb.pack_diff(f"demo-env:{int(time.time())}")
        say(f"packed the sandbox's writes as environment {env.name} ({len(env.layers)} layers)")
    if packed.ok:
        with steps.step("start a sandbox from the packed environment"):
            try:
                with agent.create(image=env.name, cpu=0.5, memory_mb=256, ttl_s=300) as child:
                    seen = child.run("cat /work/answer.txt").text.strip()
            finally:  # the demo leaves no environment behind (its packer may delete it)
                agent.delete_environment(env.name)
            expect(seen == "42", f"the new sandbox sees {seen!r}")
            say(f"a new sandbox from it sees /work/answer.txt = {seen!r}")
    else:
        steps.skip("start a sandbox from the packed environment")
    with steps.step("a microVM: its own kernel, paused to disk"):
        _demo_microvm(agent)
    with steps.step("list by task id"):
        listed = [s.id for s in agent.list(task_id="demo-task")]
        expect(sb.id in listed, f"{sb.id} not among {listed}")
        say(f"listed by task id: {listed}")
    with steps.step("stop the sandbox"):
        info = sb.stop()
        expect(
            info.state == "TERMINATED" and info.termination_reason == "STOPPED",
            f"{info.state} ({info.termination_reason})",
        )
        say(f"stopped: {info.state} ({info.termination_reason})")


def _demo_microvm(agent: Client) -> None:
    t0 = time.monotonic()
    try:
        vm = agent.create(backend="microvm", image="busybox", memory_mb=256, ttl_s=300)
    except BackendNotOffered as exc:  # a host whose QEMU boots no guest (see `dsec status`)
        say(f"no edge offers microVMs here: {exc.message}")
        return
    with vm:
        kernel = vm.run("uname -r").text.strip()
        say(f"microVM {vm.id} up in {time.monotonic() - t0:.1f} s, guest kernel {kernel}")
        vm.files.write("/work/kept.txt", "through a pause")
        vm.pause()
        state = vm.refresh().state
        kept = vm.files.read("/work/kept.txt").decode()
        expect(state == "PAUSED" and kept == "through a pause", f"{state}, {kept!r}")
        say(f"paused ({state}: saved to disk, its QEMU ended); a read resumed it: {kept!r}")


def _delete_project(dsec: Client, project_id: str, wait_s: float = 15.0) -> None:
    """Deletes the demo's project once its sandboxes' quota is released (edges report a
    sandbox's end to IAM a moment after it stops)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            dsec.delete_project(project_id)
            say(f"deleted subproject {project_id}")
            return
        except FailedPrecondition as err:
            if err.reason != "PROJECT_NOT_EMPTY" or time.monotonic() > deadline:
                raise
            time.sleep(0.2)

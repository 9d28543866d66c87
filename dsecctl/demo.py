"""The `make up` demo: a short tour of what dsec does, through libdsec."""

from __future__ import annotations

import time

from libdsec import Client, Quota
from libdsec.errors import DSecError, FailedPrecondition


def step(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def run_demo() -> int:
    with Client() as dsec:
        me = dsec.whoami()
        step(
            f"connected to {dsec.target} as {me.name} ({me.role.lower()}) in project {me.project_id}"
        )

        name = f"demo-{int(time.time())}"
        project = dsec.create_project(
            name, quota=Quota(cpu_millis=4000, memory_mb=4096, sandboxes=8)
        )
        step(f"created subproject {project.project_id} with quota 4 cores / 4096 MB / 8 sandboxes")
        token = dsec.create_token("demo-agent", project=project.project_id, agent=True)
        step(
            f"issued an agent token {token.info.token_id} for it (secret shown once, stored hashed)"
        )

    with Client(token=token.secret) as agent:
        step(f"the agent sees itself in {agent.whoami().project_id}")
        t0 = time.perf_counter()
        try:
            sb = agent.create(
                image="busybox",
                cpu=0.5,
                memory_mb=256,
                ttl_s=600,
                idle_timeout_s=120,
                labels={"demo": "yes"},
                task_id="demo-task",
            )
        except FailedPrecondition as err:
            step(f"sandbox creation unavailable here: {err}")
            return 0
        with sb:
            took = (time.perf_counter() - t0) * 1000
            step(
                f"created container sandbox {sb.id} on edge {sb.info.edge_id} ({sb.info.state})"
                f" in {took:.0f} ms (a warm sandbox, if the edge had one ready)"
            )
            try:
                r = sb.run("echo hello from $(hostname); uname -sr")
                step(
                    f"run -> exit {r.exit_code}: {r.text.strip()!r} in {r.duration_s * 1000:.1f} ms"
                )
                r = sb.run("sleep 5", timeout_s=0.5)
                step(f"a command past its timeout -> timed_out={r.timed_out}, exit {r.exit_code}")
                sb.files.write("/work/answer.txt", "42\n")
                step(f"wrote /work/answer.txt; read back {sb.files.read('/work/answer.txt')!r}")
                events = [
                    type(ev).__name__
                    for ev in sb.stream("for i in 1 2 3; do echo $i; sleep 0.1; done")
                ]
                step(f"streamed output events: {events}")
                with sb.session() as shell:
                    shell.run("mkdir -p /work/repo && cd /work/repo && export STAGE=eval")
                    step(
                        f"a shell session keeps state: {shell.run('pwd; echo $STAGE').text.split()}"
                    )
                proc = sb.start("sleep 0.3; echo background done")
                done = proc.wait(timeout_s=10)
                step(
                    f"background command {proc.exec_id} exited {done.exit.exit_code if done.exit else '?'}"
                )
                sb.pause()
                step(
                    f"paused (frozen): {sb.refresh().state}; the next call resumes it transparently"
                )
                kept = sb.run("cat /work/answer.txt").text.strip()
                step(f"after resume: {kept!r}, state {sb.refresh().state}")
                sb.run("echo 'intruder:x:0:0::/:/bin/sh' >> /etc/passwd; rm -f /bin/vi")
                changed = [f.path for f in sb.modified_files()]
                step(f"files of the read-only image the agent changed: {changed}")
                env = sb.pack_diff(f"demo-env:{int(time.time())}")
                step(
                    f"packed the sandbox's writes as environment {env.name} ({len(env.layers)} layers)"
                )
                with agent.create(image=env.name, cpu=0.5, memory_mb=256, ttl_s=300) as child:
                    step(
                        f"a new sandbox from it sees /work/answer.txt = {child.run('cat /work/answer.txt').text.strip()!r}"
                    )
            except FailedPrecondition as err:
                step(f"commands unavailable on this runtime: {err.reason}")
            listed = agent.list(task_id="demo-task")
            step(f"listed by task id: {[s.id for s in listed]}")
        info = agent.get(sb.id).info
        step(f"stopped: {info.state} ({info.termination_reason})")
        try:
            job = agent.fncall(
                language="python", code="import numpy; print(numpy.arange(10).sum())"
            )
            step(
                f"fncall in a warm pool: verdict {job.verdict}, stdout {job.stdout.decode().strip()!r}, "
                f"{job.wall_time_s * 1000:.1f} ms"
            )
        except DSecError as err:
            step(f"fncall unavailable here: {err.reason}")
    try:
        with Client() as dsec:
            dsec.delete_project(project.project_id)
    except DSecError:
        pass  # the stopped sandbox's record still counts; it expires on its own
    step("demo done")
    return 0

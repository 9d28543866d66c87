"""An RL rollout driver that survives a trainer preemption, on dsec's task operations.

N episodes run at once (asyncio, one AsyncClient), each in its own sandbox of one task:
``task_id=<task>``, ``labels={"episode": i}``. Every turn the policy picks an action from the
last observation, the sandbox runs the step, which appends the turn's result to the episode's
log inside the sandbox, and the driver reads the new observation back. The episode's progress
lives in the sandbox (its log), not in the driver, so a driver that dies can pick up where its
episodes were.

Preemption: with ``--preempt-after K``, once an episode has done K turns the trainer "is
preempted" (a SIGTERM does the same): every episode finishes the turn it is in and starts no
other, then one ``pause_task(task)`` freezes every sandbox of the job, on every edge, with its
files and processes, and the process exits.

Resume: run again with ``--resume``. The new process finds the job's sandboxes by task id,
maps their labels back to episodes, ``resume_task(task)`` thaws them all in one call, each
episode reads its progress from its own sandbox and goes on. At the end every episode's log
is checked: each turn there exactly once, in order, each result the one its action gives (no
turn lost, none applied twice); then a summary, and ``stop_task(task)`` ends the sandboxes.

    python examples/rl_rollout.py --task rl-demo --episodes 8 --turns 20 --preempt-after 5
    python examples/rl_rollout.py --task rl-demo --episodes 8 --turns 20 --resume

It connects like every dsec client: ``DSEC_TARGET``/``DSEC_TOKEN``, else the local cluster
of ``dsec up``. ``--report FILE`` writes the outcome as JSON (what the test reads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from dataclasses import dataclass, field

from libdsec import AsyncClient, AsyncSandbox

LOG = "/tmp/episode.log"  # inside each sandbox: one line per turn, "turn T action A state S"
MODULUS = 1_000_003


# --------------------------------------------------------------- the "environment" and policy


def seed(episode: int) -> int:
    """The state an episode starts from (turn 0)."""
    return 1000 * episode + 7


def policy(episode: int, turn: int, observation: int) -> int:
    """Stands in for the model: an action from the last observation."""
    return (observation + episode + turn) % 7


def transition(state: int, action: int) -> int:
    """What the step computes in the sandbox; the driver uses it only to check the logs."""
    return (state * 31 + action) % MODULUS


def step_command(turn: int, action: int) -> str:
    """One turn, run in the sandbox: append its result to the log unless the log has it
    already (a step sent again, by a driver that never saw its answer, must not apply
    twice), and print the result."""
    return (
        f'if ! grep -q "^turn {turn} " {LOG}; then '
        f"s=$(tail -n 1 {LOG} | cut -d' ' -f6); "
        f'echo "turn {turn} action {action} state $(( (s * 31 + {action}) % {MODULUS} ))" >> {LOG}; '
        f"fi; "
        f'grep "^turn {turn} " {LOG}'
    )


def parse(line: str) -> tuple[int, int, int]:
    """(turn, action, state) of a log line."""
    _, turn, _, action, _, state = line.split()
    return int(turn), int(action), int(state)


# ------------------------------------------------------------------------------ episodes


@dataclass
class Episode:
    index: int
    sandbox: AsyncSandbox
    turn: int = 0  # the last turn done (in the sandbox's log)
    observation: int = 0
    resumed_at: int | None = None  # the turn a resumed driver found

    async def read_progress(self) -> None:
        """Where the episode is, from its log in the sandbox."""
        lines = (await self.sandbox.files.read(LOG)).decode().splitlines()
        self.turn, _, self.observation = parse(lines[-1])

    async def step(self) -> None:
        turn = self.turn + 1
        action = policy(self.index, turn, self.observation)
        r = await self.sandbox.run(step_command(turn, action))
        if r.exit_code != 0:
            raise RuntimeError(f"episode {self.index} turn {turn}: {r.stderr.decode()}")
        done, _, self.observation = parse(r.text.strip())
        assert done == turn
        self.turn = turn

    async def run(self, until: int, preempted: asyncio.Event, preempt_after: int) -> None:
        """Turns until ``until``, or until the trainer is preempted (the turn in flight ends
        first: pausing mid-step would leave it to finish after the resume, unseen)."""
        while self.turn < until and not preempted.is_set():
            await self.step()
            if preempt_after and self.turn >= preempt_after:
                preempted.set()  # the simulated preemption: the first episode at K turns

    async def check(self, turns: int) -> list[str]:
        """Problems of the episode's log: every turn 0..``turns`` once, in order, each state
        the one its action gives from the previous state."""
        lines = (await self.sandbox.files.read(LOG)).decode().splitlines()
        entries = [parse(line) for line in lines]
        problems = []
        logged = [t for t, _, _ in entries]
        if logged != list(range(turns + 1)):
            problems.append(f"episode {self.index}: turns {logged} (lost or doubled)")
        state = seed(self.index)
        for t, action, got in entries[1:]:
            want_action = policy(self.index, t, state)
            state = transition(state, want_action)
            if (action, got) != (want_action, state):
                problems.append(
                    f"episode {self.index} turn {t}: {action}/{got}, not {want_action}/{state}"
                )
                break
        return problems


# ------------------------------------------------------------------------------- driver


@dataclass
class Report:
    task: str
    phase: str  # "preempted" or "finished"
    episodes: dict[int, dict[str, object]] = field(default_factory=dict)
    paused: list[str] = field(default_factory=list)  # sandboxes pause_task left PAUSED
    problems: list[str] = field(default_factory=list)


async def start_episodes(dsec: AsyncClient, args: argparse.Namespace) -> list[Episode]:
    if [s for s in await dsec.list(task_id=args.task) if not s.terminated]:
        sys.exit(
            f"task {args.task} has sandboxes already: run with --resume, or pick another --task"
        )
    sandboxes = await asyncio.gather(
        *(
            dsec.create(
                image=args.image,
                cpu=0.25,
                memory_mb=64,
                task_id=args.task,
                labels={"episode": str(i)},
                ttl_s=3600,
            )
            for i in range(args.episodes)
        )
    )
    episodes = [Episode(i, sb, observation=seed(i)) for i, sb in enumerate(sandboxes)]
    await asyncio.gather(
        *(e.sandbox.run(f"echo 'turn 0 action 0 state {seed(e.index)}' > {LOG}") for e in episodes)
    )
    print(f"task {args.task}: {len(episodes)} episodes started")
    return episodes


async def reattach(dsec: AsyncClient, args: argparse.Namespace) -> list[Episode]:
    """The job's sandboxes by task id, mapped back to episodes by their labels; resumed."""
    infos = [i for i in await dsec.list(task_id=args.task) if not i.terminated]
    by_episode = {int(i.labels["episode"]): i for i in infos}
    missing = sorted(set(range(args.episodes)) - set(by_episode))
    if missing:
        sys.exit(f"task {args.task}: no live sandbox for episodes {missing} (lost?)")
    states = ", ".join(sorted({i.state for i in infos}))
    print(f"task {args.task}: found {len(by_episode)} sandboxes ({states})")
    # One call thaws the whole job. (Any call into a paused sandbox would resume it too, one
    # by one; the task operation does them all at once, on every edge.)
    # The task's sandboxes that ended earlier (an older run of it) stay listed for a while and
    # fail alone (SandboxTerminated): only this job's live ones count.
    resumed = await dsec.resume_task(args.task)
    live = {i.id for i in infos}
    failed = [f for f in resumed.failed if f.sandbox_id in live]
    for failure in failed:
        print(f"  resume of {failure.sandbox_id} failed: {failure.error}")
    if failed or resumed.edge_errors:
        sys.exit(f"task {args.task}: resume_task did not resume every sandbox")
    print(f"task {args.task}: resume_task resumed {len(live)} sandboxes in one call")

    async def attach(index: int, sandbox_id: str) -> Episode:
        e = Episode(index, await dsec.get(sandbox_id))
        await e.read_progress()  # the episode's progress is in its sandbox
        e.resumed_at = e.turn
        return e

    return list(
        await asyncio.gather(*(attach(i, info.id) for i, info in sorted(by_episode.items())))
    )


async def drive(args: argparse.Namespace) -> int:
    report = Report(args.task, "finished")
    async with AsyncClient() as dsec:
        episodes = await (reattach(dsec, args) if args.resume else start_episodes(dsec, args))
        preempted = asyncio.Event()
        # A real preemption arrives as SIGTERM: the same graceful path as --preempt-after.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, preempted.set)
        await asyncio.gather(
            *(
                e.run(args.turns, preempted, 0 if args.resume else args.preempt_after)
                for e in episodes
            )
        )
        for e in episodes:
            report.episodes[e.index] = {
                "sandbox": e.sandbox.id,
                "turns": e.turn,
                "resumed_at": e.resumed_at,
            }

        if preempted.is_set() and any(e.turn < args.turns for e in episodes):
            # The preemption handler: one call pauses the whole job, every edge at once.
            paused = await dsec.pause_task(args.task)
            report.phase = "preempted"
            report.paused = sorted(x.sandbox_id for x in paused if x.state == "PAUSED")
            mine = {e.sandbox.id for e in episodes}  # not the task's ended ones of a past run
            failed = [f for f in paused.failed if f.sandbox_id in mine]
            print(
                f"preempted: pause_task paused {len(set(report.paused) & mine)} of this run's"
                f" {len(mine)} sandboxes"
            )
            for e in episodes:
                print(f"  episode {e.index}: {e.turn}/{args.turns} turns, in {e.sandbox.id}")
            print("exiting; run again with --resume to finish")
            write(args, report)
            return 0 if not failed and not paused.edge_errors else 1

        for e in episodes:
            report.problems += await e.check(args.turns)
        stopped = await dsec.stop_task(args.task)
        print(f"task {args.task}: summary")
        for e in episodes:
            since = f", resumed at turn {e.resumed_at}" if e.resumed_at is not None else ""
            print(f"  episode {e.index}: {e.turn} turns{since}  ({e.sandbox.id})")
        total = sum(e.turn for e in episodes)
        verdict = "every turn accounted for" if not report.problems else "PROBLEMS"
        print(f"  {len(episodes)} episodes, {total} turns: {verdict}")
        for p in report.problems:
            print(f"  {p}")
        print(f"stop_task stopped {len(stopped.sandboxes)} sandboxes")
        write(args, report)
        return 0 if not report.problems and stopped.ok else 1


def write(args: argparse.Namespace, report: Report) -> None:
    if args.report:
        with open(args.report, "w") as fh:
            json.dump(report.__dict__, fh, indent=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True, help="the job's task id (its sandboxes carry it)")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--turns", type=int, default=6, help="turns per episode")
    p.add_argument(
        "--preempt-after", type=int, default=0, help="simulate a preemption after K turns"
    )
    p.add_argument("--resume", action="store_true", help="reattach to the task and finish it")
    p.add_argument("--image", default="busybox")
    p.add_argument("--report", default="", help="write the outcome as JSON here")
    return asyncio.run(drive(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())

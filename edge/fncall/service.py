"""The edge's FnCall service: warm pools per environment, jobs, batches, compile-once.

Domain code (no gRPC): the edge servicer converts FunctionJob/FunctionResult around it.

- `run(job)`: plan (validate, defaults) -> compile if the language needs it (once per distinct
  source: deterministic outcomes are cached by content hash and concurrent identical compiles
  share one) -> take a worker from the environment's pool -> set the memory limit of the
  step's own cgroup inside the container's -> the runner runs it (and returns the job's
  `fetch_files` after its processes are gone) -> read the step cgroup's OOM counter and
  peak, the container's pids counter -> verdict -> worker back (or retired).
- `run_many(jobs, parallelism)`: the same for many jobs at once, results yielded as they
  finish; one program against many test cases compiles once.

A channel failure before an answer (the container died under us) retries the job once on
another worker; an unresponsive runner is a SYSTEM_ERROR. Either way the worker is retired and
the pool refills itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.fncall import gpu as gpus
from edge.fncall.environments import FnCallSettings
from edge.fncall.jobs import (
    MAX_ARTIFACT_BYTES,
    MAX_FETCH_BYTES,
    MAX_FILE_BYTES,
    MAX_RESULT_BYTES,
    CompileInfo,
    Job,
    Limits,
    Observed,
    Plan,
    Result,
    Step,
    compile_outcome,
    judge,
    plan,
)
from edge.fncall.pool import COMPILE_CGROUP, JOB_CGROUP, Launcher, Pool, Worker, WorkerBroken
from edge.images import ImageResolver
from edge.runtime.runc import become_subreaper
from libdsec.errors import DSecError, FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

#: The runner and the modules it imports, all standard library only.
KIT_FILES = ("runner.py", "runner_files.py", "runner_job.py", "runner_spares.py", "wire.py")
#: How long past its wall limit a job's answer may take (runner cleanup, output drain).
ANSWER_MARGIN_S = 15.0
#: How often the edge repeats its abort signal until a given-up job's answer comes.
ABORT_REPEAT_S = 0.1
COMPILE_CACHE_BYTES = 256 * 1024 * 1024
COMPILE_CACHE_ENTRIES = 4096
MAX_BATCH = 100_000


@dataclass(frozen=True)
class Compiled:
    """A compile step's outcome (what the cache keeps)."""

    verdict: str  # CompileInfo's: OK, COMPILE_ERROR, TIME_LIMIT, ..., SYSTEM_ERROR
    artifact: bytes = b""
    output: str = ""
    message: str = ""
    exit_code: int = -1
    wall_s: float = 0.0
    #: The same source and compiler give it again whatever the limits (jobs.compile_outcome).
    cacheable: bool = False

    @property
    def ok(self) -> bool:
        return self.verdict == "OK"


def build_kit(root: Path) -> Path:
    """The runner kit (KIT_FILES), content-addressed under `root`; idempotent."""
    src = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in KIT_FILES:
        h.update(name.encode() + b"\0" + (src / name).read_bytes())
    final = root / f"kit-{h.hexdigest()[:12]}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".kit-", dir=root))
    try:
        for name in KIT_FILES:
            shutil.copyfile(src / name, tmp / name)
            (tmp / name).chmod(0o644)
        tmp.chmod(0o755)
        try:
            tmp.rename(final)
        except OSError:  # another edge process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in root.glob("kit-*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


class FnCallService:
    def __init__(
        self,
        edge_id: str,
        state_dir: Path,
        image_dir: Path,
        settings: FnCallSettings,
        *,
        detect_gpus: Any = gpus.detect,
    ) -> None:
        self.edge_id = edge_id
        self.state_dir = state_dir
        self.settings = settings
        self.images = ImageResolver(image_dir)
        #: environment -> why it is not offered here ("" = offered).
        self.unavailable: dict[str, str] = {}
        self._gpu_plans: dict[str, list[gpus.Gpu]] = {}
        self._check_environments(detect_gpus)
        self.pools: dict[str, Pool] = {}
        self.launcher: Launcher | None = None
        self._compiled: OrderedDict[str, Compiled] = OrderedDict()
        self._compiled_bytes = 0
        #: key -> the limits of the compile under way and its outcome (None: given up).
        self._compiling: dict[str, tuple[Limits, asyncio.Future[Compiled | None]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started = asyncio.Event()

    # -------------------------------------------------------------- set-up

    def _check_environments(self, detect_gpus: Any) -> None:
        gpu_list: list[gpus.Gpu] | None = None
        gpu_why = ""
        for name in self.settings.pools:
            env = self.settings.environments.get(name)
            if env is None:
                self.unavailable[name] = f"unknown fncall environment {name!r}"
                continue
            try:
                self.images.resolve(env.image)
            except DSecError as err:
                self.unavailable[name] = f"image {env.image!r} missing: {err.message}"
                continue
            if env.gpu:
                if gpu_list is None:
                    gpu_list, gpu_why = detect_gpus()
                    if gpu_list and shutil.which("nvidia-container-cli") is None:
                        gpu_list, gpu_why = [], "nvidia-container-cli not found"
                if not gpu_list:
                    self.unavailable[name] = gpu_why
                    continue
                self._gpu_plans[name] = gpus.assign(self.settings.pools[name], gpu_list, env.gpu)
        for name, why in self.unavailable.items():
            log.warning("fncall environment %s is not offered: %s", name, why)

    @property
    def offered(self) -> list[str]:
        """Environments this edge runs pools of."""
        return sorted(n for n in self.settings.pools if n not in self.unavailable)

    def labels(self) -> dict[str, str]:
        """Edge labels for placement: `fncall.env.<name>` and `fncall.lang.<language>`."""
        from edge.fncall.jobs import ALIASES, LANGUAGES

        out = {f"fncall.env.{n}": "ready" for n in self.offered}
        for lang in LANGUAGES.values():
            if lang.environment in self.offered:
                out[f"fncall.lang.{lang.name}"] = "ready"
        for alias, target in ALIASES.items():
            if f"fncall.lang.{target}" in out:
                out[f"fncall.lang.{alias}"] = "ready"
        return out

    async def run_pools(self) -> None:
        """Background: remove a previous run's containers, then fill and refill every pool."""
        if not self.offered:
            self.started.set()
            await asyncio.Event().wait()
        become_subreaper()  # pool inits are orphaned by `runc run -d`; we collect them
        kit = await asyncio.to_thread(build_kit, self.state_dir / "kits")
        # One cgroup parent per edge state dir: several edges on one host never clean up
        # each other's containers.
        tag = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:10]
        self.launcher = Launcher(
            self.state_dir, self.images, self.settings, kit, cgroup_parent=f"dsec-fncall-{tag}"
        )
        removed = await self.launcher.cleanup_orphans()
        if removed:
            log.info("fncall: removed %d leftovers of a previous run", len(removed))
        slots = asyncio.Semaphore(self.settings.start_concurrency)
        for name in self.offered:
            self.pools[name] = Pool(
                self.settings.environments[name],
                self.settings.pools[name],
                self.launcher,
                self.settings,
                slots,
                self._gpu_plans.get(name),
            )
        self.started.set()
        async with asyncio.TaskGroup() as tg:
            for pool in self.pools.values():
                tg.create_task(pool.supervise())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*(p.close() for p in self.pools.values()), return_exceptions=True)
        if self.launcher is not None:
            await self.launcher.close()

    def stats(self) -> dict[str, dict[str, int]]:
        return {n: p.stats() for n, p in self.pools.items()}

    # ----------------------------------------------------------------- jobs

    async def _pool(self, environment: str) -> Pool:
        if environment not in self.settings.environments and environment not in self.unavailable:
            raise InvalidArgument(
                f"unknown fncall environment {environment!r}",
                reason="UNKNOWN_ENVIRONMENT",
                metadata={"environment": environment},
            )
        if environment not in self.settings.pools or environment in self.unavailable:
            why = self.unavailable.get(environment, "no pool configured")
            raise FailedPrecondition(
                f"edge {self.edge_id} does not run fncall environment {environment!r}: {why}",
                reason="ENVIRONMENT_NOT_OFFERED",
                metadata={"environment": environment, "edge": self.edge_id},
            )
        if not self.started.is_set():
            await asyncio.wait_for(self.started.wait(), self.settings.queue_timeout_s)
        return self.pools[environment]

    def check(self, job: Job) -> Plan:
        """Validates a job (InvalidArgument / FailedPrecondition) without running it."""
        p = plan(job, max_memory_mb=self.settings.max_memory_mb)
        if p.environment not in self.settings.environments:
            raise InvalidArgument(
                f"unknown fncall environment {p.environment!r}",
                reason="UNKNOWN_ENVIRONMENT",
                metadata={"environment": p.environment},
            )
        return p

    async def run(self, job: Job, p: Plan | None = None) -> Result:
        p = p or self.check(job)
        pool = await self._pool(p.environment)
        result = Result(job_id=job.job_id, index=job.index, edge_id=self.edge_id)
        step = p.run
        if p.compile is not None:
            compiled, cached = await self._compile(pool, p)
            result.compile = CompileInfo(
                compiled.verdict, compiled.exit_code, compiled.wall_s, cached
            )
            if not compiled.ok:
                # The compiler failed or the compile step hit its limits: the program's fault
                # (`compile.verdict` tells which); a platform failure is the platform's.
                platform = compiled.verdict == "SYSTEM_ERROR"
                result.verdict = "SYSTEM_ERROR" if platform else "COMPILE_ERROR"
                result.compile_output = compiled.output
                result.message = compiled.message
                return result
            step = dataclasses.replace(
                step, files=(*step.files, (p.artifact, compiled.artifact, 0o755))
            )
        try:
            reply, obs = await self._execute(pool, step)
        except WorkerBroken as exc:
            result.verdict = "SYSTEM_ERROR"
            result.message = f"the pool container failed: {exc}"
            return result
        result.verdict, result.message = judge(obs, step.limits, pids_max=self.settings.pids_max)
        result.exit_code = obs.exit_code
        result.signal = obs.signal
        result.stdout = reply.get("stdout", b"")
        result.stderr = reply.get("stderr", b"")
        result.wall_time_s = obs.wall_s
        result.cpu_time_s = obs.cpu_s
        result.peak_memory_bytes = obs.peak_bytes
        if step.fetch:
            result.files, result.fetch_errors = _fetched(reply, step.fetch)
        return result

    async def run_many(self, jobs: list[Job], parallelism: int = 0) -> AsyncIterator[Result]:
        """Runs `jobs` (each job's `index` is its position); yields results as they finish."""
        if len(jobs) > MAX_BATCH:
            raise InvalidArgument(f"at most {MAX_BATCH} jobs per call", reason="BATCH_TOO_LARGE")
        plans = []
        for i, job in enumerate(jobs):
            job.index = i
            try:
                plans.append(self.check(job))
            except DSecError as err:
                raise type(err)(
                    f"jobs[{i}]: {err.message}",
                    reason=err.reason,
                    metadata={**err.metadata, "job_index": str(i)},
                ) from None
        for env in {p.environment for p in plans}:
            await self._pool(env)  # fail the call up front if an environment is not offered
        if parallelism <= 0:
            parallelism = sum(self.pools[e].size for e in {p.environment for p in plans})
        done: asyncio.Queue[Result | BaseException] = asyncio.Queue()
        todo = iter(zip(jobs, plans, strict=True))

        async def worker() -> None:
            # `parallelism` of these pull jobs in order: a batch of 100k jobs is not 100k tasks.
            for job, p in todo:
                try:
                    await done.put(await self.run(job, p))
                except DSecError as err:  # e.g. no container free in time: this job failed
                    await done.put(
                        Result(
                            job_id=job.job_id,
                            verdict="SYSTEM_ERROR",
                            index=job.index,
                            message=f"{err.reason}: {err.message}",
                            edge_id=self.edge_id,
                        )
                    )
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:
                    await done.put(exc)

        tasks = [asyncio.create_task(worker()) for _ in range(min(max(parallelism, 1), len(jobs)))]
        try:
            for _ in range(len(jobs)):
                item = await done.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ internals

    async def _compile(self, pool: Pool, p: Plan) -> tuple[Compiled, bool]:
        """The program of `p` and whether the cache or a compile already under way gave it.

        Only deterministic outcomes are cached (`Compiled.cacheable`). A request that finds an
        identical compile under way waits for it and takes its outcome, unless that compile ran
        out of limits smaller than its own (or was given up): then it compiles itself."""
        assert p.compile is not None
        key, lim = p.compile_key, p.compile.limits
        while True:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit, True
            pending = self._compiling.get(key)
            if pending is None:
                break
            theirs, waited = pending
            shared = await asyncio.shield(waited)
            if shared is not None and (shared.cacheable or _within(lim, theirs)):
                return shared, True
        fut: asyncio.Future[Compiled | None] = asyncio.get_running_loop().create_future()
        self._compiling[key] = (lim, fut)
        outcome: Compiled | None = None  # None: we failed or were cancelled; waiters try again
        try:
            outcome = compiled = await self._compile_now(pool, p)
        finally:
            if self._compiling.get(key, (lim, None))[1] is fut:
                del self._compiling[key]
            fut.set_result(outcome)
        if compiled.cacheable:
            self._remember(key, compiled)
        return compiled, False

    async def _compile_now(self, pool: Pool, p: Plan) -> Compiled:
        assert p.compile is not None
        try:
            reply, obs = await self._execute(pool, p.compile)
        except WorkerBroken as exc:
            return Compiled(
                "SYSTEM_ERROR", message=f"the pool container failed while compiling: {exc}"
            )
        output = (reply.get("stderr", b"") + reply.get("stdout", b"")).decode(errors="replace")
        artifact = reply.get("artifact", b"")
        verdict, why, cacheable = compile_outcome(obs, p.compile.limits, bool(artifact))
        if verdict == "OK":
            return Compiled("OK", artifact, output, "", obs.exit_code, obs.wall_s, cacheable)
        return Compiled(
            verdict,
            output=output or why,
            message=f"compilation failed: {why}",
            exit_code=obs.exit_code,
            wall_s=obs.wall_s,
            cacheable=cacheable,
        )

    def _remember(self, key: str, compiled: Compiled) -> None:
        self._compiled[key] = compiled
        self._compiled_bytes += len(compiled.artifact)
        while self._compiled and (
            self._compiled_bytes > COMPILE_CACHE_BYTES
            or len(self._compiled) > COMPILE_CACHE_ENTRIES
        ):
            _, old = self._compiled.popitem(last=False)
            self._compiled_bytes -= len(old.artifact)

    async def _execute(self, pool: Pool, step: Step) -> tuple[dict[str, Any], Observed]:
        """Runs one step on a worker; retries once on another if the channel broke."""
        for attempt in (1, 2):
            worker = await pool.acquire(self.settings.queue_timeout_s)
            # From here the exchange runs to its end even if our caller goes away: the answer
            # must be read before the worker can serve anyone else (the job is stopped early).
            task = asyncio.create_task(self._exchange(pool, worker, step))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.done():
                    # Nobody waits for this job: stop it, free the container. Repeated until
                    # the answer comes: a signal that finds the runner still reading the
                    # request does nothing (one after the answer does nothing either).
                    aborting = asyncio.create_task(_abort_until_done(worker, task))
                    self._tasks.add(aborting)
                    aborting.add_done_callback(self._tasks.discard)
                raise
            except WorkerBroken as exc:
                if attempt == 2 or not isinstance(exc.__cause__, (EOFError, OSError)):
                    raise
                log.warning("fncall: %s; retrying the job on another container", exc)
        raise AssertionError("unreachable")

    async def _exchange(
        self, pool: Pool, worker: Worker, step: Step
    ) -> tuple[dict[str, Any], Observed]:
        lim = step.limits
        msg: dict[str, Any] = {
            "op": "run",
            "files": [{"path": path, "mode": mode} for path, _, mode in step.files],
            "stdin": step.stdin,
            "wall_s": lim.wall_s,
            "cpu_s": lim.cpu_s,
            "max_output": lim.max_output,
            "fsize": MAX_FILE_BYTES,
            # Deep recursion may use the whole memory limit (a judge's convention); the stack's
            # pages are charged to the step's memory cgroup like any other.
            "stack": lim.memory_bytes,
        }
        for i, (_, content, _) in enumerate(step.files):
            msg[f"file{i}"] = content
        if step.python_main:
            msg["python_main"] = step.python_main
        else:
            msg["argv"] = list(step.argv)
        if step.collect:
            msg["collect"] = step.collect
            msg["collect_max"] = MAX_ARTIFACT_BYTES
        if step.fetch:
            msg["fetch"] = list(step.fetch)
            msg["fetch_max"] = MAX_FETCH_BYTES
            msg["result_max"] = MAX_RESULT_BYTES
        probe = worker.probe
        retire = ""
        try:
            # The step's processes join their own memory cgroup before the program starts:
            # memory_mb is theirs alone (the runner and the step's input files are the
            # container's). Its limit is set here, from the host: if the kernel refuses, the
            # step does not run (the worker is retired, the job tried on another).
            cgroup = probe.steps[COMPILE_CGROUP if step.collect else JOB_CGROUP]
            msg["cgroup"] = cgroup.name
            try:
                cgroup.prepare(lim.memory_bytes)
            except OSError as exc:
                raise WorkerBroken(
                    f"{worker.sandbox_id}: cannot set the {cgroup.name} memory limit: {exc}"
                ) from exc
            oom0, pids0 = cgroup.oom_kills(), probe.pids_limit_hits()
            worker.jobs += 1
            pool.jobs_done += 1
            reply = await worker.call(msg, lim.wall_s + ANSWER_MARGIN_S)
            if "exit_code" not in reply:
                retire = reply.get("anomaly") or reply.get("error") or "bad answer"
                raise WorkerBroken(f"{worker.sandbox_id}: {retire}")
            retire = reply.get("anomaly", "")
            obs = Observed(
                exit_code=int(reply["exit_code"]),
                signal=int(reply["signal"]),
                wall_s=float(reply["wall_s"]),
                cpu_s=_cpu_seconds(reply),
                peak_bytes=cgroup.peak(),
                killed=str(reply.get("killed", "")),
                over=str(reply.get("over", "")),
                full=str(reply.get("full", "")),
                oom_kills=cgroup.oom_kills() - oom0,
                pids_limit_hits=probe.pids_limit_hits() - pids0,
            )
            return reply, obs
        except WorkerBroken as exc:
            retire = retire or str(exc)
            raise
        except BaseException as exc:
            retire = retire or f"unexpected {exc!r}"
            raise
        finally:
            pool.release(worker, retire=retire)


async def _abort_until_done(worker: Worker, exchange: asyncio.Task[Any]) -> None:
    while not exchange.done():
        worker.abort()
        await asyncio.wait({exchange}, timeout=ABORT_REPEAT_S)


def _within(mine: Limits, theirs: Limits) -> bool:
    """A compile under `theirs` limits ran with at least as much time and memory as `mine`."""
    return (
        mine.wall_s <= theirs.wall_s
        and mine.cpu_s <= theirs.cpu_s
        and mine.memory_bytes <= theirs.memory_bytes
    )


def _fetched(
    reply: dict[str, Any], asked: tuple[str, ...]
) -> tuple[list[tuple[str, bytes]], dict[str, str]]:
    """The runner's answer about the job's fetch_files: (path, content) in its order, and path
    -> why for the others."""
    wanted = set(asked)
    files = [
        (str(path), bytes(reply.get(f"fetch{i}", b"")))
        for i, path in enumerate(reply.get("fetched") or [])
        if path in wanted
    ]
    errors = {
        str(path): str(why)
        for path, why in (reply.get("fetch_errors") or {}).items()
        if path in wanted
    }
    for path in wanted.difference(errors, (p for p, _ in files)):
        errors[path] = "not returned by the runner"
    return files, errors


def _cpu_seconds(reply: dict[str, Any]) -> float:
    """The job's CPU time: its waited-for processes' rusage, or the container's cgroup count
    when processes the job left behind burned noticeably more (orphans are not waited for)."""
    own = float(reply["cpu_s"])
    tree = float(reply.get("tree_cpu_s", -1.0))
    return tree if tree > own + 0.02 else own

"""FnCall jobs, languages and verdicts: pure domain code (no I/O, no gRPC).

A job is a short stateless program: source code in a language (or an explicit command), extra
files, stdin, and limits. `plan()` turns it into what a pool container runs: an optional
compile step (compiled once per distinct source, see `compile_key`) and the run step.
`judge()` turns what the runner observed into a verdict.
"""

from __future__ import annotations

import hashlib
import math
import re
import signal
from dataclasses import dataclass, field

from libdsec.errors import InvalidArgument

MIB = 1024 * 1024

#: Defaults and bounds of a job's limits (FunctionJob documents the defaults).
DEFAULT_TIME_LIMIT_S = 10.0
MAX_TIME_LIMIT_S = 600.0
DEFAULT_MEMORY_MB = 256
MIN_MEMORY_MB = 16
DEFAULT_MAX_OUTPUT_BYTES = 1 * MIB
MAX_OUTPUT_BYTES = 16 * MIB
MAX_SOURCE_BYTES = 16 * MIB  # code + files
MAX_STDIN_BYTES = 64 * MIB
#: Any single file a job writes (RLIMIT_FSIZE); past it the job dies of SIGXFSZ: OUTPUT_LIMIT.
MAX_FILE_BYTES = 64 * MIB
#: Compilation gets its own limits, not the job's (a 1 s run limit must not fail g++); the job
#: may set the compile step's wall clock (`compile_time_limit_s`), up to MAX_TIME_LIMIT_S.
COMPILE_TIME_LIMIT_S = 30.0
COMPILE_MEMORY_MB = 1024
COMPILE_OUTPUT_BYTES = 64 * 1024
MAX_ARTIFACT_BYTES = 64 * MIB
#: Files a job may ask back (`fetch_files`), and their total size per job.
MAX_FETCH_FILES = 64
MAX_FETCH_BYTES = 32 * MIB
#: A result's payload (stdout + stderr + fetched files) stays under this, below the 64 MiB
#: message limit of the gRPC channels it travels on: the fetch budget shrinks by the output.
MAX_RESULT_BYTES = 60 * MIB

_PATH = re.compile(r"^[A-Za-z0-9_.+-]+(/[A-Za-z0-9_.+-]+)*$")


@dataclass(frozen=True)
class Language:
    name: str
    environment: str  # the pool it runs in unless the job names another
    source: str  # file name `code` is written to
    run: tuple[str, ...]  # argv of the run step (after compilation, if any)
    compile: tuple[str, ...] = ()  # argv of the compile step; () = interpreted
    artifact: str = ""  # the file the compile step produces
    warm_python: bool = False  # run in the pool's warm interpreter instead of exec()


LANGUAGES: dict[str, Language] = {
    "python": Language("python", "python", "main.py", ("python3", "main.py"), warm_python=True),
    "cpp": Language(
        "cpp",
        "cpp",
        "main.cpp",
        ("./main",),
        ("g++", "-O2", "-std=gnu++17", "-pipe", "-o", "main", "main.cpp"),
        "main",
    ),
    "c": Language(
        "c",
        "cpp",
        "main.c",
        ("./main",),
        ("gcc", "-O2", "-std=gnu11", "-pipe", "-o", "main", "main.c", "-lm"),
        "main",
    ),
    "bash": Language("bash", "bash", "main.sh", ("bash", "main.sh")),
    "sh": Language("sh", "bash", "main.sh", ("sh", "main.sh")),
}
ALIASES = {"python3": "python", "py": "python", "c++": "cpp", "cxx": "cpp", "shell": "bash"}
#: Where a job with a command and no language runs.
DEFAULT_COMMAND_ENVIRONMENT = "bash"


def language(name: str) -> Language:
    key = name.strip().lower()
    lang = LANGUAGES.get(ALIASES.get(key, key))
    if lang is None:
        raise InvalidArgument(
            f"unknown language {name!r}; known: {', '.join(sorted(LANGUAGES))}",
            reason="UNKNOWN_LANGUAGE",
            metadata={"language": name},
        )
    return lang


@dataclass
class Job:
    language: str = ""
    code: bytes = b""
    files: list[tuple[str, bytes]] = field(default_factory=list)
    command: list[str] = field(default_factory=list)
    stdin: bytes = b""
    time_limit_s: float = 0.0
    cpu_limit_s: float = 0.0
    memory_mb: int = 0
    max_output_bytes: int = 0
    environment: str = ""
    job_id: str = ""
    index: int = 0
    compile_time_limit_s: float = 0.0  # 0 = COMPILE_TIME_LIMIT_S
    fetch_files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CompileInfo:
    """The compile step as it ran, or as the compile cache remembers it."""

    verdict: str  # OK, COMPILE_ERROR (the compiler failed), TIME_LIMIT, ..., SYSTEM_ERROR
    exit_code: int  # the compiler's (-1: killed)
    wall_time_s: float  # of the compile that produced this outcome
    cached: bool = False  # the cache (or an identical compile under way) answered


@dataclass
class Result:
    job_id: str = ""
    verdict: str = "SYSTEM_ERROR"  # OK, TIME_LIMIT, MEMORY_LIMIT, OUTPUT_LIMIT, ...
    exit_code: int = 0
    signal: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    wall_time_s: float = 0.0
    cpu_time_s: float = 0.0
    peak_memory_bytes: int = 0
    compile_output: str = ""
    index: int = 0
    message: str = ""
    edge_id: str = ""
    compile: CompileInfo | None = None  # compiled languages only
    files: list[tuple[str, bytes]] = field(default_factory=list)  # fetched, in request order
    fetch_errors: dict[str, str] = field(default_factory=dict)  # fetch path -> why not


@dataclass(frozen=True)
class Limits:
    """A job's limits after defaults, as the runner applies them."""

    wall_s: float
    cpu_s: float
    memory_bytes: int
    max_output: int


@dataclass(frozen=True)
class Step:
    """One runner request: files to write, what to run, and its limits."""

    files: tuple[tuple[str, bytes, int], ...]  # (path, content, mode)
    argv: tuple[str, ...] = ()
    python_main: str = ""  # run this file in the warm interpreter instead of argv
    stdin: bytes = b""
    limits: Limits = Limits(0, 0, 0, 0)
    collect: str = ""  # file to return on success (the compiled program)
    fetch: tuple[str, ...] = ()  # files to return after the run, whatever its outcome


@dataclass(frozen=True)
class Plan:
    environment: str
    run: Step
    compile: Step | None = None
    compile_key: str = ""
    artifact: str = ""  # where the compiled program goes in the run step's job directory


def limits(job: Job, max_memory_mb: int) -> Limits:
    wall = job.time_limit_s or DEFAULT_TIME_LIMIT_S
    if not (0 < wall <= MAX_TIME_LIMIT_S) or math.isnan(wall):
        raise InvalidArgument(
            f"time_limit_s={job.time_limit_s} must be in (0, {MAX_TIME_LIMIT_S:g}]",
            reason="INVALID_LIMITS",
        )
    cpu = job.cpu_limit_s or wall
    if not (0 < cpu <= MAX_TIME_LIMIT_S) or math.isnan(cpu):
        raise InvalidArgument(
            f"cpu_limit_s={job.cpu_limit_s} must be in (0, {MAX_TIME_LIMIT_S:g}]",
            reason="INVALID_LIMITS",
        )
    mem = job.memory_mb or DEFAULT_MEMORY_MB
    if not MIN_MEMORY_MB <= mem <= max_memory_mb:
        raise InvalidArgument(
            f"memory_mb={job.memory_mb} must be in {MIN_MEMORY_MB}..{max_memory_mb}",
            reason="INVALID_LIMITS",
        )
    out = job.max_output_bytes or DEFAULT_MAX_OUTPUT_BYTES
    if out > MAX_OUTPUT_BYTES:
        raise InvalidArgument(
            f"max_output_bytes={job.max_output_bytes} exceeds {MAX_OUTPUT_BYTES}",
            reason="INVALID_LIMITS",
        )
    return Limits(wall, cpu, mem * MIB, out)


def compile_time_limit(job: Job) -> float:
    """The compile step's wall-clock and CPU limit of `job` (validated)."""
    t = job.compile_time_limit_s or COMPILE_TIME_LIMIT_S
    if not (0 < t <= MAX_TIME_LIMIT_S) or math.isnan(t):
        raise InvalidArgument(
            f"compile_time_limit_s={job.compile_time_limit_s} must be in (0, {MAX_TIME_LIMIT_S:g}]",
            reason="INVALID_LIMITS",
        )
    return t


def fetch_list(job: Job) -> tuple[str, ...]:
    """The files `job` asks back (validated: at most MAX_FETCH_FILES, unique, `files`' rules)."""
    if len(job.fetch_files) > MAX_FETCH_FILES:
        raise InvalidArgument(
            f"fetch_files has {len(job.fetch_files)} paths, more than {MAX_FETCH_FILES}",
            reason="INVALID_FILE",
        )
    paths = []
    for p in job.fetch_files:
        try:
            paths.append(_check_path(p))
        except InvalidArgument as err:
            raise InvalidArgument(f"fetch_files: {err.message}", reason=err.reason) from None
    if len(set(paths)) != len(paths):
        raise InvalidArgument("fetch_files: paths must be unique", reason="INVALID_FILE")
    return tuple(paths)


def _check_path(path: str) -> str:
    if not _PATH.match(path) or any(p in (".", "..") for p in path.split("/")) or len(path) > 255:
        raise InvalidArgument(
            f"file path {path!r} must be relative, without '..', of [A-Za-z0-9_.+-] parts",
            reason="INVALID_FILE",
        )
    return path


def plan(job: Job, *, max_memory_mb: int = 4096) -> Plan:
    """What to run for `job`, validated (InvalidArgument naming the field on bad input)."""
    lim = limits(job, max_memory_mb)
    compile_s = compile_time_limit(job)
    fetch = fetch_list(job)
    size = len(job.code) + sum(len(c) for _, c in job.files)
    if size > MAX_SOURCE_BYTES:
        raise InvalidArgument(
            f"code and files total {size} bytes, more than {MAX_SOURCE_BYTES}",
            reason="JOB_TOO_LARGE",
        )
    if len(job.stdin) > MAX_STDIN_BYTES:
        raise InvalidArgument(
            f"stdin has {len(job.stdin)} bytes, more than {MAX_STDIN_BYTES}", reason="JOB_TOO_LARGE"
        )
    if any(not isinstance(a, str) or "\0" in a for a in job.command) or (
        job.command and not job.command[0]
    ):
        raise InvalidArgument("command must be a list of non-empty strings without NUL")
    files = [(_check_path(p), c) for p, c in job.files]
    if len({p for p, _ in files}) != len(files):
        raise InvalidArgument("file paths must be unique", reason="INVALID_FILE")
    if not job.language:
        if not job.command:
            raise InvalidArgument("give a language (with code) or a command", reason="NO_PROGRAM")
        if job.code:
            raise InvalidArgument("code needs a language", reason="NO_LANGUAGE")
        env = job.environment or DEFAULT_COMMAND_ENVIRONMENT
        run = Step(tuple((p, c, 0o644) for p, c in files), argv=tuple(job.command), stdin=job.stdin)
        return Plan(env, _with_limits(run, lim, fetch))
    lang = language(job.language)
    env = job.environment or lang.environment
    if lang.source in {p for p, _ in files}:
        raise InvalidArgument(
            f"file {lang.source!r} would be overwritten by `code`", reason="INVALID_FILE"
        )
    source = (lang.source, job.code, 0o644)
    extra = tuple((p, c, 0o644) for p, c in files)
    if not lang.compile:
        if job.command:
            run = Step((source, *extra), argv=tuple(job.command), stdin=job.stdin)
        elif lang.warm_python:
            run = Step((source, *extra), python_main=lang.source, stdin=job.stdin)
        else:
            run = Step((source, *extra), argv=lang.run, stdin=job.stdin)
        return Plan(env, _with_limits(run, lim, fetch))
    # A compiler may need more than the program it builds, never more than a job may have.
    compile_mb = min(max(COMPILE_MEMORY_MB, lim.memory_bytes // MIB), max_memory_mb)
    compile_step = Step(
        (source, *extra),
        argv=lang.compile,
        limits=Limits(compile_s, compile_s, compile_mb * MIB, COMPILE_OUTPUT_BYTES),
        collect=lang.artifact,
    )
    # The key is the program's content, not the step's limits: only outcomes the limits cannot
    # change are cached (see `compile_outcome`).
    h = hashlib.sha256()
    for part in (env, *lang.compile):
        h.update(part.encode() + b"\0")
    for path, content, _ in compile_step.files:
        h.update(path.encode() + b"\0" + len(content).to_bytes(8, "big") + content)
    run = Step(extra, argv=tuple(job.command) or lang.run, stdin=job.stdin)
    return Plan(env, _with_limits(run, lim, fetch), compile_step, h.hexdigest(), lang.artifact)


def _with_limits(step: Step, lim: Limits, fetch: tuple[str, ...] = ()) -> Step:
    return Step(step.files, step.argv, step.python_main, step.stdin, lim, step.collect, fetch)


# ------------------------------------------------------------------ verdicts


@dataclass(frozen=True)
class Observed:
    """What the runner and the container's cgroup saw of one step."""

    exit_code: int
    signal: int
    wall_s: float
    cpu_s: float
    #: The peak of the memory charged to the step's own memory cgroup (what memory_mb limits:
    #: its processes' memory, the files they wrote in the container's tmpfs, page cache they
    #: brought in), not RSS: pages a warm Python job shares with the runner are not its own.
    peak_bytes: int
    killed: str = ""  # "wall", "cpu", "output", "cancelled" (the caller went away) or ""
    over: str = ""  # the stream that exceeded the output limit
    oom_kills: int = 0  # kernel OOM kills in the step's memory cgroup during the step
    pids_limit_hits: int = 0  # forks refused by the pids cgroup during the step
    full: str = ""  # a tmpfs of the job's files ("/job", "/tmp") was full when it ended


def judge(o: Observed, lim: Limits, *, pids_max: int = 0) -> tuple[str, str]:
    """(verdict, message). Precedence: cancelled, output, memory (the kernel killed it), time,
    memory (peak above the limit), files (a full tmpfs), runtime error, OK. A fork refused at
    the process limit is noted on a time or runtime verdict (a fork bomb may end either way)."""
    fork = (
        f"; the process limit{f' ({pids_max})' if pids_max else ''} was reached"
        if o.pids_limit_hits
        else ""
    )
    if o.killed == "cancelled":
        return "SYSTEM_ERROR", "cancelled: the caller went away"
    if o.killed == "output":
        return "OUTPUT_LIMIT", f"{o.over or 'output'} exceeded {lim.max_output} bytes"
    if o.signal == signal.SIGXFSZ:
        return "OUTPUT_LIMIT", f"a file exceeded the {MAX_FILE_BYTES}-byte size limit"
    if o.oom_kills:
        return "MEMORY_LIMIT", f"killed at the memory limit of {lim.memory_bytes // MIB} MiB"
    if o.killed == "wall":
        return "TIME_LIMIT", f"wall-clock limit of {lim.wall_s:g} s exceeded{fork}"
    if o.killed == "cpu" or o.signal == signal.SIGXCPU:
        return "TIME_LIMIT", f"CPU time limit of {lim.cpu_s:g} s exceeded{fork}"
    if o.peak_bytes > lim.memory_bytes:
        return (
            "MEMORY_LIMIT",
            f"peak memory {o.peak_bytes / MIB:.1f} MiB above the limit of {lim.memory_bytes // MIB} MiB",
        )
    if o.full and (o.signal or o.exit_code):
        return "OUTPUT_LIMIT", f"the job's files filled {o.full}"
    if o.signal:
        return "RUNTIME_ERROR", f"killed by {_signame(o.signal)}{fork}"
    if o.exit_code != 0:
        return "RUNTIME_ERROR", f"exit code {o.exit_code}{fork}"
    if o.pids_limit_hits:
        return "RUNTIME_ERROR", fork.removeprefix("; ").capitalize()
    return "OK", ""


def compile_outcome(o: Observed, lim: Limits, produced: bool) -> tuple[str, str, bool]:
    """(verdict, message, cacheable) of a compile step; `produced`: the program came back.

    The verdict is CompileInfo's: OK, COMPILE_ERROR (the compiler failed), or the step's own
    limit or failure (TIME_LIMIT, MEMORY_LIMIT, OUTPUT_LIMIT, SYSTEM_ERROR). Cacheable are the
    outcomes the same source and compiler always give, whatever the limits: a program, or the
    compiler exiting non-zero by itself. Never a limit (a 1 s timeout must not fail a later 30 s
    compile), a signal or the process limit (the machine, not the source)."""
    verdict, why = judge(o, lim)
    if verdict == "OK":
        return (
            ("OK", "", True)
            if produced
            else ("COMPILE_ERROR", "the compiler produced no program", True)
        )
    if verdict == "RUNTIME_ERROR":
        by_itself = o.exit_code > 0 and not o.signal and not o.pids_limit_hits
        return "COMPILE_ERROR", why, by_itself
    return verdict, why, False


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"

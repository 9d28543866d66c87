"""FnCall domain code: jobs and languages, verdicts, the runner's wire, settings, GPU planning,
pool queueing, conversions. No containers here (tests/integration/test_fncall.py has them)."""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from apiserver.functions import _selector
from common.config import ConfigError, load
from dsec.types.v1 import types_pb2
from edge.config import EdgeConfig
from edge.fncall import gpu, runner_files, wire
from edge.fncall.adapter import job_from_pb, result_pb
from edge.fncall.environments import FnCallSettings, environments, parse_pools
from edge.fncall.jobs import (
    COMPILE_TIME_LIMIT_S,
    DEFAULT_MAX_OUTPUT_BYTES,
    MAX_FETCH_FILES,
    MIB,
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
from edge.fncall.pool import Pool
from edge.fncall.service import KIT_FILES, FnCallService, build_kit
from libdsec import CompileInfo as SdkCompileInfo
from libdsec import FunctionJob, FunctionResult
from libdsec.errors import EdgeCapacity, InvalidArgument

ROOT = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------ wire


def test_wire_roundtrip_keeps_bytes_raw() -> None:
    msg = {"op": "run", "n": 3, "files": [{"path": "a"}], "stdin": b"\x00\xff" * 1000, "e": b""}
    frame = wire.encode(msg)
    n = wire.body_length(frame[:4])
    assert n == len(frame) - 4
    assert wire.decode(frame[4:]) == msg


@pytest.mark.parametrize(
    "body",
    [b"", b"\x00\x00\x00\x09{}", b"\x00\x00\x00\x02[]", b"\x00\x00\x00\x02{}x"],
    ids=["empty", "short-header", "not-an-object", "trailing"],
)
def test_wire_rejects_malformed_frames(body: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(body)


def test_wire_rejects_oversized_lengths() -> None:
    with pytest.raises(wire.WireError):
        wire.body_length((wire.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_runner_uses_only_the_standard_library() -> None:
    """It runs on the pool image's own Python, from /.dsec, with nothing else installed."""
    for name in KIT_FILES:
        for m in _imports(ROOT / "edge" / "fncall" / name):
            top = m.split(".")[0]
            ours = (
                "edge.fncall",
                "edge.fncall.runner",
                *(f.removesuffix(".py") for f in KIT_FILES),
            )
            assert top in sys.stdlib_module_names or m in ours, (name, m)


def test_fncall_domain_modules_import_no_grpc() -> None:
    for name in ("jobs.py", "environments.py", "gpu.py", "pool.py", "service.py", *KIT_FILES):
        bad = {
            m
            for m in _imports(ROOT / "edge" / "fncall" / name)
            if m == "grpc" or m.startswith(("grpc.", "dsec.", "google.protobuf"))
        }
        assert not bad, (name, bad)


def test_runner_fetches_regular_files_and_never_follows_a_link(tmp_path: Path) -> None:
    """The runner's fetch on a real directory a job could have left: files, nested files, an
    empty one; symlinks to a secret (as the file, and as a directory on the way), a FIFO (an
    open would block without O_NONBLOCK), a directory, a missing file, and one over the budget
    left. (tests/integration does it in a pool container.)"""
    job = tmp_path / "job"
    (job / "d" / "e").mkdir(parents=True)
    (job / "out.txt").write_bytes(b"hello\n")
    (job / "d" / "e" / "deep.bin").write_bytes(b"\x00\xff" * 1000)
    (job / "empty").write_bytes(b"")
    (job / "big").write_bytes(b"x" * (3 * MIB))
    secret = tmp_path / "secret"
    secret.write_text("root's")
    (job / "link").symlink_to(secret)
    (job / "linkdir").symlink_to(tmp_path)
    os.mkfifo(job / "fifo")
    ask = ["out.txt", "d/e/deep.bin", "empty", "link", "linkdir/secret", "fifo", "d", "nope"]
    ask += ["d/nope/x", "out.txt/x", "big"]
    result: dict[str, Any] = {"stdout": b"o" * MIB, "stderr": b""}
    # 4 MiB in all, 5 MiB for the whole result: the 1 MiB of output leaves 4 MiB; the first
    # files take ~0.002 MiB of them.
    runner_files.fetch(str(job), ask, {"fetch_max": 4 * MIB, "result_max": 5 * MIB}, result)
    files = {p: result[f"fetch{i}"] for i, p in enumerate(result["fetched"])}
    assert files == {
        "out.txt": b"hello\n",
        "d/e/deep.bin": b"\x00\xff" * 1000,
        "empty": b"",
        "big": b"x" * (3 * MIB),
    }
    errors = result["fetch_errors"]
    assert set(errors) == set(ask) - set(files)
    assert errors["link"] == "not a regular file: a symbolic link (not followed)"
    assert "symbolic link" in errors["linkdir/secret"]
    assert errors["fifo"] == "not a regular file"
    assert errors["d"] == "not a regular file: a directory"
    assert errors["nope"] == errors["d/nope/x"] == "no such file"
    assert "not a directory" in errors["out.txt/x"]
    # The budget: what is left after the files before, and what the output took.
    result = {"stdout": b"o" * (2 * MIB), "stderr": b""}
    runner_files.fetch(
        str(job), ["out.txt", "big"], {"fetch_max": 4 * MIB, "result_max": 5 * MIB}, result
    )
    assert result["fetched"] == ["out.txt"]
    assert result["fetch_errors"]["big"] == (
        f"{3 * MIB} bytes, larger than the {3 * MIB - 6} bytes left of the 4 MiB limit"
        " (the output took 2 MiB of the result's 5 MiB)"
    ), result["fetch_errors"]
    result = {"stdout": b"", "stderr": b""}
    runner_files.fetch(
        str(job), ["big", "out.txt"], {"fetch_max": 2 * MIB, "result_max": 5 * MIB}, result
    )
    assert result["fetched"] == ["out.txt"]  # a file refused leaves the budget to the next
    assert result["fetch_errors"] == {"big": "3 MiB, larger than the 2 MiB left of the 2 MiB limit"}


def test_runner_kit_is_content_addressed_and_idempotent(tmp_path: Path) -> None:
    a = build_kit(tmp_path)
    b = build_kit(tmp_path)
    assert a == b and sorted(p.name for p in a.iterdir()) == sorted(KIT_FILES)
    for name in KIT_FILES:
        assert (a / name).read_bytes() == (ROOT / "edge/fncall" / name).read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == [a.name]


# ------------------------------------------------------------------ jobs


def test_python_plan_runs_warm_without_compiling() -> None:
    p = plan(Job(language="Python3", code=b"print(1)", stdin=b"x"))
    assert p.environment == "python" and p.compile is None
    assert p.run.python_main == "main.py" and p.run.argv == ()
    assert p.run.files == (("main.py", b"print(1)", 0o644),)
    assert p.run.stdin == b"x"
    assert p.run.limits == Limits(10.0, 10.0, 256 * MIB, DEFAULT_MAX_OUTPUT_BYTES)


def test_cpp_plan_compiles_once_per_distinct_source() -> None:
    job = Job(language="c++", code=b"int main(){}", files=[("a.h", b"//")], time_limit_s=2)
    p = plan(job)
    assert p.environment == "cpp" and p.compile is not None
    assert p.compile.argv[0] == "g++" and p.compile.collect == "main"
    assert p.compile.limits.wall_s == 30 and p.compile.limits.memory_bytes >= 1024 * MIB
    assert p.run.argv == ("./main",) and p.artifact == "main"
    assert p.run.files == (("a.h", b"//", 0o644),)  # the source is not needed to run
    assert p.run.limits.wall_s == 2
    same = plan(Job(language="cpp", code=b"int main(){}", files=[("a.h", b"//")], stdin=b"9"))
    other = plan(Job(language="cpp", code=b"int main(){ }", files=[("a.h", b"//")]))
    c = plan(Job(language="c", code=b"int main(){}", files=[("a.h", b"//")]))
    assert p.compile_key == same.compile_key  # stdin and limits do not matter
    assert len({p.compile_key, other.compile_key, c.compile_key}) == 3


def test_command_jobs() -> None:
    p = plan(Job(command=["sh", "-c", "true"], files=[("d/x.txt", b"1")]))
    assert p.environment == "bash" and p.run.argv == ("sh", "-c", "true")
    p = plan(Job(command=["python3", "x.py"], environment="python"))
    assert p.environment == "python" and not p.run.python_main
    p = plan(Job(language="bash", code=b"echo", command=["bash", "main.sh", "arg"]))
    assert p.run.argv == ("bash", "main.sh", "arg")


@pytest.mark.parametrize(
    ("job", "reason"),
    [
        (Job(language="cobol", code=b"x"), "UNKNOWN_LANGUAGE"),
        (Job(), "NO_PROGRAM"),
        (Job(code=b"print(1)"), "NO_PROGRAM"),
        (Job(code=b"x", command=["ls"]), "NO_LANGUAGE"),
        (Job(language="python", time_limit_s=-1), "INVALID_LIMITS"),
        (Job(language="python", time_limit_s=float("nan")), "INVALID_LIMITS"),
        (Job(language="python", time_limit_s=10_000), "INVALID_LIMITS"),
        (Job(language="python", memory_mb=1), "INVALID_LIMITS"),
        (Job(language="python", memory_mb=1 << 20), "INVALID_LIMITS"),
        (Job(language="python", max_output_bytes=1 << 30), "INVALID_LIMITS"),
        (Job(language="python", files=[("../x", b"")]), "INVALID_FILE"),
        (Job(language="python", files=[("/etc/passwd", b"")]), "INVALID_FILE"),
        (Job(language="python", files=[("a/./b", b"")]), "INVALID_FILE"),
        (Job(language="python", files=[("a", b""), ("a", b"")]), "INVALID_FILE"),
        (Job(language="python", files=[("main.py", b"")]), "INVALID_FILE"),
        (Job(language="python", stdin=b"x" * (65 * MIB)), "JOB_TOO_LARGE"),
    ],
)
def test_bad_jobs_are_invalid_argument(job: Job, reason: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        plan(job, max_memory_mb=4096)
    assert e.value.reason == reason


def test_limits_defaults_and_cpu() -> None:
    p = plan(Job(language="bash", code=b"", time_limit_s=3, cpu_limit_s=1, memory_mb=64))
    assert p.run.limits == Limits(3, 1, 64 * MIB, DEFAULT_MAX_OUTPUT_BYTES)


def test_compile_time_limit_is_the_compile_steps_and_not_part_of_the_cache_key() -> None:
    src = b"int main(){}"
    default = plan(Job(language="cpp", code=src, time_limit_s=1))
    quick = plan(Job(language="cpp", code=src, time_limit_s=1, compile_time_limit_s=0.5))
    assert default.compile is not None and quick.compile is not None
    assert default.compile.limits.wall_s == default.compile.limits.cpu_s == COMPILE_TIME_LIMIT_S
    assert quick.compile.limits.wall_s == quick.compile.limits.cpu_s == 0.5
    assert quick.run.limits.wall_s == 1  # the run keeps the job's own limit
    assert quick.compile_key == default.compile_key


def test_fetch_files_travel_with_the_run_step_only() -> None:
    fetch = ["out.txt", "d/e/result.bin", "main.cpp"]
    p = plan(Job(language="cpp", code=b"int main(){}", fetch_files=fetch))
    assert p.run.fetch == tuple(fetch)
    assert p.compile is not None and p.compile.fetch == ()
    assert plan(Job(language="python", code=b"", fetch_files=["a"])).run.fetch == ("a",)
    assert plan(Job(command=["true"], fetch_files=["a"])).run.fetch == ("a",)
    assert plan(Job(language="python", code=b"")).run.fetch == ()
    # the most a job may ask for
    many = [f"f{i}" for i in range(MAX_FETCH_FILES)]
    assert len(plan(Job(command=["true"], fetch_files=many)).run.fetch) == MAX_FETCH_FILES


@pytest.mark.parametrize(
    ("job", "reason", "field"),
    [
        (Job(language="cpp", compile_time_limit_s=-1), "INVALID_LIMITS", "compile_time_limit_s"),
        (Job(language="cpp", compile_time_limit_s=601), "INVALID_LIMITS", "compile_time_limit_s"),
        (
            Job(language="cpp", compile_time_limit_s=float("nan")),
            "INVALID_LIMITS",
            "compile_time_limit_s",
        ),
        (
            Job(language="python", fetch_files=[f"f{i}" for i in range(MAX_FETCH_FILES + 1)]),
            "INVALID_FILE",
            "fetch_files",
        ),
        (Job(language="python", fetch_files=["../x"]), "INVALID_FILE", "fetch_files"),
        (Job(language="python", fetch_files=["/etc/passwd"]), "INVALID_FILE", "fetch_files"),
        (Job(language="python", fetch_files=["a/../../b"]), "INVALID_FILE", "fetch_files"),
        (Job(language="python", fetch_files=["a/./b"]), "INVALID_FILE", "fetch_files"),
        (Job(language="python", fetch_files=[""]), "INVALID_FILE", "fetch_files"),
        (Job(language="python", fetch_files=["d/"]), "INVALID_FILE", "fetch_files"),
        (Job(language="python", fetch_files=["a", "b", "a"]), "INVALID_FILE", "fetch_files"),
    ],
)
def test_bad_compile_limits_and_fetch_files_are_invalid_argument(
    job: Job, reason: str, field: str
) -> None:
    with pytest.raises(InvalidArgument) as e:
        plan(job)
    assert e.value.reason == reason
    assert field in e.value.message


# ------------------------------------------------------------------ verdicts

LIM = Limits(wall_s=2, cpu_s=1, memory_bytes=64 * MIB, max_output=1000)


def obs(**kw: Any) -> Observed:
    base: dict[str, Any] = dict(exit_code=0, signal=0, wall_s=0.1, cpu_s=0.1, peak_bytes=MIB)
    return Observed(**{**base, **kw})


@pytest.mark.parametrize(
    ("observed", "verdict", "says"),
    [
        (obs(), "OK", ""),
        (obs(exit_code=3), "RUNTIME_ERROR", "exit code 3"),
        (obs(exit_code=-1, signal=signal.SIGSEGV), "RUNTIME_ERROR", "SIGSEGV"),
        (obs(exit_code=-1, signal=9, killed="wall"), "TIME_LIMIT", "wall-clock"),
        (obs(exit_code=-1, signal=9, killed="cpu"), "TIME_LIMIT", "CPU"),
        (obs(exit_code=-1, signal=signal.SIGXCPU), "TIME_LIMIT", "CPU"),
        (obs(exit_code=-1, signal=9, oom_kills=1), "MEMORY_LIMIT", "64 MiB"),
        (obs(peak_bytes=65 * MIB), "MEMORY_LIMIT", "peak"),
        (obs(exit_code=-1, signal=9, killed="output", over="stdout"), "OUTPUT_LIMIT", "stdout"),
        (obs(exit_code=-1, signal=signal.SIGXFSZ), "OUTPUT_LIMIT", "file"),
        (obs(pids_limit_hits=5), "RUNTIME_ERROR", "process limit"),
        (obs(exit_code=1, pids_limit_hits=5), "RUNTIME_ERROR", "process limit"),
        # precedence: the output flood killed it, whatever else was going on
        (obs(signal=9, killed="output", oom_kills=1), "OUTPUT_LIMIT", ""),
        (obs(signal=9, killed="wall", oom_kills=1), "MEMORY_LIMIT", ""),
        (obs(signal=9, killed="wall", peak_bytes=100 * MIB), "TIME_LIMIT", ""),
        # a fork bomb that ends at its time limit still says why
        (obs(signal=9, killed="wall", pids_limit_hits=3), "TIME_LIMIT", "process limit (64)"),
        # files: a failure with a full tmpfs; a time limit comes first; success is success
        (obs(exit_code=7, full="/job"), "OUTPUT_LIMIT", "filled /job"),
        (obs(signal=9, killed="wall", full="/tmp"), "TIME_LIMIT", "wall-clock"),
        (obs(full="/tmp"), "OK", ""),
        # the caller went away: nobody reads it, but it must not look like the program's fault
        (obs(signal=9, killed="cancelled"), "SYSTEM_ERROR", "cancelled"),
    ],
)
def test_judge(observed: Observed, verdict: str, says: str) -> None:
    v, message = judge(observed, LIM, pids_max=64)
    assert v == verdict
    assert says in message


# ------------------------------------------------------------------ compile outcomes, cache


@pytest.mark.parametrize(
    ("observed", "produced", "verdict", "cacheable"),
    [
        (obs(), True, "OK", True),
        (obs(), False, "COMPILE_ERROR", True),  # exit 0 but no program: the same every time
        (obs(exit_code=1), False, "COMPILE_ERROR", True),  # the compiler's diagnostics
        # the compile step's limits: another request may have larger ones
        (obs(exit_code=-1, signal=9, killed="wall"), False, "TIME_LIMIT", False),
        (obs(exit_code=-1, signal=9, killed="cpu"), False, "TIME_LIMIT", False),
        (obs(exit_code=-1, signal=9, oom_kills=1), False, "MEMORY_LIMIT", False),
        (obs(exit_code=1, peak_bytes=65 * MIB), False, "MEMORY_LIMIT", False),
        (obs(exit_code=-1, signal=9, killed="output", over="stderr"), False, "OUTPUT_LIMIT", False),
        (obs(exit_code=4, full="/job"), False, "OUTPUT_LIMIT", False),
        # the machine rather than the source
        (obs(exit_code=-1, signal=signal.SIGSEGV), False, "COMPILE_ERROR", False),
        (obs(exit_code=1, pids_limit_hits=2), False, "COMPILE_ERROR", False),
        (obs(exit_code=-1, signal=9, killed="cancelled"), False, "SYSTEM_ERROR", False),
    ],
)
def test_compile_outcomes_and_which_are_cacheable(
    observed: Observed, produced: bool, verdict: str, cacheable: bool
) -> None:
    v, message, c = compile_outcome(observed, LIM, produced)
    assert (v, c) == (verdict, cacheable)
    assert (message == "") == (v == "OK")


class _ScriptedCompiles(FnCallService):
    """The edge's real compile cache (`_compile`, `_compile_now`, `compile_outcome`); only the
    exchange with a pool container answers from a script (tests/integration runs g++)."""

    def __init__(self, tmp: Path) -> None:
        super().__init__("e0", tmp, tmp, FnCallSettings(pools={}))
        self.script: list[tuple[dict[str, Any], Observed]] = []
        self.ran: list[Step] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def _execute(self, pool: Any, step: Step) -> tuple[dict[str, Any], Observed]:
        self.ran.append(step)
        await self.gate.wait()
        return self.script.pop(0)

    async def compile(self, p: Plan) -> tuple[Any, bool]:
        return await self._compile(None, p)  # type: ignore[arg-type]


COMPILED = ({"artifact": b"\x7fELF", "stderr": b""}, obs(wall_s=0.8))
TIMED_OUT = ({"stderr": b""}, obs(exit_code=-1, signal=9, killed="wall", wall_s=0.5))
DIAGNOSED = ({"stderr": b"main.cpp:1: error: nope"}, obs(exit_code=1, wall_s=0.3))


async def test_a_compile_time_limit_is_never_remembered_a_compiler_error_is(
    tmp_path: Path,
) -> None:
    svc = _ScriptedCompiles(tmp_path)
    src = b"int main(){}"
    quick = plan(Job(language="cpp", code=src, compile_time_limit_s=0.5))
    default = plan(Job(language="cpp", code=src))
    svc.script = [TIMED_OUT, COMPILED]
    timed_out, cached = await svc.compile(quick)
    assert (timed_out.verdict, timed_out.exit_code, cached) == ("TIME_LIMIT", -1, False)
    assert "0.5 s" in timed_out.message
    # The same program with the default limit compiles again (no poisoned cache) ...
    compiled, cached = await svc.compile(default)
    assert (compiled.verdict, compiled.artifact, cached) == ("OK", b"\x7fELF", False)
    assert [s.limits.wall_s for s in svc.ran] == [0.5, COMPILE_TIME_LIMIT_S]
    # ... and that success is remembered, whatever the next request's limit.
    again, cached = await svc.compile(quick)
    assert (again.verdict, again.wall_s, cached) == ("OK", 0.8, True) and len(svc.ran) == 2
    # A compiler's own error is the same every time: remembered with its diagnostics.
    bad = plan(Job(language="cpp", code=b"nope"))
    svc.script = [DIAGNOSED]
    first, cached = await svc.compile(bad)
    assert (first.verdict, first.exit_code, cached) == ("COMPILE_ERROR", 1, False)
    second, cached = await svc.compile(plan(Job(language="cpp", code=b"nope", memory_mb=64)))
    assert (second.verdict, second.output, cached) == ("COMPILE_ERROR", first.output, True)
    assert "error: nope" in second.output and len(svc.ran) == 3


async def test_waiting_on_an_identical_compile_shares_it_unless_its_limit_was_smaller(
    tmp_path: Path,
) -> None:
    svc = _ScriptedCompiles(tmp_path)
    src = b"int main(){ return 1; }"
    quick = plan(Job(language="cpp", code=src, compile_time_limit_s=0.5))
    default = plan(Job(language="cpp", code=src))
    svc.script = [TIMED_OUT, COMPILED]
    svc.gate.clear()
    first = asyncio.ensure_future(svc.compile(quick))
    same = asyncio.ensure_future(svc.compile(quick))
    larger = asyncio.ensure_future(svc.compile(default))
    await asyncio.sleep(0)
    assert len(svc.ran) == 1  # one compile under way; the others wait for it
    svc.gate.set()
    (a, a_cached), (b, b_cached), (c, c_cached) = await asyncio.gather(first, same, larger)
    assert (a.verdict, a_cached) == ("TIME_LIMIT", False)
    assert (b.verdict, b_cached) == ("TIME_LIMIT", True)  # the same limit: the same outcome
    assert (c.verdict, c_cached) == ("OK", False)  # a larger limit: it compiled itself
    assert [s.limits.wall_s for s in svc.ran] == [0.5, COMPILE_TIME_LIMIT_S]


async def test_a_given_up_compile_leaves_its_waiters_to_compile_themselves(
    tmp_path: Path,
) -> None:
    svc = _ScriptedCompiles(tmp_path)
    p = plan(Job(language="c", code=b"int main(void){}"))
    svc.script = [COMPILED]
    svc.gate.clear()
    owner = asyncio.ensure_future(svc.compile(p))
    waiter = asyncio.ensure_future(svc.compile(p))
    await asyncio.sleep(0)
    owner.cancel()  # its caller went away
    await asyncio.sleep(0)
    svc.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await owner
    compiled, cached = await waiter
    assert (compiled.verdict, cached) == ("OK", False) and len(svc.ran) == 2


# ------------------------------------------------------------------ settings


def test_pool_settings_from_the_environment() -> None:
    cfg = load(EdgeConfig, "EDGE", {"DSEC_EDGE_FNCALL_POOLS": "python=4,cpp=2,bash=0"})
    s = cfg.fncall_settings()
    assert s.pools == {"python": 4, "cpp": 2}
    assert s.environments["python"].preload == ("numpy",)
    assert load(EdgeConfig, "EDGE", {}).fncall_settings().pools == {
        "python": 4,
        "cpp": 2,
        "bash": 2,
    }
    assert load(EdgeConfig, "EDGE", {"DSEC_EDGE_FNCALL_POOLS": ""}).fncall_settings().pools == {}
    for bad in ("python=x", "Py=1", "python=1000"):
        with pytest.raises(ConfigError):
            load(EdgeConfig, "EDGE", {"DSEC_EDGE_FNCALL_POOLS": bad})


def test_environment_images_can_be_overridden_and_added() -> None:
    envs = environments({"python": "mypython", "rust": "rust-image"})
    assert envs["python"].image == "mypython" and envs["python"].preload == ("numpy",)
    assert envs["rust"].image == "rust-image" and envs["rust"].preload == ()
    assert parse_pools({"rust": "1"}) == {"rust": 1}


# ------------------------------------------------------------------ GPU planning


def test_gpu_query_parsing_and_assignment() -> None:
    gpus = gpu.parse_query("0, GPU-aaa, NVIDIA A100-SXM4-80GB\n1, GPU-bbb, NVIDIA A100\n\n")
    assert [g.uuid for g in gpus] == ["GPU-aaa", "GPU-bbb"]
    assert gpus[0].name == "NVIDIA A100-SXM4-80GB"
    assert [g.index for g in gpu.assign(8, gpus, "exclusive")] == [0, 1]  # one each, capped
    assert [g.index for g in gpu.assign(5, gpus, "shared")] == [0, 1, 0, 1, 0]
    assert len(gpu.assign(20, gpus, "shared", share=4)) == 8
    assert gpu.assign(3, [], "shared") == []
    assert gpu.visible_env(gpus[1])["NVIDIA_VISIBLE_DEVICES"] == "GPU-bbb"
    cmd = gpu.inject_command(gpus[0], 1234, Path("/r"))
    assert "--pid=1234" in cmd and "--device=GPU-aaa" in cmd and cmd[-1] == "/r"


def test_no_gpu_is_reported_with_a_reason() -> None:
    found, why = gpu.detect("no-such-nvidia-smi-binary")
    assert found == [] and "nvidia-smi not found" in why


# ------------------------------------------------------------------ pool queueing


class _Worker:
    def __init__(self, n: int) -> None:
        self.sandbox_id = f"w{n}"
        self.jobs = 0
        self.dead = False
        self.gpu = None


class _Launcher:
    def __init__(self) -> None:
        self.destroyed: list[str] = []

    async def destroy(self, worker: Any, keep_log: bool = False) -> None:
        self.destroyed.append(worker.sandbox_id)


def _pool(**kw: Any) -> tuple[Pool, _Launcher]:
    launcher = _Launcher()
    settings = FnCallSettings(pools={"bash": 1}, **kw)
    pool = Pool(
        settings.environments["bash"],
        1,
        launcher,
        settings,
        asyncio.Semaphore(1),  # type: ignore[arg-type]
    )
    return pool, launcher


async def test_pool_hands_workers_to_waiters_in_order_and_times_out() -> None:
    pool, _ = _pool(max_queue=2)
    w = _Worker(1)
    pool.workers.add(w)  # type: ignore[arg-type]
    pool.release(w)  # type: ignore[arg-type]
    got = await pool.acquire(1.0)
    assert got is w
    first = asyncio.ensure_future(pool.acquire(5.0))
    second = asyncio.ensure_future(pool.acquire(5.0))
    await asyncio.sleep(0)
    with pytest.raises(EdgeCapacity):  # the queue is full
        await pool.acquire(5.0)
    pool.release(w)  # type: ignore[arg-type]
    assert await first is w and not second.done()
    second.cancel()
    with pytest.raises(EdgeCapacity) as e:
        await pool.acquire(0.05)
    assert e.value.reason == "FNCALL_BUSY"


async def test_pool_retires_after_n_jobs_and_on_anomaly() -> None:
    pool, launcher = _pool(jobs_per_container=2)
    a, b = _Worker(1), _Worker(2)
    pool.workers |= {a, b}  # type: ignore[arg-type]
    a.jobs = 2
    pool.release(a)  # type: ignore[arg-type]
    pool.release(b, retire="SysV IPC objects left behind")  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert sorted(launcher.destroyed) == ["w1", "w2"]
    assert not pool.workers and not pool.idle and pool.recycled == 2
    assert pool.changed.is_set()  # the supervisor starts replacements


async def test_a_cancelled_waiter_does_not_lose_the_worker() -> None:
    pool, _ = _pool()
    w = _Worker(1)
    pool.workers.add(w)  # type: ignore[arg-type]
    waiter = asyncio.ensure_future(pool.acquire(5.0))
    await asyncio.sleep(0)
    pool.release(w)  # type: ignore[arg-type]  # handed to the waiter...
    waiter.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert list(pool.idle) == [w]


# ------------------------------------------------------------------ conversions


def test_sdk_job_to_edge_job_and_back() -> None:
    pb = FunctionJob(
        language="cpp",
        code="int main(){}",
        stdin="in",
        files={"a.txt": "x", "b.bin": b"\x00"},
        time_limit_s=2,
        memory_mb=64,
        job_id="j1",
        compile_time_limit_s=5,
        fetch_files=["out/a.txt", "b"],
    ).to_pb()
    job = job_from_pb(pb)
    assert job.code == b"int main(){}" and job.stdin == b"in" and job.job_id == "j1"
    assert job.files == [("a.txt", b"x"), ("b.bin", b"\x00")]
    assert job.compile_time_limit_s == 5 and job.fetch_files == ["out/a.txt", "b"]
    assert job_from_pb(FunctionJob(language="cpp").to_pb()).compile_time_limit_s == 0
    with pytest.raises(TypeError):
        FunctionJob(command=["true"], fetch_files="out.txt").to_pb()  # type: ignore[arg-type]
    r = Result(
        job_id="j1",
        verdict="TIME_LIMIT",
        exit_code=-1,
        signal=9,
        stdout=b"o",
        wall_time_s=2.0,
        index=3,
        message="wall-clock limit of 2 s exceeded",
        edge_id="e0",
    )
    back = FunctionResult.from_pb(result_pb(r))
    assert back.verdict == "TIME_LIMIT" and back.signal == 9 and back.index == 3
    assert back.message.startswith("wall-clock") and back.edge_id == "e0" and not back.ok
    assert back.text == "o"
    assert back.compile is None and back.files == {} and back.fetch_errors == {}
    r.compile = CompileInfo("OK", 0, 1.25, cached=True)
    r.files = [("out/a.txt", b"1\n"), ("empty", b"")]
    r.fetch_errors = {"b": "no such file"}
    back = FunctionResult.from_pb(result_pb(r))
    assert back.compile == SdkCompileInfo("OK", 0, 1.25, True)
    assert back.files == {"out/a.txt": b"1\n", "empty": b""}
    assert back.fetch_errors == {"b": "no such file"}
    r.compile = CompileInfo("TIME_LIMIT", -1, 0.5)
    assert FunctionResult.from_pb(result_pb(r)).compile == SdkCompileInfo(
        "TIME_LIMIT", -1, 0.5, False
    )


def test_apiserver_selects_edges_by_environment_or_language() -> None:
    J = types_pb2.FunctionJob
    assert _selector([J(language="Python")]) == {"fncall.lang.python": "ready"}
    assert _selector([J(language="cpp", environment="gcc13")]) == {"fncall.env.gcc13": "ready"}
    assert _selector([J(language="cpp"), J(language="cpp")]) == {"fncall.lang.cpp": "ready"}
    assert _selector([J(language="cpp"), J(language="python")]) == {}
    assert _selector([J(command=["ls"])]) == {}

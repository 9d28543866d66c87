"""``dsec fncall``: run short jobs in the warm pools from the command line.

    dsec fncall -l python -c 'print(6*7)'
    dsec fncall -l cpp -f sol.cpp --stdin-file in.txt --time-limit-s 2 --memory-mb 256
    dsec fncall -l cpp -f sol.cpp --cases 'tests/*.in'     # compile once, judge every case
    dsec fncall -- sh -c 'uname -a'                          # a command, no language
    dsec fncall -l bash -c 'seq 3 > n.txt' --fetch n.txt --fetch-dir out/   # files back

One job: its stdout/stderr are passed through, a summary goes to stderr, and the exit status
is 0 for OK, the program's own status for RUNTIME_ERROR (128+signal when killed), 1 for any
other verdict. With --cases, every file is one test case's stdin; when ``<case>.out`` or
``<case>.ans`` exists next to it, the output is compared (trailing whitespace ignored) and the
case is AC or WA; the exit status is 0 when every case is OK and none is WA.

--fetch PATH (repeatable) brings files the job wrote back, whatever the verdict, into
--fetch-dir (default: the current directory; with --cases, a directory per case under it);
a path that could not be fetched is named on stderr (and in --json's ``fetch_errors``).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path
from typing import Any

MIB = 1024 * 1024


def add_parser(sub: Any) -> None:
    fn = sub.add_parser(
        "fncall",
        help="run a short job (or a batch of test cases) in a warm pool",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fn.add_argument("-l", "--language", default="", help="python, cpp, c, bash, sh")
    src = fn.add_mutually_exclusive_group()
    src.add_argument("-c", "--code", default=None, help="the program's source")
    src.add_argument("-f", "--file", default=None, help="read the source from a file ('-': stdin)")
    inp = fn.add_mutually_exclusive_group()
    inp.add_argument("--stdin", default=None, help="the job's stdin (text)")
    inp.add_argument("--stdin-file", default=None, help="the job's stdin from a file")
    inp.add_argument("--cases", default=None, help="glob of stdin files: one job per case")
    fn.add_argument("--attach", action="append", default=[], help="extra file PATH[=NAME]")
    fn.add_argument(
        "--time-limit-s", type=float, default=0.0, help="wall-clock limit in seconds (0: 10)"
    )
    fn.add_argument(
        "--cpu-limit-s",
        type=float,
        default=0.0,
        help="CPU-time limit in seconds (0: the wall limit)",
    )
    fn.add_argument(
        "--compile-time-limit-s",
        type=float,
        default=0.0,
        help="C/C++: the compile step's wall-clock limit (0: 30 s); past it, COMPILE_ERROR",
    )
    fn.add_argument("--memory-mb", type=int, default=0, help="memory limit in MiB (0: 256)")
    fn.add_argument(
        "--fetch",
        action="append",
        default=[],
        metavar="PATH",
        help="a file the job writes (relative to its directory) to bring back (repeatable)",
    )
    fn.add_argument(
        "--fetch-dir",
        default=".",
        help="where fetched files are written (default: here; with --cases, a dir per case)",
    )
    fn.add_argument(
        "--max-output-bytes",
        type=int,
        default=0,
        help="per stream; more is verdict OUTPUT_LIMIT (0: 1 MiB)",
    )
    fn.add_argument("--env", default="", help="pool environment (default: the language's)")
    fn.add_argument("--parallelism", type=int, default=0, help="with --cases")
    fn.add_argument("--json", action="store_true", help="print results as JSON lines")
    fn.add_argument("command", nargs=argparse.REMAINDER, help="-- argv (instead of a language)")
    fn.set_defaults(fn=cmd_fncall)


def _job(args: argparse.Namespace) -> dict[str, Any]:
    code = args.code
    if args.file is not None:
        code = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    files: dict[str, bytes] = {}
    for item in args.attach:
        path, _, name = item.partition("=")
        files[name or Path(path).name] = Path(path).read_bytes()
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    return {
        "language": args.language,
        "code": code or "",
        "files": files,
        "command": command,
        "time_limit_s": args.time_limit_s,
        "cpu_limit_s": args.cpu_limit_s,
        "memory_mb": args.memory_mb,
        "max_output_bytes": args.max_output_bytes,
        "environment": args.env,
        "compile_time_limit_s": args.compile_time_limit_s,
        "fetch_files": list(args.fetch),
    }


def _save_fetched(r: Any, into: Path) -> None:
    """Writes the job's fetched files under ``into`` (their relative paths kept) and names
    the ones that could not be fetched on stderr."""
    for path, content in r.files.items():
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    for path, why in r.fetch_errors.items():
        print(f"dsec fncall: {path} not fetched: {why}", file=sys.stderr)


def _summary(r: Any) -> str:
    bits = [r.verdict]
    if r.verdict in ("OK", "RUNTIME_ERROR"):
        bits.append(f"exit {r.exit_code}" if not r.signal else f"signal {r.signal}")
    bits += [
        f"wall {r.wall_time_s * 1000:.1f} ms",
        f"cpu {r.cpu_time_s * 1000:.1f} ms",
        f"peak {r.peak_memory_bytes / MIB:.1f} MiB",
    ]
    if r.message:
        bits.append(r.message)
    return ", ".join(bits)


def _as_json(r: Any, extra: dict[str, Any] | None = None) -> str:
    d = {
        "index": r.index,
        "verdict": r.verdict,
        "exit_code": r.exit_code,
        "signal": r.signal,
        "stdout": r.stdout.decode(errors="replace"),
        "stderr": r.stderr.decode(errors="replace"),
        "wall_time_s": r.wall_time_s,
        "cpu_time_s": r.cpu_time_s,
        "peak_memory_bytes": r.peak_memory_bytes,
        "compile_output": r.compile_output,
        "message": r.message,
        "fetched": sorted(r.files),
        "fetch_errors": r.fetch_errors,
        **(extra or {}),
    }
    return json.dumps(d)


def _expected(case: str) -> str | None:
    base = Path(case)
    for suffix in (".out", ".ans"):
        p = base.with_suffix(suffix)
        if p.is_file():
            return p.read_text()
    return None


def cmd_fncall(args: argparse.Namespace) -> int:
    from libdsec import Client

    job = _job(args)
    if not job["language"] and not job["command"]:
        print("dsec fncall: give --language with --code/--file, or -- COMMAND", file=sys.stderr)
        return 2
    with Client() as c:
        if args.cases is None:
            stdin = b""
            if args.stdin is not None:
                stdin = args.stdin.encode()
            elif args.stdin_file is not None:
                stdin = Path(args.stdin_file).read_bytes()
            r = c.fncall(stdin=stdin, **job)
            _save_fetched(r, Path(args.fetch_dir))
            if args.json:
                print(_as_json(r))
            else:
                if r.verdict == "COMPILE_ERROR":
                    sys.stderr.write(r.compile_output)
                sys.stdout.buffer.write(r.stdout)
                sys.stdout.flush()
                sys.stderr.buffer.write(r.stderr)
                print(f"dsec: {_summary(r)}", file=sys.stderr)
            if r.verdict == "OK":
                return 0
            if r.verdict == "RUNTIME_ERROR":
                return (128 + r.signal) if r.signal else (r.exit_code or 1)
            return 1
        cases = sorted(glob.glob(args.cases))
        if not cases:
            print(f"dsec fncall: no file matches {args.cases!r}", file=sys.stderr)
            return 2
        jobs = [{**job, "stdin": Path(p).read_bytes(), "job_id": p} for p in cases]
        bad = 0
        for r in c.fncall_many(jobs, parallelism=args.parallelism):
            case = cases[r.index]
            _save_fetched(r, Path(args.fetch_dir) / Path(case).name)
            want = _expected(case)
            judge = "-"
            if r.verdict == "OK" and want is not None:
                judge = "AC" if r.text.rstrip() == want.rstrip() else "WA"
            bad += r.verdict != "OK" or judge == "WA"
            if args.json:
                print(_as_json(r, {"case": case, "judge": judge}), flush=True)
            else:
                print(f"{case}  {judge:<2}  {_summary(r)}", flush=True)
                if r.verdict == "COMPILE_ERROR" and r.index == 0:
                    sys.stderr.write(r.compile_output)
        print(f"dsec: {len(cases) - bad}/{len(cases)} cases passed", file=sys.stderr)
        return 0 if bad == 0 else 1

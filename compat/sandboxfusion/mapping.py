"""dsec FnCall results as SandboxFusion answers them (pure: no I/O).

SandboxFusion's ``RunCodeResponse``: ``status`` "Success" / "Failed" / "SandboxError", a
``message``, ``compile_result`` (compiled languages) and ``run_result``, each a
``CommandRunResult``: ``status`` "Finished" / "TimeLimitExceeded" / "Error",
``execution_time`` (s), ``return_code``, ``stdout``, ``stderr``; ``files`` (path -> base64) and
``executor_pod_name``. The top-level status follows the reference's rule (``parse_run_status``):
an ``Error`` step is a SandboxError, a time limit or a non-zero return code is Failed.

dsec's verdicts map onto that as the reference would have observed the same program:

=============  ======================================================================
OK             Finished, return_code 0
RUNTIME_ERROR  Finished, the exit code (or minus the signal, as Python's returncode)
TIME_LIMIT     TimeLimitExceeded, no return code (the reference kills it and has none)
MEMORY_LIMIT   Finished, the exit code or minus the killing signal (SIGKILL when dsec
               judged the peak after a clean exit): the reference's program dies too
OUTPUT_LIMIT   Finished, minus the killing signal: dsec stops a program past its output
               limit (the reference has none); the output is the part kept
COMPILE_ERROR  compile_result Finished with the compiler's return code (TimeLimitExceeded
               when the compile step hit its limit), no run_result
SYSTEM_ERROR   the step is Error with dsec's message: the platform failed, not the program
=============  ======================================================================

dsec adds ``cpu_time`` (s; the sandbox-fusion client's model has the field) and, for a step
that did not end OK, its verdict and message in the top-level ``message``.
"""

from __future__ import annotations

import base64
import signal
from typing import Any

from libdsec import FunctionResult

FINISHED = "Finished"
TIME_LIMIT_EXCEEDED = "TimeLimitExceeded"
ERROR = "Error"


def _text(data: bytes) -> str:
    return data.decode(errors="replace")


def return_code(r: FunctionResult) -> int:
    """The return code the reference would report (asyncio's: -N for a signal)."""
    if r.exit_code > 0:
        return r.exit_code
    if r.signal:
        return -r.signal
    if r.verdict in ("OK", "TIME_LIMIT"):
        return 0
    # MEMORY_LIMIT judged on the peak, OUTPUT_LIMIT of a file: dsec ended it; the
    # reference's process would have been killed.
    return -int(signal.SIGKILL)


def compile_result(r: FunctionResult) -> dict[str, Any] | None:
    info = r.compile
    if info is None:
        return None
    out: dict[str, Any] = {
        "status": FINISHED,
        "execution_time": info.wall_time_s,
        "return_code": info.exit_code,
        "stdout": "",
        "stderr": r.compile_output if r.verdict == "COMPILE_ERROR" else "",
    }
    if info.verdict == "TIME_LIMIT":
        out.update(status=TIME_LIMIT_EXCEEDED, return_code=None)
    elif info.verdict == "SYSTEM_ERROR":
        out.update(status=ERROR, return_code=None, stderr=r.message or r.compile_output)
    elif info.verdict != "OK" and info.exit_code == 0:
        # No program although the compiler said 0 (COMPILE_ERROR), or a limit dsec enforced
        # on the step: never a return code the caller could read as success.
        out["return_code"] = 1 if info.verdict == "COMPILE_ERROR" else -int(signal.SIGKILL)
    return out


def run_result(r: FunctionResult) -> dict[str, Any] | None:
    if r.verdict == "COMPILE_ERROR":
        return None  # nothing ran
    if r.verdict == "SYSTEM_ERROR":
        return {
            "status": ERROR,
            "execution_time": r.wall_time_s or None,
            "return_code": None,
            "stdout": _text(r.stdout),
            "stderr": r.message or "dsec could not run the job",
        }
    out: dict[str, Any] = {
        "status": FINISHED,
        "execution_time": r.wall_time_s,
        "cpu_time": r.cpu_time_s,
        "return_code": return_code(r),
        "stdout": _text(r.stdout),
        "stderr": _text(r.stderr),
    }
    if r.verdict == "TIME_LIMIT":
        out.update(status=TIME_LIMIT_EXCEEDED, return_code=None)
    return out


def overall(steps: list[dict[str, Any] | None]) -> tuple[str, str]:
    """(status, message) by the reference's rule."""
    done = [s for s in steps if s is not None]
    for s in done:
        if s["status"] == ERROR:
            return "SandboxError", str(s.get("stderr") or "")
    if any(s["status"] == TIME_LIMIT_EXCEEDED for s in done):
        return "Failed", ""
    if any(s.get("return_code") not in (0, None) for s in done):
        return "Failed", ""
    return "Success", ""


def run_code_response(r: FunctionResult) -> dict[str, Any]:
    compiled = compile_result(r)
    ran = run_result(r)
    status, message = overall([compiled, ran])
    if status == "Failed" and r.verdict != "OK":
        message = f"{r.verdict}: {r.message}" if r.message else r.verdict
    if r.fetch_errors:
        missing = "; ".join(f"{p}: {why}" for p, why in sorted(r.fetch_errors.items()))
        message = f"{message}; " if message else ""
        message += f"fetch_files not returned: {missing}"
    return {
        "status": status,
        "message": message,
        "compile_result": compiled,
        "run_result": ran,
        "executor_pod_name": r.edge_id or None,
        "files": {p: base64.b64encode(c).decode() for p, c in r.files.items()},
    }


def sandbox_error(message: str) -> dict[str, Any]:
    """The answer when dsec could not run the job at all (the reference's exception path)."""
    return {
        "status": "SandboxError",
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": None,
        "files": {},
    }


def batch_status(responses: list[dict[str, Any]]) -> str:
    statuses = {r["status"] for r in responses}
    for s in ("SandboxError", "Failed"):
        if s in statuses:
            return s
    return "Success"

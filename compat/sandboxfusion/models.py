"""SandboxFusion's request bodies, validated as the reference service validates them.

The reference is a FastAPI service: a body that does not validate is answered 422 with
``{"detail": [{"type", "loc", "msg", "input", "ctx"?}, ...]}`` (pydantic's errors, ``loc``
starting with ``"body"``); clients print that body. The same models here give the same
answers, so a client sees the errors it knows. Where dsec is stricter than the reference (a
file path must stay in the job directory, timeouts are bounded, only the languages dsec's
FnCall pools run), the error has the same shape and names the field (or the file).

After validation, :func:`job_files` decodes the base64 files (each error names its file) and
:func:`fetch_paths` checks the ``fetch_files``; both pure functions of the request.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: The languages dsec's FnCall pools run (edge/fncall/jobs.py LANGUAGES; a unit test keeps the
#: two lists equal). SandboxFusion has no "c" or "sh"; dsec offers them as well.
Language = Literal["python", "cpp", "c", "bash", "sh"]
#: Compiled languages: their answers carry a compile_result.
COMPILED = frozenset({"cpp", "c"})
#: dsec's bounds on a job (edge/fncall/jobs.py): wall clock, compile wall clock, memory.
MAX_TIMEOUT_S = 600.0
MIN_MEMORY_MB = 16
MAX_FETCH_FILES = 64
#: The reference skips a file whose name contains this marker (its datasets use it).
IGNORED_FILE_MARK = "IGNORE_THIS_FILE"
_PATH_PART = re.compile(r"^[A-Za-z0-9_.+-]+$")


class RunCodeRequest(BaseModel):
    """``POST /run_code``: the reference's fields and defaults; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    compile_timeout: float = Field(10, gt=0, le=MAX_TIMEOUT_S)
    run_timeout: float = Field(10, gt=0, le=MAX_TIMEOUT_S)
    #: -1 (the reference's default, "no limit"): the front end's default memory.
    memory_limit_MB: int = Field(-1, ge=-1)
    code: str
    stdin: str | None = None
    language: Language
    #: path -> base64 content; a None content is skipped (as the reference does).
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list, max_length=MAX_FETCH_FILES)


class BatchCase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stdin: str | None = None


class RunCodeBatchRequest(RunCodeRequest):
    """``POST /run_code_batch`` (dsec's own): one program, many stdin cases, compiled once.
    ``stdin`` of the program is not used: each case brings its own."""

    cases: list[BatchCase] = Field(min_length=1)


class RequestInvalid(Exception):
    """A body the reference would answer 422: ``detail`` is its list of errors."""

    def __init__(self, detail: list[dict[str, Any]]) -> None:
        super().__init__(detail[0]["msg"] if detail else "invalid request")
        self.detail = detail


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], raw: bytes) -> M:
    """The body as ``model``; :class:`RequestInvalid` with FastAPI's error list otherwise."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestInvalid([_detail(e) for e in exc.errors(include_url=False)]) from None


def _detail(error: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": error["type"],
        "loc": ["body", *error["loc"]],
        "msg": error["msg"],
        "input": _jsonable(error.get("input")),
    }
    if error.get("ctx"):  # e.g. {"error": ValueError(...)}: plain JSON as FastAPI sends it
        out["ctx"] = {
            k: _jsonable(v) if isinstance(v, str | int | float | bool) or v is None else str(v)
            for k, v in error["ctx"].items()
        }
    return out


def _jsonable(value: Any) -> Any:
    """A validation error's input as JSON can carry it: the raw body of bad JSON is bytes,
    and the JSON parser takes ``NaN`` and ``Infinity``, which strict JSON (the response)
    cannot carry: they are sent as strings ("inf"; they made the 422 a 500, found by
    tests/fuzz)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode(errors="replace")
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def invalid(loc: list[str | int], msg: str, value: Any) -> RequestInvalid:
    """One 422 error in the reference's shape, for a check of dsec's own."""
    return RequestInvalid(
        [
            {
                "type": "value_error",
                "loc": ["body", *loc],
                "msg": f"Value error, {msg}",
                "input": value,
                "ctx": {"error": msg},
            }
        ]
    )


def memory_mb(req: RunCodeRequest, *, default_mb: int, max_mb: int) -> int:
    """The job's memory limit: -1 or 0 = ``default_mb``; else within dsec's bounds."""
    m = req.memory_limit_MB
    if m in (-1, 0):
        return default_mb
    if not MIN_MEMORY_MB <= m <= max_mb:
        raise invalid(
            ["memory_limit_MB"],
            f"memory_limit_MB must be -1 (the default, {default_mb} MB) or {MIN_MEMORY_MB}..{max_mb}",
            m,
        )
    return m


def job_path(path: str) -> str | None:
    """``path`` relative to the job directory (a leading ``./`` dropped), or None if it
    would leave it or has parts dsec does not write."""
    p = path.removeprefix("./")
    parts = p.split("/")
    if not p or len(p) > 255 or any(x in ("", ".", "..") or not _PATH_PART.match(x) for x in parts):
        return None
    return p


def job_files(req: RunCodeRequest, *, max_bytes: int) -> dict[str, bytes]:
    """The request's files decoded, each error naming its file; at most ``max_bytes`` in
    all together with the code (the file that passes the limit is named)."""
    out: dict[str, bytes] = {}
    total = len(req.code.encode())
    for name, content in req.files.items():
        if content is None or IGNORED_FILE_MARK in name:
            continue
        path = job_path(name)
        if path is None:
            raise invalid(
                ["files", name],
                f"file {name!r}: the path must be relative to the job directory, without "
                "'..', of [A-Za-z0-9_.+-] parts",
                name,
            )
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise invalid(["files", name], f"file {name!r} is not base64: {exc}", None) from None
        total += len(data)
        if total > max_bytes:
            raise invalid(
                ["files", name],
                f"file {name!r} ({len(data)} bytes decoded) takes the code and files past "
                f"the limit of {max_bytes} bytes",
                None,
            )
        out[path] = data
    return out


def fetch_paths(req: RunCodeRequest) -> list[str]:
    paths: list[str] = []
    for i, name in enumerate(req.fetch_files):
        path = job_path(name)
        if path is None:
            raise invalid(
                ["fetch_files", i],
                f"fetch_files[{i}] {name!r}: the path must be relative to the job "
                "directory, without '..', of [A-Za-z0-9_.+-] parts",
                name,
            )
        if path not in paths:
            paths.append(path)
    return paths

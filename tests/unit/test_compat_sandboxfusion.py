"""The SandboxFusion front end's pure parts: request validation in the reference's 422 shape,
dsec verdicts in SandboxFusion's vocabulary, routing (token prefix, error bodies), configuration."""

from __future__ import annotations

import base64
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from typing import Any, cast, get_args

import httpx
import pytest

from common.config import ConfigError
from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.sandboxfusion import mapping
from compat.sandboxfusion.app import SandboxFusionApp
from compat.sandboxfusion.models import (
    Language,
    RequestInvalid,
    RunCodeBatchRequest,
    RunCodeRequest,
    fetch_paths,
    job_files,
    memory_mb,
    parse,
)
from edge.fncall.jobs import LANGUAGES
from libdsec import CompileInfo, FunctionResult


def _body(**kw: Any) -> bytes:
    return json.dumps({"code": "print(1)", "language": "python", **kw}).encode()


def _detail(raw: bytes, model: type[RunCodeRequest] = RunCodeRequest) -> list[dict[str, Any]]:
    with pytest.raises(RequestInvalid) as info:
        parse(model, raw)
    return info.value.detail


# ------------------------------------------------------------------ requests


def test_defaults_are_the_references() -> None:
    req = parse(RunCodeRequest, _body(unknown_field=1))
    assert (req.compile_timeout, req.run_timeout, req.memory_limit_MB) == (10, 10, -1)
    assert req.stdin is None and req.files == {} and req.fetch_files == []


def test_languages_are_fncalls() -> None:
    assert set(get_args(Language)) == set(LANGUAGES)


def test_not_json_is_422_json_invalid() -> None:
    [err] = _detail(b"{not json")
    assert err["type"] == "json_invalid" and err["loc"][0] == "body"


def test_missing_code_names_the_field() -> None:
    [err] = _detail(json.dumps({"language": "python"}).encode())
    assert err == {
        "type": "missing",
        "loc": ["body", "code"],
        "msg": "Field required",
        "input": {"language": "python"},
    }


def test_unsupported_language_lists_the_offered_ones() -> None:
    [err] = _detail(_body(language="go"))
    assert err["type"] == "literal_error" and err["loc"] == ["body", "language"]
    for lang in ("python", "cpp", "bash"):
        assert f"'{lang}'" in err["msg"]


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("run_timeout", -1, "greater_than"),
        ("run_timeout", 0, "greater_than"),
        ("run_timeout", 1e9, "less_than_equal"),
        ("compile_timeout", 601, "less_than_equal"),
        ("memory_limit_MB", -5, "greater_than_equal"),
    ],
)
def test_bad_limits_name_the_field(field: str, value: float, kind: str) -> None:
    [err] = _detail(_body(**{field: value}))
    assert err["type"] == kind and err["loc"] == ["body", field]


def test_memory_default_and_bounds() -> None:
    assert memory_mb(parse(RunCodeRequest, _body()), default_mb=1024, max_mb=4096) == 1024
    assert (
        memory_mb(parse(RunCodeRequest, _body(memory_limit_MB=0)), default_mb=512, max_mb=4096)
        == 512
    )
    assert (
        memory_mb(parse(RunCodeRequest, _body(memory_limit_MB=256)), default_mb=1, max_mb=4096)
        == 256
    )
    for bad in (8, 5000):
        with pytest.raises(RequestInvalid) as info:
            memory_mb(
                parse(RunCodeRequest, _body(memory_limit_MB=bad)), default_mb=1024, max_mb=4096
            )
        assert info.value.detail[0]["loc"] == ["body", "memory_limit_MB"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_files_decoded_and_skipped_as_the_reference_does() -> None:
    req = parse(
        RunCodeRequest,
        _body(
            files={
                "data/in.txt": _b64(b"42"),
                "./top.txt": _b64(b"x"),
                "none.txt": None,
                "IGNORE_THIS_FILE.txt": _b64(b"y"),
            }
        ),
    )
    assert job_files(req, max_bytes=1000) == {"data/in.txt": b"42", "top.txt": b"x"}


@pytest.mark.parametrize("name", ["/etc/passwd", "../up.txt", "a/../../b", "sp ace.txt", ""])
def test_file_path_leaving_the_job_dir_is_named(name: str) -> None:
    req = parse(RunCodeRequest, _body(files={name: _b64(b"x")}))
    with pytest.raises(RequestInvalid) as info:
        job_files(req, max_bytes=1000)
    assert info.value.detail[0]["loc"] == ["body", "files", name]


def test_bad_base64_and_oversized_files_are_named() -> None:
    req = parse(RunCodeRequest, _body(files={"a.bin": "!!!not base64"}))
    with pytest.raises(RequestInvalid) as info:
        job_files(req, max_bytes=1000)
    assert info.value.detail[0]["loc"] == ["body", "files", "a.bin"]
    assert "base64" in info.value.detail[0]["msg"]
    req = parse(
        RunCodeRequest, _body(files={"ok.bin": _b64(b"x" * 10), "big.bin": _b64(b"x" * 990)})
    )
    with pytest.raises(RequestInvalid) as info:
        job_files(req, max_bytes=1000)
    assert info.value.detail[0]["loc"] == ["body", "files", "big.bin"]
    assert "big.bin" in info.value.detail[0]["msg"] and "1000" in info.value.detail[0]["msg"]


def test_fetch_files_checked_and_deduplicated() -> None:
    assert fetch_paths(
        parse(RunCodeRequest, _body(fetch_files=["out.txt", "./out.txt", "d/e"]))
    ) == ["out.txt", "d/e"]
    with pytest.raises(RequestInvalid) as info:
        fetch_paths(parse(RunCodeRequest, _body(fetch_files=["ok", "/etc/shadow"])))
    assert info.value.detail[0]["loc"] == ["body", "fetch_files", 1]
    [err] = _detail(_body(fetch_files=[f"f{i}" for i in range(65)]))
    assert err["type"] == "too_long" and err["loc"] == ["body", "fetch_files"]


def test_batch_needs_cases() -> None:
    [err] = _detail(_body(cases=[]), RunCodeBatchRequest)
    assert err["loc"] == ["body", "cases"]
    req = parse(RunCodeBatchRequest, _body(cases=[{"stdin": "1"}, {}]))
    assert [c.stdin for c in req.cases] == ["1", None]


# ------------------------------------------------------------------ answers


def _result(verdict: str, **kw: Any) -> FunctionResult:
    base: dict[str, Any] = dict(
        verdict=verdict,
        exit_code=0,
        signal=0,
        stdout=b"out",
        stderr=b"err",
        wall_time_s=0.25,
        cpu_time_s=0.2,
        peak_memory_bytes=1 << 20,
        edge_id="e0",
    )
    base.update(kw)
    return FunctionResult(**base)


def test_ok_is_success_finished_zero() -> None:
    a = mapping.run_code_response(_result("OK", files={"o.txt": b"hi"}))
    assert a["status"] == "Success" and a["message"] == ""
    assert a["compile_result"] is None
    assert a["run_result"] == {
        "status": "Finished",
        "execution_time": 0.25,
        "cpu_time": 0.2,
        "return_code": 0,
        "stdout": "out",
        "stderr": "err",
    }
    assert a["files"] == {"o.txt": _b64(b"hi")} and a["executor_pod_name"] == "e0"


@pytest.mark.parametrize(
    ("verdict", "kw", "status", "code"),
    [
        ("RUNTIME_ERROR", {"exit_code": 3}, "Finished", 3),
        ("RUNTIME_ERROR", {"exit_code": -1, "signal": 11}, "Finished", -11),
        ("MEMORY_LIMIT", {"exit_code": -1, "signal": 9}, "Finished", -9),
        ("MEMORY_LIMIT", {}, "Finished", -int(signal.SIGKILL)),
        ("OUTPUT_LIMIT", {"exit_code": -1, "signal": 9}, "Finished", -9),
        ("TIME_LIMIT", {"exit_code": -1, "signal": 9}, "TimeLimitExceeded", None),
    ],
)
def test_failures_are_failed_with_the_references_return_code(
    verdict: str, kw: dict[str, Any], status: str, code: int | None
) -> None:
    a = mapping.run_code_response(_result(verdict, message="why", **kw))
    assert a["status"] == "Failed"
    assert a["run_result"]["status"] == status and a["run_result"]["return_code"] == code
    assert a["message"] == f"{verdict}: why"


def test_system_error_is_sandbox_error() -> None:
    a = mapping.run_code_response(_result("SYSTEM_ERROR", message="the pool container failed"))
    assert a["status"] == "SandboxError" and a["message"] == "the pool container failed"
    assert a["run_result"]["status"] == "Error"


def test_compile_outcomes() -> None:
    ok = mapping.run_code_response(
        _result("OK", compile=CompileInfo(verdict="OK", exit_code=0, wall_time_s=1.5, cached=True))
    )
    assert ok["status"] == "Success"
    assert ok["compile_result"]["status"] == "Finished" and ok["compile_result"]["return_code"] == 0
    assert ok["compile_result"]["execution_time"] == 1.5
    bad = mapping.run_code_response(
        _result(
            "COMPILE_ERROR",
            compile=CompileInfo(
                verdict="COMPILE_ERROR", exit_code=1, wall_time_s=0.3, cached=False
            ),
            compile_output="main.cpp:1: error: expected ';'",
        )
    )
    assert bad["status"] == "Failed" and bad["run_result"] is None
    assert bad["compile_result"]["return_code"] == 1
    assert "expected ';'" in bad["compile_result"]["stderr"]
    slow = mapping.run_code_response(
        _result(
            "COMPILE_ERROR",
            compile=CompileInfo(verdict="TIME_LIMIT", exit_code=-1, wall_time_s=0.5, cached=False),
        )
    )
    assert slow["status"] == "Failed"
    assert slow["compile_result"]["status"] == "TimeLimitExceeded"
    assert slow["compile_result"]["return_code"] is None


def test_fetch_errors_are_reported_in_the_message() -> None:
    a = mapping.run_code_response(_result("OK", fetch_errors={"gone.txt": "no such file"}))
    assert a["status"] == "Success" and "gone.txt: no such file" in a["message"]


def test_batch_status_is_the_worst() -> None:
    ok = mapping.run_code_response(_result("OK"))
    failed = mapping.run_code_response(_result("RUNTIME_ERROR", exit_code=1))
    assert mapping.batch_status([ok, ok]) == "Success"
    assert mapping.batch_status([ok, failed]) == "Failed"
    assert mapping.batch_status([failed, mapping.sandbox_error("x")]) == "SandboxError"


# ------------------------------------------------------------------ routing, config


class _Pool:
    """Leases record the token they were asked for (no API server behind them)."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    @contextlib.asynccontextmanager
    async def lease(self, token: str) -> AsyncIterator[object]:
        self.tokens.append(token)
        yield object()


async def test_routes_token_prefix_and_error_bodies() -> None:
    """Each route also under /t/<token>/, a trailing slash ignored, the token from the URL
    before the bearer header, and FastAPI's bodies for 404, 405, 401, 422 and the 501s."""
    pool = _Pool()
    app = SandboxFusionApp(CompatConfig(), cast(ClientPool, pool), default_token="")
    bearer = {"Authorization": "Bearer b"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sf") as http:
        r = await http.get("/v1/ping")
        assert r.json() == "pong" and pool.tokens == []
        r = await http.get("/t/dsec_ab_cd/v1/ping/")
        assert r.json() == "pong" and pool.tokens == ["dsec_ab_cd"]
        r = await http.post("/t/tok/run_code", content=b"{}", headers=bearer)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "code"]
        r = await http.post("/run_code_batch/", content=b"{}", headers=bearer)
        assert r.status_code == 422 and pool.tokens == ["dsec_ab_cd", "tok", "b"]
        r = await http.post("/run_code", content=_body())
        assert r.status_code == 401 and "/t/<token>/run_code" in r.json()["detail"]
        r = await http.get("/t/tok/run_jupyter")
        assert r.status_code == 501 and "Jupyter" in r.json()["detail"]
        r = await http.get("/run_code")
        assert (r.status_code, r.json()) == (405, {"detail": "Method Not Allowed"})
        r = await http.get("/t/tok/nothing")
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})


def test_token_file_needs_a_loopback_listener() -> None:
    CompatConfig(sandbox_fusion_listen="127.0.0.1:7131", sandbox_fusion_token_file="/t").validate()
    with pytest.raises(ConfigError, match="loopback"):
        CompatConfig(
            sandbox_fusion_listen="0.0.0.0:7131", sandbox_fusion_token_file="/t"
        ).validate()
    with pytest.raises(ConfigError, match="differ"):
        CompatConfig(listen="127.0.0.1:7130", sandbox_fusion_listen="127.0.0.1:7130").validate()


def test_a_compile_without_a_program_is_never_success() -> None:
    a = mapping.run_code_response(
        _result(
            "COMPILE_ERROR",
            compile=CompileInfo(
                verdict="COMPILE_ERROR", exit_code=0, wall_time_s=0.1, cached=False
            ),
            compile_output="the compiler produced no program",
        )
    )
    assert a["status"] == "Failed" and a["compile_result"]["return_code"] == 1
    mem = mapping.run_code_response(
        _result(
            "COMPILE_ERROR",
            compile=CompileInfo(verdict="MEMORY_LIMIT", exit_code=0, wall_time_s=0.1, cached=False),
        )
    )
    assert mem["status"] == "Failed" and mem["compile_result"]["return_code"] == -9


def test_every_error_body_is_json() -> None:
    for raw in (b"{not json", b"[1, 2]", b'{"code": 1, "language": ["x"]}', b"\xff\xfe"):
        json.dumps(_detail(raw))

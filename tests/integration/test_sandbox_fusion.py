"""SandboxFusion's API on dsec, driven by the real clients from PyPI.

verl's own reward code (``verl.utils.reward_score.sandbox_fusion``, loaded from the installed
verl without importing the rest of verl, see tests/verl_support.py) and the
``sandbox-fusion`` client post to the compat process's SandboxFusion listener; every job runs
in the container edge's warm FnCall pools (runc). The URL carries the token
(``/t/<token>/run_code``), as an operator would hand it to a trainer.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sandbox_fusion

from dsecctl.cluster import LocalCluster, free_port
from libdsec import Client
from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith
from tests.verl_support import load_verl_sandbox_fusion

pytestmark = pytest.mark.images("bookworm", "python")

PY_SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
PY_WRONG = "a, b = map(int, input().split())\nprint(a - b)\n"
PY_SLOW = "import time\ntime.sleep(30)\n"
PY_CRASH = "raise SystemExit(int(input().split()[0]) % 7 + 1)\n"
CPP_SUM = '#include <cstdio>\nint main(){long a,b;scanf("%ld %ld",&a,&b);printf("%ld\\n",a+b);}\n'
CPP_WRONG = (
    '#include <cstdio>\nint main(){long a,b;scanf("%ld %ld",&a,&b);printf("%ld\\n",a-b-1);}\n'
)
CPP_SLOW = "int main(){volatile unsigned long x=0; for(;;) x++;}\n"
CPP_CRASH = "#include <cstdlib>\nint main(){ std::abort(); }\n"
CPP_BROKEN = "int main() { return missing_name; }\n"
CASES = {"inputs": ["1 2\n", "40 2\n", "-5 5\n", "100 200\n"], "outputs": ["3", "42", "0", "300"]}


@pytest.fixture(scope="module")
def fusion_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: an edge with FnCall pools."""
    with cluster_with("sf0", edge_env={"DSEC_EDGE_FNCALL_POOLS": "python=2,cpp=1,bash=1"}) as c:
        with Client(c.apiserver, token=c.token) as client:
            assert client.fncall(language="python", code="print('warm')").ok  # pools are up
        yield c


@pytest.fixture(scope="module")
def token(fusion_cluster: LocalCluster) -> str:
    with Client(fusion_cluster.apiserver, token=fusion_cluster.token) as admin:
        return admin.create_token("verl-trainer", agent=True).secret


@pytest.fixture(scope="module")
def endpoint(fusion_cluster: LocalCluster, token: str) -> str:
    """The base URL an operator hands out: SandboxFusion's paths go after it."""
    return f"{fusion_cluster.sandbox_fusion_url}/t/{token}"


def post(
    url: str, body: Any, *, raw: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# ------------------------------------------------------------------ verl


def test_verl_check_correctness_python(endpoint: str) -> None:
    utils = sys.modules[load_verl_sandbox_fusion().__name__ + ".utils"]
    url = f"{endpoint}/run_code"

    def check(code: str, timeout: int = 5) -> list[Any]:
        results, metadata = utils.check_correctness(
            url, CASES, code, timeout=timeout, memory_limit_mb=256, language="python"
        )
        assert all(m["api_request_error"] is None for m in metadata), metadata
        return list(results)

    assert check(PY_SUM) == [True] * 4
    assert check(PY_WRONG) == [False, False, False, False]
    assert check(PY_SLOW, timeout=1) == [-3] * 4
    assert check(PY_CRASH) == [-2] * 4
    assert check("def broken(:\n") == [-2] * 4  # a SyntaxError exits 1, as in the reference
    assert "verl" not in sys.modules  # verl's GPU stack was never imported


def test_verl_check_correctness_cpp(endpoint: str) -> None:
    utils = sys.modules[load_verl_sandbox_fusion().__name__ + ".utils"]
    url = f"{endpoint}/run_code"

    def check(code: str, timeout: int = 10) -> tuple[list[Any], list[dict[str, Any]]]:
        results, metadata = utils.check_correctness(
            url, CASES, code, timeout=timeout, memory_limit_mb=512, language="cpp"
        )
        return list(results), metadata

    ok, meta = check(CPP_SUM)
    assert ok == [True] * 4 and meta[0]["compile_status"] == "Finished"
    assert check(CPP_WRONG)[0] == [False] * 4
    assert check(CPP_SLOW, timeout=1)[0] == [-3] * 4
    crashed, meta = check(CPP_CRASH)
    assert crashed == [-2] * 4 and meta[0]["exit_code"] == -6  # SIGABRT, as asyncio reports it
    broken, meta = check(CPP_BROKEN)
    assert broken == [-4] * 4
    assert any("missing_name" in (m.get("compile_stderr") or "") for m in meta)


def test_verl_compute_score(endpoint: str) -> None:
    reward = load_verl_sandbox_fusion()
    completion = f"Here is my answer:\n```python\n{PY_SUM}```\n"
    score, metadata = reward.compute_score(
        f"{endpoint}/run_code", None, 256, completion, json.dumps(CASES), timeout=5
    )
    assert score == 1.0 and [m["status"] for m in metadata] == ["success"] * 4
    half = {"inputs": CASES["inputs"], "outputs": ["3", "41", "0", "301"]}
    score, _ = reward.compute_score(f"{endpoint}/run_code", None, 256, completion, half)
    assert score == 0.5


# --------------------------------------------------------- sandbox-fusion client


def test_sandbox_fusion_client_run_code(endpoint: str) -> None:
    req = sandbox_fusion.RunCodeRequest(
        code=(
            "import json, pathlib\n"
            "n = json.load(open('data/in.json'))['n']\n"
            "pathlib.Path('out').mkdir()\n"
            "pathlib.Path('out/sq.txt').write_text(str(n * n))\n"
            "print('done', n)\n"
        ),
        language="python",
        files={"data/in.json": base64.b64encode(b'{"n": 12}').decode()},
        fetch_files=["out/sq.txt", "missing.txt"],
    )
    r = sandbox_fusion.run_code(req, endpoint=endpoint)
    assert r.status == sandbox_fusion.RunStatus.Success
    assert r.run_result is not None and r.run_result.stdout == "done 12\n"
    assert r.run_result.return_code == 0 and r.run_result.execution_time is not None
    assert base64.b64decode(r.files["out/sq.txt"]) == b"144"
    assert "missing.txt" not in r.files and "missing.txt" in r.message
    assert sandbox_fusion.summary_run_code_result(r, sandbox_fusion.SummaryMapping()) == "Success"

    cpp = sandbox_fusion.run_code(
        sandbox_fusion.RunCodeRequest(code=CPP_SUM, language="cpp", stdin="20 22"),
        endpoint=endpoint,
    )
    assert cpp.compile_result is not None and cpp.compile_result.return_code == 0
    assert cpp.run_result is not None and cpp.run_result.stdout == "42\n"
    broken = sandbox_fusion.run_code(
        sandbox_fusion.RunCodeRequest(code=CPP_BROKEN, language="cpp"), endpoint=endpoint
    )
    mapping = sandbox_fusion.SummaryMapping(CompileFailed="CE", RunTimeout="TLE")
    assert sandbox_fusion.summary_run_code_result(broken, mapping) == "CE"
    slow = sandbox_fusion.run_code(
        sandbox_fusion.RunCodeRequest(code=PY_SLOW, language="python", run_timeout=0.5),
        endpoint=endpoint,
    )
    assert sandbox_fusion.summary_run_code_result(slow, mapping) == "TLE"


def test_wrong_token_is_401_the_client_surfaces(fusion_cluster: LocalCluster) -> None:
    bad = f"{fusion_cluster.sandbox_fusion_url}/t/dsec_0000000000000000_nope"
    with pytest.raises(Exception, match="401") as info:
        sandbox_fusion.run_code(
            sandbox_fusion.RunCodeRequest(code="print(1)", language="python"),
            endpoint=bad,
            max_attempts=1,
        )
    assert "dsec refused the token" in str(info.value)
    status, body = post(
        f"{fusion_cluster.sandbox_fusion_url}/run_code", {"code": "1", "language": "python"}
    )
    assert status == 401 and "/t/<token>/run_code" in body["detail"]


def test_bearer_header_and_ping(fusion_cluster: LocalCluster, token: str, endpoint: str) -> None:
    base = fusion_cluster.sandbox_fusion_url
    status, body = post(
        f"{base}/run_code",
        {"code": "print(6*7)", "language": "python"},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert status == 200 and body["run_result"]["stdout"] == "42\n"
    with urllib.request.urlopen(f"{base}/v1/ping", timeout=10) as resp:
        assert json.loads(resp.read()) == "pong"
    with urllib.request.urlopen(f"{endpoint}/v1/ping", timeout=10) as resp:
        assert json.loads(resp.read()) == "pong"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{base}/t/dsec_0000000000000000_nope/v1/ping", timeout=10)
    assert info.value.code == 401


# ------------------------------------------------------------------ bad input


def test_bad_bodies_answer_as_the_reference(endpoint: str) -> None:
    url = f"{endpoint}/run_code"
    status, body = post(url, None, raw=b"{this is not json")
    assert status == 422 and body["detail"][0]["type"] == "json_invalid"
    status, body = post(url, {"language": "python"})
    assert status == 422 and body["detail"][0]["loc"] == ["body", "code"]
    status, body = post(url, {"code": "x", "language": "go"})
    assert status == 422 and body["detail"][0]["loc"] == ["body", "language"]
    assert "'python'" in body["detail"][0]["msg"] and "'cpp'" in body["detail"][0]["msg"]
    for field, value in (("run_timeout", -1), ("compile_timeout", 1e9)):
        status, body = post(url, {"code": "x", "language": "cpp", field: value})
        assert status == 422 and body["detail"][0]["loc"] == ["body", field], body
    big = base64.b64encode(b"\0" * (17 << 20)).decode()
    status, body = post(url, {"code": "x", "language": "python", "files": {"huge.bin": big}})
    assert status == 422 and body["detail"][0]["loc"] == ["body", "files", "huge.bin"]
    status, body = post(url, {"code": "x", "language": "python", "files": {"../escape": "eA=="}})
    assert status == 422 and body["detail"][0]["loc"] == ["body", "files", "../escape"]
    status, body = post(f"{endpoint}/run_jupyter", {"cells": ["1"]})
    assert status == 501 and "Jupyter" in body["detail"]


# ------------------------------------------------------------------ hostile programs


def test_output_flood_fork_bomb_memory_bomb(endpoint: str) -> None:
    url = f"{endpoint}/run_code"
    status, flood = post(url, {"code": "yes", "language": "bash", "run_timeout": 5})
    assert status == 200 and flood["status"] == "Failed"
    assert flood["run_result"]["return_code"] != 0
    assert len(flood["run_result"]["stdout"]) <= 1 << 20
    assert flood["message"].startswith("OUTPUT_LIMIT")
    status, bomb = post(url, {"code": ":(){ :|:& };:", "language": "bash", "run_timeout": 3})
    assert status == 200 and bomb["status"] == "Failed"
    status, mem = post(
        url,
        {
            "code": "x = bytearray(600 << 20)\nprint(len(x))\n",
            "language": "python",
            "memory_limit_MB": 128,
        },
    )
    assert status == 200 and mem["status"] == "Failed", mem
    assert mem["message"].startswith("MEMORY_LIMIT") and mem["run_result"]["return_code"] != 0
    status, after = post(url, {"code": "echo fine", "language": "bash"})
    assert (
        status == 200 and after["status"] == "Success" and after["run_result"]["stdout"] == "fine\n"
    )


# ------------------------------------------------------------------ batch, cancel


def test_batch_compiles_once_and_keeps_order(endpoint: str) -> None:
    inputs = [f"{i} {i * 3}" for i in range(24)]
    status, body = post(
        f"{endpoint}/run_code_batch",
        {"code": CPP_SUM, "language": "cpp", "cases": [{"stdin": s} for s in inputs]},
    )
    assert status == 200 and body["status"] == "Success"
    assert [r["run_result"]["stdout"] for r in body["results"]] == [f"{i * 4}\n" for i in range(24)]
    status, body = post(
        f"{endpoint}/run_code_batch",
        {"code": PY_CRASH, "language": "python", "cases": [{"stdin": "0 0"}, {"stdin": "6 0"}]},
    )
    assert body["status"] == "Failed"
    assert [r["run_result"]["return_code"] for r in body["results"]] == [1, 7]


def test_client_gone_cancels_its_job(endpoint: str) -> None:
    """The only bash container runs a 30 s job; its client hangs up; the next bash job runs
    at once instead of queueing behind it."""
    host, port = endpoint.removeprefix("http://").split("/", 1)[0].split(":")
    path = "/" + endpoint.removeprefix("http://").split("/", 1)[1] + "/run_code"
    body = json.dumps({"code": "sleep 30", "language": "bash", "run_timeout": 60}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(1.0)  # the job is running in the bash container
    t0 = time.monotonic()
    status, after = post(f"{endpoint}/run_code", {"code": "echo next", "language": "bash"})
    waited = time.monotonic() - t0
    assert status == 200 and after["run_result"]["stdout"] == "next\n"
    assert waited < 15, f"the next job waited {waited:.1f} s: the abandoned one kept running"


# ------------------------------------------------------------------ anonymous listener


def _compat(cluster: LocalCluster, tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    full = {
        **os.environ,
        "DSEC_COMPAT_LISTEN": f"127.0.0.1:{free_port()}",
        "DSEC_COMPAT_APISERVER": cluster.apiserver,
        "DSEC_COMPAT_LOG_FORMAT": "text",
        **env,
    }
    log = (tmp_path / "compat.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "compat"], env=full, stdout=log, stderr=subprocess.STDOUT
    )


def test_token_file_listener_acts_for_its_project(
    fusion_cluster: LocalCluster, token: str, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    address = f"127.0.0.1:{free_port()}"
    proc = _compat(
        fusion_cluster,
        tmp_path,
        {
            "DSEC_COMPAT_SANDBOX_FUSION_LISTEN": address,
            "DSEC_COMPAT_SANDBOX_FUSION_TOKEN_FILE": str(token_file),
        },
    )
    try:

        def up() -> bool:
            try:
                with urllib.request.urlopen(f"http://{address}/v1/ping", timeout=2):
                    return True
            except OSError:
                assert proc.poll() is None, (tmp_path / "compat.log").read_text()
                return False

        wait_for(up, timeout_s=30)
        status, body = post(
            f"http://{address}/run_code", {"code": "print(7)", "language": "python"}
        )
        assert status == 200 and body["run_result"]["stdout"] == "7\n"
        status, body = post(
            f"http://{address}/t/dsec_0000000000000000_nope/run_code",
            {"code": "print(7)", "language": "python"},
        )
        assert status == 401  # a token that is given is checked, never replaced
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_token_file_on_a_reachable_address_refuses_to_start(
    fusion_cluster: LocalCluster, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("dsec_x_y")
    proc = _compat(
        fusion_cluster,
        tmp_path,
        {
            "DSEC_COMPAT_SANDBOX_FUSION_LISTEN": f"0.0.0.0:{free_port()}",
            "DSEC_COMPAT_SANDBOX_FUSION_TOKEN_FILE": str(token_file),
        },
    )
    try:
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "loopback" in (tmp_path / "compat.log").read_text()


def test_concurrent_requests_from_threads(endpoint: str) -> None:
    """verl posts from up to 32 threads at once: every answer is its own request's."""
    answers: dict[int, Any] = {}

    def one(i: int) -> None:
        answers[i] = post(f"{endpoint}/run_code", {"code": f"print({i}*2)", "language": "python"})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert {i: a[1]["run_result"]["stdout"] for i, a in answers.items()} == {
        i: f"{i * 2}\n" for i in range(32)
    }

"""The dashboard (apiserver/dashboard.py) and ``dsec top`` (dsecctl/top.py) against a real
cluster of their own (one container edge): what a project's token sees and what it never sees,
over HTTP, in headless Chromium and in the terminal.

Two projects, ``root/dash-a`` and ``root/dash-b``, each with a token; the tests create busybox
sandboxes in both and check that A's token shows A's and never a trace of B's. The browser test
watches one of A's sandboxes go RUNNING -> PAUSED -> TERMINATED on the page without a reload.
``DSEC_DASHBOARD_SCREENSHOT=docs/img/dashboard.png`` makes the operator's test save its
screenshot there (the README's picture); otherwise it goes to the test's temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsecctl.cluster import LocalCluster
from libdsec import Client, Sandbox
from libdsec.errors import DSecError
from tests.helpers import sandbox_factory, wait_for
from tests.integration.conftest import ClusterWith

pytestmark = pytest.mark.images("busybox")

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
API_PATHS = [
    "/dashboard/api/sandboxes",
    "/dashboard/api/history",
    "/dashboard/api/nodes",
    "/dashboard/api/events",
]
EDGE = "dash0"
#: The dashboard feed's idle time here (DSEC_APISERVER_DASHBOARD_IDLE_S; 900 s by default).
IDLE_S = 3


@pytest.fixture(scope="module")
def container_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of this module's own: the operator's view (every sandbox, the node's load)
    shows only this module's sandboxes. The dashboard's watch stops after 3 s unused."""
    with cluster_with(EDGE, extra_env={"DSEC_APISERVER_DASHBOARD_IDLE_S": str(IDLE_S)}) as c:
        yield c


@dataclass
class Project:
    project_id: str
    token: str
    client: Client


@pytest.fixture(scope="module")
def projects(container_cluster: LocalCluster) -> Iterator[dict[str, Project]]:
    """Projects ``a`` and ``b`` below root, each with an agent token and a client."""
    out: dict[str, Project] = {}
    with Client(container_cluster.apiserver, token=container_cluster.token) as admin:
        try:
            for key in ("a", "b"):
                p = admin.create_project(f"dash-{key}", exist_ok=True)
                secret = admin.create_token(f"dash-{key}", project=p.project_id, agent=True).secret
                c = Client(container_cluster.apiserver, token=secret)
                out[key] = Project(p.project_id, secret, c)
            yield out
        finally:
            for p in out.values():  # the tests' factories stopped theirs; anything left goes
                try:
                    for info in p.client.list():
                        if not info.terminated:
                            with contextlib.suppress(DSecError):
                                p.client.get(info.id).stop(grace_s=0.5)
                finally:
                    p.client.close()
            for p in out.values():
                admin.delete_project(p.project_id)


@pytest.fixture
def make_in(
    projects: dict[str, Project], request: pytest.FixtureRequest
) -> Iterator[Callable[..., Sandbox]]:
    """``make_in("a", task_id=...)``: a busybox sandbox of project a or b, stopped afterwards."""
    with (
        sandbox_factory(projects["a"].client, request.node.nodeid) as make_a,
        sandbox_factory(projects["b"].client, request.node.nodeid) as make_b,
    ):
        makers = {"a": make_a, "b": make_b}

        def make(key: str, **kw: Any) -> Sandbox:
            kw.setdefault("memory_mb", 64)
            kw.setdefault("cpu", 0.25)
            return makers[key](**kw)

        yield make


@pytest.fixture
def http(container_cluster: LocalCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=container_cluster.viewer_url, timeout=30) as c:
        yield c


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


# ------------------------------------------------------------------- HTTP


def test_without_a_good_token_everything_is_401_and_shows_nothing(
    http: httpx.Client, make_in: Callable[..., Sandbox]
) -> None:
    a, b = make_in("a", task_id="t-auth"), make_in("b", task_id="t-auth")
    for path in ["/dashboard", *API_PATHS]:
        for how, kw in [
            ("no token", {}),
            ("bad query token", {"params": {"token": "not-a-token"}}),
            ("bad bearer token", {"headers": bearer("not-a-token")}),
        ]:
            r = http.get(path, **kw)
            assert r.status_code == 401, (path, how, r.text)
            assert a.id not in r.text and b.id not in r.text and "dash-" not in r.text
            assert r.headers["cache-control"] == "no-store"
            if path != "/dashboard":
                error = r.json()["error"]
                assert error["code"] == "UNAUTHENTICATED", (path, how, error)
                assert error["reason"] == ("NO_TOKEN" if how == "no token" else error["reason"])
    # The page without a token is a sign-in form, also a 401.
    page = http.get("/dashboard")
    assert page.status_code == 401 and 'name="token"' in page.text
    assert "NO_TOKEN" in page.text


def test_json_is_scoped_to_the_callers_project(
    container_cluster: LocalCluster,
    http: httpx.Client,
    projects: dict[str, Project],
    make_in: Callable[..., Sandbox],
) -> None:
    a, b = make_in("a", task_id="t-json"), make_in("b", task_id="t-json")
    r = http.get("/dashboard/api/sandboxes", headers=bearer(projects["a"].token))
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"] == "no-store"
    assert r.headers["referrer-policy"] == "no-referrer"
    body = r.json()
    ids = {s["id"] for s in body["sandboxes"]}
    assert a.id in ids and b.id not in ids and b.id not in r.text
    assert body["project_id"] == projects["a"].project_id
    assert all(s["project_id"] == projects["a"].project_id for s in body["sandboxes"])
    mine = next(s for s in body["sandboxes"] if s["id"] == a.id)
    assert mine["state"] == "RUNNING" and mine["task_id"] == "t-json" and mine["edge_id"] == EDGE
    # ?token= works as the header does; ?task= filters.
    only = http.get(
        "/dashboard/api/sandboxes", params={"token": projects["a"].token, "task": "no-such"}
    )
    assert only.status_code == 200 and only.json()["sandboxes"] == []
    # The admin of root sees both.
    admin = http.get("/dashboard/api/sandboxes", headers=bearer(container_cluster.token)).json()
    assert {a.id, b.id} <= {s["id"] for s in admin["sandboxes"]}
    # Nodes are for operators, as ListNodes is.
    refused = http.get("/dashboard/api/nodes", headers=bearer(projects["a"].token))
    assert refused.status_code == 403 and refused.json()["error"]["reason"] == "OPERATOR_ONLY"

    def node() -> dict[str, Any] | None:  # the watcher's next probe brings the new load
        r = http.get("/dashboard/api/nodes", headers=bearer(container_cluster.token))
        assert r.status_code == 200, r.text
        n = next(n for n in r.json()["nodes"] if n["id"] == EDGE)
        return n if n["sandboxes"] >= 2 else None

    node = wait_for(node, timeout_s=30)
    assert node["health"] == "HEALTHY"
    assert 0 < node["cpu_millis_allocated"] <= node["cpu_millis_capacity"]
    assert "dash-" not in json.dumps(node)  # no per-project counts
    long_task = http.get(
        "/dashboard/api/sandboxes", params={"token": projects["a"].token, "task": "x" * 129}
    )
    assert long_task.status_code == 400 and long_task.json()["error"]["reason"] == "INVALID_TASK"


class EventReader:
    """The events of one /dashboard/api/events stream, read on a thread."""

    def __init__(self, http: httpx.Client, token: str) -> None:
        self.events: list[tuple[str, Any]] = []
        self.raw: list[str] = []
        self._stop = threading.Event()
        self._ctx = http.stream("GET", "/dashboard/api/events", headers=bearer(token))
        self.response = self._ctx.__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        name = ""
        try:
            for line in self.response.iter_lines():
                if self._stop.is_set():
                    return
                self.raw.append(line)
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    self.events.append((name, json.loads(line.removeprefix("data: "))))
        except httpx.HTTPError:
            pass  # closed by close()

    def first(self, predicate: Callable[[str, Any], bool], timeout_s: float = 60) -> Any:
        def found() -> Any:
            return next((d for n, d in list(self.events) if predicate(n, d)), None)

        return wait_for(found, timeout_s=timeout_s)

    def close(self) -> None:
        self._stop.set()
        # A close() does not wake the thread blocked reading the socket (nor release the
        # connection) until the server writes again: shut the socket down, as a closed page does.
        sock = self.response.extensions["network_stream"].get_extra_info("socket")
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        self.response.close()
        self._ctx.__exit__(None, None, None)
        self._thread.join(timeout=10)


def test_event_stream_brings_the_projects_changes_only(
    http: httpx.Client, projects: dict[str, Project], make_in: Callable[..., Sandbox]
) -> None:
    a, b = make_in("a", task_id="t-sse"), make_in("b", task_id="t-sse")
    reader = EventReader(http, projects["a"].token)
    try:
        assert reader.response.status_code == 200
        assert reader.response.headers["content-type"].startswith("text/event-stream")
        snapshot = reader.first(lambda n, d: n == "snapshot")
        assert a.id in {s["id"] for s in snapshot["sandboxes"]}
        assert snapshot["nodes"] is None and snapshot["nodes_error"]["reason"] == "OPERATOR_ONLY"
        reader.first(lambda n, d: n in ("snapshot", "keepalive") and d["watching"])
        b.pause()
        a.pause()

        def changed_to(state: str) -> Callable[[str, Any], bool]:
            return lambda n, d: (
                n == "sandbox" and d["sandbox"]["id"] == a.id and d["sandbox"]["state"] == state
            )

        paused = reader.first(changed_to("PAUSED"))
        assert paused["change"]["previous"] == "RUNNING"
        b.stop(grace_s=0.5)
        a.stop(grace_s=0.5)
        ended = reader.first(changed_to("TERMINATED"))
        assert ended["sandbox"]["termination_reason"] == "STOPPED"
        history = http.get("/dashboard/api/history", headers=bearer(projects["a"].token)).json()
        states = [c["state"] for c in history["changes"] if c["sandbox_id"] == a.id]
        assert "PAUSED" in states and states[-1] == "TERMINATED", states  # STOPPING between
        assert history["history_since"] is not None
        assert b.id not in json.dumps(history)
    finally:
        reader.close()
    assert b.id not in "\n".join(reader.raw)


def test_the_feed_stops_unused_and_starts_again_empty(
    container_cluster: LocalCluster,
    http: httpx.Client,
    projects: dict[str, Project],
    make_in: Callable[..., Sandbox],
) -> None:
    """The history goes back to the feed's start: after IDLE_S unused the API server's watch
    ends (no edge streams left open for nobody), and the next use starts an empty one."""

    def history() -> dict[str, Any]:  # each request is a use: the feed runs
        r = http.get("/dashboard/api/history", headers=bearer(projects["a"].token))
        assert r.status_code == 200, r.text
        return r.json()

    wait_for(lambda: history()["watching"], timeout_s=30)
    a = make_in("a", task_id="t-idle")
    a.pause()
    seen = wait_for(
        lambda: (h := history()) and any(c["sandbox_id"] == a.id for c in h["changes"]) and h,
        timeout_s=30,
    )
    log = container_cluster.process("apiserver").log_path
    stops = log.read_text().count("dashboard feed stopped")
    # Unused now: it stops within IDLE_S and the watch's keepalive (5 s).
    wait_for(lambda: log.read_text().count("dashboard feed stopped") > stops, timeout_s=30)
    again = history()
    assert again["history_since"] > seen["history_since"]
    assert not any(c["sandbox_id"] == a.id for c in again["changes"]), again


# ---------------------------------------------------------------- browser


def _launch(pw: Any) -> Any:
    return pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (scripts/setup.sh)")
def test_browser_shows_changes_live_and_nothing_of_another_project(
    container_cluster: LocalCluster,
    projects: dict[str, Project],
    make_in: Callable[..., Sandbox],
) -> None:
    from playwright.sync_api import expect, sync_playwright

    a = make_in("a", task_id="swe-live")
    b = make_in("b", task_id="swe-live")
    token = projects["a"].token
    with sync_playwright() as pw:
        browser = _launch(pw)
        try:
            page = browser.new_page()
            urls: list[str] = []
            page.on("request", lambda req: urls.append(req.url))
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            response = page.goto(f"{container_cluster.viewer_url}/dashboard?token={token}")
            assert response is not None and response.status == 200
            assert response.headers["referrer-policy"] == "no-referrer"
            # The token left the address bar, and no later request carried it in its URL.
            assert page.url == f"{container_cluster.viewer_url}/dashboard"
            row = page.locator(f'#tasks tr[data-sandbox-id="{a.id}"]')
            expect(row.locator(".state")).to_have_text("RUNNING", timeout=30_000)
            expect(
                page.locator(f'[data-task="swe-live"] tr[data-sandbox-id="{a.id}"]')
            ).to_have_count(1)
            expect(page.locator("#live")).to_have_text("live", timeout=30_000)
            assert projects["a"].project_id in page.locator("#project").inner_text()

            b.pause()  # another project's changes: never on the page
            a.pause()
            expect(row.locator(".state")).to_have_text("PAUSED", timeout=30_000)
            history = page.locator('[data-task="swe-live"] .history li')
            expect(history.filter(has_text=f"{a.id}  RUNNING \u2192 PAUSED")).to_have_count(1)
            b.stop(grace_s=0.5)
            a.stop(grace_s=0.5)
            expect(row.locator(".state")).to_have_text("TERMINATED", timeout=30_000)
            ended = page.locator(f'#terminations tr[data-sandbox-id="{a.id}"]')
            expect(ended.locator(".reason")).to_have_text("STOPPED", timeout=30_000)
            assert page.url == f"{container_cluster.viewer_url}/dashboard"  # never reloaded

            assert b.id not in page.content()
            assert not any(token in u for u in urls[1:]), urls
            assert not errors, errors
            # Nodes are an operator's: this token is told so.
            expect(page.locator("#nodes")).to_contain_text("operators")
            # A reload finds the token in the tab (the sign-in page's 401 hands it back once).
            page.reload()
            expect(page.locator("#live")).to_have_text("live", timeout=30_000)
            expect(row.locator(".state")).to_have_text("TERMINATED", timeout=30_000)
            assert page.url == f"{container_cluster.viewer_url}/dashboard"
            assert b.id not in page.content()
        finally:
            browser.close()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (scripts/setup.sh)")
def test_operator_sees_nodes_and_every_project(
    container_cluster: LocalCluster,
    projects: dict[str, Project],
    make_in: Callable[..., Sandbox],
    tmp_path: Path,
) -> None:
    """The operator's picture (saved: the README's screenshot): a node with its load, tasks of
    both projects, a paused sandbox, a running one and one that ended."""
    from playwright.sync_api import expect, sync_playwright

    running = [make_in("a", task_id="swe-1021") for _ in range(2)]
    paused = make_in("a", task_id="swe-1022")
    ended = make_in("b", task_id="swe-1022")
    other = make_in("b", task_id="eval-77")
    with sync_playwright() as pw:
        browser = _launch(pw)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 820})
            page.goto(f"{container_cluster.viewer_url}/dashboard?token={container_cluster.token}")
            expect(page.locator("#live")).to_have_text("live", timeout=30_000)
            paused.pause()
            ended.stop(grace_s=0.5)
            for sb, state in [(paused, "PAUSED"), (ended, "TERMINATED"), (other, "RUNNING")]:
                expect(page.locator(f'#tasks tr[data-sandbox-id="{sb.id}"] .state')).to_have_text(
                    state, timeout=30_000
                )
            for sb in running:
                expect(
                    page.locator(f'[data-task="swe-1021"] tr[data-sandbox-id="{sb.id}"]')
                ).to_have_count(1)
            node = page.locator(f'#nodes [data-node-id="{EDGE}"]')
            expect(node.locator(".health")).to_have_text("HEALTHY", timeout=30_000)
            target = Path(os.environ.get("DSEC_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
            target.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(target), full_page=True)
            assert target.stat().st_size > 10_000
        finally:
            browser.close()


# ----------------------------------------------------------------- dsec top


def cli_env(cluster: LocalCluster, token: str, home: Path) -> dict[str, str]:
    env = dict(os.environ, DSEC_TARGET=cluster.apiserver, DSEC_TOKEN=token, DSEC_HOME=str(home))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["COLUMNS"] = "200"  # rich's width when stdout is not a terminal
    return env


def dsec(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsecctl", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_top_once_shows_the_projects_sandboxes_only(
    container_cluster: LocalCluster,
    projects: dict[str, Project],
    make_in: Callable[..., Sandbox],
    tmp_path: Path,
) -> None:
    a = make_in("a", task_id="top-task")
    b = make_in("b", task_id="top-task")
    a.pause()
    env = cli_env(container_cluster, projects["a"].token, tmp_path)
    r = dsec("top", "--once", env=env)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if a.id in ln)
    assert "PAUSED" in line
    assert "top-task" in r.stdout and b.id not in r.stdout
    assert "OPERATOR_ONLY" in r.stdout  # nodes: not for this token, said so

    js = dsec("top", "--once", "--json", "--task", "top-task", env=env)
    assert js.returncode == 0, js.stderr
    frame = json.loads(js.stdout)
    assert [s["id"] for s in frame["sandboxes"]] == [a.id]
    assert frame["sandboxes"][0]["state"] == "PAUSED"
    assert frame["sandboxes"][0]["task_id"] == "top-task"
    assert frame["nodes"] is None and frame["nodes_error"]["reason"] == "OPERATOR_ONLY"
    assert b.id not in js.stdout

    admin = dsec(
        "top", "--once", "--json", env=cli_env(container_cluster, container_cluster.token, tmp_path)
    )
    assert admin.returncode == 0, admin.stderr
    everything = json.loads(admin.stdout)
    assert {a.id, b.id} <= {s["id"] for s in everything["sandboxes"]}
    assert EDGE in {n["id"] for n in everything["nodes"]}


def test_top_bad_input_is_a_precise_error(
    container_cluster: LocalCluster, projects: dict[str, Project], tmp_path: Path
) -> None:
    env = cli_env(container_cluster, projects["a"].token, tmp_path)
    for bad in (["--interval", "0"], ["--interval", "soon"], ["--interval", "nan"]):
        r = dsec("top", *bad, env=env)
        assert r.returncode == 2 and "--interval" in r.stderr, (bad, r.stderr)
    refused = dsec("top", "--once", env=cli_env(container_cluster, "not-a-token", tmp_path))
    assert refused.returncode == 2
    assert refused.stderr.startswith("dsec top: Unauthenticated ["), refused.stderr


def test_top_refreshes_until_interrupted(
    container_cluster: LocalCluster,
    projects: dict[str, Project],
    make_in: Callable[..., Sandbox],
    tmp_path: Path,
) -> None:
    a = make_in("a", task_id="top-live")
    env = cli_env(container_cluster, projects["a"].token, tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsecctl", "top", "--interval", "0.5", "--task", "top-live"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:

        def shown(*texts: str) -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"dsec top ended: {proc.returncode} {''.join(out)}")
            return any(all(t in ln for t in texts) for ln in out)

        try:
            wait_for(lambda: shown(a.id, "RUNNING"), timeout_s=60)
            a.pause()
            wait_for(lambda: shown(a.id, "PAUSED"), timeout_s=60)
            # the watch saw the change: it is in the task's history
            wait_for(lambda: shown(a.id, "RUNNING → PAUSED"), timeout_s=60)
        except AssertionError as err:
            raise AssertionError(f"{err}; dsec top printed:\n{''.join(out[-60:])}") from None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        reader.join(timeout=10)

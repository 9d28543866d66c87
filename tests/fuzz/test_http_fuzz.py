"""Both HTTP front ends of ``compat`` (E2B's REST control API and envd's Connect-RPC
services, SandboxFusion's HTTP API) fed generated requests.

Routes are read from the Starlette applications' routers and envd's methods from
``protos/e2b``, so a route added there is fuzzed without a change here. Each route gets
generated bodies (random JSON, wrong types, huge values, random bytes), bad ids in its
path parameters (and real ones, another project's sandbox among them), absent, wrong and
real keys, and bad content types. Asserted: never a 5xx for bad input (501 is what an
unsupported route answers by design), an answer before the deadline, and after each
route's batch both listeners still answer ``/health`` (and SandboxFusion's ``/v1/ping``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from starlette.routing import Mount, Route

from compat.clients import ClientPool
from compat.config import CompatConfig
from compat.e2b.app import E2bApp
from compat.e2b.routing import ENVD_PORT
from compat.sandboxfusion.app import SandboxFusionApp
from dsecctl.cluster import LocalCluster
from libdsec.sync import Client
from libdsec.types import Quota
from tests.fuzz.protofuzz import BAD_IDS

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("DSEC_FUZZ_EXAMPLES", "5"))
SEED = os.environ.get("DSEC_FUZZ_SEED")
TIMEOUT_S = 10.0
ROOT = Path(__file__).resolve().parents[2]


def _routes(routes: list[Any], prefix: str = "") -> list[tuple[str, tuple[str, ...]]]:
    out: list[tuple[str, tuple[str, ...]]] = []
    for r in routes:
        if isinstance(r, Mount):
            out += _routes(list(r.routes), prefix + r.path)
        elif isinstance(r, Route):
            out.append((prefix + r.path, tuple(sorted(r.methods or {"GET"}))))
    return out


def envd_methods() -> list[str]:
    """``/<package>.<Service>/<Method>`` of every envd RPC in protos/e2b."""
    out = []
    for proto in sorted((ROOT / "protos" / "e2b").rglob("*.proto")):
        text = proto.read_text()
        package = re.search(r"^package (\w+);", text, re.M)
        assert package is not None, proto
        for service, body in re.findall(r"^service (\w+) \{(.*?)^\}", text, re.M | re.S):
            out += [f"/{package[1]}.{service}/{m}" for m in re.findall(r"rpc (\w+)\(", body)]
    return out


def routes() -> list[tuple[str, str, tuple[str, ...]]]:
    """(front end, path template, methods) of every route; envd's Connect routes expanded to
    one per RPC."""
    config, pool = CompatConfig(), ClientPool("unix:/nonexistent")
    e2b = E2bApp(config, pool)
    fusion = SandboxFusionApp(config, pool)
    out = [("control", p, m) for p, m in _routes(list(e2b.control.app.routes))]
    for p, m in _routes(list(e2b.envd_app.routes)):
        if "{method}" in p:
            prefix = p.removesuffix("{method}")
            out += [("envd", e, ("POST",)) for e in envd_methods() if e.startswith(prefix)]
        else:
            out.append(("envd", p, m))
    out += [("fusion", p, m) for p, m in _routes(list(fusion.app.routes))]
    return out


ROUTES = routes()


def test_routes_are_enumerated() -> None:
    kinds = {k for k, _, _ in ROUTES}
    assert kinds == {"control", "envd", "fusion"}
    paths = {p for _, p, _ in ROUTES}
    assert {"/sandboxes", "/sandboxes/{id}", "/process.Process/Start", "/run_code"} <= paths
    assert "/filesystem.Filesystem/ListDir" in paths and "/t/{token}/run_code" in paths


class Front:
    """The cluster's front ends and the objects generated requests aim at."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.admin = cluster.token
        self.tokens: list[str] = []
        self.sandboxes: list[str] = []
        with Client(cluster.apiserver, token=self.admin, timeout=15) as admin:
            for key in ("ha", "hb"):
                pid = admin.create_project(f"httpfuzz-{key}", quota=Quota()).project_id
                self.tokens.append(admin.create_token(key, project=pid, agent=True).secret)
                self.sandboxes.append("")
        self.http = httpx.Client(timeout=TIMEOUT_S)
        self.repair()

    def running(self, i: int) -> bool:
        with Client(self.cluster.apiserver, token=self.tokens[i], timeout=15) as cl:
            return any(s.id == self.sandboxes[i] and s.state == "RUNNING" for s in cl.list())

    def repair(self) -> None:
        """A running sandbox per project again (a generated DELETE may have killed one)."""
        for i, token in enumerate(self.tokens):
            if not self.sandboxes[i] or not self.running(i):
                with Client(self.cluster.apiserver, token=token, timeout=15) as cl:
                    sb = cl.create(
                        image="busybox",
                        cpu=0.1,
                        memory_mb=32,
                        ttl_s=3600,
                        node_selector={"fuzz": "null"},
                    )
                self.sandboxes[i] = sb.id

    def healthy(self) -> None:
        assert self.http.get(self.cluster.compat_url + "/health").status_code < 300
        assert self.http.get(self.cluster.sandbox_fusion_url + "/v1/ping").status_code < 300
        self.repair()


@pytest.fixture(scope="module")
def front(fuzz_cluster: LocalCluster) -> Iterator[Front]:
    f = Front(fuzz_cluster)
    try:
        yield f
    finally:
        f.http.close()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
CONTENT_TYPES = [
    None,
    "application/json",
    "application/proto",
    "application/connect+json",
    "application/connect+proto",
    "text/plain",
    "multipart/form-data; boundary=x",
    "application/x-www-form-urlencoded",
    "junk/nonsense;;=",
]


def _field_names(path: str) -> list[str]:
    return re.findall(r"\{(\w+)\}", path)


def bodies() -> st.SearchStrategy[bytes]:
    keys = [
        "template_id",
        "templateID",
        "timeout",
        "code",
        "language",
        "cmd",
        "path",
        "pid",
        "metadata",
        "envVars",
        "autoPause",
        "files",
        "compile_timeout",
        "run_timeout",
        "stdin",
        "process",
        "selector",
        "input",
        "signal",
        "configs",
        "fetch_files",
    ]
    weird: st.SearchStrategy[Any] = st.sampled_from(
        [None, -1, 2**63, -(2**63), 1e308, "", "x" * 70_000, [], {}, True]
    )
    shaped = st.dictionaries(st.sampled_from(keys), JSON | weird, max_size=6)
    return st.one_of(
        shaped.map(lambda d: json.dumps(d).encode()),
        JSON.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.sampled_from([b"", b"{", b"null", b"\x00\x00\x00\x00\x05{}", b"[" * 5000]),
    )


@pytest.mark.parametrize(
    ("kind", "path", "methods"), ROUTES, ids=[f"{k}:{p}" for k, p, _ in ROUTES]
)
def test_route(front: Front, kind: str, path: str, methods: tuple[str, ...]) -> None:
    ids = st.sampled_from([*BAD_IDS[:-1], "x" * 300, *front.sandboxes])

    @settings(
        max_examples=EXAMPLES * 2,
        derandomize=SEED is None,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        url_path = path
        for name in _field_names(path):
            value = data.draw(
                ids if name != "token" else st.sampled_from(["", "bad", *front.tokens, front.admin])
            )
            url_path = url_path.replace("{" + name + "}", quote(value, safe="") or "x")
        method = data.draw(st.sampled_from([*methods, "PATCH"]))
        token = data.draw(st.sampled_from([None, "", "bad", "Bearer", *front.tokens, front.admin]))
        headers: dict[str, str] = {}
        ctype = data.draw(st.sampled_from(CONTENT_TYPES))
        if ctype is not None:
            headers["content-type"] = ctype
        if kind == "envd":
            headers["e2b-sandbox-id"] = data.draw(
                st.sampled_from(["", "x", "sb-nope", *front.sandboxes])
            )
            headers["e2b-sandbox-port"] = str(ENVD_PORT)
            if token is not None:
                headers["x-access-token"] = token
            headers["connect-protocol-version"] = "1"
        elif token is not None:
            headers["x-api-key" if kind == "control" else "authorization"] = (
                token if kind == "control" else f"Bearer {token}".strip()
            )
        base = front.cluster.sandbox_fusion_url if kind == "fusion" else front.cluster.compat_url
        body = data.draw(bodies())
        query = data.draw(
            st.sampled_from(
                [
                    "",
                    "?path=/etc/passwd",
                    "?path=../../x&username=root",
                    "?limit=-1&nextToken=%00",
                    "?metadata=a%3D%00",
                ]
            )
        )
        try:
            r = front.http.request(method, base + url_path + query, headers=headers, content=body)
        except httpx.TimeoutException as exc:
            pytest.fail(f"{method} {url_path}: no answer in {TIMEOUT_S} s ({exc})")
        # 501: an unsupported route, by design. 502 (503 as Connect's UNAVAILABLE) "The
        # sandbox <id> was not found": what E2B's proxy answers for a sandbox that is not
        # there, and what the e2b SDK reads (compat/e2b/errors.py), for a sandbox-addressed
        # request only, and only when that sandbox really is not there for that token.
        gone = (
            r.status_code in (502, 503)
            and kind == "envd"
            and ("was not found" in r.text or method == "HEAD")
        )
        if gone:
            sid = headers.get("e2b-sandbox-id", "")
            for i, own in enumerate(front.sandboxes):
                if sid == own and token == front.tokens[i]:
                    assert not front.running(i), (
                        f"{method} {url_path}: own running {sid} 'not found'"
                    )
        assert r.status_code < 500 or r.status_code == 501 or gone, (
            f"{method} {url_path}{query} {headers} body={body[:200]!r}: {r.status_code} {r.text[:300]}"
        )

    if SEED is not None:
        one = seed(int(SEED))(one)
    try:
        one()
    finally:
        front.healthy()

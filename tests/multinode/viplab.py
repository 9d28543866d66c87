"""API servers behind a virtual IP on lab hosts: the layout of tests/multinode/test_vip.py and
bench/bench_vip.py.

| host | runs |
|---|---|
| ``router`` | FRR (zebra + bgpd): the ECMP router every instance peers with (dsecctl/vip_router.py) |
| ``cp`` | IAM, the watcher, placement, a null edge (sandboxes tracked, nothing started), the compat front end (a client of the virtual IP) |
| ``api1`` .. ``apiN`` | an API server each, announcing the virtual IP while healthy (common/vip.py) |

Clients (the SDK, the CLI, the e2b SDK) run in the caller's namespace and reach the virtual
IP through the router (a route the lab adds), as a data-centre host reaches an anycast
service through its top-of-rack switch.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from dsec.apiserver.v1 import apiserver_pb2, apiserver_pb2_grpc
from dsecctl.cluster import EdgeSpec, LocalCluster, ServiceProcess, VipPlan
from dsecctl.hosts import Host, HostLab
from dsecctl.vip_router import VipRouter, lab_vips
from libdsec import Client


@dataclass
class VipLab:
    lab: HostLab
    router: VipRouter
    cluster: LocalCluster
    vip: str

    @property
    def target(self) -> str:
        return self.cluster.apiserver

    def instances(self) -> list[ServiceProcess]:
        return [p for p in self.cluster.processes if p.module == "apiserver"]

    def instance_on(self, host: str) -> ServiceProcess:
        return next(p for p in self.instances() if p.host is not None and p.host.name == host)

    def addresses(self, procs: list[ServiceProcess] | None = None) -> set[str]:
        """The host addresses of ``procs`` (default: every instance): the route's next hops."""
        return {p.host.address for p in (procs or self.instances()) if p.host is not None}

    def client(self, **kw: object) -> Client:
        return Client(self.target, token=self.cluster.token, **kw)  # type: ignore[arg-type]

    def add_host(self, name: str) -> Host:
        h = self.lab.add_host(name)
        self.lab.wait_reachable()
        return h


def answering_instance(target: str, token: str) -> str:
    """The instance a new connection to ``target`` lands on (its WhoAmI)."""
    with grpc.insecure_channel(target) as ch:
        resp = apiserver_pb2_grpc.ProjectServiceStub(ch).WhoAmI(
            apiserver_pb2.WhoAmIRequest(),
            metadata=(("authorization", f"Bearer {token}"),),
            timeout=5,
        )
    return resp.apiserver_instance


def instance_of(c: Client) -> str:
    """The instance a client's connection is on."""
    rpc = c._async._rpc

    async def ask() -> apiserver_pb2.WhoAmIResponse:
        return await rpc.projects.WhoAmI(
            apiserver_pb2.WhoAmIRequest(), metadata=rpc.metadata, timeout=20, wait_for_ready=True
        )

    resp = c._loop.run(ask())
    return str(resp.apiserver_instance)


class Load:
    """``threads`` clients (one connection each) calling an idempotent RPC in a loop."""

    def __init__(
        self, v: VipLab, threads: int = 6, spread: tuple[str, ...] = ("apiserver", "apiserver1")
    ) -> None:
        self.clients = [v.client() for _ in range(threads)]
        self.on = [instance_of(c) for c in self.clients]
        # ECMP hashes each connection: a few may all land on one instance (6 of 6 on one of
        # two: 1 in 32). New connections replace some until every instance of ``spread`` has
        # one (bounded: an instance the route does not reach stays missing, and tests say so).
        for _ in range(40):
            missing = [name for name in spread if name not in self.on]
            if not missing:
                break
            c = v.client()
            name = instance_of(c)
            if name not in missing:
                c.close()
                continue
            crowded = max(set(self.on), key=self.on.count)
            i = self.on.index(crowded)
            self.clients[i].close()
            self.clients[i], self.on[i] = c, name
        self.ok: list[list[float]] = [[] for _ in self.clients]
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True)
            for i in range(len(self.clients))
        ]

    def _run(self, i: int) -> None:
        c = self.clients[i]
        while not self._stop.is_set():
            try:
                c.list(task_id="none", timeout=20)
                self.ok[i].append(time.monotonic())
            except Exception as exc:
                self.failed.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.01)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        for c in self.clients:
            c.close()

    def first_ok_after(self, t: float, instance: str) -> float:
        """Seconds from ``t`` to the first success after it of a client that was on
        ``instance`` (inf if none)."""
        times = [x for i, ts in enumerate(self.ok) if self.on[i] == instance for x in ts if x > t]
        return min(times, default=float("inf")) - t

    def longest_stall(self, t: float, instance: str) -> float:
        """The longest time a client that was on ``instance`` went without a completed call
        from its last success before ``t`` (the failure) on (inf: none since)."""
        stalls = []
        for i, ts in enumerate(self.ok):
            if self.on[i] != instance:
                continue
            after = [x for x in ts if x > t]
            if not after:
                stalls.append(float("inf"))
                continue
            seq = [max((x for x in ts if x <= t), default=t), *after]
            stalls.append(max(b - a for a, b in itertools.pairwise(seq)))
        return max(stalls, default=float("nan"))


def wait_withdrawn(v: VipLab, address: str, t0: float, timeout_s: float = 15) -> float:
    while address in v.router.next_hops(v.vip):
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{address} still a next hop of {v.vip} after {timeout_s} s")
        time.sleep(0.01)
    return time.monotonic() - t0


@contextlib.contextmanager
def vip_cluster(root: Path, instances: int = 2, **cluster_kw: object) -> Iterator[VipLab]:
    """The layout above with ``instances`` API servers; everything stopped on exit."""
    lab = HostLab(root / "hosts")
    router: VipRouter | None = None
    cluster: LocalCluster | None = None
    try:
        lab.start()
        names = [f"api{i + 1}" for i in range(instances)]
        for name in ("router", "cp", *names):
            lab.add_host(name)
        lab.wait_reachable()
        router = VipRouter(lab.hosts["router"]).start()
        vip = lab_vips(lab)[0]
        lab.route(f"{vip}/32", lab.hosts["router"])
        cp = lab.hosts["cp"]
        hosts = {
            "iam": cp,
            "watcher": cp,
            "placement": cp,
            "compat": cp,
            "edge-cp": cp,
            "apiserver": lab.hosts[names[0]],
            **{f"apiserver{i}": lab.hosts[n] for i, n in enumerate(names) if i},
        }
        cluster = LocalCluster(
            root / "home",
            edges=[
                EdgeSpec(
                    edge_id="cp",
                    runtime="null",
                    # nominal (a null edge starts nothing): room for a benchmark's creates
                    cpu_millis=4_000_000,
                    memory_mb=4_000_000,
                    max_sandboxes=5000,
                    extra_env={"DSEC_EDGE_STATE_DIR": str(cp.local("edge"))},
                )
            ],
            apiservers=instances,
            hosts=hosts,
            vip=VipPlan(vip, lab.hosts["router"].address),
            **cluster_kw,  # type: ignore[arg-type]
        )
        cluster.start(timeout_s=90)
        lab_ = VipLab(lab, router, cluster, vip)
        router.wait_next_hops(vip, lab_.addresses())
        yield lab_
    finally:
        if cluster is not None:
            cluster.stop()
        if router is not None:
            router.close()
        lab.close()

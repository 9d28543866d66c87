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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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

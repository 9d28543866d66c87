"""MicroVM sandbox benchmarks (issue: MicroVM sandboxes), with baselines measured in the same
run: the same guest cold-booted (an edge with DSEC_EDGE_MICROVM_TEMPLATES=false) and a
container sandbox of the same image (busybox) and memory (256 MB).

1. create -> first command (create + run("true") returning), N sandboxes per system one after
   another, interleaved: microVM restored from its shape's template vs the same microVM
   cold-booted vs a container; the same creates split (create() / first run / second run), and
   where a microVM create's time goes on the edge (its start log: disk, QEMU + restore or boot,
   Hello, claim).
2. run("true") round trip on a running microVM beside a container, interleaved.
3. pause to disk and resume at 256 MB and 1 GB guests with ~60% of guest RAM dirtied (random
   data in the guest's /dev/shm): pause, resume, resume -> first command, the QEMU process's
   memory before and after (it ends), the sandbox's memory cgroup before and after (the saved
   state's page cache is charged to it), the state's size. `--cycles` rounds, each of three
   cycles in turn: the state as the edge leaves it, written back by the bench (fsync), and
   written back and evicted from the page cache (a resume long after the pause); the last two
   are diagnostics. The data is checked after every resume (size and sampled checksums): a
   broken resume is an error, not a figure.
4. idle host memory per microVM: M idle 256 MB guests cloned from one template (250 millis
   each, created IDLE_BATCH at a time); PSS of each QEMU, what sharing the template's RAM file
   saves, the TCG code cache, idle CPU; against cold-booted guests and containers of the run.
   Then guest memory with free-page reporting on vs off (issue 43, item 5), in the same run:
   a guest that fills and frees FPR_FILL_MB (QEMU RSS before, peak, after; RSS integrated over
   the cycle), and the host memory of M idle guests each way: the sum of their PSS plus the
   page cache of the files behind them (read-only layers and toolkit, the template's RAM file,
   each guest's writable disk), every file counted once. Reporting needs guests whose RAM is
   their own (QEMU 7.2 would punch holes in a clone's template file: edge/config.py), so its
   pair is two cold-booting edges (pool=cold, pool=fpr); the clones of the template, which
   cannot report, are the third row. virtio-pmem cannot be attached on the microvm machine
   (DSEC_EDGE_MICROVM_PMEM says why): printed, not measured.

Four container edges of this machine offer microVMs (DSEC_EDGE_MICROVM=on): one creating them
from templates (labels pool=tmpl; it also runs the container baseline), one cold-booting every
guest (pool=cold), one keeping a warm pool (pool=warm) and one cold-booting guests that report
free pages (pool=fpr); creates are steered with node_selector. Everything runs in a private
cluster whose node-wide microVM cache (guest kit, accelerator verdict, templates) is private
too; sandboxes, the cluster and any QEMU left behind are removed at the end, also on failure
(the logs are kept then, and with --keep-logs). Each section ends with how busy the machine
was and how much of that was outside this run (a shared machine's neighbours show there).

Under TCG (no usable KVM on this machine kind) a guest cold-boots in seconds; absolute times
are this machine's, the ratios against the same-run baselines are the claim. Targets from the
issue are printed beside the figures, met or not; a miss does not fail the run.

usage: python bench/bench_microvm.py [--quick] [--n 30] [--rtt 50] [--idle 32] [--cycles 3]
                                     [--sections 1,2,3,4] [--keep-logs DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import pct, summary_ms, table
from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, Sandbox
from libdsec.errors import DSecError

IMAGE = "busybox"
TMPL = {"pool": "tmpl"}
COLD = {"pool": "cold"}
WARM = {"pool": "warm"}  # an edge keeping restored guests of the bench's shape ready to claim
FPR = {"pool": "fpr"}  # cold boots with free-page reporting (DSEC_EDGE_MICROVM_FREE_PAGE_REPORTING)
CGROUP_ROOT = Path("/sys/fs/cgroup")
QEMU = "qemu-system-x86_64"
#: Section 4 creates its idle guests this many at a time.
IDLE_BATCH = 4
#: Section 4's free-page-reporting cycle: what the guest fills in its /dev/shm and frees.
FPR_FILL_MB = 96
#: A guest reports the pages it freed within ~2 s (the kernel's page_reporting delay).
FPR_SETTLE_S = 10.0

# Targets of the issue (printed, never enforced).
TARGET_CREATE_P50_MS = 300.0
TARGET_COLD_OVER_SNAPSHOT = 10.0
TARGET_FREED_PCT = 95.0
TARGET_RESUME_FIRST_MS = 600.0  # 256 MB guest
TARGET_IDLE_PSS_MB = 64.0
#: The DSec report: free-page reporting cut time-integrated memory 21.2%, pmem peak host memory
#: 40.2% (issue 43, item 5).
TARGET_FPR_INTEGRATED = 1 - 0.212
TARGET_PMEM_PEAK = 1 - 0.402


@dataclass
class Targets:
    """(what, target, measured, met) rows of the final table."""

    rows: list[list[object]] = field(default_factory=list)

    def add(self, what: str, target: str, measured: str, met: bool | None) -> None:
        self.rows.append([what, target, measured, "-" if met is None else ("yes" if met else "NO")])


# ---------------------------------------------------------------------------- the cluster


@dataclass
class Bench:
    cluster: LocalCluster
    dsec: Client
    home: Path
    parents: dict[str, str]  # edge id -> its cgroup parent
    run_id: str

    def state(self, edge: str) -> Path:
        return self.home / "edges" / edge / "microvm"

    def create(self, backend: str, sel: dict[str, str], **kw: Any) -> Sandbox:
        kw.setdefault("image", IMAGE)
        kw.setdefault("cpu", 1)
        kw.setdefault("memory_mb", 256)
        kw.setdefault("task_id", self.run_id)
        return self.dsec.create(backend=backend, node_selector=sel, **kw)  # type: ignore[arg-type]

    def edge_of(self, sb: Sandbox) -> str:
        return sb.info.edge_id

    def procs(self, sb: Sandbox) -> list[int]:
        """Host pids in the sandbox's pids cgroup (a microVM: its QEMU, first)."""
        f = CGROUP_ROOT / "pids" / self.parents[self.edge_of(sb)] / sb.id / "cgroup.procs"
        try:
            return [int(p) for p in f.read_text().split()]
        except OSError:
            return []

    def qemu_pid(self, sb: Sandbox) -> int:
        for pid in self.procs(sb):
            if _comm(pid).startswith("qemu-system"):
                return pid
        raise RuntimeError(f"no QEMU in the pids cgroup of {sb.id}: {self.procs(sb)}")

    def memcg(self, sb: Sandbox) -> dict[str, int]:
        """The sandbox's memory cgroup: usage, limit, failcnt (times the limit was hit) and
        the local memory.stat counters (bytes)."""
        d = CGROUP_ROOT / "memory" / self.parents[self.edge_of(sb)] / sb.id
        out: dict[str, int] = {}
        with contextlib.suppress(OSError):
            out["usage"] = int((d / "memory.usage_in_bytes").read_text())
            out["limit"] = int((d / "memory.limit_in_bytes").read_text())
            out["failcnt"] = int((d / "memory.failcnt").read_text())
            for line in (d / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                out[key] = int(value)
        return out

    def wait_warm_refilled(self, timeout_s: float = 60.0) -> None:
        """Until the warm edge's pool is full again: its refill (a restore) must not run
        during the next system's create."""
        import grpc

        from dsec.edge.v1 import edge_pb2, edge_pb2_grpc

        edge = next(p for p in self.cluster.processes if p.name == "edge-warm")
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(edge.address) as ch:
            stub = edge_pb2_grpc.EdgeServiceStub(ch)
            while time.monotonic() < deadline:
                status = stub.GetNodeStatus(edge_pb2.GetNodeStatusRequest(), timeout=5)
                w = status.warm.get(f"{IMAGE}@microvm")
                if w is not None and w.ready >= w.target:
                    return
                time.sleep(0.1)
        raise RuntimeError(f"the warm pool did not refill within {timeout_s} s")

    def stop(self, sb: Sandbox) -> None:
        """Stop and wait until its host side is gone (nothing of it overlaps the next figure)."""
        with contextlib.suppress(DSecError):
            sb.stop(grace_s=0)
        cg = CGROUP_ROOT / "pids" / self.parents[self.edge_of(sb)] / sb.id
        deadline = time.monotonic() + 30
        while cg.exists() and time.monotonic() < deadline:
            try:
                if not (cg / "cgroup.procs").read_text().split():
                    break
            except OSError:
                break
            time.sleep(0.02)


@contextlib.contextmanager
def microvm_cluster(max_sandboxes: int, keep_logs: Path | None = None) -> Iterator[Bench]:
    """Two edges offering microVMs (templates / cold boot), always torn down: the cluster's
    services, then any QEMU whose command line points into this run's directory, then the
    cgroups of the edges' parents. The services' logs and the guests' console and QEMU logs
    are copied to `keep_logs`, or on a failure to a directory of their own."""
    run_id = f"mvbench{os.getpid()}"
    failed = False
    with tempfile.TemporaryDirectory(prefix="dsec-bench-mv-") as tmp:
        home = Path(tmp)
        cache = home / "microvm-cache"
        prewarm_cache(cache)
        parents = {e: f"dsec-bench-{os.getpid()}-{e}" for e in ("tmpl", "cold", "warm", "fpr")}

        def env(edge: str) -> dict[str, str]:
            return {
                "DSEC_EDGE_MICROVM": "on",
                "DSEC_EDGE_MICROVM_CACHE_DIR": str(cache),
                "DSEC_EDGE_CGROUP_PARENT": parents[edge],
                "DSEC_EDGE_FNCALL_POOLS": "",
                # Admission: M guests at 250 millis + the baselines must fit this 2-core node.
                "DSEC_EDGE_CPU_OVERCOMMIT": "32",
                # The start/pause/resume lines (timing breakdown) are INFO.
                "DSEC_EDGE_LOG_LEVEL": "INFO",
            }

        edges = [
            EdgeSpec(
                edge_id="tmpl",
                labels=TMPL,
                max_sandboxes=max_sandboxes,
                extra_env=env("tmpl"),
            ),
            EdgeSpec(
                edge_id="cold",
                labels=COLD,
                max_sandboxes=max_sandboxes,
                extra_env={**env("cold"), "DSEC_EDGE_MICROVM_TEMPLATES": "false"},
            ),
            EdgeSpec(
                edge_id="warm",
                labels=WARM,
                max_sandboxes=max_sandboxes,
                extra_env={
                    **env("warm"),
                    "DSEC_EDGE_MICROVM_WARM_POOL": f"{IMAGE}=2",
                    "DSEC_EDGE_MICROVM_WARM_MEMORY_MB": "256",
                },
            ),
            EdgeSpec(
                edge_id="fpr",
                labels=FPR,
                max_sandboxes=max_sandboxes,
                extra_env={
                    **env("fpr"),
                    "DSEC_EDGE_MICROVM_TEMPLATES": "false",
                    "DSEC_EDGE_MICROVM_FREE_PAGE_REPORTING": "true",
                },
            ),
        ]
        c = LocalCluster(home, transport="unix", edges=edges, log_level="WARNING")
        try:
            c.start(timeout_s=180)
            with Client(c.apiserver, token=c.token, timeout=120) as dsec:
                b = Bench(c, dsec, home, parents, run_id)
                try:
                    yield b
                finally:
                    with contextlib.suppress(Exception):
                        dsec.stop_all(task_id=run_id)
        except BaseException:
            failed = True
            for p in c.processes:
                if p.name.startswith("edge"):
                    print(f"--- {p.name} (log tail)\n{c.log_tail(p, 40)}", file=sys.stderr)
            raise
        finally:
            c.stop()
            left = reap_qemus(home)
            if left:
                print(f"killed {len(left)} QEMU processes left behind: {left}", file=sys.stderr)
            remove_cgroups(list(parents.values()))
            if keep_logs is not None or failed:
                dest = keep_logs or Path(tempfile.mkdtemp(prefix="dsec-bench-mv-logs-"))
                save_logs(home, dest)
                print(f"logs kept in {dest}", file=sys.stderr)


def save_logs(home: Path, dest: Path) -> None:
    """The services' logs and each edge's microVM logs (consoles, QEMU stderr): small files."""
    dest.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        shutil.copytree(home / "logs", dest / "services", dirs_exist_ok=True)
    for d in sorted((home / "edges").glob("*/microvm/logs")):
        with contextlib.suppress(OSError):
            shutil.copytree(d, dest / f"{d.parent.parent.name}-microvm", dirs_exist_ok=True)


class CpuMeter:
    """The machine's CPU over a section, and the share of it outside this run's process tree
    (this is a shared 2-core machine: a neighbour's load shows here, not in the ratios)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy0, self.mine0 = self._read()

    @staticmethod
    def _read() -> tuple[float, float]:
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(v) - v[3] - v[4]) / hz
        parent: dict[int, int] = {}
        ticks: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                f = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            parent[int(d)] = int(f[1])
            ticks[int(d)] = sum(int(x) for x in f[11:15])  # own + reaped children's
        me = os.getpid()

        def ours(pid: int) -> bool:
            while pid > 1:
                if pid == me:
                    return True
                pid = parent.get(pid, 0)
            return False

        return busy, sum(t for pid, t in ticks.items() if ours(pid)) / hz

    def report(self, what: str) -> None:
        busy, mine = self._read()
        wall = time.monotonic() - self.t0
        cores = os.cpu_count() or 1
        other = max(0.0, (busy - self.busy0) - (mine - self.mine0))
        print(
            f"  [{what}: {wall:.0f} s; the machine {100 * (busy - self.busy0) / wall / cores:.0f}% "
            f"busy of {cores} cores, {100 * other / wall / cores:.0f}% of it outside this run]",
            flush=True,
        )


def prewarm_cache(cache: Path) -> None:
    """The node-wide microVM cache as a node's first edge start leaves it (guest kit built,
    accelerator probed): both edges then start from it instead of probing at the same time.
    The same functions the edge calls (edge/backends/microvm/backend.py from_config)."""
    from edge.backends.microvm.accel import probe
    from edge.backends.microvm.guest import build_guest

    kit = build_guest(cache / "guest")
    verdict = probe(kit, cache, "auto")
    if not verdict.accel:
        raise SystemExit(f"no microVM guest boots on this machine: {verdict.why}")
    print(f"microVM accelerator: {verdict.accel} ({verdict.why})", flush=True)


def reap_qemus(home: Path) -> list[int]:
    """SIGKILL every QEMU whose command line names a path of this run (its disks, kit or
    templates live under `home`): processes this run started, and nothing else."""
    mark = str(home)
    killed = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(QEMU.encode()) and any(mark.encode() in a for a in argv):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(d.name), signal.SIGKILL)
                killed.append(int(d.name))
    deadline = time.monotonic() + 10
    while killed and time.monotonic() < deadline and any(_alive(p) for p in killed):
        time.sleep(0.05)
    return killed


def remove_cgroups(parents: list[str]) -> None:
    """The (now empty) cgroups under this run's edges' parents, and the parents."""
    for controller in CGROUP_ROOT.iterdir():
        for parent in parents:
            root = controller / parent
            if not root.is_dir():
                continue
            for d in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if d.is_dir():
                    with contextlib.suppress(OSError):
                        d.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# ---------------------------------------------------------------------------- memory


def rollup(pid: int) -> dict[str, int]:
    """smaps_rollup of `pid` in kB (Rss, Pss, Pss_Anon, Pss_File, ...)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0])
    return out


def mapping_of(pid: int, match: Callable[[str, str], bool]) -> dict[str, int]:
    """Size/Rss/Pss/Anonymous (kB) summed over the mappings of `pid` for which
    `match(permissions, path)` holds (path "" for an anonymous mapping)."""
    out = {"Size": 0, "Rss": 0, "Pss": 0, "Anonymous": 0}
    take = False
    header = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            if header.match(line):
                fields = line.split(None, 5)
                take = match(fields[1], fields[5].strip() if len(fields) == 6 else "")
            elif take:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] += int(rest.split()[0])
    return out


def is_tcg_code_buffer(perms: str, path: str) -> bool:
    """TCG's translation cache: QEMU's one anonymous rwx mapping (1 GB reserved, used as
    guest code is translated; THP-backed)."""
    return perms == "rwxp" and not path


def cpu_ticks(pid: int) -> int:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    return int(f[11]) + int(f[12])


def edge_log(b: Bench, edge: str, msg: str) -> list[dict[str, Any]]:
    """The edge's JSON log lines whose message contains `msg`."""
    out = []
    path = b.home / "logs" / f"edge-{edge}.log"
    for line in path.read_text(errors="replace").splitlines():
        if msg in line and line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


# ---------------------------------------------------------------------------- 1. create


def section_create(b: Bench, n: int, targets: Targets) -> None:
    # Warm-up: the template of the shape is built (one boot), both edges mount the image.
    for backend, sel in (
        ("microvm", TMPL),
        ("microvm", COLD),
        ("microvm", WARM),
        ("container", TMPL),
    ):
        sb = b.create(backend, sel)
        assert sb.run("true").exit_code == 0
        b.stop(sb)

    systems: dict[str, tuple[str, dict[str, str]]] = {
        "microVM from template": ("microvm", TMPL),
        "microVM cold boot": ("microvm", COLD),
        "microVM claimed warm": ("microvm", WARM),
        "container": ("container", TMPL),
    }
    lat: dict[str, list[float]] = {k: [] for k in systems}
    created: dict[str, list[float]] = {k: [] for k in systems}  # create() returned
    second: dict[str, list[float]] = {k: [] for k in systems}  # the next run("true") alone
    ids: dict[str, list[str]] = {k: [] for k in systems}
    # Interleaved, one of each in turn: the machine's noise (a shared 2-core host) falls on all.
    for _ in range(n):
        for name, (backend, sel) in systems.items():
            t = time.perf_counter()
            sb = b.create(backend, sel)
            t1 = time.perf_counter()
            r = sb.run("true")
            t2 = time.perf_counter()
            assert r.exit_code == 0, r  # a failed start is not a fast one
            lat[name].append(t2 - t)
            created[name].append(t1 - t)
            assert sb.run("true").exit_code == 0
            second[name].append(time.perf_counter() - t2)
            if backend == "microvm":
                assert b.qemu_pid(sb)  # it is a guest
            ids[name].append(sb.id)
            b.stop(sb)
            if sel is WARM:
                b.wait_warm_refilled()

    s50, s99, _ = summary_ms(lat["microVM from template"])
    c50, c99, _ = summary_ms(lat["microVM cold boot"])
    k50, k99, _ = summary_ms(lat["container"])
    w50, w99, _ = summary_ms(lat["microVM claimed warm"])
    table(
        f'create -> first command (run("true") returned), {n} sandboxes each, interleaved, '
        "busybox, 256 MB, 1 vCPU (ms)",
        ["system", "p50", "p99", "ratio of p50s", "target", "met"],
        [
            [
                "microVM from template",
                s50,
                s99,
                "1.00",
                f"p50 <= {TARGET_CREATE_P50_MS:.0f}",
                "yes" if s50 <= TARGET_CREATE_P50_MS else "NO",
            ],
            [
                "microVM cold boot (no template)",
                c50,
                c99,
                f"cold/snapshot {c50 / s50:.2f}",
                f"cold/snapshot >= {TARGET_COLD_OVER_SNAPSHOT:.0f}",
                "yes" if c50 / s50 >= TARGET_COLD_OVER_SNAPSHOT else "NO",
            ],
            [
                "microVM claimed warm (pool of 2)",
                w50,
                w99,
                f"warm/snapshot {w50 / s50:.2f}",
                f"p50 <= {TARGET_CREATE_P50_MS:.0f}",
                "yes" if w50 <= TARGET_CREATE_P50_MS else "NO",
            ],
            ["container (runc + aether)", k50, k99, f"snapshot/container {s50 / k50:.2f}", "", ""],
        ],
    )
    targets.add(
        "create -> first command p50, microVM from template",
        f"<= {TARGET_CREATE_P50_MS:.0f} ms",
        f"{s50:.0f} ms",
        s50 <= TARGET_CREATE_P50_MS,
    )
    targets.add(
        "cold boot / template p50",
        f">= {TARGET_COLD_OVER_SNAPSHOT:.0f}x",
        f"{c50 / s50:.1f}x",
        c50 / s50 >= TARGET_COLD_OVER_SNAPSHOT,
    )

    table(
        'the same creates split: create() returned, then the first and the second run("true") '
        "(p50 ms; the second is not part of the figure above)",
        ["system", "create()", "first run", "second run"],
        [
            [
                name,
                summary_ms(created[name])[0],
                summary_ms([a - c for a, c in zip(lat[name], created[name], strict=True)])[0],
                summary_ms(second[name])[0],
            ]
            for name in systems
        ],
    )

    # Where the time goes, from the edges' own start log of the same sandboxes.
    rows = []
    for name, edge in (
        ("microVM from template", "tmpl"),
        ("microVM cold boot", "cold"),
        ("microVM claimed warm", "warm"),
    ):
        mine = set(ids[name])
        lines = [e for e in edge_log(b, edge, "started in") if e.get("sandbox_id") in mine]
        if not lines:
            continue
        row: list[object] = [name, len(lines)]
        for key in ("disk_ms", "qemu_ms", "hello_ms", "claim_ms"):
            row.append(pct([float(e.get(key, "nan")) for e in lines], 50))
        total = [float(e["msg"].rsplit(" in ", 1)[1].split()[0]) for e in lines]
        row += [pct(total, 50), summary_ms(lat[name])[0] - pct(total, 50)]
        rows.append(row)
    if rows:
        table(
            "where a microVM create's time goes (edge start log, p50 ms of the same sandboxes)",
            [
                "system",
                "n",
                "disk",
                "qemu + restore/boot",
                "hello",
                "claim",
                "edge start",
                "rest (SDK, apiserver, placement, exec)",
            ],
            rows,
        )


# ---------------------------------------------------------------------------- 2. round trip


def section_rtt(b: Bench, calls: int) -> None:
    vm = b.create("microvm", TMPL)
    ct = b.create("container", TMPL)
    try:
        for _ in range(10):
            assert vm.run("true").exit_code == 0
            assert ct.run("true").exit_code == 0
        t_vm: list[float] = []
        t_ct: list[float] = []
        for _ in range(calls):
            for sb, out in ((vm, t_vm), (ct, t_ct)):
                t = time.perf_counter()
                r = sb.run("true")
                out.append(time.perf_counter() - t)
                assert r.exit_code == 0, r
    finally:
        b.stop(vm)
        b.stop(ct)
    v50, v99, vmean = summary_ms(t_vm)
    c50, c99, cmean = summary_ms(t_ct)
    table(
        f'run("true") round trip, {calls} calls each after 10 warm-up, interleaved (ms)',
        ["sandbox", "p50", "p99", "mean", "p50 vs container"],
        [
            ["microVM (virtio-serial -> aether -> chronus)", v50, v99, vmean, v50 / c50],
            ["container (unix socket -> aether -> chronus)", c50, c99, cmean, 1.0],
        ],
    )


# ---------------------------------------------------------------------------- 3. pause/resume


#: What happens to the saved state between pause and resume: nothing (the edge's own path:
#: the state is still dirty page cache, charged to the sandbox's memory cgroup), written back
#: (fsync: clean page cache), or written back and dropped from the page cache (a resume long
#: after the pause).
STATE_MODES = {
    "as paused": "state as the pause left it",
    "fsync": "state written back by the bench (fsync)",
    "evict": "state written back and evicted from page cache",
}


@dataclass
class Cycle:
    mode: str  # a key of STATE_MODES
    pause_s: float
    resume_s: float
    first_s: float  # resume() called -> run("true") returned
    pss_before_kb: int
    rss_before_kb: int
    pss_after_kb: int  # of whatever is left in the sandbox's cgroup after pause
    procs_after: int
    memcg_before: dict[str, int]
    memcg_after: dict[str, int]
    state_bytes: int
    writeback_s: float  # the bench's fsync of the state ("fsync", "evict")
    pss_resumed_kb: int
    limit_hits: int  # the memory cgroup's failcnt over resume + first command


CHUNKS = 8


def _sums_cmd(fill_mb: int) -> str:
    offsets = sorted({min(fill_mb - 1, i * fill_mb // (CHUNKS - 1)) for i in range(CHUNKS)})
    return " ; ".join(
        f"dd if=/dev/shm/fill bs=1M skip={o} count=1 2>/dev/null | md5sum" for o in offsets
    )


def fill_guest(sb: Sandbox, memory_mb: int) -> tuple[int, float, str]:
    """Dirty ~60% of guest RAM with random data in /dev/shm (what fits: MemAvailable less a
    margin for aether). Returns (MB written, seconds, the sampled checksums)."""
    meminfo = sb.run("cat /proc/meminfo").text
    avail_mb = int(re.search(r"MemAvailable:\s+(\d+)", meminfo).group(1)) // 1024  # type: ignore[union-attr]
    fill = min(round(memory_mb * 0.6), avail_mb - 48)
    r = sb.run(f"mount -o remount,size={fill + 16}m /dev/shm")
    if r.exit_code != 0:
        raise RuntimeError(f"cannot grow the guest's /dev/shm: {r.stderr!r}")
    t = time.perf_counter()
    r = sb.run(f"dd if=/dev/urandom of=/dev/shm/fill bs=1M count={fill}", timeout_s=600)
    took = time.perf_counter() - t
    if r.exit_code != 0:
        raise RuntimeError(f"filling the guest's RAM failed: {r.exit_code} {r.stderr!r}")
    size = int(sb.run("stat -c %s /dev/shm/fill").text)
    assert size == fill << 20, (size, fill)
    return fill, took, sb.run(_sums_cmd(fill), timeout_s=120).text


def check_intact(sb: Sandbox, fill_mb: int, sums: str) -> None:
    size = int(sb.run("stat -c %s /dev/shm/fill").text)
    if size != fill_mb << 20:
        raise RuntimeError(f"after resume /dev/shm/fill is {size} bytes, not {fill_mb << 20}")
    now = sb.run(_sums_cmd(fill_mb), timeout_s=120).text
    if now != sums:
        raise RuntimeError(f"after resume the data changed:\n{sums}\nvs\n{now}")


def write_back(path: Path, *, drop: bool) -> tuple[float, int]:
    """fsync `path` (and drop it from the page cache): (seconds, bytes still cached)."""
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if drop:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    took = time.perf_counter() - t
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", str(path)],
        capture_output=True,
        text=True,
    )
    cached = int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else -1
    return took, cached


def pause_cycle(b: Bench, sb: Sandbox, fill_mb: int, sums: str, mode: str) -> Cycle:
    pid = b.qemu_pid(sb)
    before = rollup(pid)
    mem_before = b.memcg(sb)
    t = time.perf_counter()
    info = sb.pause()
    pause_s = time.perf_counter() - t
    assert info.state == "PAUSED", info
    left = [p for p in b.procs(sb) if _alive(p)]
    pss_after = 0
    for p in left:
        with contextlib.suppress(OSError):
            pss_after += rollup(p).get("Pss", 0)
    mem_after = b.memcg(sb)
    state = b.state("tmpl") / "paused" / f"{sb.id}.vmstate"
    size = state.stat().st_size
    writeback_s = float("nan")
    if mode != "as paused":
        writeback_s, cached = write_back(state, drop=mode == "evict")
        if mode == "evict" and cached:
            print(f"  (the saved state still has {cached} bytes cached after eviction)")
    hits = b.memcg(sb).get("failcnt", 0)
    t = time.perf_counter()
    sb.resume()
    resume_s = time.perf_counter() - t
    r = sb.run("true")
    first_s = time.perf_counter() - t
    assert r.exit_code == 0, r
    hits = b.memcg(sb).get("failcnt", 0) - hits
    check_intact(sb, fill_mb, sums)
    return Cycle(
        mode,
        pause_s,
        resume_s,
        first_s,
        before["Pss"],
        before["Rss"],
        pss_after,
        len(left),
        mem_before,
        mem_after,
        size,
        writeback_s,
        rollup(b.qemu_pid(sb))["Pss"],
        hits,
    )


def _edge_ms(b: Bench, edge: str, sid: str, msg: str) -> list[float]:
    """The durations (ms) of the edge's log lines for `sid` containing `msg`, in order."""
    out = []
    for e in edge_log(b, edge, msg):
        if e.get("sandbox_id") == sid:
            out.append(float(e["msg"].split(msg, 1)[1].split()[0]))
    return out


def _freed(before: float, after: float) -> float:
    return 100.0 * (before - after) / before if before else float("nan")


def section_pause(b: Bench, cycles: int, sizes: list[int], targets: Targets) -> None:
    rows: list[list[object]] = []
    mem_rows: list[list[object]] = []
    for mb in sizes:
        sb = b.create("microvm", TMPL, memory_mb=mb)
        try:
            fill, fill_s, sums = fill_guest(sb, mb)
            cg = b.memcg(sb)
            print(
                f"  {mb} MB guest: {fill} MB of random data in /dev/shm in {fill_s:.1f} s; its "
                f"memory cgroup then holds {cg.get('usage', 0) / 2**20:.0f} of "
                f"{cg.get('limit', 0) / 2**20:.0f} MB ({cg.get('cache', 0) / 2**20:.0f} MB page "
                f"cache: the template RAM file's pages the writes faulted in), limit hit "
                f"{cg.get('failcnt', 0)} times",
                flush=True,
            )
            # The modes in turn (the first pause after the create is "as paused"): the
            # machine's noise falls on all of them alike.
            done = [
                pause_cycle(b, sb, fill, sums, mode) for _ in range(cycles) for mode in STATE_MODES
            ]
            edge_pause = _edge_ms(b, "tmpl", sb.id, "paused to disk in ")
            edge_resume = _edge_ms(b, "tmpl", sb.id, "resumed in ")
        finally:
            b.stop(sb)
        label = f"{mb} MB guest, {fill} MB dirtied"
        for mode, what in STATE_MODES.items():
            idx = [i for i, c in enumerate(done) if c.mode == mode]
            cs = [done[i] for i in idx]
            p = [c.pause_s * 1000 for c in cs]
            r = [c.resume_s * 1000 for c in cs]
            f = [c.first_s * 1000 for c in cs]
            rows.append(
                [
                    f"{label}: {what} (x{len(cs)})",
                    pct(p, 50),
                    max(p),
                    pct([edge_pause[i] for i in idx if i < len(edge_pause)], 50),
                    pct(r, 50),
                    max(r),
                    pct([edge_resume[i] for i in idx if i < len(edge_resume)], 50),
                    pct(f, 50),
                    max(f),
                    "-" if mode == "as paused" else pct([c.writeback_s * 1000 for c in cs], 50),
                ]
            )
        # The first pause after the create apart (its memory cgroup still holds the template
        # RAM file's pages the guest's writes faulted in), then the medians of the others.
        groups = [("first pause after the create", done[:1])] + [
            (f"{mode}, median of {len(cs)}", cs)
            for mode in STATE_MODES
            if (cs := [c for c in done[1:] if c.mode == mode])
        ]
        for what, cs in groups:

            def med(get: Callable[[Cycle], float], cs: list[Cycle] = cs) -> float:
                return pct([get(c) for c in cs], 50)

            mem_rows.append(
                [
                    f"{label}: {what}",
                    med(lambda c: c.rss_before_kb / 1024),
                    med(lambda c: c.pss_before_kb / 1024),
                    max(c.procs_after for c in cs),
                    med(lambda c: _freed(c.pss_before_kb, c.pss_after_kb)),
                    med(lambda c: c.memcg_before.get("limit", 0) / 2**20),
                    med(lambda c: c.memcg_before.get("usage", 0) / 2**20),
                    med(lambda c: c.memcg_before.get("cache", 0) / 2**20),
                    med(lambda c: c.memcg_after.get("usage", 0) / 2**20),
                    med(lambda c: c.memcg_after.get("cache", 0) / 2**20),
                    med(lambda c: c.memcg_after.get("dirty", 0) / 2**20),
                    med(
                        lambda c: _freed(
                            c.memcg_before.get("usage", 0), c.memcg_after.get("usage", 0)
                        )
                    ),
                    med(lambda c: c.state_bytes / 2**20),
                    med(lambda c: c.pss_resumed_kb / 1024),
                    sum(c.limit_hits for c in cs),
                ]
            )
        worst = min(_freed(x.pss_before_kb, x.pss_after_kb) for x in done)
        targets.add(
            f"host memory freed by pause, {mb} MB guest: the QEMU process (PSS)",
            f">= {TARGET_FREED_PCT:.0f}%",
            f"{worst:.1f}% (worst of {len(done)})",
            worst >= TARGET_FREED_PCT,
        )
        charged = [
            _freed(x.memcg_before["usage"], x.memcg_after["usage"])
            for x in done
            if "usage" in x.memcg_before and "usage" in x.memcg_after
        ]
        if charged:
            targets.add(
                f"host memory freed by pause, {mb} MB guest: its memory cgroup's charge",
                f">= {TARGET_FREED_PCT:.0f}%",
                f"{min(charged):.1f}% (worst; what stays charged is page cache)",
                min(charged) >= TARGET_FREED_PCT,
            )
        if mb == 256:
            for mode in STATE_MODES:
                f50 = pct([c.first_s * 1000 for c in done if c.mode == mode], 50)
                note = "" if mode == "as paused" else ", diagnostic"
                targets.add(
                    f"resume -> first command p50, 256 MB ({STATE_MODES[mode]}{note})",
                    f"<= {TARGET_RESUME_FIRST_MS:.0f} ms",
                    f"{f50:.0f} ms",
                    f50 <= TARGET_RESUME_FIRST_MS,
                )
    table(
        "pause to disk / resume, ~60% of guest RAM dirtied, the data verified after every resume "
        "(ms; SDK round trips, and the edge's own figure from its log)",
        [
            "guest",
            "pause p50",
            "max",
            "edge",
            "resume p50",
            "max",
            "edge",
            "resume -> first cmd p50",
            "max",
            "bench fsync",
        ],
        rows,
    )
    table(
        "host memory around a pause (MB; 'memcg': the sandbox's memory cgroup, to which the "
        "saved state's page cache is charged: QEMU's `cat` child writes it)",
        [
            "guest (state mode)",
            "QEMU RSS before",
            "QEMU PSS before",
            "procs after",
            "freed % (PSS)",
            "memcg limit",
            "memcg before",
            "of it page cache",
            "memcg after",
            "of it page cache",
            "dirty",
            "freed % (memcg)",
            "state file",
            "QEMU PSS after resume",
            "memcg limit hits in resumes",
        ],
        mem_rows,
    )


# ---------------------------------------------------------------------------- 4. idle memory


def section_idle(b: Bench, count: int, baselines: int, targets: Targets) -> None:
    vms: list[Sandbox] = []
    cold: list[Sandbox] = []
    cts: list[Sandbox] = []
    try:
        started = time.perf_counter()
        # In batches: a burst of all of them at once on this 2-core TCG machine fails most
        # creates (the guests' claim times out at 10 s; see the bench's report), and this
        # section is about the memory of idle guests, not about bursts.
        vms = start_idle(b, TMPL, count, 0.25)
        print(
            f"  {len(vms)} microVMs from one template (250 millis each, {IDLE_BATCH} at a time) in "
            f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
        if not vms:
            raise RuntimeError("no idle microVM started")
        # Baselines of the same shape (1 vCPU, 256 MB); the cold boots at a full core's quota
        # (at 250 millis a TCG boot takes four times as long; the memory is the same).
        cold = [b.create("microvm", COLD) for _ in range(baselines)]
        cts = [b.create("container", TMPL, cpu=0.25) for _ in range(baselines)]
        for sb in [*vms, *cold, *cts]:
            assert sb.run("true").exit_code == 0  # alive and claimed
        time.sleep(5.0)  # idle
        tmpl_root = b.home / "microvm-cache" / "templates"

        def is_template_ram(perms: str, path: str) -> bool:
            return path.startswith(str(tmpl_root)) and path.endswith("/ram")

        def vm_row(sbs: list[Sandbox]) -> dict[str, float]:
            pids = [b.qemu_pid(sb) for sb in sbs]
            rolls = [rollup(p) for p in pids]
            ram = [mapping_of(p, is_template_ram) for p in pids]
            tcg = [mapping_of(p, is_tcg_code_buffer) for p in pids]
            t0 = {p: cpu_ticks(p) for p in pids}
            time.sleep(5.0)
            ticks = sum(cpu_ticks(p) - t0[p] for p in pids) / os.sysconf("SC_CLK_TCK")
            k = len(pids)
            return {
                "n": k,
                "rss": sum(r["Rss"] for r in rolls) / k / 1024,
                "pss": sum(r["Pss"] for r in rolls) / k / 1024,
                "pss_p99": pct([r["Pss"] / 1024 for r in rolls], 99),
                "pss_anon": sum(r.get("Pss_Anon", 0) for r in rolls) / k / 1024,
                "pss_file": sum(r.get("Pss_File", 0) for r in rolls) / k / 1024,
                "ram_rss": sum(m["Rss"] for m in ram) / k / 1024,
                "ram_pss": sum(m["Pss"] for m in ram) / k / 1024,
                "ram_anon": sum(m["Anonymous"] for m in ram) / k / 1024,
                "tcg": sum(m["Rss"] for m in tcg) / k / 1024,
                "cpu_pct": 100.0 * ticks / 5.0 / k,
            }

        t = vm_row(vms)
        c = vm_row(cold) if cold else None
        rows: list[list[object]] = [
            [
                f"microVM from one template (x{t['n']:.0f})",
                t["rss"],
                t["pss"],
                t["pss_p99"],
                t["pss_anon"],
                t["pss_file"],
                t["ram_rss"],
                t["ram_pss"],
                t["ram_anon"],
                t["tcg"],
                t["cpu_pct"],
            ]
        ]
        if c is not None:
            rows.append(
                [
                    f"microVM cold boot (x{c['n']:.0f})",
                    c["rss"],
                    c["pss"],
                    c["pss_p99"],
                    c["pss_anon"],
                    c["pss_file"],
                    "-",
                    "-",
                    "-",
                    c["tcg"],
                    c["cpu_pct"],
                ]
            )
        if cts:
            per = []
            for sb in cts:
                total = 0
                for p in b.procs(sb):
                    with contextlib.suppress(OSError):
                        total += rollup(p)["Pss"]
                per.append(total / 1024)
            rows.append(
                [
                    f"container: aether + chronus (x{len(cts)})",
                    "-",
                    sum(per) / len(per),
                    pct(per, 99),
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                ]
            )
        table(
            f"idle host memory per sandbox, 256 MB guests, {t['n']:.0f} clones running (MB)",
            [
                "sandbox",
                "RSS",
                "PSS",
                "PSS p99",
                "Pss_Anon",
                "Pss_File",
                "guest RAM map RSS",
                "guest RAM map PSS",
                "of it CoW copies",
                "TCG code cache RSS",
                "idle CPU %",
            ],
            rows,
        )
        saved = (t["ram_rss"] - t["ram_pss"]) * t["n"]
        print(
            f"  sharing the template's RAM file: {t['ram_rss']:.1f} MB of guest RAM resident per "
            f"clone, {t['ram_pss']:.1f} MB of it its share: {saved:.0f} MB saved over "
            f"{t['n']:.0f} clones (sum of RSS - sum of PSS of the RAM mapping)"
            + (f"; a cold-booted guest's PSS is {c['pss']:.1f} MB" if c else ""),
            flush=True,
        )
        targets.add(
            f"PSS per idle 256 MB microVM ({t['n']:.0f} clones of one template)",
            f"<= {TARGET_IDLE_PSS_MB:.0f} MB",
            f"{t['pss']:.1f} MB",
            t["pss"] <= TARGET_IDLE_PSS_MB,
        )
    finally:
        for sb in [*vms, *cold, *cts]:
            b.stop(sb)


# ------------------------------------------------------- 4b. free-page reporting, pmem


def start_idle(b: Bench, sel: dict[str, str], count: int, cpu: float) -> list[Sandbox]:
    """`count` busybox microVMs (256 MB) on the edge of `sel`, IDLE_BATCH at a time; each
    answered a command. A failed create is printed and left out."""
    out: list[Sandbox] = []
    failed: list[str] = []
    for i in range(0, count, IDLE_BATCH):
        made = b.dsec.create_many(
            min(IDLE_BATCH, count - i),
            backend="microvm",
            image=IMAGE,
            cpu=cpu,
            memory_mb=256,
            node_selector=sel,
            task_id=b.run_id,
        )
        for r in made:
            if isinstance(r, Sandbox) and r.info.state == "RUNNING":
                out.append(r)
            elif isinstance(r, Sandbox):
                failed.append(f"{r.id}: {r.info.termination_reason} {r.info.termination_message}")
                b.stop(r)
            else:
                failed.append(repr(r))
    for sb in out:
        assert sb.run("true").exit_code == 0
    if failed:
        print(f"  {len(failed)} creates on {sel} failed: {failed[:3]}", flush=True)
    return out


def _files_of(pid: int) -> tuple[set[str], set[str], set[str]]:
    """The files behind a QEMU's guest, from its command line: its RAM file if any
    (memory-backend-file mem-path=), its read-only and its writable drives (-drive file=)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    ram: set[str] = set()
    readonly: set[str] = set()
    writable: set[str] = set()
    for arg in argv:
        opts = dict(o.split("=", 1) for o in arg.split(",") if "=" in o)
        if arg.startswith("memory-backend-file") and "mem-path" in opts:
            ram.add(opts["mem-path"])
        elif "file" in opts and "if" in opts:  # a -drive
            (readonly if opts.get("readonly") == "on" else writable).add(opts["file"])
    return ram, readonly, writable


def _in(paths: set[str]) -> Callable[[str, str], bool]:
    return lambda perms, path: path in paths


def page_cache_kb(paths: set[str]) -> int:
    """Resident page cache of `paths` (each once), kB (fincore)."""
    if not paths:
        return 0
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", *sorted(paths)],
        capture_output=True,
        text=True,
    )
    return sum(int(x) for x in out.stdout.split()) // 1024


def host_memory(pids: list[int]) -> dict[str, float]:
    """MB: the QEMUs' PSS less what of it is their guest-RAM file's page cache, plus the page
    cache of every file behind them counted once (the RAM file, read-only layers and toolkit,
    writable disks: a guest's disk I/O goes through the host's page cache, which no PSS
    shows)."""
    pss = file_part = 0
    rams: set[str] = set()
    readonly: set[str] = set()
    writable: set[str] = set()
    for pid in pids:
        pss += rollup(pid)["Pss"]
        ram, ro, rw = _files_of(pid)
        rams |= ram
        readonly |= ro
        writable |= rw
        if ram:
            m = mapping_of(pid, _in(ram))
            file_part += m["Pss"] - m["Anonymous"]  # counted below, once, as page cache
    cache = {
        "ram_file": page_cache_kb(rams) / 1024,
        "readonly": page_cache_kb(readonly) / 1024,
        "writable": page_cache_kb(writable) / 1024,
    }
    own = (pss - file_part) / 1024
    return {
        "n": len(pids),
        "pss": pss / 1024 / max(1, len(pids)),
        "sum_pss": pss / 1024,
        **cache,
        "total": own + sum(cache.values()),
    }


@dataclass
class FreeCycle:
    before: float  # MB, QEMU RSS
    peak: float
    after: float
    integral: float  # MB*s of RSS over the cycle
    seconds: float


def free_cycle(b: Bench, sb: Sandbox, fill_mb: int) -> FreeCycle:
    """The guest fills `fill_mb` of its /dev/shm with random data and removes it; its QEMU's
    RSS is sampled every 0.1 s from before the fill until FPR_SETTLE_S after the removal."""
    import threading

    pid = b.qemu_pid(sb)
    sb.run(f"mount -o remount,size={fill_mb + 24}m /dev/shm; sync")
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.monotonic(), rollup(pid)["Rss"] / 1024))
            done.wait(0.1)

    t = threading.Thread(target=sample, daemon=True)
    time.sleep(1.0)
    before = rollup(pid)["Rss"] / 1024
    t.start()
    try:
        r = sb.run(f"dd if=/dev/urandom of=/dev/shm/fill bs=1M count={fill_mb}", timeout_s=300)
        if r.exit_code != 0:
            raise RuntimeError(f"the fill failed: {r.exit_code} {r.stderr!r}")
        assert sb.run("rm /dev/shm/fill").exit_code == 0
        time.sleep(FPR_SETTLE_S)
    finally:
        done.set()
        t.join()
    integral = sum((t1 - t0) * m0 for (t0, m0), (t1, _) in itertools.pairwise(samples))
    tail = [m for ts, m in samples if ts >= samples[-1][0] - 1.0]
    return FreeCycle(
        before,
        max(m for _, m in samples),
        sorted(tail)[len(tail) // 2],
        integral,
        samples[-1][0] - samples[0][0],
    )


def section_guest_memory(b: Bench, count: int, targets: Targets) -> None:
    """Free-page reporting on vs off (and pmem: why not) in this run: one fill-and-free cycle
    per configuration, then `count` idle guests per configuration, one configuration at a
    time (the previous one stopped)."""
    from edge.config import PMEM_UNAVAILABLE

    cycles: dict[str, FreeCycle] = {}
    for name, sel in (("off", COLD), ("on", FPR)):
        sb = b.create("microvm", sel)
        try:
            cycles[name] = free_cycle(b, sb, FPR_FILL_MB)
        finally:
            b.stop(sb)
    off, on = cycles["off"], cycles["on"]
    table(
        f"a 256 MB guest fills {FPR_FILL_MB} MB of its /dev/shm and frees it (cold boots; "
        "QEMU RSS, MB)",
        [
            "free-page reporting",
            "before",
            "peak",
            f"{FPR_SETTLE_S:.0f} s after the free",
            "given back",
            "RSS integrated (MB*s)",
            "over (s)",
        ],
        [
            [k, c.before, c.peak, c.after, c.peak - c.after, c.integral, c.seconds]
            for k, c in cycles.items()
        ],
    )
    ratio = on.integral / off.integral if off.integral else float("nan")
    targets.add(
        f"time-integrated QEMU RSS of a guest freeing {FPR_FILL_MB} MB, reporting on/off",
        f"<= {TARGET_FPR_INTEGRATED:.3f}x (report: -21.2%)",
        f"{ratio:.3f}x ({on.peak - on.after:.0f} MB given back in {FPR_SETTLE_S:.0f} s, "
        f"off: {off.peak - off.after:.0f} MB)",
        ratio <= TARGET_FPR_INTEGRATED,
    )

    groups = [
        ("clones of one template (cannot report)", TMPL, 0.25),
        ("cold boots, reporting off", COLD, 1.0),
        ("cold boots, reporting on", FPR, 1.0),
    ]
    rows: list[list[object]] = []
    totals: dict[str, dict[str, float]] = {}
    for label, sel, cpu in groups:
        started = time.perf_counter()
        sbs = start_idle(b, sel, count, cpu)
        try:
            print(
                f"  {len(sbs)} idle guests: {label} (started in "
                f"{time.perf_counter() - started:.0f} s)",
                flush=True,
            )
            time.sleep(FPR_SETTLE_S)  # idle; what the boots freed is reported meanwhile
            m = host_memory([b.qemu_pid(sb) for sb in sbs])
        finally:
            for sb in sbs:
                b.stop(sb)
        totals[label] = m
        rows.append(
            [
                label,
                m["n"],
                m["pss"],
                m["sum_pss"],
                m["ram_file"],
                m["readonly"],
                m["writable"],
                m["total"],
                m["total"] / max(1, m["n"]),
            ]
        )
    table(
        f"host memory of {count} idle 256 MB guests (MB; page cache of each file counted once)",
        [
            "guests",
            "n",
            "PSS each",
            "sum of PSS",
            "RAM file cache",
            "layers+toolkit cache",
            "writable disks cache",
            "host total",
            "per guest",
        ],
        rows,
    )
    cold_off = totals["cold boots, reporting off"]
    cold_on = totals["cold boots, reporting on"]
    ratio = cold_on["total"] / cold_off["total"] if cold_off["total"] else float("nan")
    print(
        f"  free-page reporting: {count} idle cold-booted guests hold {cold_on['total']:.0f} MB "
        f"with it, {cold_off['total']:.0f} MB without ({ratio:.2f}x); template clones "
        f"(reporting impossible: their RAM is the template's file) "
        f"{totals[groups[0][0]]['total']:.0f} MB",
        flush=True,
    )
    print(f"  virtio-pmem not measured: {PMEM_UNAVAILABLE}", flush=True)
    targets.add(
        f"host memory, {count} idle guests, pmem + reporting on vs off",
        f"<= {TARGET_PMEM_PEAK:.3f}x (report: pmem -40.2% peak)",
        f"reporting only (pmem impossible on microvm): {ratio:.3f}x of cold boots without",
        False,
    )


# ---------------------------------------------------------------------------- main


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # the cleanup of the finally blocks runs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small n everywhere (~3 minutes)")
    ap.add_argument("--n", type=int, help="sandboxes per system in section 1 (default 30)")
    ap.add_argument("--rtt", type=int, help="round trips per sandbox in section 2 (default 50)")
    ap.add_argument("--idle", type=int, help="idle microVMs in section 4 (default 32)")
    ap.add_argument(
        "--cycles",
        type=int,
        help="rounds of pause/resume (one per state mode) per size (default 3)",
    )
    ap.add_argument("--sections", default="1,2,3,4", help="which sections, e.g. 1,3")
    ap.add_argument("--keep-logs", type=Path, help="copy the services' and guests' logs here")
    args = ap.parse_args()
    n = args.n or (8 if args.quick else 30)
    rtt = args.rtt or (20 if args.quick else 50)
    idle = args.idle or (8 if args.quick else 32)
    cycles = args.cycles or (1 if args.quick else 3)
    baselines = 2
    sections = {int(s) for s in args.sections.split(",") if s}
    signal.signal(signal.SIGTERM, _terminate)

    targets = Targets()
    t0 = time.monotonic()
    with microvm_cluster(idle + 2 * baselines + 16, args.keep_logs) as b:
        print(f"cluster up in {time.monotonic() - t0:.1f} s", flush=True)
        runs: list[tuple[int, str, Callable[[], None]]] = [
            (1, "create", lambda: section_create(b, n, targets)),
            (2, "round trip", lambda: section_rtt(b, rtt)),
            (3, "pause/resume", lambda: section_pause(b, cycles, [256, 1024], targets)),
            (4, "idle memory", lambda: section_idle(b, idle, baselines, targets)),
            (4, "guest memory", lambda: section_guest_memory(b, idle, targets)),
        ]
        for number, name, run in runs:
            if number in sections:
                meter = CpuMeter()
                run()
                meter.report(f"section {number} ({name})")
    if targets.rows:
        table(
            "targets (issue: MicroVM sandboxes; TCG guests on this 2-core machine)",
            ["what", "target", "measured", "met"],
            targets.rows,
        )
    print(f"\ntotal {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MicroVM sandboxes beyond the conformance suite: what only a guest with its own kernel has.

Pause to disk and back many times (also right after a call and in the middle of one), template
clones that each become their own sandbox, a guest kernel's panic and its running out of memory,
the shape bounds of an edge, a paused guest across an edge crash, what an operator sees, the
cold-boot path (templates off), pack_diff of a running and of a paused guest, and forks (a
running guest 8 ways, every process continuing in every child; a paused one; a child's child).

Not here: a running guest taken back by a restarted edge (the conformance suite has it); an
image whose layer is a directory (the public path cannot make one: flat `<name>.rootfs` images
are imported into the layer store as EROFS layers, and only the FnCall pools, containers, read
flat directories as they are); aether exiting.

One module-scoped cluster (guests boot under TCG here): three container edges with
DSEC_EDGE_MICROVM=on, "mvt" (templates, where every test's sandboxes go unless it asks for
another), "mvc" (DSEC_EDGE_MICROVM_TEMPLATES=false) and "mvr" (templates off and
DSEC_EDGE_MICROVM_FREE_PAGE_REPORTING=true), told apart by a `pool` label and the creates'
node_selector. Each test's sandboxes are labelled with its id and always stopped; a
failed test prints the services' log tails and its guests' serial consoles.

Host-side knowledge (where a guest's QEMU, disk and saved state live) is confined to the
helpers below `_host`; every outcome is asserted through the public SDK or the CLI.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsecctl.cluster import EdgeSpec, LocalCluster
from libdsec import Client, ForkResult, NetworkPolicy, Output, Sandbox
from libdsec.errors import DSecError, InvalidArgument, Unimplemented
from tests.conftest import print_log_tails
from tests.helpers import dsec_status, sandbox_factory, wait_for
from tests.integration.conftest import ClusterWith, container_edge

pytestmark = pytest.mark.images("busybox")

TEMPLATED, COLD, REPORTING = "mvt", "mvc", "mvr"
MAX_MEMORY_MB, MAX_VCPUS = 2048, 2

Make = Callable[..., Sandbox]


@dataclass
class Lab:
    cluster: LocalCluster
    client: Client

    def edge_process(self, edge_id: str) -> str:
        return f"edge-{edge_id}"

    def state_dir(self, edge_id: str) -> Path:
        """The edge's microvm backend directory (rw/, paused/, logs/, sockets/)."""
        return self.cluster.home / "edges" / edge_id / "microvm"

    def cgroup_parent(self, edge_id: str) -> str:
        spec = next(e for e in self.cluster.edges if e.edge_id == edge_id)
        return spec.extra_env["DSEC_EDGE_CGROUP_PARENT"]


def _edge(edge_id: str, pool: str, **env: str) -> EdgeSpec:
    microvm = {
        "DSEC_EDGE_MICROVM": "on",
        "DSEC_EDGE_MICROVM_MAX_MEMORY_MB": str(MAX_MEMORY_MB),
        "DSEC_EDGE_MICROVM_MAX_VCPUS": str(MAX_VCPUS),
    }
    return container_edge(edge_id, {**microvm, **env}, labels={"pool": pool})


@pytest.fixture(scope="module")
def lab(cluster_with: ClusterWith) -> Iterator[Lab]:
    edges = [
        _edge(TEMPLATED, "templates"),
        _edge(COLD, "cold", DSEC_EDGE_MICROVM_TEMPLATES="false"),
        _edge(
            REPORTING,
            "reporting",
            DSEC_EDGE_MICROVM_TEMPLATES="false",
            DSEC_EDGE_MICROVM_FREE_PAGE_REPORTING="true",
        ),
    ]
    with (
        cluster_with("microvm", edges=edges) as cluster,
        Client(cluster.apiserver, token=cluster.token) as client,
    ):
        yield Lab(cluster, client)


@pytest.fixture
def make(lab: Lab, request: pytest.FixtureRequest) -> Iterator[Make]:
    """Factory: a busybox microVM (half a core, 256 MB) on the templated edge unless
    `node_selector` says otherwise, labelled with the test id, always stopped. On failure: the
    services' log tails and the console of every guest the test made."""
    made: list[Sandbox] = []
    with sandbox_factory(lab.client, request.node.nodeid, memory_mb=256, grace_s=0.5) as factory:

        def make_one(**kw: Any) -> Sandbox:
            kw.setdefault("backend", "microvm")
            kw.setdefault("node_selector", {"pool": "templates"})
            sb = factory(**kw)
            made.append(sb)
            return sb

        yield make_one
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print_log_tails(lab.cluster, request.node.nodeid)
        for sb in made:
            for edge_id in (TEMPLATED, COLD, REPORTING):
                console = lab.state_dir(edge_id) / "logs" / f"{sb.id}.console"
                if console.exists():
                    print(f"----- console of {sb.id} ({console})")
                    print(console.read_bytes()[-6000:].decode(errors="replace"))


# ------------------------------------------------------------------ helpers


def _ended(sb: Sandbox, timeout_s: float = 30.0) -> tuple[str | None, str]:
    info = wait_for(lambda: (i := sb.refresh()).state == "TERMINATED" and i, timeout_s=timeout_s)
    return info.termination_reason, info.termination_message


def _bounded(call: Callable[[], object], timeout_s: float) -> tuple[object, BaseException | None]:
    """`call()` in a thread: (its result, its exception). Fails the test if it is still running
    after `timeout_s` (a call into a dead guest must end, not hang)."""
    out: list[object] = []
    failure: list[BaseException] = []

    def go() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            failure.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"the call did not end within {timeout_s} s"
    return (out[0] if out else None), (failure[0] if failure else None)


# ------------------------------------------------------------------ _host: the host's view


def _cgroup_procs(lab: Lab, sb: Sandbox) -> list[int]:
    """The processes of the sandbox's pids cgroup (its QEMU first); none if it has no cgroup."""
    procs = Path("/sys/fs/cgroup/pids") / lab.cgroup_parent(sb.info.edge_id) / sb.id
    try:
        return [int(p) for p in (procs / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def _qemus_of(sandbox_id: str) -> list[int]:
    """Live QEMU processes of a sandbox on this host (its -name is dsec:<edge tag>:<id>)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[0].endswith("qemu-system-x86_64") and "-name" in argv:
            if argv[argv.index("-name") + 1].endswith(f":{sandbox_id}"):
                found.append(int(d.name))
    return found


def _start_log(lab: Lab, edge_id: str, sandbox_id: str) -> dict[str, Any]:
    """The edge's "microVM <id> started" log record (its fields say how it started)."""
    log = lab.cluster.process(lab.edge_process(edge_id)).log_path
    for line in log.read_text(errors="replace").splitlines():
        if sandbox_id in line and "started in" in line:
            record: dict[str, Any] = json.loads(line)
            return record
    raise AssertionError(f"no start record of {sandbox_id} in {log}")


# ------------------------------------------------------------------ pause / resume


def test_pause_resume_keeps_files_processes_and_servers_over_20_cycles(
    make: Make, lab: Lab, tmp_path: Path
) -> None:
    sb = make()
    blob = os.urandom(5 << 20)
    md5 = hashlib.md5(blob).hexdigest()
    (tmp_path / "big.bin").write_bytes(blob)
    sb.files.write("/work/a.txt", "alpha")
    sb.files.upload(str(tmp_path / "big.bin"), "/work/big.bin")
    sleeper = sb.start("sleep 3600")
    sb.files.write("/www/index.html", "served from inside")
    sb.start("busybox httpd -f -p 8080 -h /www")
    # waits in the guest for httpd to listen (WaitForPort), then the request
    assert sb.http(8080, "/index.html", wait_s=10).body == b"served from inside"

    # What resumes the paused guest: the caller, or (transparently) the next call into it.
    resumers: list[tuple[str, Callable[[], object], object]] = [
        ("resume", lambda: sb.resume().state, "RUNNING"),
        ("run", lambda: sb.run("cat /work/a.txt").text, "alpha"),
        ("file read", lambda: sb.files.read("/work/a.txt"), b"alpha"),
        ("http", lambda: sb.http(8080, "/index.html").body, b"served from inside"),
    ]
    for cycle in range(20):
        qemu = _cgroup_procs(lab, sb)[:1]
        assert qemu and _qemus_of(sb.id) == qemu, f"cycle {cycle}: {qemu} {_qemus_of(sb.id)}"
        assert sb.pause().state == "PAUSED"
        assert sb.refresh().state == "PAUSED"
        # Paused to disk: the QEMU process is gone, nothing is left in its cgroup.
        assert _cgroup_procs(lab, sb) == [] and _qemus_of(sb.id) == [], f"cycle {cycle}"
        how, resume, expected = resumers[cycle % len(resumers)]
        assert resume() == expected, f"cycle {cycle}, resumed by {how}"
        assert sb.refresh().state == "RUNNING"
        assert _cgroup_procs(lab, sb)[:1] != qemu, "a resumed guest runs in a new QEMU"
        assert sb.files.read("/work/a.txt") == b"alpha", f"cycle {cycle}"
        assert sb.run("md5sum /work/big.bin").text.split()[0] == md5, f"cycle {cycle}"
        assert sb.process(sleeper.exec_id).wait(timeout_s=0.1).running, f"cycle {cycle}"
        assert sb.http(8080, "/index.html").body == b"served from inside", f"cycle {cycle}"
        assert sb.run("echo ok").text == "ok\n", f"cycle {cycle}"


def test_a_pause_right_after_a_call_resumes(make: Make) -> None:
    # The call's stream may still be ending in the guest when its state is saved: the resume
    # must not take that for the new connection's (it once refused it, on every retry).
    sb = make()
    sb.files.write("/work/kept.txt", "kept")
    for cycle in range(5):
        sleeper = sb.start("sleep 3600")
        assert sb.pause().state == "PAUSED"
        assert sb.files.read("/work/kept.txt") == b"kept", f"cycle {cycle}"
        assert sb.process(sleeper.exec_id).wait(timeout_s=0.1).running, f"cycle {cycle}"


def test_a_stream_outlives_a_pause_and_the_guest_resumes_clean(make: Make) -> None:
    sb = make()
    for cycle in range(10):
        _pause_during_a_stream(sb, f"inflight-{cycle}")


def _pause_during_a_stream(sb: Sandbox, marker: str) -> None:
    """A command flooding its output when the guest is paused (its QEMU ends, the channel with
    it): the caller's stream waits through the pause (the edge's keepalives) and goes on after
    the resume from exactly where it was — no byte lost, none repeated (issue 31)."""
    events: list[Output] = []
    failure: list[BaseException] = []
    stop = threading.Event()

    def follow() -> None:
        try:
            for event in sb.stream(f"while :; do echo {marker}; sleep 0.02; done"):
                if isinstance(event, Output):
                    events.append(event)
                if stop.is_set():
                    return  # leaving the loop: the caller's cancel kills the command
        except BaseException as exc:
            failure.append(exc)

    stream = threading.Thread(target=follow, daemon=True)
    stream.start()
    wait_for(lambda: len(events) > 3, timeout_s=10)
    assert sb.pause().state == "PAUSED"
    time.sleep(1.0)
    assert stream.is_alive() and not failure, (marker, failure)
    before = len(events)
    # The next call resumes the guest and is answered (not taken for the stream's) ...
    assert _bounded(lambda: sb.run("echo ok").text, 20) == ("ok\n", None), marker
    # ... and the stream goes on where it was.
    wait_for(lambda: len(events) > before + 3, timeout_s=20)
    stop.set()
    stream.join(20)
    assert not stream.is_alive() and not failure, (marker, failure)
    out = [e for e in events if e.stream == "stdout"]
    for a, b in itertools.pairwise(out):
        assert b.offset == a.offset + len(a.data), (marker, a.offset, len(a.data), b.offset)
    # The command of the stream its caller left is gone, as when a caller goes away.
    count = f"ps -o args | grep -c '[{marker[0]}]{marker[1:]}'"
    assert wait_for(lambda: _bounded(lambda: sb.run(count).text, 20) == ("0\n", None)), marker


def test_stopping_a_paused_microvm_leaves_nothing_behind(make: Make, lab: Lab) -> None:
    sb = make()
    sb.files.write("/work/x.txt", "x")
    sb.pause()
    state = lab.state_dir(TEMPLATED)
    saved = state / "paused" / f"{sb.id}.vmstate"
    disk = state / "rw" / f"{sb.id}.img"
    assert saved.exists() and disk.exists()  # what the stop must remove
    stopped = sb.stop()
    assert stopped.state == "TERMINATED" and stopped.termination_reason == "STOPPED"
    assert _qemus_of(sb.id) == []
    assert not disk.exists() and not saved.exists()
    assert not (Path("/sys/fs/cgroup/pids") / lab.cgroup_parent(TEMPLATED) / sb.id).exists()


def _thread_policies(pid: int) -> dict[int, int]:
    """Every thread of process `pid`: its scheduling policy (field 41 of its stat: 0
    SCHED_OTHER, 5 SCHED_IDLE; counted after comm's closing parenthesis)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        out[int(task.name)] = int(stat[stat.rindex(")") + 2 :].split()[38])
    return out


def test_a_best_effort_microvm_runs_every_qemu_thread_under_sched_idle(
    make: Make, lab: Lab
) -> None:
    be, ls = make(best_effort=True), make()
    cpu = Path("/sys/fs/cgroup/cpu") / lab.cgroup_parent(TEMPLATED)
    for sb, policy in ((be, 5), (ls, 0)):
        [pid] = _qemus_of(sb.id)
        threads = _thread_policies(pid)
        assert len(threads) > 1 and set(threads.values()) == {policy}, (sb.id, threads)
        # and its cpu cgroup is idle (a group competes by its weight, whatever its tasks')
        assert (cpu / sb.id / "cpu.idle").read_text() == ("1\n" if policy else "0\n")
    # A resume is a new QEMU (restored from the saved state) in the same cgroup: best-effort
    # again (and its limits rewritten: an idle group refuses cpu.shares until made normal).
    be.pause()
    assert be.run("echo resumed").text == "resumed\n"
    [pid] = _qemus_of(be.id)
    assert set(_thread_policies(pid).values()) == {5}
    assert (cpu / be.id / "cpu.idle").read_text() == "1\n"


# ------------------------------------------------------------------ template clones


def test_template_clones_are_independent_each_with_its_own_identity(make: Make, lab: Lab) -> None:
    clones = [make(env={"A": str(i)}, workdir="/tmp") for i in range(3)]
    for i, sb in enumerate(clones):
        assert _start_log(lab, TEMPLATED, sb.id)["from"].startswith("template ")
        r = sb.run("hostname; cat /etc/hostname; echo $A; pwd; date +%s")
        hostname, etc_hostname, env_a, cwd, clock = r.text.split("\n")[:5]
        assert (hostname, etc_hostname) == (sb.id, sb.id)
        assert (env_a, cwd) == (str(i), "/tmp")
        assert abs(int(clock) - time.time()) < 5, f"guest clock {clock}, host {time.time()}"
    # The clones were restored from one snapshot: only a reseeded CRNG tells them apart here.
    randoms = {sb.run("head -c 32 /dev/urandom | od -An -tx1").text for sb in clones}
    assert len(randoms) == 3, randoms
    clones[0].files.write("/work/mine.txt", "first")
    assert clones[0].files.read("/work/mine.txt") == b"first"
    assert not clones[1].files.exists("/work/mine.txt")
    assert not clones[2].files.exists("/work/mine.txt")


def test_cold_boot_without_templates(make: Make, lab: Lab) -> None:
    sb = make(node_selector={"pool": "cold"})
    assert sb.info.edge_id == COLD
    assert sb.run("echo booted; hostname").text == f"booted\n{sb.id}\n"
    assert _start_log(lab, COLD, sb.id)["from"] == "boot"


# ------------------------------------------------------------------ how a guest ends


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _fill_and_free(sb: Sandbox, fill_mb: int, wait_s: float) -> tuple[float, float, float]:
    """The guest's QEMU RSS (MB): before, after the guest filled `fill_mb` of its tmpfs, and
    once it removed the file again and the RSS was given back and stood still (or `wait_s`
    passed: a guest reports free pages ~2 s after it frees them)."""
    (pid,) = _qemus_of(sb.id)
    sb.run("sync; echo 3 > /proc/sys/vm/drop_caches")
    before = _rss_mb(pid)
    r = sb.run(f"dd if=/dev/urandom of=/dev/shm/fill bs=1M count={fill_mb} 2>&1")
    assert r.exit_code == 0, r.text
    peak = _rss_mb(pid)
    assert sb.run("rm /dev/shm/fill").exit_code == 0
    deadline, last, after = time.monotonic() + wait_s, peak, peak
    while time.monotonic() < deadline:
        time.sleep(1.0)
        after = _rss_mb(pid)
        if after < before + fill_mb / 2 and abs(after - last) < 1:
            break  # given back and settled
        last = after
    return before, peak, after


def test_a_guest_that_reports_free_pages_gives_freed_memory_back_and_cannot_fork(
    make: Make, lab: Lab
) -> None:
    fill = 80
    sb = make(node_selector={"pool": "reporting"}, cpu=1)
    assert sb.info.edge_id == REPORTING
    (pid,) = _qemus_of(sb.id)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert "virtio-balloon-device,free-page-reporting=on" in argv
    before, peak, after = _fill_and_free(sb, fill, wait_s=20)
    assert peak - before >= fill * 0.8, (before, peak, after)
    assert peak - after >= fill * 0.7, f"QEMU RSS {before:.0f} -> {peak:.0f} -> {after:.0f} MB"
    # The same on an edge without reporting: the freed memory stays with QEMU.
    plain = make(node_selector={"pool": "cold"}, cpu=1)
    b0, p0, a0 = _fill_and_free(plain, fill, wait_s=6)
    assert p0 - a0 < fill * 0.2, f"QEMU RSS {b0:.0f} -> {p0:.0f} -> {a0:.0f} MB"
    # Its children would share one RAM file that its reports punch holes in.
    result = sb.fork(1)
    (err,) = result.children
    assert isinstance(err, Unimplemented) and err.reason == "FREE_PAGE_REPORTING", err
    assert "punching a hole" in err.message
    assert sb.run("echo alive").text == "alive\n"


def test_a_guest_kernel_panic_ends_the_sandbox_with_kernel_fault(make: Make) -> None:
    sb = make()
    neighbour = make()
    _, failure = _bounded(lambda: sb.run("echo c > /proc/sysrq-trigger", timeout_s=30), 40)
    assert failure is None or isinstance(failure, DSecError), failure
    reason, message = _ended(sb)
    assert reason == "KERNEL_FAULT", message
    assert "panic" in message and "sysrq triggered crash" in message, message
    assert neighbour.run("echo fine").text == "fine\n"


def test_a_guest_with_nothing_left_to_kill_ends_oom(make: Make) -> None:
    sb = make(memory_mb=256)
    # The hog makes itself unkillable (root in its own guest may): the OOM killer takes what
    # else there is, aether's helper, and then the kernel panics with nothing left to kill.
    hog = "echo -1000 > /proc/self/oom_score_adj; exec tail /dev/zero"
    _, failure = _bounded(lambda: sb.run(hog, timeout_s=60), 90)
    assert failure is None or isinstance(failure, DSecError), failure
    reason, message = _ended(sb, timeout_s=60)
    assert reason == "OOM", message
    assert "memory" in message, message


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"memory_mb": 64}, "resources.memory_mb"),  # below the guest minimum (256)
        ({"memory_mb": 2 * MAX_MEMORY_MB}, "resources.memory_mb"),
        ({"cpu": MAX_VCPUS + 1}, "resources.cpu_millis"),  # cpu is in cores: 3 vCPUs
    ],
    ids=["memory-below-guest-minimum", "memory-above-edge-maximum", "more-vcpus-than-allowed"],
)
def test_a_shape_the_edge_cannot_boot_is_invalid_naming_the_field(
    make: Make, options: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        make(**options)
    assert info.value.metadata["field"] == field, info.value


# ------------------------------------------------------------------ operators


def test_node_status_and_dsec_status_show_the_microvm_accelerator(lab: Lab) -> None:
    edge = lab.cluster.process(lab.edge_process(TEMPLATED))
    with grpc.insecure_channel(edge.address) as ch:
        status = edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
            edge_pb2.GetNodeStatusRequest(), timeout=10
        )
    microvm = next(c for c in status.controls if c.name == "microvm")
    assert microvm.state == "enforced", microvm
    assert microvm.detail.startswith(("tcg", "kvm")), microvm
    printed = dsec_status(lab.cluster.home)
    enforced = [line for line in printed.splitlines() if "controls enforced:" in line]
    assert len(enforced) == 3 and all("microvm" in line for line in enforced), printed
    lines = [
        line
        for line in printed.splitlines()
        if line.strip().startswith("microvm: tcg") or "microvm: kvm" in line
    ]
    assert len(lines) == 3, printed
    # The guest-memory settings end each microvm line (one edge reports free pages).
    assert printed.count("free-page reporting on") == 1, printed
    assert printed.count("free-page reporting off") == 2, printed
    assert printed.count("virtio-pmem unavailable on microvm") == 3, printed


# ------------------------------------------------------------------ fork

#: The toolkit's Python, which aether runs on (edge/backends/microvm/init.sh): a busybox guest
#: (the module's template) can run a Python program without an image of its own.
PY = "/.dsec/lib/ld-linux-x86-64.so.2 --library-path /.dsec/lib /.dsec/bin/python3.11 -I -S"

#: A counter held only in a Python process's memory, behind a listening socket, with an open
#: file: each connection may increment it and gets back its value and the guest's hostname;
#: every answer is appended to the file the process keeps open.
COUNTER = """
import socket
log = open("/work/served.log", "a")
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7000))
s.listen(8)
n = 0
while True:
    c, _ = s.accept()
    if c.recv(64).strip() == b"inc":
        n += 1
    log.write(f"{n}\\n")
    log.flush()
    c.sendall(f"{n} {socket.gethostname()}".encode())
    c.close()
"""


def _counter(sb: Sandbox, command: str = "get") -> tuple[int, str]:
    """(the counter process's value, the hostname it sees), after `command` (inc: +1)."""
    out = sb.run(f"echo {command} | nc -w 5 127.0.0.1 7000", timeout_s=30).text.split()
    return int(out[0]), out[1]


def _serve_counter(sb: Sandbox, increments: int) -> None:
    sb.files.write("/work/counter.py", COUNTER)
    sb.start(f"{PY} /work/counter.py")
    assert wait_for(lambda: _answers(sb), timeout_s=30)
    for _ in range(increments):
        _counter(sb, "inc")


def _answers(sb: Sandbox) -> bool:
    return sb.run("echo get | nc -w 2 127.0.0.1 7000", timeout_s=30).text != ""


def _inet(sb: Sandbox) -> list[str]:
    """The guest's IPv4 addresses on its NIC."""
    return sb.run("ip -4 -o addr show dev eth0 | awk '{print $4}'").text.split()


@pytest.fixture
def fork(lab: Lab, request: pytest.FixtureRequest) -> Iterator[Callable[..., ForkResult[Sandbox]]]:
    """`fork(sb, n, **options)`: `sb.fork(n, ...)`, its children always stopped afterwards;
    on failure their consoles are printed (the `make` fixture prints the sources')."""
    results: list[ForkResult[Sandbox]] = []

    def do(sb: Sandbox, n: int, **kw: Any) -> ForkResult[Sandbox]:
        result = sb.fork(n, **kw)
        results.append(result)
        return result

    yield do
    children = [c for r in results for c in r.sandboxes]
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for sb in children:
            console = lab.state_dir(TEMPLATED) / "logs" / f"{sb.id}.console"
            if console.exists():
                print(f"----- console of fork child {sb.id} ({console})")
                print(console.read_bytes()[-6000:].decode(errors="replace"))
    for sb in children:
        try:
            sb.stop(grace_s=0.5)
        except DSecError:
            pass  # already gone


def test_a_fork_8_ways_continues_every_process_from_one_state_and_diverges(
    make: Make, fork: Callable[..., ForkResult[Sandbox]], lab: Lab
) -> None:
    source = make(network=NetworkPolicy(allow=["192.0.2.1:443"]))
    _serve_counter(source, increments=3)
    source.files.write("/work/before.txt", "before the fork")
    [source_address] = _inet(source)

    result = fork(source, 8)
    assert result.kind == "memory" and not result.errors, result.errors
    assert len(result.children) == 8 and result.sandboxes == result.children
    assert 0 < result.stall_s < 5, result.stall_s  # measured here: 0.1-0.7 s
    children = result.sandboxes
    assert len({c.id for c in children} | {source.id}) == 9
    # the captured state is gone once the children run (they keep their mappings of it), and
    # so is the helper QEMU that made it shareable
    state = lab.state_dir(TEMPLATED)
    assert list((state / "forks").iterdir()) == []
    assert [p.name for p in (state / "sockets").iterdir() if p.name.startswith("fork-")] == []
    addresses = {source_address}
    for i, child in enumerate(children):
        info = child.refresh()
        assert (info.state, info.forked_from, info.edge_id) == ("RUNNING", source.id, TEMPLATED)
        assert _start_log(lab, TEMPLATED, child.id)["from"] == f"fork {source.id}"
        # the process went on from the fork's instant, in a guest that is now the child
        assert _counter(child) == (3, child.id)
        assert child.run("hostname; cat /etc/hostname").text == f"{child.id}\n{child.id}\n"
        assert child.files.read("/work/before.txt") == b"before the fork"
        # its own address, and only it (the source's was replaced, not added to)
        [address] = _inet(child)
        assert address not in addresses, (address, addresses)
        addresses.add(address)
        for _ in range(i + 1):  # each child its own number of increments
            _counter(child, "inc")
        child.files.write("/work/mine.txt", child.id)
    for i, child in enumerate(children):
        assert _counter(child) == (3 + i + 1, child.id)
        assert child.files.read("/work/mine.txt") == child.id.encode()  # no sibling's write
        # the file the process kept open is the child's own, written on from the fork's
        served = child.files.read("/work/served.log").decode().split()
        assert served[-(i + 3) :] == ["3", *map(str, range(4, 4 + i + 1)), str(3 + i + 1)]
    # The source is unaffected: running, its state as at the fork, no child's file.
    assert source.refresh().state == "RUNNING"
    assert _counter(source) == (3, source.id)
    assert not source.files.exists("/work/mine.txt")
    assert _inet(source) == [source_address]


def test_a_fork_of_a_paused_source_leaves_it_paused_and_a_child_forks_too(
    make: Make, fork: Callable[..., ForkResult[Sandbox]]
) -> None:
    source = make()
    _serve_counter(source, increments=2)
    assert source.pause().state == "PAUSED"

    result = fork(source, 2)
    assert result.kind == "memory" and not result.errors, result.errors
    assert result.stall_s == 0.0  # a paused source does not run: nothing stood still
    assert source.refresh().state == "PAUSED"  # and stays paused
    first, second = result.sandboxes
    assert _counter(first, "inc") == (3, first.id)
    assert _counter(second) == (2, second.id)

    [grandchild] = fork(first, 1).sandboxes
    assert grandchild.refresh().forked_from == first.id
    assert _counter(grandchild, "inc") == (4, grandchild.id)
    assert _counter(first) == (3, first.id)
    assert first.refresh().state == "RUNNING"

    assert source.resume().state == "RUNNING"
    assert _counter(source) == (2, source.id)


# ------------------------------------------------------------------ pack_diff


def test_pack_diff_of_a_microvm_starts_microvms_and_containers(make: Make, lab: Lab) -> None:
    """The guest's writable layer (the overlay upper on its disk) packed while it runs (stopped
    for the disk's copy only) and while it is paused; both environments start on either
    backend with the guest's new, modified and deleted files, and without its /tmp."""
    sb = make()
    user = "packer:x:4242:4242::/home/packer:/bin/sh"
    sb.run(
        "mkdir -p /work && echo new > /work/new.txt && rm /bin/vi && echo secret > /tmp/answer "
        f"&& echo '{user}' >> /etc/passwd"
    )
    tag = f"mvpack-{os.getpid()}"
    running = sb.pack_diff(f"{tag}:running")
    assert [x.kind for x in running.layers] == ["BASE", "DIFF"]
    assert sb.refresh().state == "RUNNING"
    assert sb.run("cat /work/new.txt").text == "new\n"  # the source runs on
    # Written just before the pause, still in the guest's page cache: the pause writes it out
    # (with the toolkit's Python here: the image's `sync` is gone).
    sb.run("echo second > /work/second.txt && rm /bin/sync")
    assert sb.pause().state == "PAUSED"
    paused = sb.pack_diff(f"{tag}:paused")
    assert sb.refresh().state == "PAUSED"  # paused stays paused
    assert [x.kind for x in paused.layers] == ["BASE", "DIFF"]
    check = (
        "cat /work/*.txt; grep -c packer /etc/passwd; test -e /bin/vi || echo vi-gone; "
        "ls -A /tmp | wc -l"
    )
    try:
        container = make(image=running.name, backend="container")
        assert container.run(check).text == "new\n1\nvi-gone\n0\n"
        microvm = make(image=paused.name)
        assert microvm.run(check).text == "new\nsecond\n1\nvi-gone\n0\n"
        assert sb.run("cat /work/second.txt").text == "second\n"  # resumes with its files
    finally:
        for env in (running, paused):
            lab.client.delete_environment(env.name)


# ------------------------------------------------------------------ edge restart (last: the
# templated edge is killed)


def test_a_paused_microvm_survives_an_edge_crash_and_resumes_with_its_files(
    make: Make, lab: Lab
) -> None:
    sb = make()
    sb.files.write("/work/kept.txt", "before the crash")
    sleeper = sb.start("sleep 3600")
    assert sb.pause().state == "PAUSED"
    edge = lab.edge_process(TEMPLATED)
    lab.cluster.kill(edge, signal.SIGKILL)  # a crash: nothing is cleaned up on the way out
    lab.cluster.restart(edge)
    assert wait_for(lambda: _state_or_none(sb) == "PAUSED", timeout_s=30)
    assert wait_for(lambda: _read_or_none(sb, "/work/kept.txt"), timeout_s=30) == (
        b"before the crash"
    )
    assert sb.refresh().state == "RUNNING"
    assert sb.process(sleeper.exec_id).wait(timeout_s=0.1).running
    assert sb.run("echo ok").text == "ok\n"
    # ... and the restarted edge takes creates again once the watcher has seen it healthy.
    wait_for(lambda: _created(make), timeout_s=30)


def _state_or_none(sb: Sandbox) -> str | None:
    try:
        return sb.refresh().state
    except DSecError:
        return None


def _read_or_none(sb: Sandbox, path: str) -> bytes | None:
    try:
        return sb.files.read(path)
    except DSecError:
        return None


def _created(make: Make) -> bool:
    try:
        return make().run("true").exit_code == 0
    except DSecError:
        return False

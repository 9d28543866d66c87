"""Containment of untrusted agents in container sandboxes (the Untrusted agents issue).

The container backend (`edge.backends.container.backend`) calls in here at a few points of a sandbox's life; this
module owns what the edge adds to a runc sandbox so that an agent that is root inside it, and
optimises its reward rather than its task, stays contained and gets reported:

- network (`edge.network`): policy validated before admission, veth + eBPF filter attached
  before any agent code runs, replaceable while running (`update_network`);
- chronus's private runtime directory: a detached tmpfs handed to pid 1 as fd 4
  (`edge.runtime.detached`; chronus applies Landlock to every command, `chronus.landlock`);
- a disk quota on the writable layer (`edge.runtime.disk`);
- the watchdog: every `watch_interval_s`, per running sandbox, reads the counters (blocked
  connects, OOM kills, forks refused at the pids limit, DNS refusals, Landlock denials where the
  kernel lets us count them) into the record's violations, and ends sandboxes with a reason an RL
  framework can use: DISK_QUOTA (writable layer full), PIDS_EXHAUSTED (at the pids limit with
  forks failing for `pids_exhausted_after_s`), POLICY_VIOLATION (more blocked connects than the
  policy's max_blocked_connects), KERNEL_FAULT (a kernel oops in one of its processes, from
  /dev/kmsg);
- samples of each running sandbox's CPU, memory and disk use every `usage_sample_s`, kept for
  `usage_keep_s` (`usage_samples`, edge/usage.py), taken by the watchdog's pass;
- the report of which lower-layer files the agent modified or deleted (`modified_files`);
  trusted execution, the evaluation step in a sibling made of the read-only layers, is
  `edge.backends.container.trusted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.backends.channels import ChannelKeeper
from edge.backends.container.trusted import init_pid
from edge.config import MIN_DISK_MB
from edge.model import SandboxRecord, SandboxSpec
from edge.network.denials import DenialCounter
from edge.network.manager import NetworkManager
from edge.network.policy import Policy
from edge.runtime import apparmor, cgroups, integrity
from edge.runtime.bundle import rewrite_in_place
from edge.runtime.detached import detached_tmpfs
from edge.runtime.runc import RuncRuntime
from edge.usage import UsageRing, UsageSamples, memory_v1
from libdsec.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

RUNTIME_FD = 4  # chronus's runtime directory in the sandbox (after the channel at 3)
_POLICY_CACHE_S = 30.0


@dataclass
class Prepared:
    """What `prepare` made for one start: closed by `close` whatever happens."""

    extra_fds: tuple[int, ...]
    env: dict[str, str]
    dns_servers: tuple[str, ...] | None
    disk_mb: int
    policy: Policy
    resolved: dict[str, list[str]] = field(default_factory=dict)
    apparmor_profile: str = ""

    def close(self) -> None:
        for fd in self.extra_fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class _Watch:
    rec: SandboxRecord
    at_pids_limit_since: float = 0.0  # monotonic time the sandbox reached its pids limit
    files: _CgroupFiles | None = None  # found at its first check (after a warm claim's rename)
    cpu_ns: int = -1  # the sandbox's CPU time (cpuacct.usage) at its last full check
    counters: dict[str, int] = field(default_factory=dict)  # what that check read
    usage: UsageRing | None = None  # its resource use, sampled (edge/usage.py)


@dataclass(frozen=True)
class _CgroupFiles:
    """The cgroup v1 files the watchdog reads every pass, as plain paths: read with
    os.open/os.read (`_read_small`), 3 files cost ~50 us instead of ~320 us through pathlib and
    text I/O (measured with 200 sandboxes), the bulk of an idle edge's CPU per sandbox."""

    oom_control: str
    pids_events: str
    pids_current: str
    pids_dir: Path
    cpu_usage: str
    memory_usage: str = ""
    memory_stat: str = ""

    @classmethod
    def of(cls, cgroup_path: str) -> _CgroupFiles:
        memory = cgroups.controller_dir("memory", cgroup_path) or Path("/nonexistent")
        pids = cgroups.controller_dir("pids", cgroup_path) or Path("/nonexistent")
        cpuacct = cgroups.controller_dir("cpuacct", cgroup_path) or Path("/nonexistent")
        return cls(
            str(memory / "memory.oom_control"),
            str(pids / "pids.events"),
            str(pids / "pids.current"),
            pids,
            str(cpuacct / "cpuacct.usage"),
            str(memory / "memory.usage_in_bytes"),
            str(memory / "memory.stat"),
        )


class Containment:
    """What the edge adds to the container backend's runc sandboxes. It is handed what it acts
    on (the runtime, the node's network, the channels, the logs directory, and how to wait
    for a claimed sandbox's cgroup to settle) and never reaches back into the backend."""

    def __init__(
        self,
        runtime: RuncRuntime,
        network: NetworkManager | None,
        channels: ChannelKeeper,
        *,
        logs: Path,
        settled: Callable[[str], Awaitable[None]],
        default_disk_mb: int = 10240,
        max_disk_mb: int = 204800,
        log_max_bytes: int = 1 << 20,
        watch_interval_s: float = 1.0,
        pids_exhausted_after_s: float = 3.0,
        usage_sample_s: float = 5.0,
        usage_keep_s: float = 600.0,
    ) -> None:
        self.runtime = runtime
        self.network = network
        self.channels = channels
        self.logs = logs
        self.settled = settled
        self.default_disk_mb = default_disk_mb
        self.max_disk_mb = max_disk_mb
        self.log_max_bytes = log_max_bytes
        self.watch_interval_s = watch_interval_s
        self.pids_exhausted_after_s = pids_exhausted_after_s
        self.usage_sample_s = usage_sample_s
        self.usage_keep_s = usage_keep_s
        self.watched: dict[str, _Watch] = {}
        self._policy_cache: dict[str, tuple[float, Policy, dict[str, list[str]]]] = {}
        self.denials = DenialCounter()
        self._kmsg = _KernelLog()
        self.apparmor_profile = ""
        if apparmor.available():
            if apparmor.load():
                self.apparmor_profile = apparmor.PROFILE_NAME
        else:
            log.warning(
                "AppArmor is unavailable on this host (no /sys/kernel/security/apparmor or "
                "apparmor_parser): sandboxes get no AppArmor profile; file, socket and signal "
                "controls are Landlock's (chronus), with seccomp, namespaces and masked paths"
            )

    def start_counters(self) -> None:
        self.denials.start()

    # ------------------------------------------------------------------ admission

    def _policy(self, raw: Mapping[str, Any] | None) -> tuple[Policy, dict[str, list[str]]]:
        """Parse and resolve a policy (blocking), cached briefly per distinct policy: a burst
        of sandboxes with one policy resolves its names once."""
        key = json.dumps(raw or {}, sort_keys=True)
        hit = self._policy_cache.get(key)
        now = time.monotonic()
        if hit is not None and now - hit[0] < _POLICY_CACHE_S:
            return hit[1], hit[2]
        if self.network is None:
            from edge.network.policy import parse

            policy = parse(raw)
            if policy.networked:
                raise FailedPrecondition(
                    "this edge has no sandbox networking", reason="NETWORK_UNAVAILABLE"
                )
            return policy, {}
        policy, resolved = self.network.check(raw)
        if len(self._policy_cache) > 256:
            self._policy_cache.clear()
        self._policy_cache[key] = (now, policy, resolved)
        return policy, resolved

    def validate(self, spec: SandboxSpec) -> None:
        """Before admission (blocking): network policy and disk quota."""
        if spec.disk_mb and not MIN_DISK_MB <= spec.disk_mb <= self.max_disk_mb:
            raise InvalidArgument(
                f"resources.disk_mb={spec.disk_mb}: expected {MIN_DISK_MB}..{self.max_disk_mb} "
                f"(this edge's maximum), or 0 for its default ({self.default_disk_mb})",
                reason="INVALID_RESOURCES",
                metadata={"field": "resources.disk_mb", "max_disk_mb": str(self.max_disk_mb)},
            )
        self._policy(spec.network)

    async def prepare(self, rec: SandboxRecord) -> Prepared:
        policy, resolved = await asyncio.to_thread(self._policy, rec.spec.network)
        runtime_fd = detached_tmpfs()
        dns_servers = None
        if policy.networked and self.network is not None:
            dns_servers = (self.network.gateway,)
        return Prepared(
            extra_fds=(runtime_fd,),
            env={"DSEC_CHRONUS_RUNTIME_FD": str(RUNTIME_FD)},
            dns_servers=dns_servers,
            disk_mb=rec.spec.disk_mb or self.default_disk_mb,
            policy=policy,
            resolved=resolved,
            apparmor_profile=self.apparmor_profile,
        )

    async def started(self, rec: SandboxRecord, pid: int, cgroup_path: str, prep: Prepared) -> None:
        """After runc started pid 1 and before the sandbox is RUNNING."""
        if prep.policy.networked and self.network is not None:
            rec.runtime["net"] = await self.network.attach(
                rec.sandbox_id, pid, cgroup_path, prep.policy, prep.resolved
            )
        rec.runtime["disk_mb"] = prep.disk_mb
        self.watched[rec.sandbox_id] = _Watch(rec)

    async def adopt(self, rec: SandboxRecord) -> None:
        self.watched[rec.sandbox_id] = _Watch(rec)
        net = rec.runtime.get("net")
        if net and self.network is not None:
            policy, _ = await asyncio.to_thread(self._policy_lenient, rec.spec.network)
            cg = self.runtime.cgroup_path(rec.sandbox_id)
            if not await self.network.adopt(rec.sandbox_id, net, policy, cg):
                log.warning("could not take back the network policy of %s", rec.sandbox_id)

    def _policy_lenient(self, raw: Mapping[str, Any] | None) -> tuple[Policy, dict[str, list[str]]]:
        from edge.network.policy import parse

        return parse(raw), {}

    # ------------------------------------------------------------------ teardown

    def unwatch(self, sandbox_id: str) -> None:
        """The sandbox is being destroyed: the watchdog reports nothing of it any more."""
        self.watched.pop(sandbox_id, None)

    async def destroyed(self, rec: SandboxRecord) -> None:
        """After its trusted sibling went (its network is attached as the sandbox's)."""
        sid = rec.sandbox_id
        self.unwatch(sid)
        if self.network is not None:
            await self.network.detach(sid)
        self.denials.forget(self._cgroup2(sid))

    async def cleanup_orphans(self, keep: set[str]) -> list[str]:
        removed: list[str] = []
        if self.network is not None:
            removed += await self.network.cleanup_orphans(keep)
        return removed

    async def close(self) -> None:
        self.denials.close()
        self._kmsg.close()
        # (The network is the node's: edge/node.py closes it after every backend.)
        if not self.runtime.list_ids():
            await asyncio.to_thread(_remove_empty_cgroup_parent, self.runtime.cgroup_parent)

    # ------------------------------------------------------------------ policies

    async def update_network(self, rec: SandboxRecord, raw: Mapping[str, Any]) -> None:
        """Replace a running sandbox's policy; the next connection sees it."""
        sid = rec.sandbox_id
        await self.settled(sid)  # its cgroup2 directory, where the programs attach
        net = self.network
        if net is None:
            from edge.network.policy import parse

            if parse(raw).networked:
                raise FailedPrecondition(
                    "this edge has no sandbox networking", reason="NETWORK_UNAVAILABLE"
                )
            rec.spec.network = dict(raw)
            return
        if net.is_attached(sid):
            await net.replace(sid, raw)  # refuses a bad policy before touching the old one
            rec.spec.network = dict(raw)
            return
        policy, resolved = await asyncio.to_thread(net.check, raw)
        if policy.networked:
            pid = int(rec.runtime.get("pid") or 0)
            cg = self.runtime.cgroup_path(sid)
            rec.runtime["net"] = await net.attach(sid, pid, cg, policy, resolved)
            # DNS through the edge from now on (the file is bind-mounted: rewrite in place).
            resolv = self.runtime.sandbox_dir(sid) / "etc" / "resolv.conf"
            await asyncio.to_thread(rewrite_in_place, resolv, f"nameserver {net.gateway}\n")
        rec.spec.network = dict(raw)

    # ------------------------------------------------------------------ integrity

    async def modified_files(self, rec: SandboxRecord) -> list[integrity.ModifiedFile]:
        pid = init_pid(rec)

        def scan() -> list[integrity.ModifiedFile]:
            lowers = integrity.overlay_lowers(pid)
            if not lowers:
                raise FailedPrecondition(
                    f"sandbox {rec.sandbox_id} has no mounted filesystem", reason="NOT_MOUNTED"
                )
            return integrity.modified_files(self.runtime.upper_dir(rec.sandbox_id), lowers)

        return await asyncio.to_thread(scan)

    # ------------------------------------------------------------------ watchdog

    def _cgroup2(self, sid: str) -> Path:
        root = cgroups.hierarchies().get("unified", Path("/sys/fs/cgroup/unified"))
        return root / self.runtime.cgroup_path(sid).lstrip("/")

    async def watch_loop(self) -> None:
        """The watchdog, and the periodic re-resolution of the policies' domain names."""
        self._kmsg.open()
        refreshed = time.monotonic()
        while True:
            await asyncio.sleep(self.watch_interval_s)
            try:
                await self.watch_once()
                if (
                    self.network is not None
                    and time.monotonic() - refreshed >= self.network.refresh_s
                ):
                    refreshed = time.monotonic()
                    await self.network.refresh_once()
            except Exception:
                log.exception("watchdog pass failed")

    async def watch_once(self) -> None:
        """One pass over every running sandbox, its reads in one thread: a thread hop per
        sandbox (two, with the log cap) cost the idle edge ~0.05% of a core per sandbox, half
        a core at 1,000 (bench/bench_density.py)."""
        due = []
        for sid, w in self.watched.items():
            if w.rec.state == "RUNNING" and sid in self.channels:
                due.append((sid, w))
            else:
                # Paused (or not running yet): the pids-limit clock measures running time
                # only; a sandbox at its limit when paused gets the full grace after resume.
                w.at_pids_limit_since = 0.0
        for sid, w, counters, verdict in await asyncio.to_thread(self._check_all, due):
            if self.watched.get(sid) is not w or w.rec.state != "RUNNING":
                continue  # stopped, paused or ended meanwhile
            if any(w.rec.violations.get(k) != v for k, v in counters.items()):
                # Merged here, on the loop: the servicer counts output truncations too.
                w.rec.violations = {**w.rec.violations, **counters}
            if self.network is not None:
                w.rec.blocked_names = self.network.blocked_names(sid)
            if verdict is not None:
                reason, message = verdict
                log.warning(
                    "sandbox %s contained: %s (%s)", sid, reason, message, extra={"sandbox_id": sid}
                )
                self.watched.pop(sid, None)
                await self.channels.report_exit(sid, reason, message)

    def _check_all(
        self, due: list[tuple[str, _Watch]]
    ) -> list[tuple[str, _Watch, dict[str, int], tuple[str, str] | None]]:
        """`_check` and `_cap_log` of each sandbox (one failing is logged, the rest go on).
        Blocking."""
        faults = self._kmsg.faulting_pids()
        out = []
        for sid, w in due:
            try:
                counters, verdict = self._check(sid, w, faults)
                self._cap_log(sid)
            except Exception:
                log.exception("watchdog check of %s failed", sid, extra={"sandbox_id": sid})
                continue
            out.append((sid, w, counters, verdict))
        return out

    def _cap_log(self, sid: str) -> None:
        """Keep the sandbox's aether/chronus log below log_max_bytes: past it, cut it back to
        its head (how the sandbox started) plus a marker; what follows is appended after it
        (the writers' descriptor is O_APPEND). Blocking."""
        path = self.logs / f"{sid}.log"
        try:
            size = os.stat(path).st_size
            if size <= self.log_max_bytes:
                return
            head = self.log_max_bytes // 4
            with open(path, "r+b") as fh:
                fh.truncate(head)
                fh.seek(head)
                fh.write(
                    f"\n[dsec edge: log cut at {size} bytes; head kept, tail follows]\n".encode()
                )
        except OSError:
            return

    def _check(
        self, sid: str, w: _Watch, faults: set[int]
    ) -> tuple[dict[str, int], tuple[str, str] | None]:
        """(counters read now, (reason, message) if the sandbox must end). Blocking."""
        if w.files is None:
            w.files = _CgroupFiles.of(self.runtime.cgroup_path(sid))
        # Nothing of the sandbox ran since its last check (its CPU time is the same): what the
        # rest reads cannot have moved either (a write, a fork, an allocation, a connect, a
        # log line all take CPU), so the check is skipped, unless a time-based verdict is
        # pending or the kernel reported a fault. An idle sandbox's aether wakes every
        # ping_idle_s (5 s), so it is checked fully every ~5 s, for one read in between.
        cpu_ns = _int(_read_small(w.files.cpu_usage))
        self._sample(sid, w, cpu_ns)
        if cpu_ns and cpu_ns == w.cpu_ns and not faults and not w.at_pids_limit_since:
            counters = dict(w.counters)
            refused = self.network.dns_refusals_of(sid) if self.network is not None else 0
            if refused:  # counted by the edge's resolver: it may land after the query
                counters["dns_refusals"] = refused
            return counters, None
        counters = self._counters(sid, w.files)
        w.cpu_ns, w.counters = cpu_ns, counters
        return counters, self._verdict(sid, w, faults, counters, w.files)

    def _sample(self, sid: str, w: _Watch, cpu_ns: int) -> None:
        """A usage sample of the sandbox when one is due (edge/usage.py). Blocking."""
        now = time.time()
        ring = w.usage
        if ring is None:
            ring = w.usage = UsageRing(math.ceil(self.usage_keep_s / self.usage_sample_s) + 1)
        elif now - ring.last_at < self.usage_sample_s - self.watch_interval_s / 2:
            return
        last = ring.last()
        cpu_s = cpu_ns / 1e9
        if last is not None and cpu_s == last[1]:  # nothing of it ran: nothing else moved
            ring.add(now, cpu_s, *(int(v) for v in last[2:]))
            return
        files = w.files
        assert files is not None
        mem_used, mem_cache = memory_v1(
            _read_small(files.memory_usage), _read_small(files.memory_stat, 8192)
        )
        used = self.runtime.disk_usage(sid)
        disk_used, disk_total = (used.used_bytes, used.total_bytes) if used else (0, 0)
        ring.add(now, cpu_s, mem_used, mem_cache, disk_used, disk_total)

    def usage_samples(self, rec: SandboxRecord, start: float, end: float) -> UsageSamples:
        """The samples of `rec` taken in [start, end] (none before its first watchdog pass)."""
        w = self.watched.get(rec.sandbox_id)
        cpu_count = rec.spec.cpu_millis / 1000
        samples = w.usage.between(start, end, cpu_count) if w and w.usage else []
        return UsageSamples(
            samples,
            cpu_count,
            rec.spec.memory_mb << 20,
            self.usage_sample_s,
            self.usage_keep_s,
        )

    def _counters(self, sid: str, files: _CgroupFiles) -> dict[str, int]:
        v: dict[str, int] = {}
        if self.network is not None:
            blocked = self.network.blocked(sid)
            if blocked is not None:
                v["blocked_connects"] = blocked
            refused = self.network.dns_refusals_of(sid)
            if refused:
                v["dns_refusals"] = refused
        denied = self.denials.count(self._cgroup2(sid))
        if denied:
            v["denied_file_accesses"] = denied
        oom = _keyed(_read_small(files.oom_control), b"oom_kill")
        if oom:
            v["oom_kills"] = oom
        pids_hits = _keyed(_read_small(files.pids_events), b"max")
        if pids_hits:
            v["pids_limit_hits"] = pids_hits
        return v

    def _verdict(
        self, sid: str, w: _Watch, faults: set[int], v: dict[str, int], files: _CgroupFiles
    ) -> tuple[str, str] | None:
        rec = w.rec
        rt = self.runtime
        pids_hits = v.get("pids_limit_hits", 0)
        max_blocked = int((rec.spec.network or {}).get("max_blocked_connects", 0) or 0)
        if max_blocked and v.get("blocked_connects", 0) > max_blocked:
            return (
                "POLICY_VIOLATION",
                f"{v['blocked_connects']} connections blocked by the network policy "
                f"(max_blocked_connects {max_blocked})",
            )
        usage = rt.disk_usage(sid)
        if usage is not None and usage.full:
            return (
                "DISK_QUOTA",
                f"the writable layer is full ({usage.used_bytes >> 20} of "
                f"{usage.total_bytes >> 20} MiB, {usage.free_inodes} inodes free)",
            )
        # Exhausted: at the limit (give or take the two forks chronus needs for a command) for
        # pids_exhausted_after_s, with forks refused at least once: nothing new can start.
        current = _int(_read_small(files.pids_current))
        now = time.monotonic()
        if pids_hits and current >= rec.spec.pids_max - 2:
            if not w.at_pids_limit_since:
                w.at_pids_limit_since = now
            elif now - w.at_pids_limit_since >= self.pids_exhausted_after_s:
                return (
                    "PIDS_EXHAUSTED",
                    f"{current} of {rec.spec.pids_max} processes for "
                    f"{now - w.at_pids_limit_since:.1f} s; {pids_hits} forks refused",
                )
        else:
            w.at_pids_limit_since = 0.0
        if faults:
            procs = cgroups.procs(files.pids_dir)
            hit = faults.intersection(procs)
            if hit:
                return ("KERNEL_FAULT", f"kernel oops in process {min(hit)} of the sandbox")
        return None


# ---------------------------------------------------------------------- helpers


def _read_small(path: str, size: int = 4096) -> bytes:
    """A small kernel file's content (b"" if it cannot be read: the sandbox just ended)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.read(fd, size)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _keyed(raw: bytes, key: bytes) -> int:
    """The value of `key` in a "key value" per line file (memory.oom_control, pids.events)."""
    for line in raw.splitlines():
        k, _, value = line.partition(b" ")
        if k == key:
            return _int(value)
    return 0


def _int(raw: bytes) -> int:
    try:
        return int(raw.split()[0])
    except (ValueError, IndexError):
        return 0


def _remove_empty_cgroup_parent(parent: str) -> None:
    """rmdir the edge's cgroup parent in every hierarchy (only ever succeeds when it is empty:
    nothing is killed). Test clusters use a parent each; they must not pile up."""
    for root in set(cgroups.hierarchies().values()):
        with contextlib.suppress(OSError):
            (root / parent.strip("/")).rmdir()


class _KernelLog:
    """Pids of processes a kernel oops / BUG hit, from /dev/kmsg (read without blocking)."""

    _START = re.compile(r"(BUG:|Oops:|general protection fault|kernel BUG at|Unable to handle)")
    _PID = re.compile(r"\bPID: (\d+)\b")

    def __init__(self) -> None:
        self._fd = -1
        self._pending = False

    def open(self) -> None:
        try:
            self._fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self._fd, 0, os.SEEK_END)  # only what happens from now on
        except OSError as exc:
            log.info("kernel faults are not watched: /dev/kmsg: %s", exc.strerror)
            self._fd = -1

    def faulting_pids(self) -> set[int]:
        out: set[int] = set()
        if self._fd < 0:
            return out
        for _ in range(10_000):
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records were overwritten before we read them
                continue
            if not record:
                break
            out |= self.parse(record.decode(errors="replace"))
        return out

    def parse(self, record: str) -> set[int]:
        """One /dev/kmsg record: "prio,seq,usec,flags;message"."""
        msg = record.split(";", 1)[-1]
        out: set[int] = set()
        if self._START.search(msg):
            self._pending = True
        if self._pending:
            m = self._PID.search(msg)
            if m:
                out.add(int(m.group(1)))
                self._pending = False
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

"""OCI bundle (config.json) for one sandbox: a pure function of the launch spec and host paths.

The hardening follows Docker's defaults, then goes further where the DSec incidents (DESIGN.md
section 6) ask for it:

- seccomp: Docker's default profile, taken from a real `docker run` on this machine (the OCI form
  dockerd hands to runc, /run/docker/containerd/daemon/io.containerd.runtime.v2.task/moby/<id>/
  config.json, linux.seccomp; Docker 20.10.24) and committed as `seccomp_default.json`. Docker
  resolves its capability-conditional rules when it renders the profile; rendered for Docker's
  default capability set, the only such rule left is `chroot` (CAP_SYS_CHROOT), which we keep.
- capabilities: Docker's default set minus NET_RAW (raw sockets: ARP/ICMP spoofing, port scans
  that bypass connect()-level network policy), MKNOD (device nodes: the device cgroup stops their
  use, but nothing legitimate needs them), AUDIT_WRITE (nothing to audit to in a sandbox) and
  SETFCAP (file capabilities would let a binary regain caps across exec). What remains, and why:
    CHOWN, DAC_OVERRIDE, FOWNER, FSETID  -- root inside must behave like root for package managers,
                                            tar/cp -p, pip and build tools (ownership, modes);
    SETUID, SETGID                        -- su/sudo, apt's _apt sandbox user, harnesses that run
                                            tests as an unprivileged user;
    SETPCAP                               -- dropping capabilities from the bounding set before
                                            running untrusted code (chronus, capsh);
    KILL                                  -- killing processes of other uids inside the sandbox;
    NET_BIND_SERVICE                      -- services on ports < 1024 inside the sandbox's netns;
    SYS_CHROOT                            -- build tools that chroot; harmless in a mount namespace
                                            and does not escape Landlock.
- masked /proc and /sys paths: Docker's list plus /proc/kpage* (reading /proc/kpagecgroup crashed
  a host in DSec's report), /sys/kernel/mm/page_idle (the same kind of physical-page walker),
  /proc/sysrq-trigger (Docker only makes it read-only), and the kernel's logs and heap maps
  (/proc/kmsg, /proc/slabinfo, /proc/vmallocinfo, /proc/kallsyms, /proc/pagetypeinfo).
- seccomp: on top of Docker's profile (`hardened_seccomp`), io_uring (which runs operations
  outside seccomp's view and has a long CVE record; Docker blocks it since 25.0) fails with
  ENOSYS so programs fall back. Dangerous ioctls (EXT4_IOC_MOVE_EXT extent swapping, TIOCSTI, ...)
  cannot be refused here: Docker's profile allows ioctl unconditionally and libseccomp lets that
  allow win over conditional refusals (verified, runc 1.1.5 / libseccomp 2.5.4). chronus stacks a
  second filter on every command for them (`chronus.seccomp`).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from edge.runtime.spec import LaunchSpec
from edge.toolkit import SUDO_SHIM


@lru_cache(maxsize=1)
def _has_memsw() -> bool:
    from edge.runtime import cgroups

    memory = cgroups.hierarchies().get("memory")
    return memory is not None and (memory / "memory.memsw.limit_in_bytes").exists()


OCI_VERSION = "1.0.2-dev"
CPU_PERIOD_US = 100_000
NOFILE = 65_536
OOM_SCORE_ADJ = 500
#: The image's sudo, which dsec-sudo replaces when the toolkit has it (sudo_over).
SUDO_PATH = "/usr/bin/sudo"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLKIT_MOUNT = "/.dsec"

CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_NET_BIND_SERVICE",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
    "CAP_SYS_CHROOT",
)
DROPPED_FROM_DOCKER_DEFAULT: tuple[str, ...] = (
    "CAP_AUDIT_WRITE",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETFCAP",
)

MASKED_PATHS: tuple[str, ...] = (
    # Docker's (moby oci/defaults.go)
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
    # ours: per-page kernel state (a read of kpagecgroup crashed a host in DSec's report)
    "/proc/kpagecgroup",
    "/proc/kpageflags",
    "/proc/kpagecount",
    "/sys/kernel/mm/page_idle",
    "/proc/sysrq-trigger",
    # ours: the loader of every process reads it, the toolkit's too (pid 1 is ld.so): a file an
    # agent wrote into a packed environment must not load its library into aether
    "/etc/ld.so.preload",
    "/proc/kmsg",
    "/proc/slabinfo",
    "/proc/vmallocinfo",
    "/proc/kallsyms",
    "/proc/pagetypeinfo",
)
READONLY_PATHS: tuple[str, ...] = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
)

# Refused with ENOSYS (callers fall back to ordinary system calls).
BLOCKED_SYSCALLS: tuple[str, ...] = ("io_uring_setup", "io_uring_enter", "io_uring_register")
ENOSYS = 38

NAMESPACES: tuple[str, ...] = ("pid", "ipc", "uts", "mount", "network", "cgroup")

_SECCOMP_FILE = Path(__file__).with_name("seccomp_default.json")


@lru_cache(maxsize=1)
def _seccomp_text() -> str:
    return _SECCOMP_FILE.read_text()


def default_seccomp() -> dict[str, Any]:
    """A fresh copy of the committed Docker default profile (OCI linux.seccomp form)."""
    result: dict[str, Any] = json.loads(_seccomp_text())
    return result


def hardened_seccomp() -> dict[str, Any]:
    """Docker's profile with BLOCKED_SYSCALLS refused (ENOSYS). They are taken out of the allow
    list first: one syscall cannot carry two unconditional actions."""
    profile = default_seccomp()
    blocked = set(BLOCKED_SYSCALLS)
    rules = []
    for rule in profile["syscalls"]:
        if rule.get("action") == "SCMP_ACT_ALLOW" and not rule.get("args"):
            names = [n for n in rule["names"] if n not in blocked]
            if not names:
                continue
            rule = dict(rule, names=names)
        rules.append(rule)
    rules.append({"names": sorted(blocked), "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS})
    profile["syscalls"] = rules
    return profile


def cpu_quota_us(cpu_millis: int) -> int:
    """CFS quota per 100 ms period: 1000 millicores = one full CPU = 100000 us."""
    return cpu_millis * CPU_PERIOD_US // 1000


def cpu_shares(cpu_millis: int) -> int:
    """Relative weight under contention, Kubernetes' convention (1 CPU = 1024, minimum 2)."""
    return max(2, cpu_millis * 1024 // 1000)


def _mount(dest: str, typ: str, source: str, options: list[str]) -> dict[str, Any]:
    return {"destination": dest, "type": typ, "source": source, "options": options}


def make_config(
    spec: LaunchSpec,
    *,
    rootfs: Path,
    etc_dir: Path,
    cgroups_path: str,
    toolkit_source: Path | None = None,
    seccomp: dict[str, Any] | None = None,
    use_seccomp: bool = True,
    nofile: int = NOFILE,
    sudo_over: bool = False,
) -> dict[str, Any]:
    """The config.json of one sandbox.

    rootfs: the overlay target; etc_dir: holds the per-sandbox hosts/hostname/resolv.conf;
    toolkit_source: the host directory to show read-only at /.dsec (defaults to
    spec.toolkit_dir, which the runtime replaces by the mountpoint when it is an EROFS image);
    nofile: RLIMIT_NOFILE (soft = hard); the runtime lowers it to its own hard limit where it
    lacks CAP_SYS_RESOURCE to raise it (this machine: hard limit 20000, no CAP_SYS_RESOURCE);
    sudo_over: show the toolkit's dsec-sudo at /usr/bin/sudo (the image has a sudo there, which
    cannot work under no_new_privs: chronus/sudo.py).
    """
    env = dict(spec.env)
    env.setdefault("PATH", DEFAULT_PATH)
    memory = spec.memory_mb * 1024 * 1024
    mounts = [
        _mount("/proc", "proc", "proc", ["nosuid", "noexec", "nodev"]),
        _mount("/dev", "tmpfs", "tmpfs", ["nosuid", "strictatime", "mode=755", "size=65536k"]),
        _mount(
            "/dev/pts",
            "devpts",
            "devpts",
            ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        ),
        _mount(
            "/dev/shm", "tmpfs", "shm", ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]
        ),
        _mount("/dev/mqueue", "mqueue", "mqueue", ["nosuid", "noexec", "nodev"]),
        _mount("/sys", "sysfs", "sysfs", ["nosuid", "noexec", "nodev", "ro"]),
        _mount(
            "/sys/fs/cgroup", "cgroup", "cgroup", ["nosuid", "noexec", "nodev", "relatime", "ro"]
        ),
    ]
    toolkit = toolkit_source if toolkit_source is not None else spec.toolkit_dir
    if toolkit is not None:
        # no noexec: the toolkit's interpreter runs from here.
        mounts.append(
            _mount(
                TOOLKIT_MOUNT,
                "bind",
                os.fspath(toolkit),
                ["rbind", "ro", "nosuid", "nodev", "rprivate"],
            )
        )
    if toolkit is not None and sudo_over:
        mounts.append(
            _mount(
                SUDO_PATH,
                "bind",
                os.fspath(toolkit / SUDO_SHIM),
                ["rbind", "ro", "nosuid", "nodev", "rprivate"],
            )
        )
    for name in ("hosts", "hostname", "resolv.conf"):
        mounts.append(
            _mount(f"/etc/{name}", "bind", os.fspath(etc_dir / name), ["rbind", "rprivate"])
        )
    for fs in spec.tmpfs:
        mounts.append(
            _mount(
                fs.target,
                "tmpfs",
                "tmpfs",
                ["nosuid", "nodev", f"mode={fs.mode:o}", f"size={fs.size_mb}m"],
            )
        )
    for bind in spec.binds:
        options = ["rbind", "rprivate", "nosuid", "nodev"]
        if bind.readonly:
            options.append("ro")
        mounts.append(_mount(bind.target, "bind", os.fspath(bind.source), options))

    namespaces: list[dict[str, str]] = []
    for ns in NAMESPACES:
        entry = {"type": ns}
        if ns == "network" and spec.netns_path:
            entry["path"] = spec.netns_path
        namespaces.append(entry)

    linux: dict[str, Any] = {
        "namespaces": namespaces,
        "maskedPaths": list(MASKED_PATHS),
        "readonlyPaths": list(READONLY_PATHS),
        "cgroupsPath": cgroups_path,
        "resources": {
            # deny-all; runc adds its default allow list (null, zero, full, random, urandom,
            # tty, ptmx, pts) and creates those nodes.
            "devices": [{"allow": False, "access": "rwm"}],
            # swap == limit: OCI's "swap" is memory+swap (memsw), so no swap escape. Without
            # swap accounting (only where the operator turned memory_swap off) runc cannot
            # set it: the memory limit alone. Swappiness 0: the kernel's reclaim does not push
            # a running sandbox's anonymous memory to swap either; only a pause pages it out
            # (edge/runtime/pager.py).
            "memory": {"limit": memory, "disableOOMKiller": False, "swappiness": 0}
            | ({"swap": memory} if _has_memsw() else {}),
            "cpu": {
                "quota": cpu_quota_us(spec.cpu_millis),
                "period": CPU_PERIOD_US,
                "shares": cpu_shares(spec.cpu_millis),
            },
            "pids": {"limit": spec.pids_max},
        },
    }
    if use_seccomp:
        linux["seccomp"] = seccomp if seccomp is not None else hardened_seccomp()

    caps = list(CAPABILITIES)
    process_extra: dict[str, Any] = {}
    if spec.apparmor_profile:
        process_extra["apparmorProfile"] = spec.apparmor_profile
    return {
        "ociVersion": OCI_VERSION,
        "process": {
            **process_extra,
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(spec.init_argv),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": spec.cwd,
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}],
            "noNewPrivileges": True,
            "oomScoreAdj": OOM_SCORE_ADJ,
        },
        "root": {"path": os.fspath(rootfs), "readonly": False},
        "hostname": spec.effective_hostname,
        "mounts": mounts,
        "linux": linux,
    }


def hosts_file(hostname: str) -> str:
    return (
        "127.0.0.1\tlocalhost\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
        "fe00::0\tip6-localnet\n"
        "ff00::0\tip6-mcastprefix\n"
        "ff02::1\tip6-allnodes\n"
        "ff02::2\tip6-allrouters\n"
        f"127.0.1.1\t{hostname}\n"
    )


def resolv_conf(host_text: str, nameservers: tuple[str, ...] | None = None) -> str:
    """The host's resolv.conf minus loopback nameservers (unreachable from the sandbox netns),
    as Docker does. With no nameserver left the file only has a comment: DNS fails fast.

    `nameservers` replaces the host's: a networked sandbox resolves only through its edge."""
    if nameservers is not None:
        text = "".join(f"nameserver {ns}\n" for ns in nameservers)
        return text + "options timeout:2 attempts:2\n" if text else text
    lines = []
    for line in host_text.splitlines():
        parts = line.split()
        if (
            parts[:1] == ["nameserver"]
            and len(parts) > 1
            and (parts[1].startswith("127.") or parts[1] == "::1")
        ):
            continue
        lines.append(line)
    if not any(line.split()[:1] == ["nameserver"] for line in lines):
        lines.insert(0, "# no nameserver reachable from this sandbox")
    return "\n".join(lines) + "\n"


def rewrite_in_place(path: Path, text: str) -> None:
    """Replace the content of a file the sandbox sees bind-mounted (its /etc files): in place,
    since a new file renamed over it would not be seen through the bind mount."""
    with open(path, "r+") as fh:
        fh.truncate(0)
        fh.write(text)


def write_etc_files(
    etc_dir: Path,
    hostname: str,
    host_resolv: Path = Path("/etc/resolv.conf"),
    nameservers: tuple[str, ...] | None = None,
) -> None:
    """Write the per-sandbox files that config.json bind-mounts over /etc in the sandbox."""
    etc_dir.mkdir(parents=True, exist_ok=True)
    try:
        host_text = host_resolv.read_text()
    except OSError:
        host_text = ""
    (etc_dir / "hosts").write_text(hosts_file(hostname))
    (etc_dir / "hostname").write_text(hostname + "\n")
    (etc_dir / "resolv.conf").write_text(resolv_conf(host_text, nameservers))


def write_config(bundle_dir: Path, config: dict[str, Any]) -> Path:
    path = bundle_dir / "config.json"
    path.write_text(json.dumps(config, separators=(",", ":")))
    return path

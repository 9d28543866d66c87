"""config.json generation: a pure function, checked without root or runc."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge.runtime import InvalidLaunchSpecError, LaunchSpec
from edge.runtime.bundle import (
    CAPABILITIES,
    DROPPED_FROM_DOCKER_DEFAULT,
    default_seccomp,
    hosts_file,
    make_config,
    resolv_conf,
)

ROOTFS = Path("/state/sandboxes/sb-1/rootfs")
ETC = Path("/state/sandboxes/sb-1/etc")


def _spec(**kw: Any) -> LaunchSpec:
    base: dict[str, Any] = {
        "sandbox_id": "sb-1",
        "lowers": [Path("/layers/base")],
        "init_argv": ["/.dsec/bin/aether", "--flag"],
        "env": {"LANG": "C.UTF-8", "TASK": "x=y"},
    }
    base.update(kw)
    return LaunchSpec(**base)


def _config(spec: LaunchSpec | None = None, **kw: Any) -> dict[str, Any]:
    return make_config(spec or _spec(), rootfs=ROOTFS, etc_dir=ETC, cgroups_path="/dsec/sb-1", **kw)


def _mount(cfg: dict[str, Any], dest: str) -> dict[str, Any]:
    matches = [m for m in cfg["mounts"] if m["destination"] == dest]
    assert len(matches) == 1, dest
    return matches[0]


def test_capabilities_are_docker_default_minus_dangerous() -> None:
    caps = _config()["process"]["capabilities"]
    docker_default = {
        "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
        "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
        "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
    }  # fmt: skip
    expected = docker_default - {"CAP_NET_RAW", "CAP_MKNOD", "CAP_AUDIT_WRITE", "CAP_SETFCAP"}
    assert set(CAPABILITIES) == expected
    assert set(DROPPED_FROM_DOCKER_DEFAULT) == docker_default - expected
    for kind in ("bounding", "effective", "permitted"):
        assert set(caps[kind]) == expected
    assert "inheritable" not in caps and "ambient" not in caps


def test_process_hardening() -> None:
    proc = _config()["process"]
    assert proc["noNewPrivileges"] is True
    assert proc["terminal"] is False
    assert proc["oomScoreAdj"] == 500
    assert proc["user"] == {"uid": 0, "gid": 0}
    assert proc["rlimits"] == [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536}]
    assert _config(nofile=20000)["process"]["rlimits"][0]["hard"] == 20000


def test_argv_cwd_env_preserved() -> None:
    cfg = _config(_spec(cwd="/work", env={"A": "1", "B": "two words", "PATH": "/x"}))
    proc = cfg["process"]
    assert proc["args"] == ["/.dsec/bin/aether", "--flag"]
    assert proc["cwd"] == "/work"
    assert proc["env"] == ["A=1", "B=two words", "PATH=/x"]


def test_path_defaulted_when_absent() -> None:
    env = _config()["process"]["env"]
    assert "LANG=C.UTF-8" in env and "TASK=x=y" in env
    assert any(e.startswith("PATH=/usr/local/sbin:") for e in env)


def test_masked_and_readonly_paths() -> None:
    linux = _config()["linux"]
    for p in (
        "/proc/kpagecgroup", "/proc/kpageflags", "/proc/kpagecount", "/proc/kcore", "/proc/keys",
        "/proc/timer_list", "/proc/sched_debug", "/sys/firmware", "/proc/scsi", "/proc/acpi",
        "/proc/asound", "/proc/latency_stats", "/proc/timer_stats", "/proc/sysrq-trigger",
        "/sys/kernel/mm/page_idle", "/proc/kmsg", "/proc/slabinfo", "/proc/vmallocinfo",
    ):  # fmt: skip
        assert p in linux["maskedPaths"]
    assert set(linux["readonlyPaths"]) >= {
        "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
    }  # fmt: skip
    assert not set(linux["readonlyPaths"]) & set(linux["maskedPaths"])


def test_namespaces_new_netns_by_default_and_join_when_given() -> None:
    ns = {n["type"]: n for n in _config()["linux"]["namespaces"]}
    assert set(ns) == {"pid", "ipc", "uts", "mount", "network", "cgroup"}
    assert all("path" not in n for n in ns.values())
    joined = {
        n["type"]: n for n in _config(_spec(netns_path="/run/netns/sb-1"))["linux"]["namespaces"]
    }
    assert joined["network"] == {"type": "network", "path": "/run/netns/sb-1"}
    assert "path" not in joined["pid"]


def test_root_is_overlay_target_writable() -> None:
    cfg = _config()
    assert cfg["root"] == {"path": str(ROOTFS), "readonly": False}
    assert cfg["hostname"] == "sb-1"
    assert _config(_spec(hostname="box"))["hostname"] == "box"


def test_standard_mounts() -> None:
    cfg = _config()
    assert _mount(cfg, "/proc")["type"] == "proc"
    assert _mount(cfg, "/dev")["type"] == "tmpfs"
    assert _mount(cfg, "/dev/pts")["type"] == "devpts"
    assert _mount(cfg, "/dev/shm")["type"] == "tmpfs"
    assert _mount(cfg, "/dev/mqueue")["type"] == "mqueue"
    sysfs = _mount(cfg, "/sys")
    assert sysfs["type"] == "sysfs" and "ro" in sysfs["options"]
    cg = _mount(cfg, "/sys/fs/cgroup")
    assert cg["type"] == "cgroup" and "ro" in cg["options"]
    for name in ("hosts", "hostname", "resolv.conf"):
        m = _mount(cfg, f"/etc/{name}")
        assert m["type"] == "bind" and m["source"] == str(ETC / name)


def test_toolkit_bind_mounted_read_only() -> None:
    assert not [m for m in _config()["mounts"] if m["destination"] == "/.dsec"]
    cfg = _config(_spec(toolkit_dir=Path("/var/lib/dsec/toolkit/abc")))
    tk = _mount(cfg, "/.dsec")
    assert tk["source"] == "/var/lib/dsec/toolkit/abc"
    assert {"rbind", "ro", "nosuid", "nodev"} <= set(tk["options"])
    assert "noexec" not in tk["options"]  # the interpreter runs from there
    # the runtime substitutes the mountpoint of an EROFS toolkit image
    cfg = _config(
        _spec(toolkit_dir=Path("/img/tk.erofs")), toolkit_source=Path("/state/layers/0123")
    )
    assert _mount(cfg, "/.dsec")["source"] == "/state/layers/0123"


@pytest.mark.parametrize(
    ("millis", "quota", "shares"),
    [(1000, 100_000, 1024), (250, 25_000, 256), (2500, 250_000, 2560)],
)
def test_resources_math(millis: int, quota: int, shares: int) -> None:
    res = _config(_spec(cpu_millis=millis, memory_mb=768, pids_max=99))["linux"]["resources"]
    assert res["cpu"] == {"quota": quota, "period": 100_000, "shares": shares}
    assert res["memory"]["limit"] == 768 * 1024 * 1024
    assert res["memory"]["swap"] == res["memory"]["limit"]  # memsw == mem: no swap escape
    assert res["pids"] == {"limit": 99}
    assert res["devices"][0] == {"allow": False, "access": "rwm"}


def test_cgroups_path() -> None:
    assert _config()["linux"]["cgroupsPath"] == "/dsec/sb-1"


def test_seccomp_is_dockers_default_profile() -> None:
    sec = _config()["linux"]["seccomp"]
    assert sec["defaultAction"] == "SCMP_ACT_ERRNO"
    assert "SCMP_ARCH_X86_64" in sec["architectures"]
    allowed = {n for r in sec["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]}
    assert {"read", "write", "openat", "execve", "clone", "wait4"} <= allowed
    for forbidden in ("keyctl", "add_key", "unshare", "mount", "bpf", "ptrace_foo", "kexec_load"):
        assert forbidden not in allowed
    # Docker's profile, except io_uring: refused with ENOSYS so programs fall back.
    for uring in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        assert uring not in allowed
    refused = [r for r in sec["syscalls"] if "io_uring_setup" in r["names"]]
    assert refused == [
        {
            "names": ["io_uring_enter", "io_uring_register", "io_uring_setup"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": 38,
        }
    ]
    docker = default_seccomp()
    assert [r for r in sec["syscalls"] if r not in refused] != docker["syscalls"]
    assert sec["defaultAction"] == docker["defaultAction"]
    assert "seccomp" not in _config(use_seccomp=False)["linux"]


def test_extra_binds_and_edge_nameservers() -> None:
    from edge.runtime.spec import BindMount

    cfg = _config(_spec(binds=(BindMount(Path("/stage/work"), "/work", readonly=True),)))
    m = _mount(cfg, "/work")
    assert m["source"] == "/stage/work" and {"rbind", "ro", "nosuid", "nodev"} <= set(m["options"])
    text = resolv_conf("nameserver 10.0.0.2\n", nameservers=("10.231.0.1",))
    assert text.splitlines()[0] == "nameserver 10.231.0.1" and "10.0.0.2" not in text


def test_default_seccomp_returns_independent_copies() -> None:
    a = default_seccomp()
    a["syscalls"].clear()
    assert default_seccomp()["syscalls"]


def test_hosts_and_resolv_conf() -> None:
    assert "127.0.1.1\tsb-1" in hosts_file("sb-1")
    text = resolv_conf("nameserver 127.0.0.53\nnameserver 10.0.0.2\nsearch example\n")
    assert "127.0.0.53" not in text and "nameserver 10.0.0.2" in text and "search example" in text
    assert "nameserver" not in resolv_conf("nameserver 127.0.0.1\n").replace("# no nameserver", "")


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"sandbox_id": "Bad_ID"}, "sandbox id"),
        ({"sandbox_id": "x" * 65}, "sandbox id"),
        ({"init_argv": []}, "init_argv"),
        ({"cwd": "relative"}, "cwd"),
        ({"cpu_millis": 5}, "cpu_millis"),
        ({"memory_mb": 1}, "memory_mb"),
        ({"pids_max": 1}, "pids_max"),
        ({"env": {"A=B": "x"}}, "environment"),
        ({"hostname": "-bad-"}, "hostname"),
        ({"lowers": []}, "lower layer"),
    ],
)
def test_launch_spec_validation(tmp_path: Path, kw: dict[str, Any], fragment: str) -> None:
    base: dict[str, Any] = {"lowers": [tmp_path]}
    base.update(kw)
    with pytest.raises(InvalidLaunchSpecError, match=fragment):
        _spec(**base).validate()


def test_launch_spec_valid(tmp_path: Path) -> None:
    _spec(lowers=[tmp_path]).validate()
    with pytest.raises(InvalidLaunchSpecError, match="does not exist"):
        _spec(lowers=[tmp_path / "missing.erofs"]).validate()

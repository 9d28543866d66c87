"""Fixtures for the runtime tests: real runc, real mounts, real cgroups (root only).

Every sandbox a test creates lives in a per-test state directory and a per-session cgroup parent,
so these tests never touch another engineer's (or the edge's) sandboxes, and the `runtime`
fixture's finalizer removes everything and then asserts that nothing is left on the host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edge.runtime import LaunchSpec, RuncRuntime, SandboxStatus, become_subreaper, cgroups, disk
from edge.runtime.mounts import mounts_under

IMAGE_DIR = Path(os.environ.get("DSEC_IMAGE_DIR", "/var/lib/dsec/images"))
REPO = Path(__file__).resolve().parents[2]

CAN_RUN = (
    os.geteuid() == 0
    and shutil.which("runc") is not None
    and shutil.which("mkfs.erofs") is not None
)
NEEDS_NOTHING = {"test_layering.py"}  # static checks, run anywhere


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CAN_RUN:
        return
    skip = pytest.mark.skip(reason="runtime tests need root, runc and mkfs.erofs")
    here = Path(__file__).parent
    for item in items:
        path = Path(str(item.fspath))
        if path.parent == here and path.name not in NEEDS_NOTHING:
            item.add_marker(skip)


BUSYBOX_APPLETS = ("sh", "cat", "ls", "echo", "sleep", "dd", "env", "grep", "seq", "id", "touch")


@dataclass(frozen=True)
class BusyboxImage:
    rootfs: Path  # a plain directory tree
    erofs: Path  # the same tree as an EROFS image


def make_erofs(src: Path, out: Path, *extra: str) -> Path:
    subprocess.run(
        ["mkfs.erofs", "--quiet", "--all-root", *extra, str(out), str(src)],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session", autouse=True)
def _subreaper() -> None:
    # As the edge does at start: sandbox inits are orphaned when `runc run -d` exits and this
    # machine's PID 1 never reaps them.
    become_subreaper()


@pytest.fixture(scope="session")
def busybox(tmp_path_factory: pytest.TempPathFactory) -> BusyboxImage:
    """The base image from scripts/build-base-images.sh when present, else a tiny one built here
    from /bin/busybox (busybox-static)."""
    rootfs, image = IMAGE_DIR / "busybox.rootfs", IMAGE_DIR / "busybox.erofs"
    if (rootfs / "bin" / "busybox").exists() and image.is_file():
        return BusyboxImage(rootfs, image)
    d = tmp_path_factory.mktemp("busybox")
    root = d / "rootfs"
    for sub in ("bin", "etc", "root", "tmp", "proc", "sys", "dev"):
        (root / sub).mkdir(parents=True)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    for applet in BUSYBOX_APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    return BusyboxImage(root, make_erofs(root, d / "busybox.erofs"))


@pytest.fixture(scope="session")
def cgroup_parent() -> Iterator[str]:
    parent = f"dsec-test-{os.getpid()}"
    yield parent
    cgroups.remove(f"/{parent}")


@pytest.fixture
def runtime(tmp_path: Path, cgroup_parent: str) -> Iterator[RuncRuntime]:
    rt = RuncRuntime(tmp_path / "state", cgroup_parent=cgroup_parent, volatile_state=True)
    yield rt
    # Always clean up, even when the test failed; then check nothing leaked.
    again = RuncRuntime(tmp_path / "state", cgroup_parent=cgroup_parent, volatile_state=True)
    again.cleanup_orphans(set())
    try:
        assert leftovers_of(rt) == []
    finally:
        again.release()
    assert mounts_under(rt.state_dir) == []


def leftovers_of(rt: RuncRuntime, sandbox_id: str | None = None) -> list[str]:
    """What is left on the host of one sandbox (or of the whole runtime): mounts under the state
    dir, cgroup directories, runc state, state directories, layer mountpoints."""
    volatile = {str(rt.sandboxes_dir), str(rt.runc_root)}  # the state tmpfs mounts themselves
    left = [
        f"mount:{m.mountpoint}" for m in mounts_under(rt.state_dir) if m.mountpoint not in volatile
    ]
    if sandbox_id is None:
        left += [f"cgroup:{c}" for c in sorted(cgroups.children(rt.cgroup_parent))]
        left += [f"runc:{p}" for p in rt.runc_root.iterdir()]
        left += [f"state:{p}" for p in rt.sandboxes_dir.iterdir()]
        # the quota's formatted templates are the node's, for its later sandboxes
        left += [f"rw:{p}" for p in rt.rw_dir.iterdir() if p.name != disk.TEMPLATES]
        left += [f"layer-dir:{p}" for p in rt.layers.root.iterdir()]
        return left
    left = [x for x in left if f"/{sandbox_id}/" in x + "/"]
    left += [f"cgroup:{d}" for d in cgroups.existing_dirs(rt.cgroup_path(sandbox_id))]
    left += [f"runc:{p}" for p in [rt.runc_root / sandbox_id] if p.exists()]
    left += [f"state:{p}" for p in [rt.sandbox_dir(sandbox_id)] if p.exists()]
    left += [f"rw:{p}" for p in [rt.writable_dir(sandbox_id)] if p.exists()]
    return left


@pytest.fixture
def leftovers() -> Callable[..., list[str]]:
    return leftovers_of


@pytest.fixture
def erofs_image() -> Callable[..., Path]:
    return make_erofs


def poll_until(predicate: Callable[[], object], timeout_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(0.02)


@pytest.fixture
def wait_for() -> Callable[..., None]:
    """Polling helper: wait_for(predicate, timeout_s, what)."""
    return poll_until


@pytest.fixture
def wait_stopped() -> Callable[..., None]:
    return _wait_stopped


def _wait_stopped(rt: RuncRuntime, sandbox_id: str, timeout_s: float = 10.0) -> None:
    poll_until(
        lambda: rt.state(sandbox_id).status is SandboxStatus.STOPPED,
        timeout_s,
        f"{sandbox_id} to stop",
    )


SLEEPER = ["/bin/busybox", "sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"]


@pytest.fixture
def spec_for(busybox: BusyboxImage, request: pytest.FixtureRequest) -> Callable[..., LaunchSpec]:
    """LaunchSpec factory labelled with the test's name (ids stay within [a-z0-9-]{1,64})."""
    counter = iter(range(1000))
    label = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")

    def make(**kw: object) -> LaunchSpec:
        args: dict[str, object] = {
            "sandbox_id": f"{label}-{next(counter)}",
            "lowers": [busybox.erofs],
            "init_argv": SLEEPER,
            "env": {},
        }
        args.update(kw)
        return LaunchSpec(**args)  # type: ignore[arg-type]

    return make


@pytest.fixture(scope="session")
def toolkit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toolkit built from this checkout (content-addressed; ~1.5 s on a cold build)."""
    from edge.toolkit import build_toolkit

    return build_toolkit(tmp_path_factory.mktemp("toolkit"), REPO)


@pytest.fixture(scope="session")
def toolkit_image_path(toolkit_dir: Path) -> Path:
    from edge.toolkit import toolkit_image

    return toolkit_image(toolkit_dir)

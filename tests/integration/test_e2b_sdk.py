"""The real e2b SDK (PyPI, pinned) against a dsec cluster through the compat front end.

Each test is a scenario an agent written for E2B runs: create, commands (output, exit codes,
timeouts, envs, cwd, callbacks, background processes, stdin, PTY), files (both transfer
formats, 256 MB streamed both ways), directory watches, timeouts, pause/connect, list,
kill, and the SDK's own error classes. The SDK is pointed at dsec with E2B_API_URL,
E2B_SANDBOX_URL and E2B_API_KEY only, as user code would be.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest
from e2b import AsyncSandbox, CommandExitException, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import (
    AuthenticationException,
    FileNotFoundException,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    TimeoutException,
)
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.filesystem import FileType
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

from tests.helpers import wait_for
from tests.integration.conftest import ClusterWith
from tests.integration.e2b_support import E2bTarget, e2b_cluster, e2b_environment, sandbox_maker

pytestmark = pytest.mark.images("busybox", "bookworm", "e2b-base")

MIB = 1 << 20


@pytest.fixture(scope="module")
def target(cluster_with: ClusterWith) -> Iterator[E2bTarget]:
    with e2b_cluster(cluster_with, "e2b") as t, e2b_environment(t):
        yield t


@pytest.fixture(scope="module")
def container_cluster(target: E2bTarget):  # type: ignore[no-untyped-def]
    """(So a failing test prints the services' log tails: see tests/conftest.py.)"""
    return target.cluster


@pytest.fixture
def make(
    target: E2bTarget, container_cluster: object, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Sandbox]]:
    with sandbox_maker(request) as make:
        yield make


@pytest.fixture(scope="module")
def shared(target: E2bTarget) -> Iterator[Sandbox]:
    """One sandbox for the read-mostly command and file scenarios (creates cost time)."""
    sb = Sandbox.create(metadata={"test": "shared"})
    yield sb
    sb.kill()


# ------------------------------------------------------------------------- create


def test_create_returns_a_running_sandbox_with_its_metadata(make: Callable[..., Sandbox]) -> None:
    sb = make(metadata={"stage": "train"}, envs={"GREETING": "hi"}, timeout=120)
    assert sb.sandbox_id.startswith("sb-")
    info = sb.get_info()
    assert info.sandbox_id == sb.sandbox_id
    assert info.template_id == "base"
    assert info.metadata["stage"] == "train"
    assert info.state.value == "running"
    assert 100 <= (info.end_at - info.started_at).total_seconds() <= 125
    assert sb.is_running()
    assert sb.commands.run("echo $GREETING").stdout == "hi\n"  # envVars -> sandbox env


# ----------------------------------------------------------------------- commands


def test_run_gives_stdout_stderr_and_the_exit_code(shared: Sandbox) -> None:
    r = shared.commands.run("echo out; echo err >&2; exit 0")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    # the SDK runs `bash -l -c CMD`: bash features work
    assert shared.commands.run("[[ 1 == 1 ]] && echo ${BASH_VERSION%%.*}").stdout.strip().isdigit()


def test_a_non_zero_exit_is_the_sdks_command_exit_exception(shared: Sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        shared.commands.run("echo partial; echo bad >&2; exit 3")
    assert info.value.exit_code == 3
    assert info.value.stdout == "partial\n" and info.value.stderr == "bad\n"


def test_a_command_past_its_timeout_raises_and_is_killed(shared: Sandbox) -> None:
    marker = f"/tmp/timeout-{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        shared.commands.run(f"sleep 30; touch {marker}", timeout=1)
    assert time.monotonic() - start < 10
    # envd kills a process at its timeout: nothing of it is left running
    wait_for(lambda: not any("sleep 30" in " ".join(p.args) for p in shared.commands.list()))
    assert not shared.files.exists(marker)


def test_the_base_template_follows_e2bs_user_model(shared: Sandbox) -> None:
    """E2B's `base`: commands as `user` in /home/user, root on request; what the SDK's file
    calls create is the user's, so the user's commands may change it; the tools E2B's base
    image has are there, and `user` may sudo without a password (dsec's sudo: chronus/sudo.py)."""
    assert shared.commands.run("id -un; echo $HOME; pwd").stdout == "user\n/home/user\n/home/user\n"
    # the home is the user's (the image keeps its owners): the user's own commands write there
    assert shared.commands.run("stat -c %U:%G .; touch own.txt && stat -c %U own.txt").stdout == (
        "user:user\nuser\n"
    )
    assert shared.commands.run("sudo -n id -un; sudo -u nobody id -un").stdout == "root\nnobody\n"
    # sudo resets the environment: a command-scoped variable does not reach the root command
    r = shared.commands.run("sudo sh -c 'echo [$FOO] $SUDO_USER $HOME'", envs={"FOO": "bar"})
    assert r.stdout == "[] user /root\n"
    assert shared.commands.run("id -un; pwd", user="root").stdout == "root\n/root\n"
    shared.files.write("/home/user/made/here/mine.txt", "x")
    r = shared.commands.run(
        "stat -c %U:%G made/here/mine.txt made/here made; echo more >> made/here/mine.txt;"
        " cat made/here/mine.txt"
    )
    assert r.stdout == "user:user\nuser:user\nuser:user\nxmore\n"
    assert shared.files.make_dir("dir-of-mine") is True
    assert shared.commands.run("stat -c %U /home/user/dir-of-mine").stdout == "user\n"
    shared.files.write("/tmp/roots.txt", "r", user="root")
    assert shared.commands.run("stat -c %U:%G /tmp/roots.txt").stdout == "root:root\n"
    with pytest.raises(CommandExitException):
        shared.commands.run("echo no >> /tmp/roots.txt")  # the user may not write root's file
    tools = "bash sudo curl wget git python python3 pip3 gcc make"
    r = shared.commands.run(f"for t in {tools}; do command -v $t >/dev/null || echo $t; done")
    assert r.stdout == "", f"missing from e2b-base: {r.stdout}"


def test_envs_cwd_and_on_stdout_callbacks(shared: Sandbox) -> None:
    assert shared.commands.run("echo $A-$B", envs={"A": "1", "B": "2"}).stdout == "1-2\n"
    assert shared.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert shared.commands.run("pwd").stdout == "/home/user\n"  # the user's home, as in envd
    seen: list[str] = []
    errs: list[str] = []
    r = shared.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.05; done; echo oops >&2",
        on_stdout=seen.append,
        on_stderr=errs.append,
    )
    assert "".join(seen) == r.stdout == "line1\nline2\nline3\n"
    assert "".join(errs) == "oops\n"


def test_a_missing_cwd_is_an_error_not_a_hang(shared: Sandbox) -> None:
    with pytest.raises((SandboxException, CommandExitException)):
        shared.commands.run("pwd", cwd="/does/not/exist", timeout=20)


def test_background_process_connect_stdin_and_kill(make: Callable[..., Sandbox]) -> None:
    sb = make()
    handle = sb.commands.run(
        "read line; echo got:$line; sleep 300", background=True, stdin=True, timeout=0
    )
    pid = handle.pid
    assert any(p.pid == pid for p in sb.commands.list())
    handle.disconnect()  # the process keeps running without a client
    sb.commands.send_stdin(pid, "hello\n")
    again = sb.commands.connect(pid)
    assert again.pid == pid  # stable across reconnects
    out: list[str] = []
    for stdout, _, _ in again:
        if stdout:
            out.append(stdout)
        if "got:hello" in "".join(out):
            break
    again.disconnect()
    assert sb.commands.kill(pid)
    wait_for(lambda: all(p.pid != pid for p in sb.commands.list()))
    assert not sb.commands.kill(pid)  # already gone: False, as in E2B


def test_close_stdin_ends_input(shared: Sandbox) -> None:
    h = shared.commands.run("cat; echo done", background=True, stdin=True)
    shared.commands.send_stdin(h.pid, "abc")
    shared.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "abcdone\n" and r.exit_code == 0


def test_pty_create_send_and_resize(shared: Sandbox) -> None:
    h = shared.pty.create(PtySize(rows=24, cols=80))
    shared.pty.resize(h.pid, PtySize(rows=30, cols=100))
    shared.pty.send_stdin(h.pid, b"stty size; exit\n")
    out = bytearray()
    h.wait(on_pty=out.extend)
    assert b"30 100" in out


# -------------------------------------------------------------------------- files


def test_files_write_read_list_info_mkdir_rename_remove(shared: Sandbox) -> None:
    d = f"/tmp/files-{uuid.uuid4().hex[:8]}"
    info = shared.files.write(f"{d}/a.txt", "alpha")
    assert info.path == f"{d}/a.txt" and info.name == "a.txt"
    assert shared.files.read(f"{d}/a.txt") == "alpha"
    assert bytes(shared.files.read(f"{d}/a.txt", format="bytes")) == b"alpha"
    many = shared.files.write_files(
        [{"path": f"{d}/sub/b.bin", "data": b"\x00\x01"}, {"path": f"{d}/c.txt", "data": "c"}]
    )
    assert [w.path for w in many] == [f"{d}/sub/b.bin", f"{d}/c.txt"]
    assert {e.name for e in shared.files.list(d)} == {"a.txt", "sub", "c.txt"}
    assert {e.path for e in shared.files.list(d, depth=2)} >= {f"{d}/sub/b.bin"}
    assert shared.files.exists(f"{d}/c.txt") and not shared.files.exists(f"{d}/nope")
    entry = shared.files.get_info(f"{d}/sub/b.bin")
    assert entry.size == 2 and entry.type.value == "file" and entry.permissions == "-rw-r--r--"
    assert shared.files.make_dir(f"{d}/new/deep") is True
    assert shared.files.make_dir(f"{d}/new/deep") is False  # already there
    moved = shared.files.rename(f"{d}/a.txt", f"{d}/moved/a2.txt")
    assert moved.path == f"{d}/moved/a2.txt" and shared.files.read(moved.path) == "alpha"
    shared.files.remove(d)
    assert not shared.files.exists(d)
    with pytest.raises(FileNotFoundException):
        shared.files.read(f"{d}/a.txt")
    # relative paths are under the user's home, as in envd
    shared.files.write("rel.txt", "home")
    assert shared.commands.run("cat /home/user/rel.txt").stdout == "home"


def test_info_and_list_follow_symlinks_and_name_owners_as_envd(shared: Sandbox) -> None:
    """envd's entries: a link's own size, owner and "L" permissions, its target's type and
    mode, the fully resolved target (the link's own path when it dangles); owner and group
    are the sandbox's names, as `stat` inside prints them."""
    d = f"/tmp/links-{uuid.uuid4().hex[:8]}"
    shared.commands.run(
        f"mkdir -p {d}/sub && printf hello > {d}/sub/f.txt && chmod 640 {d}/sub/f.txt"
        f" && ln -s sub/f.txt {d}/hop && ln -s hop {d}/ln && ln -s nowhere {d}/dangling"
    )
    owner, group, size = shared.commands.run(f"stat -c '%U %G %s' {d}/ln").stdout.split()
    assert (owner, group) == ("user", "user")  # the shared sandbox runs commands as user

    link = shared.files.get_info(f"{d}/ln")
    assert (link.name, link.path, link.size) == ("ln", f"{d}/ln", int(size))
    assert (link.type, link.mode, link.permissions) == (FileType.FILE, 0o640, "Lrwxrwxrwx")
    assert (link.owner, link.group, link.symlink_target) == (owner, group, f"{d}/sub/f.txt")
    real = shared.files.get_info(f"{d}/sub/f.txt")
    assert (real.size, real.permissions, real.owner, real.symlink_target) == (
        5,
        "-rw-r-----",
        "user",
        None,
    )
    dangling = shared.files.get_info(f"{d}/dangling")
    assert (dangling.type, dangling.mode, dangling.symlink_target) == (None, 0, f"{d}/dangling")
    assert dangling.permissions == "Lrwxrwxrwx"
    root = shared.files.get_info("/etc/passwd")
    assert (root.owner, root.group) == ("root", "root")
    assert shared.files.get_info("/tmp").permissions == "dtrwxrwxrwx"

    listed = {e.name: e for e in shared.files.list(d)}
    assert listed["hop"].symlink_target == listed["ln"].symlink_target == f"{d}/sub/f.txt"
    assert (listed["sub"].type, listed["sub"].owner) == (FileType.DIR, "user")
    assert "dangling" not in listed  # no type: the SDK skips it, as it does envd's
    shared.files.remove(d)


def test_octet_stream_and_multipart_uploads(shared: Sandbox) -> None:
    shared.files.write("/tmp/oct.bin", b"o" * 1000, use_octet_stream=True)
    shared.files.write("/tmp/multi.bin", b"m" * 1000, use_octet_stream=False)
    assert shared.commands.run("wc -c < /tmp/oct.bin; wc -c < /tmp/multi.bin").stdout.split() == [
        "1000",
        "1000",
    ]


def test_256_mb_up_and_down_streamed_and_checked_by_sha256(shared: Sandbox) -> None:
    size, chunk = 256 * MIB, MIB
    sent = hashlib.sha256()

    def data() -> Iterator[bytes]:  # generated as it is sent: never on this machine's disk
        for i in range(size // chunk):
            block = hashlib.sha256(i.to_bytes(8, "big")).digest() * (chunk // 32)
            sent.update(block)
            yield block

    shared.files.write("/tmp/big.bin", data())
    digest = sent.hexdigest()
    assert shared.commands.run("sha256sum /tmp/big.bin").stdout.split()[0] == digest
    got, n = hashlib.sha256(), 0
    for part in shared.files.read("/tmp/big.bin", format="stream"):
        got.update(part)
        n += len(part)
    assert n == size and got.hexdigest() == digest
    shared.files.remove("/tmp/big.bin")


# -------------------------------------------------------------------------- watch


def test_watch_dir_reports_changes(shared: Sandbox) -> None:
    d = f"/tmp/watch-{uuid.uuid4().hex[:8]}"
    shared.files.make_dir(d)
    handle = shared.files.watch_dir(d)
    try:
        shared.files.write(f"{d}/new.txt", "x")
        events = wait_for(lambda: handle.get_new_events(), timeout_s=10)
        assert any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE for e in events)
    finally:
        handle.stop()


def test_a_write_is_watched_as_e2b_reports_it(shared: Sandbox) -> None:
    # envd writes a file in place (O_CREAT|O_TRUNC, chown, write); dsec renames a written
    # temporary into place and reports it as envd's events: a new file CREATE, CHMOD, WRITE
    # (E2B's own suite counts the three), one that was there CHMOD, WRITE.
    d = f"/tmp/watch-{uuid.uuid4().hex[:8]}"
    shared.files.make_dir(d)
    handle = shared.files.watch_dir(d)
    t = FilesystemEventType
    try:
        shared.files.write(f"{d}/f.txt", "first")
        created = wait_for(lambda: handle.get_new_events(), timeout_s=10)
        assert [(e.name, e.type) for e in created] == [
            ("f.txt", t.CREATE),
            ("f.txt", t.CHMOD),
            ("f.txt", t.WRITE),
        ]
        shared.files.write(f"{d}/f.txt", "second")
        written = wait_for(lambda: handle.get_new_events(), timeout_s=10)
        assert [(e.name, e.type) for e in written] == [("f.txt", t.CHMOD), ("f.txt", t.WRITE)]
    finally:
        handle.stop()
    # Still an atomic replace: the new contents whole, no temporary left beside them.
    assert shared.files.read(f"{d}/f.txt") == "second"
    assert [e.name for e in shared.files.list(d)] == ["f.txt"]


async def test_watch_dir_with_the_async_sdk(target: E2bTarget) -> None:
    sb = await AsyncSandbox.create(metadata={"test": "async-watch"})
    try:
        await sb.files.make_dir("/tmp/aw")
        seen = []
        handle = await sb.files.watch_dir("/tmp/aw", on_event=seen.append, recursive=True)
        await sb.files.write("/tmp/aw/sub/f.txt", "x")
        deadline = time.monotonic() + 10
        while not any(e.name.endswith("f.txt") for e in seen) and time.monotonic() < deadline:
            await sb.commands.run("true")  # let the loop run
        await handle.stop()
        assert any(e.name.endswith("f.txt") for e in seen)
    finally:
        await sb.kill()


# ------------------------------------------------------------- lifecycle and list


def test_set_timeout_changes_the_ttl_live(make: Callable[..., Sandbox]) -> None:
    sb = make(timeout=60)
    sb.set_timeout(900)
    left = (sb.get_info().end_at - datetime.now(UTC)).total_seconds()
    assert 850 < left <= 900
    sb.set_timeout(30)  # shorter works too
    assert (sb.get_info().end_at - datetime.now(UTC)).total_seconds() <= 30


def test_a_timeout_of_zero_ends_it_now_or_with_auto_pause_pauses_it(
    make: Callable[..., Sandbox],
) -> None:
    """E2B's ``set_timeout(0)``: the timeout's action now (dsec: the smallest timeout it
    takes, so the edge's reaper acts within its second)."""
    sb = make(timeout=600)
    sb.set_timeout(0)

    def gone() -> bool:  # not running at once; then ended (stopping takes a moment)
        try:
            Sandbox.get_info(sb.sandbox_id)
        except SandboxNotFoundException:
            return True
        return False

    wait_for(gone, timeout_s=30)
    assert not sb.is_running()
    kept = make(timeout=600, lifecycle={"on_timeout": "pause"})
    kept.files.write("/root/kept.txt", "yes")
    kept.set_timeout(0)
    wait_for(lambda: kept.get_info().state.value == "paused", timeout_s=60)
    again = Sandbox.connect(kept.sandbox_id)
    assert again.files.read("/root/kept.txt") == "yes"


def test_pause_then_connect_keeps_files_and_a_background_process(
    make: Callable[..., Sandbox],
) -> None:
    sb = make()
    sb.files.write("/root/state.txt", "kept")
    bg = sb.commands.run(
        "i=0; while true; do i=$((i+1)); echo $i > /tmp/tick; sleep 0.1; done",
        background=True,
        timeout=0,
    )
    wait_for(lambda: sb.files.exists("/tmp/tick"))
    sb.pause()
    assert sb.get_info().state.value == "paused"
    assert not sb.is_running()
    again = Sandbox.connect(sb.sandbox_id)
    assert again.get_info().state.value == "running"
    assert again.files.read("/root/state.txt") == "kept"
    assert any(p.pid == bg.pid for p in again.commands.list())
    first = int(again.files.read("/tmp/tick"))
    wait_for(lambda: int(again.files.read("/tmp/tick") or 0) > first)  # still ticking
    assert again.pause() is True and again.pause() is False  # already paused: False
    Sandbox.connect(sb.sandbox_id)


def test_list_filters_by_metadata_and_state_and_pages(make: Callable[..., Sandbox]) -> None:
    run = uuid.uuid4().hex[:8]
    sbs = [make(metadata={"run": run, "i": str(i)}) for i in range(3)]
    sbs[0].pause()
    q = SandboxQuery(metadata={"run": run})
    found = [s.sandbox_id for s in Sandbox.list(query=q).next_items()]
    assert sorted(found) == sorted(s.sandbox_id for s in sbs)
    one = Sandbox.list(query=SandboxQuery(metadata={"run": run, "i": "1"})).next_items()
    assert [s.sandbox_id for s in one] == [sbs[1].sandbox_id]
    paused = Sandbox.list(query=SandboxQuery(metadata={"run": run}, state=[SandboxState.PAUSED]))
    assert [s.sandbox_id for s in paused.next_items()] == [sbs[0].sandbox_id]
    pages, seen = Sandbox.list(query=q, limit=2), []
    while pages.has_next:
        items = pages.next_items()
        assert len(items) <= 2
        seen.extend(s.sandbox_id for s in items)
    assert sorted(seen) == sorted(s.sandbox_id for s in sbs)


def test_kill_ends_the_sandbox(make: Callable[..., Sandbox]) -> None:
    sb = make()
    assert sb.kill() is True
    assert not sb.is_running()
    assert Sandbox.kill(sb.sandbox_id) is False  # gone: False, as in E2B
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sb.sandbox_id)
    with pytest.raises(SandboxNotRunningException):
        sb.commands.run("true")


def test_a_sandbox_killed_during_wait_raises_not_running_saying_so(
    make: Callable[..., Sandbox],
) -> None:
    """As on E2B: the wait ends as a dropped connection, the SDK's health probe finds the
    sandbox gone, and it raises SandboxNotRunningException saying the sandbox was killed
    (not the timeout wording of a sandbox that was never there)."""
    sb = make()
    cmd = sb.commands.run("sleep 60", background=True)
    assert sb.kill() is True
    start = time.monotonic()
    with pytest.raises(SandboxNotRunningException) as info:
        cmd.wait()
    assert time.monotonic() - start < 30
    assert "killed or reached its end of life while the request was in flight" in str(info.value)


# ---------------------------------------------------------------------- bad input


def test_a_missing_sandbox_and_a_bad_key_raise_the_sdks_classes(target: E2bTarget) -> None:
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("sb-e2b0-0000000000000000")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("sb-e2b0-0000000000000000")
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-a-dsec-token")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="dsec_0000_bad").next_items()


def test_an_unknown_template_is_a_404(target: E2bTarget) -> None:
    with pytest.raises(SandboxException) as info:
        Sandbox.create(template="no-such-template")
    assert info.value.status_code == 404 and "no-such-template" in str(info.value)


def test_public_traffic_true_is_accepted_and_network_rules_are_refused(
    make: Callable[..., Sandbox],
) -> None:
    """``allow_public_traffic=True`` is E2B's default; dsec takes it (its ports still need the
    traffic token: test_e2b_wire)."""
    sb = make(network={"allow_public_traffic": True})
    assert sb.commands.run("echo up").stdout == "up\n"
    with pytest.raises(SandboxException) as info:
        Sandbox.create(network={"allow_public_traffic": True, "mask_request_host": "x.test"})
    assert info.value.status_code == 400 and "maskRequestHost" in str(info.value)


def test_fork_gives_each_child_the_files_and_the_source_runs_on(
    make: Callable[..., Sandbox],
) -> None:
    """E2B's fork (``Sandbox.fork(count=)``, POST /sandboxes/{id}/fork) on dsec's fork: a
    container template's children get its files (not its processes: dsec's files-only fork)."""
    source = make(metadata={"role": "source"})
    source.files.write("/root/state.txt", "step 7")
    children = source.fork(count=2, timeout=120)
    try:
        assert len(children) == 2 and all(isinstance(c, Sandbox) for c in children), children
        ids = {c.sandbox_id for c in children}  # type: ignore[union-attr]
        assert len(ids) == 2 and source.sandbox_id not in ids
        for i, child in enumerate(children):
            assert isinstance(child, Sandbox)
            assert child.files.read("/root/state.txt") == "step 7"
            child.files.write("/root/state.txt", f"child {i}")
            assert child.get_info().metadata["role"] == "source"  # the source's metadata
        assert source.files.read("/root/state.txt") == "step 7"  # siblings do not leak back
        assert children[0].files.read("/root/state.txt") == "child 0"  # type: ignore[union-attr]
        with pytest.raises(SandboxException, match="between 1 and"):
            source.fork(count=0)
    finally:
        for c in children:
            if isinstance(c, Sandbox):
                c.kill()


# --------------------------------------------------------------- metadata-routed images

MEMORY_LIMIT = (
    "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
)


def test_an_image_named_in_metadata_runs_instead_of_the_template_as_slime_routes_it(
    make: Callable[..., Sandbox],
) -> None:
    """slime's E2B sandboxes name their task's image and size in the metadata (the key is
    the gateway's: dsec's is DSEC_COMPAT_IMAGE_METADATA_KEY, default dsec/image, and the
    size beside it): a dsec environment, or an image of the cluster's Docker engine."""
    sb = make(metadata={"dsec/image": "python", "dsec/size": "sm"})
    assert sb.commands.run("python3 -c 'import numpy; print(1)'", user="root").stdout == "1\n"
    limit = sb.commands.run(MEMORY_LIMIT, user="root").stdout.strip()
    assert int(limit) == 1024 * 1024 * 1024  # "sm" = 1 cpu, 1024 MB
    info = Sandbox.get_info(sb.sandbox_id)
    assert info.cpu_count == 1 and info.memory_mb == 1024
    assert info.metadata["dsec/image"] == "python"
    # setup imports dsec's images into the local Docker engine as dsec/<name>
    docker = make(metadata={"dsec/image": "dsec/bookworm:latest"})
    assert docker.commands.run("cat /etc/debian_version", user="root").stdout.startswith("12")


def test_a_routed_image_or_size_that_is_not_there_is_refused_naming_it(target: E2bTarget) -> None:
    with pytest.raises(SandboxException) as missing:
        Sandbox.create(metadata={"dsec/image": "no-such-image:v9"})
    assert missing.value.status_code == 404 and "no-such-image:v9" in str(missing.value)
    with pytest.raises(SandboxException) as size:
        Sandbox.create(metadata={"dsec/image": "python", "dsec/size": "huge"})
    assert size.value.status_code == 400 and "'huge'" in str(size.value)

"""File metadata (``user.e2b.*`` extended attributes) and watch events with entries, on the
real chronus engine as a subprocess driven over its framed socket."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronus.errors import ChronusError
from chronus.files import write_metadata
from tests.unit.test_chronus import CallError, ChronusClient, start_chronus, stop_chronus

CREATE, WRITE, REMOVE, RENAME, CHMOD = 1, 2, 3, 4, 5


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronusClient]:
    client, proc = start_chronus(tmp_path_factory.mktemp("metadata"))
    try:
        yield client
    finally:
        stop_chronus(client, proc)


def xattrs(path: Path) -> dict[str, bytes]:
    return {n: os.getxattr(path, n) for n in os.listxattr(path) if n.startswith("user.")}


def test_write_sets_metadata_as_xattrs_and_reports_it(
    client: ChronusClient, tmp_path: Path
) -> None:
    target = tmp_path / "a.txt"
    info = client.one(
        {"write_file": {"path": str(target), "data": b"x", "metadata": {"author": "ann"}}}
    )["info"]
    assert info["metadata"] == {"author": "ann"}
    assert xattrs(target) == {"user.e2b.author": b"ann"}
    assert client.one({"stat_path": {"path": str(target)}})["info"]["metadata"] == {"author": "ann"}
    (entry,) = client.one({"list_dir": {"path": str(tmp_path)}})["entries"]
    assert entry["metadata"] == {"author": "ann"}


def test_a_write_without_metadata_leaves_none_and_append_keeps_it(
    client: ChronusClient, tmp_path: Path
) -> None:
    target = tmp_path / "b.txt"
    client.one({"write_file": {"path": str(target), "data": b"1", "metadata": {"k": "v"}}})
    client.one({"write_file": {"path": str(target), "data": b"2", "append": True}})
    assert xattrs(target) == {"user.e2b.k": b"v"}
    info = client.one({"write_file": {"path": str(target), "data": b"3"}})["info"]
    assert "metadata" not in info and xattrs(target) == {}


def test_upload_sets_metadata_and_a_move_keeps_it(client: ChronusClient, tmp_path: Path) -> None:
    target = tmp_path / "up.bin"
    sid = client.open(
        {"upload_file": {"header": {"path": str(target), "metadata": {"stage": "one"}}}}
    )
    client.send(sid, {"request": {"upload_file": {"chunk": b"data"}}})
    client.send(sid, {"half_close": {}})
    (resp,) = client.responses(sid)
    assert resp["upload_file"]["info"]["metadata"] == {"stage": "one"}
    moved = client.one(
        {"move_path": {"source": str(target), "destination": str(tmp_path / "moved.bin")}}
    )
    assert moved["info"]["metadata"] == {"stage": "one"}


def test_metadata_set_inside_is_seen_and_other_user_xattrs_are_not(
    client: ChronusClient, tmp_path: Path
) -> None:
    target = tmp_path / "c.txt"
    target.write_text("x")
    os.setxattr(target, "user.e2b.author", b"mish")
    os.setxattr(target, "user.other", b"not ours")
    os.setxattr(target, "user.e2b.binary", b"\xff\xfe")  # not UTF-8: left out
    info = client.one({"stat_path": {"path": str(target)}})["info"]
    assert info["metadata"] == {"author": "mish"}


@pytest.mark.parametrize(
    "metadata",
    [
        {"": "v"},
        {"bad\nkey": "v"},
        {"k": "caf\u00e9"},
        {"k": "line\n"},
        {"k" * 247: "v"},
        {f"k{i}": "v" * 100 for i in range(40)},
    ],
)
def test_bad_metadata_is_refused_and_writes_nothing(
    client: ChronusClient, tmp_path: Path, metadata: dict[str, str]
) -> None:
    target = tmp_path / "bad.txt"
    with pytest.raises(CallError) as exc:
        client.call({"write_file": {"path": str(target), "data": b"x", "metadata": metadata}})
    assert (exc.value.code, exc.value.reason) == (3, "INVALID_METADATA")
    sid = client.open({"upload_file": {"header": {"path": str(target), "metadata": metadata}}})
    client.send(sid, {"half_close": {}})
    with pytest.raises(CallError) as exc:
        list(client.responses(sid))
    assert exc.value.reason == "INVALID_METADATA"
    assert list(tmp_path.iterdir()) == []


def test_the_longest_key_is_accepted(client: ChronusClient, tmp_path: Path) -> None:
    key = "k" * 246
    info = client.one(
        {"write_file": {"path": str(tmp_path / "k.txt"), "data": b"", "metadata": {key: "v"}}}
    )["info"]
    assert info["metadata"] == {key: "v"}


def test_a_filesystem_without_user_xattrs_refuses_metadata() -> None:
    # procfs keeps no user extended attributes (a real kernel answer, not a fake)
    fd = os.open("/proc/self/status", os.O_RDONLY)
    try:
        with pytest.raises(ChronusError) as exc:
            write_metadata(fd, "/proc/self/status", {"k": "v"})
        assert exc.value.reason == "XATTR_UNSUPPORTED"
        write_metadata(fd, "/proc/self/status", {})  # nothing asked: nothing to refuse
    finally:
        os.close(fd)


def test_watch_events_carry_the_entry_when_asked(client: ChronusClient, tmp_path: Path) -> None:
    wid = client.one({"create_watcher": {"path": str(tmp_path), "include_entry": True}})[
        "watcher_id"
    ]
    plain = client.one({"create_watcher": {"path": str(tmp_path)}})["watcher_id"]
    client.one(
        {"write_file": {"path": str(tmp_path / "w.txt"), "data": b"1", "metadata": {"a": "b"}}}
    )
    (tmp_path / "gone.txt").write_text("x")
    (tmp_path / "gone.txt").unlink()
    events: list[dict] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(e.get("type") == REMOVE for e in events):
        events += client.one({"watcher_events": {"watcher_id": wid}}).get("events", [])
        time.sleep(0.05)
    write = next(e for e in events if e["name"] == "w.txt" and e["type"] == WRITE)
    assert write["entry"]["path"] == str(tmp_path / "w.txt")
    assert write["entry"]["type"] == 1 and write["entry"]["metadata"] == {"a": "b"}
    # removed before the poll: no entry for its create, none ever for a remove
    assert all("entry" not in e for e in events if e["name"] == "gone.txt")
    assert all(
        "entry" not in e for e in client.one({"watcher_events": {"watcher_id": plain}})["events"]
    )

    for watcher_id in (wid, plain):
        client.one({"remove_watcher": {"watcher_id": watcher_id}})

    sid = client.open({"watch_dir": {"path": str(tmp_path), "include_entry": True}})
    assert "started" in client.next(sid)["response"]["watch_event"]
    (tmp_path / "s.txt").write_text("y")
    msg = client.next(sid)["response"]["watch_event"]
    while "event" not in msg:
        msg = client.next(sid)["response"]["watch_event"]
    assert msg["event"]["name"] == "s.txt"
    assert msg["event"]["entry"]["path"] == str(tmp_path / "s.txt")
    client.send(sid, {"cancel": {}})
    while "end" not in client.next(sid):
        pass


def test_a_network_mount_is_refused_unless_allowed(
    client: ChronusClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chronus import watchers

    assert watchers.fs_type(str(tmp_path)) not in watchers.NETWORK_FS_TYPES  # ext4/tmpfs
    assert watchers.fs_type("/proc") == 0x9FA0  # PROC_SUPER_MAGIC: statfs is read right
    # a local directory is watched with or without the flag
    for allow in (False, True):
        wid = client.one(
            {"create_watcher": {"path": str(tmp_path), "allow_network_mounts": allow}}
        )["watcher_id"]
        client.one({"remove_watcher": {"watcher_id": wid}})
    fuse = [line.split()[4] for line in open("/proc/self/mountinfo") if " - fuse" in line]
    if not fuse:
        pytest.skip("no FUSE mount on this machine to refuse")
    with pytest.raises(CallError) as exc:
        client.call({"create_watcher": {"path": fuse[0]}})
    assert (exc.value.code, exc.value.reason) == (3, "NETWORK_MOUNT")

"""chronus's directory watchers (inotify), the real engine as a subprocess driven over its
framed socket: polled watchers, the WatchDir stream, bounds and typed errors."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_chronus import CallError, ChronusClient, start_chronus, stop_chronus

CREATE, WRITE, REMOVE, RENAME, CHMOD = 1, 2, 3, 4, 5


@pytest.fixture(scope="module")
def chronus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChronusClient, Path]]:
    work = tmp_path_factory.mktemp("watchers")
    client, proc = start_chronus(work)
    try:
        yield client, work
    finally:
        stop_chronus(client, proc)


@pytest.fixture
def client(chronus: tuple[ChronusClient, Path]) -> ChronusClient:
    return chronus[0]


@pytest.fixture
def work(chronus: tuple[ChronusClient, Path], tmp_path: Path) -> Path:
    d = chronus[1] / tmp_path.name
    d.mkdir()
    return d


def poll_until(
    client: ChronusClient, watcher_id: str, want: set[tuple[str, int]], timeout: float = 5.0
) -> list[tuple[str, int]]:
    """Every event polled until all of `want` were seen."""
    seen: list[tuple[str, int]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = client.one({"watcher_events": {"watcher_id": watcher_id}})
        seen += [(e.get("name", ""), e.get("type", 0)) for e in resp.get("events", [])]
        if want <= set(seen):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"wanted {want}, saw {seen}")


def test_polled_watcher_reports_each_kind(client: ChronusClient, work: Path) -> None:
    wid = client.one({"create_watcher": {"path": str(work)}})["watcher_id"]
    (work / "a.txt").write_text("x")
    with open(work / "a.txt", "a") as fh:
        fh.write("more")
    os.chmod(work / "a.txt", 0o600)
    os.rename(work / "a.txt", work / "b.txt")
    (work / "b.txt").unlink()
    seen = poll_until(
        client,
        wid,
        {("a.txt", CREATE), ("a.txt", WRITE), ("a.txt", CHMOD), ("a.txt", RENAME)}
        | {("b.txt", CREATE), ("b.txt", REMOVE)},
    )
    assert seen.index(("a.txt", CREATE)) < seen.index(("b.txt", REMOVE))
    # Drained: the next poll has nothing new.
    assert client.one({"watcher_events": {"watcher_id": wid}}).get("events", []) == []
    client.one({"remove_watcher": {"watcher_id": wid}})
    with pytest.raises(CallError) as exc:
        client.call({"watcher_events": {"watcher_id": wid}})
    assert (exc.value.code, exc.value.reason) == (5, "WATCHER_NOT_FOUND")


def poll_some(
    client: ChronusClient, watcher_id: str, timeout: float = 5.0
) -> list[tuple[str, int]]:
    """The events of the first poll that has any."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = client.one({"watcher_events": {"watcher_id": watcher_id}})
        if resp.get("events"):
            return [(e.get("name", ""), e.get("type", 0)) for e in resp["events"]]
        time.sleep(0.05)
    raise AssertionError("no event")


def upload(client: ChronusClient, path: Path, chunks: list[bytes]) -> None:
    header = {"path": str(path), "size_bytes": sum(map(len, chunks))}
    sid = client.open({"upload_file": {"header": header}})
    for chunk in chunks:
        client.send(sid, {"request": {"upload_file": {"chunk": chunk}}})
    client.send(sid, {"half_close": {}})
    (resp,) = client.responses(sid)
    assert resp["upload_file"]["bytes_written"] == len(b"".join(chunks))


def test_atomic_writes_are_reported_as_envd_reports_its_in_place_writes(
    client: ChronusClient, work: Path
) -> None:
    # E2B's envd opens the target O_CREAT|O_TRUNC, chowns it and writes; chronus renames a
    # temporary into place. A watcher sees the same events from both, each write's together.
    (work / "sub").mkdir()
    wid = client.one({"create_watcher": {"path": str(work), "recursive": True}})["watcher_id"]
    client.one({"write_file": {"path": str(work / "a.txt"), "data": b"first"}})
    assert poll_some(client, wid) == [("a.txt", CREATE), ("a.txt", CHMOD), ("a.txt", WRITE)]
    client.one({"write_file": {"path": str(work / "a.txt"), "data": b"second"}})
    assert poll_some(client, wid) == [("a.txt", CHMOD), ("a.txt", WRITE)]
    client.one({"write_file": {"path": str(work / "sub" / "empty"), "data": b""}})
    assert poll_some(client, wid) == [("sub/empty", CREATE), ("sub/empty", CHMOD)]
    client.one({"write_file": {"path": str(work / "sub" / "empty"), "data": b""}})
    assert poll_some(client, wid) == [("sub/empty", CHMOD), ("sub/empty", WRITE)]
    upload(client, work / "up.bin", [b"ab" * 40000, b"cd" * 40000])  # one WRITE for both chunks
    assert poll_some(client, wid) == [("up.bin", CREATE), ("up.bin", CHMOD), ("up.bin", WRITE)]
    upload(client, work / "up.bin", [b"ef"])
    assert poll_some(client, wid) == [("up.bin", CHMOD), ("up.bin", WRITE)]
    # Still atomic: the contents are whole, and no temporary is left or was ever reported.
    assert (work / "a.txt").read_bytes() == b"second"
    assert (work / "up.bin").read_bytes() == b"ef"
    assert sorted(p.name for p in work.rglob("*")) == ["a.txt", "empty", "sub", "up.bin"]
    # A rename of any other file over one that is there stays a plain CREATE.
    (work / "other").write_text("x")
    os.rename(work / "other", work / "a.txt")
    seen = poll_until(client, wid, {("a.txt", CREATE)})
    assert ("a.txt", CHMOD) not in seen
    client.one({"remove_watcher": {"watcher_id": wid}})


def test_non_recursive_ignores_subdirectories(client: ChronusClient, work: Path) -> None:
    (work / "sub").mkdir()
    wid = client.one({"create_watcher": {"path": str(work)}})["watcher_id"]
    (work / "sub" / "inner.txt").write_text("x")
    (work / "top.txt").write_text("x")
    seen = poll_until(client, wid, {("top.txt", CREATE)})
    assert not any(name.startswith("sub/") for name, _ in seen)
    client.one({"remove_watcher": {"watcher_id": wid}})


def test_recursive_covers_directories_created_later(client: ChronusClient, work: Path) -> None:
    (work / "old").mkdir()
    wid = client.one({"create_watcher": {"path": str(work), "recursive": True}})["watcher_id"]
    (work / "old" / "f.txt").write_text("x")
    (work / "new" / "deep").mkdir(parents=True)
    (work / "new" / "deep" / "g.txt").write_text("x")
    poll_until(
        client,
        wid,
        {("old/f.txt", CREATE), ("new", CREATE), ("new/deep/g.txt", CREATE)},
    )
    client.one({"remove_watcher": {"watcher_id": wid}})


def test_bad_paths_are_typed(client: ChronusClient, work: Path) -> None:
    (work / "file").write_text("x")
    with pytest.raises(CallError) as exc:
        client.call({"create_watcher": {"path": str(work / "missing")}})
    assert (exc.value.code, exc.value.reason) == (5, "PATH_NOT_FOUND")
    with pytest.raises(CallError) as exc:
        client.call({"create_watcher": {"path": str(work / "file")}})
    assert (exc.value.code, exc.value.reason) == (3, "NOT_A_DIRECTORY")
    with pytest.raises(CallError) as exc:
        client.call({"remove_watcher": {"watcher_id": "w-nope"}})
    assert (exc.value.code, exc.value.reason) == (5, "WATCHER_NOT_FOUND")


def test_at_most_64_watchers(client: ChronusClient, work: Path) -> None:
    ids = [client.one({"create_watcher": {"path": str(work)}})["watcher_id"] for _ in range(64)]
    try:
        with pytest.raises(CallError) as exc:
            client.call({"create_watcher": {"path": str(work)}})
        assert (exc.value.code, exc.value.reason) == (8, "TOO_MANY_WATCHERS")
    finally:
        for wid in ids:
            client.one({"remove_watcher": {"watcher_id": wid}})
    # The table has room again, and watchers sharing a directory keep working after removals.
    wid = client.one({"create_watcher": {"path": str(work)}})["watcher_id"]
    (work / "after.txt").write_text("x")
    poll_until(client, wid, {("after.txt", CREATE)})
    client.one({"remove_watcher": {"watcher_id": wid}})


def test_buffer_overflow_is_flagged(client: ChronusClient, work: Path) -> None:
    wid = client.one({"create_watcher": {"path": str(work)}})["watcher_id"]
    for i in range(2100):  # each makes CREATE + WRITE: past the 4096-event buffer
        (work / f"f{i}").write_text("x")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.2)
        resp = client.one({"watcher_events": {"watcher_id": wid}})
        if resp.get("overflowed"):
            break
    assert resp.get("overflowed") and len(resp["events"]) == 4096
    client.one({"remove_watcher": {"watcher_id": wid}})


def stream_until(
    client: ChronusClient, sid: int, pred: Any, timeout: float = 10.0
) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame = client.next(sid, timeout)
        assert "end" not in frame, frame
        got.append(frame["response"]["watch_event"])
        if pred(got):
            return got
    raise AssertionError(got)


def test_watch_dir_streams_started_events_keepalives_and_cancel(
    client: ChronusClient, work: Path
) -> None:
    sid = client.open({"watch_dir": {"path": str(work), "keepalive_interval_ms": 200}})
    first = client.next(sid)["response"]["watch_event"]
    assert first["started"]["path"] == str(work)
    (work / "s.txt").write_text("x")
    got = stream_until(
        client, sid, lambda g: any(m.get("event", {}).get("name") == "s.txt" for m in g)
    )
    assert {"name": "s.txt", "type": CREATE} in [m["event"] for m in got if "event" in m]
    stream_until(client, sid, lambda g: "keepalive" in g[-1])  # idle: keepalives
    assert client.one({"status": {}})  # one watcher is held now ...
    client.send(sid, {"cancel": {}})
    end = client.next(sid)
    while "end" not in end:
        end = client.next(sid)
    assert end["end"]["reason"] == "CANCELLED"
    # ... and cancelling removed it: 64 fresh ones fit.
    ids = [client.one({"create_watcher": {"path": str(work)}})["watcher_id"] for _ in range(64)]
    for wid in ids:
        client.one({"remove_watcher": {"watcher_id": wid}})


def test_watch_dir_ends_when_its_directory_is_removed(client: ChronusClient, work: Path) -> None:
    target = work / "doomed"
    target.mkdir()
    sid = client.open({"watch_dir": {"path": str(target)}})
    assert "started" in client.next(sid)["response"]["watch_event"]
    target.rmdir()
    with pytest.raises(CallError) as exc:
        list(client.responses(sid, timeout=10))
    assert (exc.value.code, exc.value.reason) == (5, "PATH_NOT_FOUND")

"""Images on many nodes: an environment imported once is usable on every node without copying
whole images (each node copies only the layer's metadata image), and a burst onto a node reads
from the shared store only the file data its sandboxes touch."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.multinode.conftest import NODES, MultiNode

pytestmark = [pytest.mark.integration, pytest.mark.images("busybox")]

BIG_MB = 48


def _tree(root: Path) -> str:
    """A workspace: a few small files and one big one the sandboxes do not read (but one)."""
    root.mkdir()
    (root / "task.txt").write_text("fix the bug\n")
    (root / "src").mkdir()
    for i in range(20):
        (root / "src" / f"m{i}.py").write_text(f"X = {i}\n" * 50)
    data = os.urandom(BIG_MB << 20)
    (root / "weights.bin").write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _bytes_under(d: Path) -> int:
    """Bytes allocated on disk (sparse images count what they hold)."""
    return sum(
        p.lstat().st_blocks * 512 for p in d.rglob("*") if p.is_file() and not p.is_symlink()
    )


def test_an_environment_imported_once_runs_on_every_node_reading_only_what_it_touches(
    multinode: MultiNode, tmp_path: Path
) -> None:
    m = multinode
    digest = _tree(tmp_path / "ws")
    with m.client() as c:
        reads = {n: m.fs.client_read_bytes(m.store[n]) for n in NODES}
        env = c.import_image(f"dir:{tmp_path / 'ws'}", "mn-ws:v1", base="busybox")
        try:
            # The import ran on one node (any edge with the store): the burst goes to another,
            # one whose store client moved none of the image's data.
            grew = {n: m.fs.client_read_bytes(m.store[n]) - reads[n] for n in NODES}
            target = min(grew, key=lambda n: grew[n])
            assert grew[target] < (BIG_MB << 20) // 4, grew
            cache = m.state_dir(target) / "container" / "layer-cache"
            local_before = _bytes_under(cache)
            served_before = m.fs.client_read_bytes(m.store[target])
            burst = c.create_many(
                4, image=env.name, memory_mb=64, cpu=0.25, node_selector={"node": target}
            )
            sandboxes = [s for s in burst if not isinstance(s, Exception)]
            try:
                assert len(sandboxes) == 4, burst
                for s in sandboxes:
                    assert s.info.edge_id == target
                    r = s.run("cat /task.txt && wc -l /src/m7.py")
                    assert r.exit_code == 0 and r.stdout.startswith(b"fix the bug\n"), r
                served = m.fs.client_read_bytes(m.store[target]) - served_before
                # Written by the layers (each sandbox's own writable layer and its journal
                # are sandbox state, not image data): the metadata cache.
                written = _bytes_under(cache) - local_before
                # The 48 MiB file was never read: far less than it came from the store, and
                # the node wrote no copy of it (metadata images only).
                assert served < (BIG_MB << 20) // 4, served
                assert written < (BIG_MB << 20) // 4, written
                print(
                    f"burst of 4 on a new node: {served / 1e6:.1f} MB from the store, "
                    f"{written / 1e6:.1f} MB written locally (image {BIG_MB} MiB)"
                )
                # The data is there when read: the whole file, on that node, as imported.
                r = sandboxes[0].run("sha256sum /weights.bin")
                assert r.stdout.split()[0].decode() == digest
                assert m.fs.client_read_bytes(m.store[target]) - served_before >= BIG_MB << 20
            finally:
                for s in sandboxes:
                    s.stop()
            # The same environment on the other nodes, from the same layers.
            for node in sorted(set(NODES) - {target}):
                with c.create(image=env.name, memory_mb=64, node_selector={"node": node}) as s:
                    assert s.info.edge_id == node
                    assert s.run("cat /task.txt").stdout == b"fix the bug\n"
        finally:
            c.delete_environment(env.name)

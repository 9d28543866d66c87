"""``dsec sandbox cp``: one file into or out of a sandbox, streamed."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

from dsecctl.cli_common import client, progress

# ---------------------------------------------------------------------- cp


def _remote(arg: str) -> tuple[str, str] | None:
    """``ID:/path`` -> (ID, /path); a local path (``-``, ``/...``, ``./...``, no colon) ->
    None, as docker cp tells them apart."""
    if arg == "-" or arg.startswith(("/", ".")):
        return None
    sandbox_id, colon, path = arg.partition(":")
    if not colon or not sandbox_id or "/" in sandbox_id:
        return None
    return sandbox_id, path


def cmd_cp(args: argparse.Namespace) -> int:
    src, dst = _remote(args.src), _remote(args.dst)
    if (src is None) == (dst is None):
        print(
            "dsec sandbox cp: exactly one of SRC and DST must be ID:/path (the other local)",
            file=sys.stderr,
        )
        return 2
    with client() as c:
        if dst is not None:
            return _upload(c, args.src, *dst, quiet=args.quiet)
        assert src is not None
        return _download(c, *src, args.dst, quiet=args.quiet)


class _CountingReader:
    """A binary file object whose reads advance a progress bar (read on the SDK's thread)."""

    def __init__(self, fh: IO[bytes], bar: Any) -> None:
        self.fh = fh
        self.bar = bar

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.bar.update(advance=len(data))
        return data


def _upload(c: Any, local: str, sandbox_id: str, path: str, *, quiet: bool) -> int:
    sb = c.get(sandbox_id)
    if local == "-":
        fh, size, mode, name = sys.stdin.buffer, None, 0, ""
    else:
        st = os.stat(local)
        if not os.path.isfile(local):
            print(
                f"dsec sandbox cp: {local} is not a regular file (cp copies one file; for a "
                f"tree: tar c DIR | dsec sandbox exec {sandbox_id} -- tar x -C /dest)",
                file=sys.stderr,
            )
            return 1
        fh, size, mode, name = open(local, "rb"), st.st_size, st.st_mode & 0o7777, Path(local).name
    if path.endswith("/") or (sb.files.exists(path) and sb.files.stat(path).is_dir):
        if not name:
            print("dsec sandbox cp: stdin needs a file name, not a directory", file=sys.stderr)
            return 1
        path = path.rstrip("/") + "/" + name
    with fh, progress(f"{sandbox_id}:{path}", total=size, transfer=True, quiet=quiet) as bar:
        sb.files.upload(_CountingReader(fh, bar), path, mode=mode)
    return 0


def _download(c: Any, sandbox_id: str, path: str, local: str, *, quiet: bool) -> int:
    sb = c.get(sandbox_id)
    info = sb.files.stat(path)
    if info.is_dir:
        print(
            f"dsec sandbox cp: {sandbox_id}:{path} is a directory (cp copies one file; for a "
            f"tree: dsec sandbox exec {sandbox_id} -- tar c -C {path} . | tar x)",
            file=sys.stderr,
        )
        return 1
    with progress(f"{sandbox_id}:{path}", total=info.size, transfer=True, quiet=quiet) as bar:
        if local == "-":
            out = sys.stdout.buffer
            for chunk in sb.files.iter_download(path):
                out.write(chunk)
                bar.update(advance=len(chunk))
            out.flush()
            return 0
        dest = Path(local)
        if local.endswith("/") or dest.is_dir():
            dest = dest / Path(path).name
        part = dest.with_name(dest.name + ".part")
        try:
            with open(part, "wb") as fh:
                for chunk in sb.files.iter_download(path):
                    fh.write(chunk)
                    bar.update(advance=len(chunk))
            os.chmod(part, info.mode & 0o7777)
            os.replace(part, dest)
        finally:
            with suppress(FileNotFoundError):
                part.unlink()
    return 0

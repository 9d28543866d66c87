"""The SDK is typed end to end: a user's program checked with ``mypy --strict`` passes when it
is right and fails, naming the keyword, when it misspells an option of the sync or the async
client (``create`` included).

One mypy run over two small programs in a temp dir, libdsec seen as an installed typed
package (its own modules are not reported on, as for a user: ``follow_imports = silent``,
``ignore_errors``).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """\
[mypy]
strict = True
ignore_missing_imports = True

[mypy-libdsec.*,dsec.*]
follow_imports = silent
ignore_errors = True
warn_unused_ignores = False
"""

GOOD = """\
from pathlib import Path

from libdsec import AsyncClient, Client, Started
from libdsec.options import RunOptions


def sync_program() -> None:
    quick: RunOptions = {"timeout_s": 5, "cwd": "/work", "env": {"A": "1"}}
    with Client() as dsec:
        with dsec.create(image="busybox", cpu=0.5, labels={"stage": "eval"}) as sb:
            r = sb.run("ls", **quick)
            print(r.exit_code + 1, r.text.strip())
            for ev in sb.stream(["sh", "-c", "echo hi"], pty=(24, 80), background=False):
                if isinstance(ev, Started):
                    print(ev.exec_id)
            proc = sb.start("sleep 9", stdin_open=True, labels={"role": "sleeper"})
            print(proc.wait(timeout_s=0.1).running)
            sb.files.write("/work/a.txt", "x", mode=0o644, append=False)
            sb.files.upload(Path("data.tar"), "/work/data.tar", chunk_bytes=1 << 20)
            print(len(sb.files.read("/work/a.txt", offset=0)))
            with sb.session(cwd="/work") as shell:
                shell.run("cd /tmp", timeout_s=5)
            print(sb.http(8000, "/", method="POST", body="{}", wait_s=5).status)
            png: bytes = sb.display.screenshot(timeout=30)
            width, height = sb.display.size()
            sb.display.click(width // 2, height // 2, button="right", double=True)
            sb.display.scroll(-3, dx=1, x=0, y=0)
            sb.display.drag((0, 0), (10, 10), button="left")
            print(len(png), sb.display.type("hi") + sb.display.press("ctrl+l"))
            print(sb.display.viewer_url().startswith("http"))
            sb.stop(grace_s=0.5)
        print([i.id for i in dsec.list(labels={"a": "b"}, states=["running"])])
        print(dsec.fncall(language="python", code="print(1)", time_limit_s=2).verdict)
        dsec.create_token("agent", agent=True, ttl_s=3600)


async def async_program() -> None:
    async with AsyncClient() as dsec:
        sb = await dsec.create(image="busybox", ttl_s=600)
        r = await sb.run("ls", timeout_s=5)
        print(r.exit_code)
        await sb.files.write("/work/a.txt", "x", mode=0o644)
        shot: bytes = await sb.display.screenshot()
        w, h = await sb.display.size(timeout=5)
        await sb.display.move(w - 1, h - 1)
        await sb.display.mouse_down("left")
        await sb.display.mouse_up(button="left")
        print(len(shot), await sb.display.viewer_url())
        async with await sb.session() as shell:
            await shell.run("pwd", cwd="/")
        print(await dsec.list(labels={"a": "b"}))
"""

#: Each misspelt keyword and the line it is on in BAD.
BAD = """\
from libdsec import AsyncClient, Client


def sync_program() -> None:
    with Client() as dsec:
        sb = dsec.create(image="busybox", memroy_mb=512)
        sb.run("ls", timout=5)
        sb.files.write("/work/a.txt", "x", mod=0o644)
        dsec.list(lable={"a": "b"})
        sb.session(shel="bash").run("ls", sesion="x")
        sb.start("sleep 1", stdinopen=True)
        sb.files.remove("/work", recursve=True)
        dsec.fncall(langauge="python", code="print(1)")


async def async_program() -> None:
    async with AsyncClient() as dsec:
        sb = await dsec.create(image="busybox")
        await sb.run("ls", timout=5)
        await sb.files.write("/work/a.txt", "x", mod=0o644)
        await dsec.list(lable={"a": "b"})
        await sb.display.click(1, 2, doubel=True)
"""
MISSPELT = {
    6: ["memroy_mb"],
    7: ["timout"],
    8: ["mod"],
    9: ["lable"],
    10: ["shel", "sesion"],
    11: ["stdinopen"],
    12: ["recursve"],
    13: ["langauge"],
    19: ["timout"],
    20: ["mod"],
    21: ["lable"],
    22: ["doubel"],
}


def test_mypy_strict_checks_every_keyword_of_both_clients(tmp_path: Path) -> None:
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "mypy.ini").write_text(CONFIG)
    env = {**os.environ, "MYPYPATH": str(ROOT)}  # this tree's libdsec, not an installed one
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "mypy.ini",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            "good.py",
            "bad.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert not [e for e in errors if not e.startswith("bad.py:")], out
    found: dict[int, list[str]] = {}
    for line in errors:
        m = re.match(r'bad\.py:(\d+): error: Unexpected keyword argument "(\w+)"', line)
        assert m, f"an error that is not a misspelt keyword: {line}\n{out}"
        found.setdefault(int(m.group(1)), []).append(m.group(2))
    assert {n: sorted(k) for n, k in found.items()} == {
        n: sorted(k) for n, k in MISSPELT.items()
    }, out
    assert proc.returncode == 1


def _keywords(method: Callable[..., Any]) -> dict[str, Any]:
    """The keywords ``method`` takes (name -> type): its keyword-only parameters, and the keys
    of the TypedDict its ``**options: Unpack[TD]`` names, if any."""
    out: dict[str, Any] = {}
    for p in inspect.signature(method, eval_str=True).parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            out[p.name] = p.annotation
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            args = getattr(p.annotation, "__args__", ())
            assert args, f"{method.__qualname__}: **{p.name} is not Unpack[<TypedDict>]"
            out.update(typing.get_type_hints(args[0]))
    return out


def _pairs() -> list[tuple[str, Callable[..., Any], Callable[..., Any]]]:
    from libdsec import aio, sync

    pairs = [
        (sync.Client, aio.AsyncClient),
        (sync.Sandbox, aio.AsyncSandbox),
        (sync.Files, aio.AsyncFiles),
        (sync.Display, aio.AsyncDisplay),
        (sync.Process, aio.AsyncProcess),
        (sync.Session, aio.AsyncSession),
    ]
    out = []
    for s, a in pairs:
        for name, method in vars(s).items():
            if not name.startswith("_") and callable(method) and hasattr(a, name):
                out.append((f"{s.__name__}.{name}", method, getattr(a, name)))
    return out


@pytest.mark.parametrize(
    ("name", "sync_method", "async_method"), [pytest.param(*p, id=p[0]) for p in _pairs()]
)
def test_the_sync_method_takes_the_async_ones_keywords(
    name: str, sync_method: Callable[..., Any], async_method: Callable[..., Any]
) -> None:
    """A sync method takes the same keywords, of the same types, as its async twin: spelt
    out, or as the TypedDict it unpacks (``**options: Unpack[...]``)."""
    assert _keywords(sync_method) == _keywords(async_method), name

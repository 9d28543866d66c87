"""The `dsec` command line without a cluster: every argument of every command has help text,
`sandbox exec` splits its own options from the command at `--`, `cp` tells sandbox paths from
local ones as docker does."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from dsecctl.main import build_parser
from dsecctl.sandbox_exec import _split_command
from dsecctl.sandbox_files import _remote


def _walk(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")
        else:
            yield path, action


def test_every_argument_of_every_command_has_help() -> None:
    seen = list(_walk(build_parser(), "dsec"))
    missing = [
        f"{path}: {'/'.join(a.option_strings) or a.dest}"
        for path, a in seen
        if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()
    ]
    assert not missing, "arguments without help text:\n" + "\n".join(missing)
    assert len({path for path, _ in seen}) > 40  # the walk reached the nested commands


def test_every_command_has_help_in_its_parent_listing() -> None:
    def commands(parser: argparse.ArgumentParser, path: str) -> Iterator[str]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {c.dest for c in action._choices_actions if c.help}
                for name, sub in action.choices.items():
                    if name not in helped:
                        yield f"{path} {name}"
                    yield from commands(sub, f"{path} {name}")

    assert list(commands(build_parser(), "dsec")) == []


@pytest.mark.parametrize(
    "command",
    [
        "sandbox",
        "project",
        "token",
        "env",
        "fncall",
        "task",
    ],
)
def test_every_command_that_prints_data_takes_json(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    top = sub.choices[command]
    leaves = [top]
    for a in top._actions:
        if isinstance(a, argparse._SubParsersAction):
            leaves = list(a.choices.values())
    # These print no data of their own: a command's output, a terminal, a file, a message.
    silent = {"exec", "shell", "cp", "rm", "delete", "screenshot"}
    for leaf in leaves:
        name = leaf.prog.split()[-1]
        if name in silent:
            continue
        assert any("--json" in a.option_strings for a in leaf._actions), leaf.prog


def test_whoami_and_status_take_json() -> None:
    for argv in (["whoami", "--json"], ["status", "--json"]):
        assert build_parser().parse_args(argv).json is True


@pytest.mark.parametrize(
    ("argv", "command", "cwd", "env", "interactive"),
    [
        (["--", "sh", "-c", "exit 7"], ["sh", "-c", "exit 7"], "", [], False),
        (["ls", "-la"], ["ls", "-la"], "", [], False),
        (
            ["--cwd", "/tmp", "--env", "A=1", "-i", "--", "cat", "--", "x"],
            ["cat", "--", "x"],
            "/tmp",
            [("A", "1")],
            True,
        ),
    ],
)
def test_exec_options_after_the_id_end_at_the_double_dash(
    argv: list[str],
    command: list[str],
    cwd: str,
    env: list[tuple[str, str]],
    interactive: bool,
) -> None:
    args = build_parser().parse_args(["sandbox", "exec", "sb-x", *argv])
    assert _split_command(args) == command
    assert (args.cwd, args.env, args.interactive) == (cwd, env, interactive)


def test_exec_options_before_the_id_are_kept() -> None:
    args = build_parser().parse_args(
        ["sandbox", "exec", "--env", "A=1", "sb-x", "--env", "B=2", "--", "env"]
    )
    assert _split_command(args) == ["env"]
    assert args.env == [("A", "1"), ("B", "2")]


@pytest.mark.parametrize(
    ("arg", "remote"),
    [
        ("sb-edge0-1:/work/a.txt", ("sb-edge0-1", "/work/a.txt")),
        ("sb-edge0-1:", ("sb-edge0-1", "")),
        ("-", None),
        ("/tmp/a:b", None),
        ("./a:b", None),
        ("dir/a:b", None),
        ("plain.txt", None),
    ],
)
def test_cp_tells_sandbox_paths_from_local_ones(arg: str, remote: tuple[str, str] | None) -> None:
    assert _remote(arg) == remote


def test_a_screenshot_is_not_written_onto_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    args = build_parser().parse_args(["sandbox", "screenshot", "sb-x"])
    assert args.output == ""
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert args.fn(args) == 2  # refused before any call: no cluster needed
    err = capsys.readouterr().err
    assert "> shot.png" in err and "-o FILE" in err
    view = build_parser().parse_args(["sandbox", "view", "sb-x"])
    assert view.sandbox_id == "sb-x" and callable(view.fn)

"""chronus's sudo service (chronus/sudo.py) on its own: the environment sudo's env_reset gives,
sudo's quoting for -i/-s, and the wire (a length with three descriptors, then the fields),
including requests that are not well formed, which are dropped without stopping the service.
End to end, in containers, with dsec-sudo: tests/integration/test_sudo.py."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronus.landlock import Sandboxing
from chronus.sudo import SECURE_PATH, SudoService, _environment, _escape
from chronus.users import User


def test_env_reset_keeps_the_terminal_and_locale_and_sets_the_target() -> None:
    caller_env = {"TERM": "xterm", "LC_ALL": "C", "FOO": "1", "LD_PRELOAD": "x", "PATH": "/p"}
    root = User("root", 0, 0, "/root", [0], "/bin/bash")
    user = User("user", 1000, 1000, "/home/user", [1000], "/bin/bash")
    env = _environment(caller_env, root, user, "", "", ["id", "-u"])
    assert env == {
        "TERM": "xterm",
        "LC_ALL": "C",
        "HOME": "/root",
        "SHELL": "/bin/bash",
        "USER": "root",
        "LOGNAME": "root",
        "MAIL": "/var/mail/root",
        "PATH": SECURE_PATH,
        "SUDO_USER": "user",
        "SUDO_UID": "1000",
        "SUDO_GID": "1000",
        "SUDO_COMMAND": "id -u",
    }
    kept = _environment(caller_env, root, user, "E", "", ["id"])
    assert kept["FOO"] == "1" and "LD_PRELOAD" not in kept and kept["PATH"] == SECURE_PATH
    named = _environment(caller_env, root, user, "", "FOO,LD_PRELOAD", ["id"])
    assert named["FOO"] == "1" and "LD_PRELOAD" not in named


def test_a_command_for_a_shell_is_quoted_as_sudo_quotes_it() -> None:
    assert _escape("a b") == "a\\ b"
    assert _escape("$HOME") == "$HOME"  # expanded by the target's shell, as with sudo -i
    assert _escape("x;rm") == "x\\;rm"


def _request(*fields: str) -> bytes:
    return b"".join(f.encode() + b"\0" for f in fields)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "sudo.sock")
    SudoService(["root"], Sandboxing("off"), path=path).start()
    yield path


def _call(path: str, body: bytes, fds: list[int] | None) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(path)
        head = struct.pack("<I", len(body))
        if fds is None:
            s.sendall(head)
        else:
            socket.send_fds(s, [head], fds)
        reply = b""
        try:
            s.sendall(body)
            while chunk := s.recv(64):
                reply += chunk
        except (ConnectionResetError, BrokenPipeError):  # refused at its length, body unread
            pass
        return reply


def test_the_wire_runs_a_command_on_the_callers_stdio(service: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with open(out, "wb") as fh, open(os.devnull, "rb") as null:
        fds = [null.fileno(), fh.fileno(), fh.fileno()]
        body = _request("dsec-sudo/1", "root", "", "", "/", "", "1", "true", "0", "0")
        assert _call(service, body, fds) == b"X 0 0\n"
        body = _request(
            "dsec-sudo/1", "root", "", "", str(tmp_path), "", "3", "sh", "-c", "pwd; exit 3",
            "1", "A=1", "0",
        )  # fmt: skip
        assert _call(service, body, fds) == b"X 3 0\n"
        body = _request("dsec-sudo/1", "nobody-here", "", "", "/", "", "1", "true", "0", "0")
        assert _call(service, body, fds) == b"X 1 0\n"
    assert out.read_text() == f"{tmp_path}\nsudo: unknown user nobody-here\n"


@pytest.mark.parametrize(
    ("body", "with_fds"),
    [
        (_request("dsec-sudo/2", "root", "", "", "/", "", "1", "true", "0", "0"), True),
        (_request("dsec-sudo/1", "root", "", "", "/", "", "5", "true", "0", "0"), True),
        (_request("dsec-sudo/1", "root", "", "", "/", "", "1", "true", "0", "0"), False),
        (b"dsec-sudo/1\0root", True),
    ],
    ids=["version", "count", "no-descriptors", "unterminated"],
)
def test_a_malformed_request_is_dropped_and_the_service_goes_on(
    service: str, body: bytes, with_fds: bool
) -> None:
    with open(os.devnull, "r+b") as null:
        fds = [null.fileno()] * 3 if with_fds else None
        assert _call(service, body, fds) == b""  # no answer: dsec-sudo says it went away
        good = _request("dsec-sudo/1", "root", "", "", "/", "", "1", "true", "0", "0")
        assert _call(service, good, [null.fileno()] * 3) == b"X 0 0\n"

"""sudo in container sandboxes (SandboxSpec.sudo_users; chronus/sudo.py, chronus/sudo.c).

Commands run with no_new_privs, so the image's setuid sudo cannot raise privileges; dsec's
sudo asks the sandbox's chronus instead. Through the SDK, in real containers: who may, what
the command gets (user, environment, stdio, exit status, signals), that it stays confined and
ends with its caller, and what a sandbox without sudo users or without a sudo says.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from libdsec import Sandbox
from tests.helpers import wait_for

pytestmark = pytest.mark.images("e2b-base", "bookworm")

# The processes of the sandbox whose command line is exactly this (no procps needed).
COUNT = (
    "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^{} $'"
)


@pytest.fixture
def sudoer(make_sandbox: Callable[..., Sandbox]) -> Sandbox:
    return make_sandbox(image="e2b-base", sudo_users=["user"], memory_mb=256)


def test_a_sudo_user_runs_commands_as_root_or_anyone(sudoer: Sandbox) -> None:
    r = sudoer.run("id -un; sudo id -un; sudo -n -u nobody id -un; sudo -i pwd", user="user")
    assert r.ok and r.text == "user\nroot\nnobody\n/root\n", r.stderr
    # stdio is the caller's, the exit status the command's
    r = sudoer.run("echo secret | sudo tee /root/f >/dev/null; sudo cat /root/f", user="user")
    assert r.text == "secret\n", r.stderr
    assert sudoer.run("sudo sh -c 'exit 7'", user="user").exit_code == 7
    r = sudoer.run("sudo no-such-program", user="user")
    assert r.exit_code == 1 and b"no-such-program: command not found" in r.stderr
    # root may too
    assert sudoer.run("sudo -u user id -un").text == "user\n"


def test_sudo_resets_the_environment_as_sudo_does(sudoer: Sandbox) -> None:
    show = "sudo {} sh -c 'echo [$FOO] [$LD_PRELOAD] $HOME $USER $SUDO_USER $SUDO_UID $PATH'"
    env = {"FOO": "bar", "LD_PRELOAD": "/nonexistent.so"}
    secure = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    r = sudoer.run(show.format(""), user="user", env=env)
    assert r.text == f"[] [] /root root user 1000 {secure}\n", r.stderr
    # -E keeps the caller's variables, never the loader's; so does --preserve-env=NAME
    assert sudoer.run(show.format("-E"), user="user", env=env).text.startswith("[bar] [] ")
    r = sudoer.run(show.format("--preserve-env=FOO"), user="user", env=env)
    assert r.text.startswith("[bar] [] ")
    # VAR=value words before the command are set
    assert sudoer.run(show.format("FOO=set"), user="user").text.startswith("[set] ")


def test_only_the_listed_accounts_may_sudo(sudoer: Sandbox) -> None:
    r = sudoer.run("sudo id -un", user="nobody")
    assert r.exit_code == 1 and r.stdout == b""
    assert b"nobody is not in the sudoers file" in r.stderr
    # an account added later counts once it is listed: `user2` is not
    assert sudoer.run("useradd -m user2", user="root").ok
    assert sudoer.run("sudo true", user="user2").exit_code == 1


def test_a_sudo_command_stays_confined_and_ends_with_its_caller(sudoer: Sandbox) -> None:
    # confined like any command: no signal to aether (pid 1) or chronus, root or not
    r = sudoer.run("sudo kill -9 1", user="user")
    assert r.exit_code == 1 and b"Operation not permitted" in r.stderr
    # the signals sudo relays reach the command
    r = sudoer.run(
        "sudo sh -c 'trap \"echo got TERM; exit 5\" TERM; while :; do sleep 0.1; done' & pid=$!;"
        " sleep 1; kill -TERM $pid; wait $pid; echo rc=$?",
        user="user",
        timeout_s=30,
    )
    assert r.text == "got TERM\nrc=5\n", r.stderr
    # a caller killed at its timeout takes its sudo command with it
    r = sudoer.run("sudo sleep 321", user="user", timeout_s=2)
    assert r.timed_out
    wait_for(lambda: sudoer.run(COUNT.format("sleep 321")).text == "0\n", timeout_s=10)


def test_without_sudo_users_sudo_says_it_is_not_enabled(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox(image="e2b-base", memory_mb=256)
    r = sb.run("sudo id", user="user")
    assert r.exit_code == 1
    assert b"sudo is not enabled in this sandbox" in r.stderr, r.stderr


def test_an_image_without_sudo_has_dsec_sudo_in_the_toolkit(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox(image="bookworm", sudo_users=["nobody"], memory_mb=256)
    # no /usr/bin/sudo is made in the image's files
    assert sb.run("test -e /usr/bin/sudo").exit_code == 1
    r = sb.run("/.dsec/bin/dsec-sudo id -un", user="nobody")
    assert r.ok and r.text == "root\n", r.stderr

"""Container fork end to end (issue 37, item 3): SDK -> apiserver -> edge -> the container
backend's files fork.

A container child gets the source's files (new, modified, deleted ones, /tmp too) and its
sessions' cwd and exported environment under the same session ids, not its processes
(``kind == "files"``); a caller that needs the memory says so and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from libdsec import Sandbox
from libdsec.errors import DSecError, FailedPrecondition

pytestmark = pytest.mark.images("busybox", "bookworm")

#: In the source before the fork: a new file, a file of the image modified, one deleted (a
#: whiteout in the writable layer), scratch space.
WRITES = (
    "echo new > /root/new.txt && echo agent-was-here >> /etc/issue"
    " && rm /etc/debian_version && mkdir -p /tmp/scratch && echo s > /tmp/scratch/s"
)
CHECK = (
    "cat /root/new.txt; tail -n1 /etc/issue;"
    " test -e /etc/debian_version && echo present || echo deleted; cat /tmp/scratch/s"
)
EXPECTED = "new\nagent-was-here\ndeleted\ns\n"


@pytest.fixture
def children() -> Iterator[list[Sandbox]]:
    """Fork children to stop at the end, also when the test failed."""
    made: list[Sandbox] = []
    yield made
    for sb in made:
        try:
            sb.stop(grace_s=0.2)
        except DSecError:
            pass  # already gone


def test_fork_4_ways_copies_files_and_sessions_and_leaves_the_source_running(
    make_sandbox: Callable[..., Sandbox], children: list[Sandbox]
) -> None:
    src = make_sandbox(image="bookworm", memory_mb=256)
    assert src.run(WRITES).ok
    session = src.session()
    assert session.run("mkdir -p /work/here && cd /work/here && export STEP=41").ok

    result = src.fork(4)
    children.extend(result.sandboxes)
    assert result.kind == "files"
    assert result.errors == [] and len(result.sandboxes) == 4
    assert 0 < result.stall_s < 5  # frozen for the copy of its writable layer only

    for child in result.sandboxes:
        assert child.id != src.id and child.info.state == "RUNNING"
        assert child.run(CHECK).text == EXPECTED
        # the source's session, by its id, with its cwd and exported environment
        assert child.run('pwd; echo "$STEP"', session=session.session_id).text == (
            "/work/here\n41\n"
        )
    # each child's changes are its own
    first, *siblings = result.sandboxes
    assert first.run("echo mine > /root/after-fork.txt && rm /root/new.txt").ok
    for other in (*siblings, src):
        assert not other.files.exists("/root/after-fork.txt")
        assert other.files.read("/root/new.txt") == b"new\n"
    # the source ran on, its files and session as they were
    assert src.refresh().state == "RUNNING"
    assert src.run(CHECK).text == EXPECTED
    assert session.run('pwd; echo "$STEP"').text == "/work/here\n41\n"


def test_fork_of_a_paused_container_leaves_it_paused(
    make_sandbox: Callable[..., Sandbox], children: list[Sandbox]
) -> None:
    src = make_sandbox(image="bookworm", memory_mb=256)
    assert src.run("echo before-pause > /root/state.txt").ok
    session = src.session()
    assert session.run("cd /root && export PHASE=paused").ok
    src.pause()

    result = src.fork(2)
    children.extend(result.sandboxes)
    assert result.kind == "files" and result.errors == [] and len(result.sandboxes) == 2
    assert src.refresh().state == "PAUSED"  # (any call to it would resume it: none is made)
    for child in result.sandboxes:
        assert child.files.read("/root/state.txt") == b"before-pause\n"
        # The session's cwd; not what it exported (a pause runs no command in a session).
        r = child.run('pwd; echo "[$PHASE]"', session=session.session_id)
        assert r.text == "/root\n[]\n"
    assert src.refresh().state == "PAUSED"
    # The pause left the session's last status as it was (no command ran in it).
    assert session.run("echo $?").text == "0\n"


def test_a_files_fork_is_refused_to_a_caller_that_needs_the_memory(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    src = make_sandbox(image="busybox")
    with pytest.raises(FailedPrecondition) as exc:
        src.fork(2, require_memory=True)
    assert exc.value.reason == "FORK_MEMORY_UNAVAILABLE"
    assert src.refresh().state == "RUNNING"

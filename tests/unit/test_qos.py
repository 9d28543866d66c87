"""CPU QoS pieces (edge/backends/qos.py) on this host: the core scheduling probe's verdict and
SCHED_IDLE over every thread of a running process (what a claimed warm microVM's QEMU gets)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge.backends import qos

#: Field 41 of /proc/<pid>/task/<tid>/stat: 0 SCHED_OTHER, 5 SCHED_IDLE.
SCHED_IDLE = 5


def _policies(pid: int) -> dict[int, int]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out[int(tid)] = int(stat[stat.rindex(")") + 2 :].split()[38])
    return out


def test_core_scheduling_is_absent_on_this_kernel_and_says_why() -> None:
    # This machine kind's kernel is built without CONFIG_SCHED_CORE (DESIGN.md §8): the
    # prctl answers EINVAL, and the verdict names it for `dsec status`.
    verdict = qos.core_scheduling()
    assert verdict.available is False
    assert "CONFIG_SCHED_CORE" in verdict.detail and "EINVAL" in verdict.detail
    assert qos.core_scheduling() is verdict  # probed once
    with pytest.raises(OSError) as info:
        qos.new_core_cookie(os.getpid())
    assert info.value.errno == errno.EINVAL


def test_every_thread_of_a_running_process_is_set_to_sched_idle() -> None:
    # A process with threads (started before the change) and one started after it: the later
    # one inherits the policy from the thread that creates it.
    script = (
        "import sys, threading\n"
        "ev = threading.Event()\n"
        "ts = [threading.Thread(target=ev.wait) for _ in range(4)]\n"
        "[t.start() for t in ts]\n"
        "print('up', flush=True)\n"
        "sys.stdin.readline()\n"
        "threading.Thread(target=ev.wait).start()\n"
        "print('more', flush=True)\n"
        "sys.stdin.readline()\n"
        "ev.set()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "up\n"
        before = _policies(proc.pid)
        assert len(before) == 5 and set(before.values()) == {0}
        qos.set_idle_all_threads(proc.pid)
        assert set(_policies(proc.pid).values()) == {SCHED_IDLE}
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "more\n"
        after = _policies(proc.pid)
        assert len(after) == 6 and set(after.values()) == {SCHED_IDLE}
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ProcessLookupError):
        qos.set_idle_all_threads(proc.pid)

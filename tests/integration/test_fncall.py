"""FnCall end to end: SDK -> apiserver -> placement -> edge -> warm pool containers (runc).

Every container is real (runc on overlay over EROFS, cgroups, seccomp), every job runs in one.
Hostile programs (fork bombs, infinite loops, memory bombs, output floods, a program that
closes stdout and keeps running) each get the right verdict within their limits, and the pool
serves the next job normally.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dsec.edge.v1 import edge_pb2, edge_pb2_grpc
from dsecctl.cluster import LocalCluster
from libdsec import AsyncClient, Client, CompileInfo, FunctionJob
from libdsec.errors import DeadlineExceeded, InvalidArgument, Unauthenticated
from tests.helpers import dsec_status
from tests.integration.conftest import ClusterWith, container_edge

pytestmark = pytest.mark.images("bookworm", "python")
JOBS_PER_CONTAINER = 40


@pytest.fixture(scope="module")
def fncall_cluster(cluster_with: ClusterWith) -> Iterator[LocalCluster]:
    """A cluster of the module's own: an edge with FnCall pools (tests read their figures)."""
    env = {
        "DSEC_EDGE_FNCALL_POOLS": "python=2,cpp=1,bash=1",
        "DSEC_EDGE_FNCALL_JOBS_PER_CONTAINER": str(JOBS_PER_CONTAINER),
    }
    with cluster_with("fn0", edge_env=env) as c:
        with Client(c.apiserver, token=c.token) as client:
            r = client.fncall(language="python", code="print('warm')")  # waits for the pool
            assert r.ok, r
        yield c
    left = subprocess.run(["mount"], capture_output=True, text=True).stdout
    assert str(c.home) not in left, "mounts left behind"


@pytest.fixture
def dsec(fncall_cluster: LocalCluster) -> Iterator[Client]:
    with Client(fncall_cluster.apiserver, token=fncall_cluster.token) as c:
        yield c


def healthy(dsec: Client, language: str = "bash", n: int = 2) -> None:
    """The pool answers normally again (n jobs in a row)."""
    code = {"bash": "echo ok", "python": "print('ok')", "cpp": CPP_OK}[language]
    for _ in range(n):
        r = dsec.fncall(language=language, code=code)
        assert r.verdict == "OK" and r.text == "ok\n", r


CPP_OK = '#include <cstdio>\nint main(){ puts("ok"); }\n'


# ------------------------------------------------------------------ the three environments


def test_python_runs_warm_with_numpy_already_imported(dsec: Client) -> None:
    r = dsec.fncall(
        language="python",
        code=(
            "import sys\n"
            "print('numpy' in sys.modules)\n"  # before any import of ours: the pool's
            "import numpy as np\n"
            "print(int(np.arange(10).sum()), input()[::-1])\n"
        ),
        stdin="abc\n",
        time_limit_s=5,
        memory_mb=256,
    )
    assert r.verdict == "OK", r
    assert r.text == "True\n45 cba\n"
    assert r.exit_code == 0 and r.signal == 0
    assert 0 < r.wall_time_s < 1 and 0 < r.cpu_time_s < 1
    assert 1 << 20 < r.peak_memory_bytes < 256 << 20
    assert r.edge_id == "fn0"
    # A warm job is fast: no interpreter start, no numpy import.
    t = time.perf_counter()
    dsec.fncall(language="python", code="import numpy; print(1)")
    assert time.perf_counter() - t < 0.5


def test_python_jobs_get_a_fresh_random_state(dsec: Client) -> None:
    # Forked from one parent, yet never the same sequence: numpy's global RNG (its state is
    # rewritten by the runner before each fork) and the standard library's (reseeded by
    # CPython after a fork), each on its own.
    code = "import numpy, random; print(numpy.random.randint(1 << 30), random.random())"
    outs = [dsec.fncall(language="python", code=code).text.split() for _ in range(6)]
    assert len({o[0] for o in outs}) == 6, outs
    assert len({o[1] for o in outs}) == 6, outs
    # Gaussian draws and the state API work on the new state like on any other ...
    r = dsec.fncall(
        language="python",
        code="import numpy as np\n"
        "s = np.random.get_state()\n"
        "assert s[0] == 'MT19937' and len(s[1]) == 624 and s[2] == 624, s[2]\n"
        "a = np.random.normal(size=3)\n"
        "np.random.set_state(s)\n"
        "assert (np.random.normal(size=3) == a).all()\n"
        "print('ok')\n",
    )
    assert r.text == "ok\n", r
    # ... and a job that seeds gets numpy's documented sequence for that seed.
    seeded = "import numpy as np; np.random.seed(42); print(np.random.randint(1 << 30, size=3))"
    fresh = dsec.fncall(command=["python3", "-c", seeded], environment="python")
    assert fresh.verdict == "OK" and len(fresh.text.split()) == 3, fresh
    assert dsec.fncall(language="python", code=seeded).text == fresh.text


def test_python_jobs_start_like_python3(dsec: Client) -> None:
    """What the runner prepared once for all jobs (stdio objects, no exit handlers, the abort
    signal's default disposition, the OOM score) is each job's as in a fresh python3 (run in
    the same environment, same run), and the job's own exit handlers and buffered output
    still run and arrive."""
    code = (
        "import atexit, os, signal, sys\n"
        "print(sys.stdout is sys.__stdout__, sys.stdin is sys.__stdin__, sys.stdout.fileno())\n"
        "print(sys.stderr.line_buffering, sys.stderr.errors, sys.stdout.encoding)\n"
        "print(atexit._ncallbacks(), signal.getsignal(signal.SIGUSR1), os.getuid())\n"
        "print(open('/proc/self/oom_score_adj').read().strip(), repr(sys.stdin.read()))\n"
        "atexit.register(lambda: print('bye'))\n"
        "sys.stdout.write('unflushed')\n"
    )
    warm = dsec.fncall(language="python", code=code, stdin="in")
    fresh = dsec.fncall(command=["python3", "-c", code], environment="python", stdin="in")
    assert warm.verdict == fresh.verdict == "OK", (warm, fresh)
    assert warm.text == fresh.text, (warm.text, fresh.text)
    assert warm.text.endswith("1000 'in'\nunflushedbye\n"), warm.text


THREADS_AND_FORK = """
import os, sys, threading
from concurrent.futures import ThreadPoolExecutor
assert threading.enumerate() == [threading.main_thread()], threading.enumerate()
with ThreadPoolExecutor(4) as pool:
    print(sum(pool.map(lambda x: x * x, range(10))))
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()
sys.stdout.flush()
pid = os.fork()  # while another thread runs: the child must get threading's own fix-up
if pid == 0:
    seen = threading.enumerate()  # only this thread: the fork's fix-up forgot the other
    ok = seen == [threading.main_thread()] and threading.current_thread() is seen[0]
    th = threading.Thread(target=print, args=("child thread",))
    th.start()
    th.join()
    sys.stdout.flush()
    os._exit(0 if ok else 3)
stop.set()
t.join()
print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_python_jobs_use_threads_and_fork_like_python3(dsec: Client) -> None:
    for _ in range(3):  # spares of one batch and the next
        r = dsec.fncall(language="python", code=THREADS_AND_FORK)
        assert r.verdict == "OK" and r.text == "285\nchild thread\nchild 0\n", r


def test_python_errors_and_exit_codes(dsec: Client) -> None:
    r = dsec.fncall(
        language="python", code="import sys\nprint('partial')\nraise ValueError('boom')"
    )
    assert r.verdict == "RUNTIME_ERROR" and r.exit_code == 1
    assert r.stdout == b"partial\n"
    assert b'File "/job/main.py", line 3' in r.stderr and b"ValueError: boom" in r.stderr
    assert b"runner" not in r.stderr  # the traceback starts at the job's code
    r = dsec.fncall(language="python", code="import sys; sys.exit(7)")
    assert r.verdict == "RUNTIME_ERROR" and r.exit_code == 7 and r.message == "exit code 7"
    r = dsec.fncall(language="python", code="def f(:\n")
    assert r.verdict == "RUNTIME_ERROR" and b"SyntaxError" in r.stderr


def test_cpp_compiles_and_runs_with_files(dsec: Client) -> None:
    r = dsec.fncall(
        language="cpp",
        code='#include <cstdio>\n#include "add.h"\nint main(){long a,b; scanf("%ld %ld",&a,&b);'
        ' printf("%ld\\n", add(a,b)); }\n',
        files={"add.h": "long add(long a, long b) { return a + b; }\n"},
        stdin="40 2",
    )
    assert r.verdict == "OK" and r.text == "42\n", r
    r = dsec.fncall(language="c", code='#include <stdio.h>\nint main(void){ puts("c"); return 3; }')
    assert r.verdict == "RUNTIME_ERROR" and r.exit_code == 3 and r.text == "c\n"


def test_cpp_compile_error(dsec: Client) -> None:
    bad = "int main() { this is not c++ }"
    r = dsec.fncall(language="cpp", code=bad, fetch_files=["main.cpp"])
    assert r.verdict == "COMPILE_ERROR"
    assert "error" in r.compile_output and "main.cpp" in r.compile_output
    assert r.stdout == b""
    assert r.compile is not None and r.compile.verdict == "COMPILE_ERROR", r.compile
    assert r.compile.exit_code > 0 and not r.compile.cached and r.compile.wall_time_s > 0
    assert r.files == {} and r.fetch_errors == {}  # nothing ran
    # The compiler's verdict on a source does not change: the cache answers the next time.
    again = dsec.fncall(language="cpp", code=bad)
    assert again.verdict == "COMPILE_ERROR" and again.compile_output == r.compile_output
    assert again.compile is not None and again.compile.cached
    assert again.compile.exit_code == r.compile.exit_code


def test_a_compile_timeout_is_told_apart_and_not_cached(dsec: Client) -> None:
    """A compile step out of its time (compile_time_limit_s) is a COMPILE_ERROR whose compile
    verdict says TIME_LIMIT; it is not remembered: the same source with the default limit
    compiles and runs, and from then on the cache answers, whatever the limit asked."""
    src = (
        "#include <iostream>\n#include <map>\n#include <regex>\n"
        "int main(){ std::map<int, int> m{{1, 2}}; std::cout << m[1] << std::endl; }\n"
        "// compile limits\n"
    )
    r = dsec.fncall(language="cpp", code=src, compile_time_limit_s=0.01)
    assert r.verdict == "COMPILE_ERROR", r
    assert r.compile is not None and r.compile.verdict == "TIME_LIMIT", r.compile
    assert r.compile.exit_code == -1 and not r.compile.cached
    assert "0.01 s" in r.message, r.message
    ok = dsec.fncall(language="cpp", code=src)
    assert ok.verdict == "OK" and ok.text == "2\n", ok
    assert ok.compile is not None and ok.compile.verdict == "OK" and not ok.compile.cached
    assert ok.compile.exit_code == 0 and ok.compile.wall_time_s > 0.01
    cached = dsec.fncall(language="cpp", code=src, compile_time_limit_s=0.01)
    assert cached.verdict == "OK" and cached.text == "2\n", cached
    assert cached.compile == CompileInfo("OK", 0, ok.compile.wall_time_s, True)


def test_cpp_crash_and_deep_recursion(dsec: Client) -> None:
    r = dsec.fncall(language="cpp", code="int main(){ volatile int *p = 0; return *p; }")
    assert r.verdict == "RUNTIME_ERROR" and r.signal == 11 and "SIGSEGV" in r.message
    deep = (
        "#include <cstdio>\nint f(int n){ volatile char pad[64]; pad[0]=n; return n ? f(n-1)+pad[0]%2 : 0; }\n"
        'int main(){ printf("%d\\n", f(1000000)); }'  # ~100 MB of stack: the memory limit
    )
    r = dsec.fncall(language="cpp", code=deep, memory_mb=512, time_limit_s=5)
    assert r.verdict == "OK", r


def test_bash_and_commands(dsec: Client) -> None:
    r = dsec.fncall(language="bash", code='read x; echo "got $x"; echo err >&2; exit 4', stdin="1")
    assert r.verdict == "RUNTIME_ERROR" and r.exit_code == 4
    assert r.text == "got 1\n" and r.stderr == b"err\n"
    r = dsec.fncall(command=["sh", "-c", "echo $HOME; id -u; pwd"])
    assert r.verdict == "OK"
    home, uid, cwd = r.text.split()
    assert home == "/job" and cwd == "/job" and uid != "0"  # never root
    r = dsec.fncall(command=["python3", "-c", "print(2)"], environment="python")
    assert r.verdict == "OK" and r.text == "2\n"


# ------------------------------------------------------------------ limits and hostile programs


def test_infinite_loop_hits_the_wall_clock_limit(dsec: Client) -> None:
    t = time.monotonic()
    r = dsec.fncall(language="python", code="while True: pass", time_limit_s=0.5)
    assert r.verdict == "TIME_LIMIT" and r.signal == 9
    assert 0.45 < r.wall_time_s < 1.5 and time.monotonic() - t < 5
    healthy(dsec, "python")


def test_cpu_limit_counts_every_process(dsec: Client) -> None:
    # Two busy processes: the CPU budget is the job's, not one process's.
    r = dsec.fncall(
        language="bash",
        code="(while :; do :; done) & while :; do :; done",
        time_limit_s=10,
        cpu_limit_s=0.4,
    )
    assert r.verdict == "TIME_LIMIT" and "CPU" in r.message, r
    assert r.wall_time_s < 5
    r = dsec.fncall(language="python", code="import time; time.sleep(30)", time_limit_s=0.5)
    assert r.verdict == "TIME_LIMIT" and "wall" in r.message and r.cpu_time_s < 0.3
    healthy(dsec)


def test_memory_bombs(dsec: Client) -> None:
    r = dsec.fncall(
        language="python",
        code="a = []\nwhile True: a.append(bytearray(8 << 20))",
        memory_mb=96,
        time_limit_s=10,
    )
    assert r.verdict == "MEMORY_LIMIT", r
    assert r.wall_time_s < 5
    r = dsec.fncall(
        language="cpp",
        code="#include <cstdlib>\n#include <cstring>\nint main(){ for(;;){ char*p=(char*)malloc(1<<24);"
        " memset(p,1,1<<24);} }",
        memory_mb=64,
        time_limit_s=10,
    )
    assert r.verdict == "MEMORY_LIMIT", r
    # Within the limit it is fine, and the peak is reported.
    r = dsec.fncall(
        language="cpp",
        code="#include <vector>\n#include <cstdio>\nint main(){ std::vector<char> v(40<<20, 1);"
        ' printf("%d\\n", (int)v[123]); }',
        memory_mb=128,
    )
    assert r.verdict == "OK" and 40 << 20 < r.peak_memory_bytes < 128 << 20, r
    healthy(dsec, "python")
    healthy(dsec, "cpp")


MIB = 1 << 20
#: How far above memory_mb a killed job's reported peak may be: the kernel lets a task it has
#: OOM-killed charge what it needs to exit (measured: 0). The limit itself has no margin.
PEAK_MARGIN = 1 * MIB
TOUCH_PY = (
    "n = {mib} << 20\nb = bytearray(n)\nfor i in range(0, n, 4096):\n    b[i] = 1\nprint(n >> 20)"
)
TOUCH_NUMPY = "import numpy as np\na = np.ones(({mib} << 20) // 8)\nprint(a.nbytes >> 20)"
TOUCH_CPP = (  # the asm keeps g++ -O2 from folding the memset away
    "#include <cstdio>\n#include <cstdlib>\n#include <cstring>\n"
    "int main(){{ size_t n = (size_t){mib} << 20; char *p = (char*)malloc(n);"
    ' memset(p, 1, n); asm volatile("" : : "r"(p) : "memory"); long s = 0;'
    " for (size_t i = 0; i < n; i += 4096) s += p[i];"
    ' printf("%ld\\n", s * 4096 >> 20); }}'
)


def _cpp_host(dsec: Client) -> str:
    r = dsec.fncall(command=["cat", "/etc/hostname"], environment="cpp")
    assert r.verdict == "OK", r
    return r.text


def test_memory_mb_is_the_jobs_own_memory(dsec: Client) -> None:
    """memory_mb limits what the job's own processes are charged, exactly: not the runner
    that serves it, not the warm interpreter's pages it shares, not its input files. Just
    under the limit passes; over it is MEMORY_LIMIT with the peak at the limit (before,
    a 128 MiB job was killed only at ~360 MiB)."""
    cases = [
        ("python", TOUCH_PY, 128),  # the lean warm interpreter
        ("python", TOUCH_NUMPY, 128),  # forked from the zygote, which holds numpy
        ("cpp", TOUCH_CPP, 64),  # exec'd: every page of the process is its own
    ]
    for language, code, limit in cases:
        under, over = limit * 3 // 4, limit * 5 // 4
        ok = dsec.fncall(language=language, code=code.format(mib=under), memory_mb=limit)
        assert ok.verdict == "OK" and ok.text == f"{under}\n", (language, ok)
        assert under * MIB <= ok.peak_memory_bytes <= limit * MIB, (language, ok)
        bad = dsec.fncall(language=language, code=code.format(mib=over), memory_mb=limit)
        assert bad.verdict == "MEMORY_LIMIT" and bad.signal == 9, (language, bad)
        assert f"{limit} MiB" in bad.message, bad
        assert (limit - 8) * MIB <= bad.peak_memory_bytes <= limit * MIB + PEAK_MARGIN, (
            language,
            bad,
        )
    # The same for a command (a fresh python3 exec'd, interpreter included; in the cpp pool:
    # the tests above count the bash container's jobs).
    cmd = ["python3", "-c", TOUCH_PY.format(mib=160)]
    r = dsec.fncall(command=cmd, environment="cpp", memory_mb=128)
    assert r.verdict == "MEMORY_LIMIT" and r.peak_memory_bytes <= 128 * MIB + PEAK_MARGIN, r


def test_a_job_killed_at_its_memory_limit_leaves_its_container_serving(dsec: Client) -> None:
    # The cpp pool has one container: the OOM kill is confined to the job's own cgroup, the
    # runner and its spares live on, and the next jobs run there with their own limits.
    # A fresh container first (a SysV IPC leftover retires the current one), so that it is not
    # recycled after its N jobs in the middle of this test.
    r = dsec.fncall(command=["ipcmk", "-M", "4096"], environment="cpp")
    assert r.verdict == "OK", r
    host = _cpp_host(dsec)
    for _ in range(2):
        bad = dsec.fncall(language="cpp", code=TOUCH_CPP.format(mib=96), memory_mb=64)
        assert bad.verdict == "MEMORY_LIMIT", bad
        assert _cpp_host(dsec) == host
        ok = dsec.fncall(language="cpp", code=TOUCH_CPP.format(mib=200), memory_mb=256)
        assert ok.verdict == "OK" and ok.text == "200\n", ok
        assert 200 * MIB <= ok.peak_memory_bytes <= 256 * MIB, ok
    assert _cpp_host(dsec) == host
    healthy(dsec, "cpp")


def test_the_files_a_job_writes_count_against_its_memory(dsec: Client) -> None:
    """/job and /tmp are tmpfs: what the job writes there is RAM, charged to the job like its
    heap (the kernel charges a tmpfs page to the memory cgroup of the process that writes
    it). The mounts' sizes still cap each; the job's own input files do not count."""
    write = "head -c 50331648 /dev/zero > a.bin; head -c 50331648 /dev/zero > /tmp/b.bin; echo done"
    # (bash in the cpp pool: the tests above count the bash container's jobs)
    ok = dsec.fncall(command=["bash", "-c", write], environment="cpp", memory_mb=128)
    assert ok.verdict == "OK" and ok.text == "done\n", ok
    assert 96 * MIB <= ok.peak_memory_bytes <= 128 * MIB, ok
    bad = dsec.fncall(command=["bash", "-c", write], environment="cpp", memory_mb=64)
    assert bad.verdict == "MEMORY_LIMIT", bad
    assert bad.peak_memory_bytes <= 64 * MIB + PEAK_MARGIN, bad
    # 12 MiB of input files (written by the runner) and 40 MiB of its own: within 48 MiB.
    data = {f"in{i}.bin": bytes(4 * MIB) for i in range(3)}
    r = dsec.fncall(
        command=["bash", "-c", "cat in*.bin | wc -c; head -c 41943040 /dev/zero > out.bin"],
        environment="cpp",
        files=data,
        memory_mb=48,
    )
    assert r.verdict == "OK" and r.text == f"{12 * MIB}\n", r
    healthy(dsec, "cpp")


def test_fork_bombs(dsec: Client) -> None:
    r = dsec.fncall(language="bash", code=":(){ :|:& };:", time_limit_s=3)
    assert r.verdict in ("RUNTIME_ERROR", "TIME_LIMIT") and "process limit" in r.message, r
    healthy(dsec, "bash")
    r = dsec.fncall(language="python", code="import os\nwhile True: os.fork()", time_limit_s=3)
    assert r.verdict in ("RUNTIME_ERROR", "TIME_LIMIT"), r
    healthy(dsec, "python")
    r = dsec.fncall(
        language="c",
        code="#include <unistd.h>\nint main(){ for(;;) fork(); }",
        time_limit_s=2,
    )
    assert r.verdict in ("RUNTIME_ERROR", "TIME_LIMIT"), r
    healthy(dsec, "cpp")


def test_a_gigabyte_of_output(dsec: Client) -> None:
    t = time.monotonic()
    r = dsec.fncall(language="bash", code="head -c 1000000000 /dev/zero", max_output_bytes=1 << 20)
    assert r.verdict == "OUTPUT_LIMIT" and "stdout" in r.message
    assert len(r.stdout) == 1 << 20 and time.monotonic() - t < 10
    r = dsec.fncall(language="python", code="import sys\nwhile True: sys.stderr.write('x' * 65536)")
    assert r.verdict == "OUTPUT_LIMIT" and "stderr" in r.message
    # Into a file instead of a pipe: the per-file size limit (RLIMIT_FSIZE) stops it.
    r = dsec.fncall(language="bash", code="exec head -c 1000000000 /dev/zero > big")
    assert r.verdict == "OUTPUT_LIMIT" and r.signal == 25 and "file" in r.message, r
    # Many files under the size limit: the job's tmpfs (/job, /tmp) fills up, the write fails.
    for d in ("/job", "/tmp"):
        r = dsec.fncall(
            language="bash",
            code=f"for i in 1 2 3 4; do head -c 50000000 /dev/zero > {d}/f$i || exit 7; done",
        )
        assert r.verdict == "OUTPUT_LIMIT" and f"filled {d}" in r.message, r
        healthy(dsec)  # and the next job has its room back
    healthy(dsec)


def test_closing_stdout_and_running_on(dsec: Client) -> None:
    r = dsec.fncall(language="bash", code="exec >&- 2>&-; sleep 100", time_limit_s=1)
    assert r.verdict == "TIME_LIMIT" and r.wall_time_s < 3
    # The main process exits at once but leaves a child holding stdout: the job is done
    # (its own exit code), the child is killed.
    t = time.monotonic()
    r = dsec.fncall(
        language="bash", code="echo hi; (sleep 100; echo late) & exit 0", time_limit_s=5
    )
    assert r.verdict == "OK" and r.text == "hi\n" and time.monotonic() - t < 3
    healthy(dsec)


# ------------------------------------------------------------------ isolation between jobs


NET_PROBE = r"""
import errno, socket, sys
port, name = int(sys.argv[1]), sys.argv[2]
print("links", sorted(n for _, n in socket.if_nameindex()))
for family, where in ((socket.AF_INET, ("127.0.0.1", port)), (socket.AF_UNIX, "\0" + name)):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(where)
        print("reached", family.name)
    except OSError as exc:
        print("refused", family.name, errno.errorcode.get(exc.errno, exc.errno))
"""


def test_jobs_have_no_network_and_cannot_reach_the_host(dsec: Client) -> None:
    """A job runs in a private, empty network namespace: only its own loopback, nothing
    listening there, and neither the host's loopback (a TCP listener this test opens on
    127.0.0.1) nor the host's abstract Unix sockets (one opened here too) are reachable."""
    tcp = socket.create_server(("127.0.0.1", 0))
    name = f"dsec-test-{os.getpid()}-fncall"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind("\0" + name)
    abstract.listen()
    try:
        port = tcp.getsockname()[1]
        for language in ("python", "bash"):
            if language == "python":
                r = dsec.fncall(
                    files={"probe.py": NET_PROBE},
                    command=["python3", "probe.py", str(port), name],
                    environment="python",
                )
            else:  # the same through bash's own /dev/tcp: no Python involved
                r = dsec.fncall(
                    language="bash",
                    code=f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo reached"
                    " || echo refused; ls /sys/class/net",
                )
            assert r.verdict == "OK", r
            if language == "python":
                lines = r.text.splitlines()
                assert lines[0] == "links ['lo']", lines
                assert lines[1] == "refused AF_INET ECONNREFUSED", lines
                assert lines[2] == "refused AF_UNIX ECONNREFUSED", lines
            else:
                assert r.text.split() == ["refused", "lo"], r.text
        tcp.settimeout(0.1)
        with pytest.raises(TimeoutError):
            tcp.accept()  # nobody came
    finally:
        tcp.close()
        abstract.close()


def test_each_job_sees_only_its_own_files_and_no_stray_process(dsec: Client) -> None:
    # The bash pool has one container: consecutive jobs share it.
    r = dsec.fncall(
        language="bash",
        code="echo secret > /tmp/leak; echo secret > mine; mkdir -p /dev/shm/x sub/dir;"
        " echo s > /var/tmp/leak; echo s > /run/lock/leak; touch /dev/mqueue/leak;"
        " python3 -c \"import os; os.setxattr('/job', 'user.leak', b'1')\"; chmod 777 /job;"
        " (sleep 300 &) ; nohup sleep 301 >/dev/null 2>&1 &"
        " ls -d /tmp/leak /dev/shm/x /var/tmp/leak /run/lock/leak /dev/mqueue/leak | wc -l;"
        " cat /etc/hostname",
    )
    assert r.verdict == "OK", r
    made, host = r.text.split("\n", 1)
    assert made == "5", r.text  # every leftover was really made
    r = dsec.fncall(
        language="bash",
        code="cat /etc/hostname; echo files: $(ls -A /job /tmp /dev/shm /var/tmp /run/lock"
        " /dev/mqueue | grep -v ':$');"
        " echo sleepers: $(ps -eo args | grep -c '[s]leep 30');"
        " echo xattrs: $(python3 -c \"import os; print(len(os.listxattr('/job')))\");"
        " echo mode: $(stat -c %a /job); touch /etc/evil 2>/dev/null || echo etc: read-only",
    )
    lines = r.text.splitlines()
    assert lines[0] + "\n" == host  # the same container
    assert lines[1:] == [
        "files: main.sh",  # only the job's own program
        "sleepers: 0",
        "xattrs: 0",
        "mode: 700",
        "etc: read-only",
    ], r.text


SPARE_PROBE = r"""
import os, signal
me = {os.getpid(), os.getppid(), 1}
others = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in me)
uids, refused = [], 0
for pid in others:
    with open(f"/proc/{pid}/status") as fh:
        uids.append(next(l.split()[1] for l in fh if l.startswith("Uid:")))
    for attempt in (
        lambda: os.kill(pid, signal.SIGKILL),
        lambda: os.kill(pid, signal.SIGSTOP),
        lambda: open(f"/proc/{pid}/environ").read(),
        lambda: open(f"/proc/{pid}/mem", "rb").read(1),
    ):
        try:
            attempt()
        except PermissionError:
            refused += 1
print(len(others), sorted(set(uids)), refused)
"""


def test_a_job_cannot_touch_the_spares_waiting_for_later_jobs(dsec: Client) -> None:
    # Job processes are forked ahead in batches; the idle ones stay root until their job
    # starts, so a job (unprivileged) can neither kill, stop nor read the next jobs'.
    # The bash pool has one container: the spares seen are the ones later jobs run in.
    seen = []
    for _ in range(5):  # more than a batch of spares: one of these jobs took the last
        r = dsec.fncall(language="bash", code=f"python3 -c '{SPARE_PROBE}'")
        assert r.verdict == "OK", r
        n, uids, refused = r.text.split(" ", 1)[0], r.text.split("[")[1].split("]")[0], r.text
        assert uids in ("'0'", ""), r.text  # all root
        assert int(refused.split()[-1]) == 4 * int(n), r.text  # every attempt refused
        seen.append(int(n))
    assert max(seen) >= 1, seen  # there were spares to attack
    healthy(dsec)


def test_jobs_naming_a_preload_fork_from_the_warm_interpreter(dsec: Client) -> None:
    """The runner is a lean interpreter; its child, the zygote, imported the preloads (numpy)
    and forks the spares of the Python jobs whose files name one. Either way a job behaves
    as under python3; the hostile programs get their verdicts on the warm path too."""

    def numpy_loaded(code: str) -> str:
        r = dsec.fncall(language="python", code=code)
        assert r.verdict == "OK", r
        return r.text

    check = "import sys; print(('nu' + 'mpy') in sys.modules)"
    # Not named: numpy is not loaded (as in a fresh python3) and the job is a lean fork ...
    assert numpy_loaded(check) == "False\n"
    # ... named (even in a comment): forked from the interpreter that has it.
    assert numpy_loaded(check + "  # numpy") == "True\n"
    # Only .py files are searched: a data file naming it changes nothing; a module does.
    r = dsec.fncall(language="python", code=check, files={"words.txt": "numpy"})
    assert r.text == "False\n", r
    r = dsec.fncall(language="python", code=check, files={"helper.py": "import numpy"})
    assert r.text == "True\n", r
    # A lean job that imports it in a way no one could see coming still gets it (cold).
    assert numpy_loaded("m = __import__('nu' + 'mpy'); print(m.arange(4).sum())") == "6\n"
    # The zygote and its idle spares are root: a job it forked can neither kill, stop nor
    # read them, nor the lean spares beside them.
    probe = SPARE_PROBE.replace("me = {os.getpid(), os.getppid(), 1}", "me = {os.getpid(), 1}")
    for _ in range(6):  # more than a batch: the zygote forks the next one meanwhile
        r = dsec.fncall(language="python", code="import numpy\n" + probe)
        assert r.verdict == "OK", r
        n, rest = r.text.split(" ", 1)
        assert rest.startswith("['0'] "), r.text  # all root
        assert int(rest.split()[-1]) == 4 * int(n), r.text  # every attempt refused
        assert int(n) >= 2, r.text  # at least the zygote and a spare to attack
    r = dsec.fncall(
        language="python",
        code="import numpy as np\na = [np.ones(1 << 22) for _ in range(100)]",
        memory_mb=96,
        time_limit_s=10,
    )
    assert r.verdict == "MEMORY_LIMIT", r
    r = dsec.fncall(
        language="python", code="import numpy, os\nwhile True: os.fork()", time_limit_s=3
    )
    assert r.verdict in ("RUNTIME_ERROR", "TIME_LIMIT"), r
    r = dsec.fncall(language="python", code="import numpy\nwhile True: pass", time_limit_s=0.5)
    assert r.verdict == "TIME_LIMIT", r
    r = dsec.fncall(language="python", code="import numpy\nraise SystemExit(3)")
    assert r.verdict == "RUNTIME_ERROR" and r.exit_code == 3, r
    for _ in range(3):  # and the warm path serves the next jobs normally
        assert numpy_loaded("import numpy as np; print(np.int64(41) + 1)") == "42\n"
    healthy(dsec, "python")


def test_a_dead_zygote_costs_one_job_and_its_container(dsec: Client) -> None:
    """The zygote killed from outside (e.g. by the OOM killer): the job that finds it gone is a
    SYSTEM_ERROR (the platform failed: retry), never a hang; the container is replaced and
    jobs naming numpy run normally again."""
    r = dsec.fncall(
        language="python",
        code="import os, numpy\nprint(os.getppid(), open('/etc/hostname').read())",
    )
    assert r.verdict == "OK", r
    zygote_ns_pid, host = r.text.split()
    host_pid = None
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:  # the container's processes see its /etc/hostname; the zygote is its NSpid there
            with open(f"/proc/{d}/root/etc/hostname") as fh:
                if fh.read().strip() != host:
                    continue
            with open(f"/proc/{d}/status") as fh:
                nspid = next(line.split()[-1] for line in fh if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if nspid == zygote_ns_pid:
            host_pid = int(d)
    assert host_pid is not None, (zygote_ns_pid, host)
    os.kill(host_pid, 9)  # a process of this test's own cluster
    verdicts, failed = [], []
    for _ in range(8):
        t = time.monotonic()
        r = dsec.fncall(
            language="python", code="import numpy; print(numpy.int8(7))", time_limit_s=5
        )
        assert time.monotonic() - t < 30, r
        verdicts.append(r.verdict)
        if r.verdict == "SYSTEM_ERROR":
            failed.append(r.message)
        else:
            assert r.verdict == "OK" and r.text == "7\n", r
    assert len(failed) == 1 and "zygote" in failed[0], (verdicts, failed)  # that container's
    assert verdicts[-4:] == ["OK"] * 4, verdicts
    healthy(dsec, "python")


RUNNER_PROBE = r"""
import os, signal, sys
def attack():
    for call in (
        lambda: os.setpriority(os.PRIO_PROCESS, 1, 19),
        lambda: os.sched_setaffinity(1, {0}),
        lambda: os.kill(1, signal.SIGINT),
        lambda: os.kill(1, signal.SIGUSR1),
    ):
        try:
            call()
            return True
        except PermissionError:
            pass
    return False
hit = attack()
if os.fork() == 0:  # an orphan that keeps trying while the runner cleans up after us
    os.setsid()
    while not attack():
        pass
    os._exit(0)
fields = open("/proc/1/stat").read().rsplit(")", 1)[1].split()
print(hit, fields[16], open("/etc/hostname").read().strip())
"""


def test_a_job_cannot_touch_the_runner(dsec: Client) -> None:
    # pid 1 stays root throughout, also while it kills the job's processes: a job (or an orphan
    # it leaves, trying all along) can neither renice, pin nor signal it.
    seen = []
    for _ in range(5):
        r = dsec.fncall(language="bash", code=f"python3 -c '{RUNNER_PROBE}'")
        assert r.verdict == "OK", r
        hit, nice, host = r.text.split()
        assert hit == "False" and nice == "0", r.text
        seen.append(host)
    assert len(set(seen)) == 1, seen  # the same container (the runner never died)
    healthy(dsec)


def test_a_container_is_recycled_after_n_jobs_and_after_an_anomaly(dsec: Client) -> None:
    hosts = [
        dsec.fncall(language="bash", code="cat /etc/hostname").text
        for _ in range(JOBS_PER_CONTAINER + 2)
    ]
    assert len(set(hosts)) >= 2  # a fresh container took over after N jobs
    # SysV IPC objects outlive processes: the runner reports it, the edge replaces the container.
    before = dsec.fncall(language="bash", code="cat /etc/hostname").text
    r = dsec.fncall(language="bash", code="ipcmk -M 4096 >/dev/null && echo made")
    assert r.verdict == "OK" and r.text == "made\n"
    after = dsec.fncall(language="bash", code="cat /etc/hostname; ipcs -m | grep -c '^0x' || true")
    assert after.text.split("\n")[0] + "\n" != before and after.text.split("\n")[1] == "0"


def _pools(c: LocalCluster) -> dict[str, edge_pb2.FnCallPoolStatus]:
    with grpc.insecure_channel(c.process("edge-fn0").address) as ch:
        resp = edge_pb2_grpc.EdgeServiceStub(ch).GetNodeStatus(
            edge_pb2.GetNodeStatusRequest(), timeout=10
        )
    return dict(resp.fncall)


def test_node_status_and_dsec_status_show_each_pool(
    fncall_cluster: LocalCluster, dsec: Client
) -> None:
    """What an operator sees (grpcurl GetNodeStatus, `dsec status`): every pool's size,
    containers up/idle/starting, queued jobs, jobs run and containers recycled."""
    before = _pools(fncall_cluster)
    assert {env: p.size for env, p in before.items()} == {"python": 2, "cpp": 1, "bash": 1}
    for p in before.values():
        assert p.idle <= p.workers <= p.size and p.waiting == 0
    for _ in range(5):
        assert dsec.fncall(language="python", code="print(1)").ok
    # SysV IPC left behind is an anomaly: the runner reports it, that container is replaced.
    assert dsec.fncall(language="bash", code="ipcmk -M 4096 >/dev/null").ok
    after = _pools(fncall_cluster)
    assert after["python"].jobs - before["python"].jobs == 5
    assert after["cpp"].jobs == before["cpp"].jobs
    assert after["bash"].jobs - before["bash"].jobs == 1
    assert after["bash"].recycled - before["bash"].recycled == 1
    deadline = time.monotonic() + 60  # the refill
    while _pools(fncall_cluster)["bash"].idle != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pools(fncall_cluster)["bash"].idle == 1
    status = dsec_status(fncall_cluster.home)
    m = re.search(
        r"fncall python: (\d)/2 up \((\d) idle, (\d) starting\), 0 queued, (\d+) jobs", status
    )
    assert m is not None, status
    assert int(m.group(4)) >= after["python"].jobs
    assert re.search(
        r"fncall bash: 1/1 up \(1 idle, 0 starting\), 0 queued, \d+ jobs, [1-9]\d* recycled",
        status,
    ), status


# ------------------------------------------------------------------ fetched files
# (after the tests above that expect consecutive bash jobs in one container: these jobs would
# move where the bash container is recycled after its N jobs)


def test_fetch_files_come_back_whatever_the_verdict(dsec: Client) -> None:
    code = (
        "import os, sys\n"
        "os.makedirs('out/deep')\n"
        "open('out/deep/data.bin', 'wb').write(bytes(range(256)) * 400)\n"
        "s = input()\n"
        "open('result.txt', 'w').write(s[::-1])\n"
        "sys.exit(3 if s == 'fail' else 0)\n"
    )
    fetch = ["result.txt", "out/deep/data.bin"]
    data = bytes(range(256)) * 400
    r = dsec.fncall(language="python", code=code, stdin="abc", fetch_files=fetch)
    assert r.verdict == "OK" and r.compile is None, r  # interpreted: no compile step
    assert r.files == {"result.txt": b"cba", "out/deep/data.bin": data} and r.fetch_errors == {}
    r = dsec.fncall(language="python", code=code, stdin="fail", fetch_files=fetch)
    assert r.verdict == "RUNTIME_ERROR" and r.exit_code == 3, r
    assert r.files == {"result.txt": b"liaf", "out/deep/data.bin": data}
    # Killed at its time limit, with a child still appending: read once all are gone.
    r = dsec.fncall(
        language="bash",
        code="echo partial > p.txt; (while :; do echo x >> bg.txt; done) & sleep 30",
        time_limit_s=0.5,
        fetch_files=["p.txt", "bg.txt"],
    )
    assert r.verdict == "TIME_LIMIT", r
    assert r.files["p.txt"] == b"partial\n" and set(r.files["bg.txt"].split()) == {b"x"}
    r = dsec.fncall(language="bash", code="ls -A", fetch_files=["p.txt"])
    assert r.text == "main.sh\n" and r.fetch_errors == {"p.txt": "no such file"}, r  # emptied


def test_fetch_files_are_regular_files_never_through_a_link(dsec: Client) -> None:
    r = dsec.fncall(
        language="bash",
        code="ln -s /etc/passwd pw; mkdir d; ln -s /etc d/etc; mkfifo fifo; echo ok > real",
        fetch_files=["missing.txt", "pw", "d/etc/passwd", "fifo", "d", "real"],
    )
    assert r.verdict == "OK", r
    assert r.files == {"real": b"ok\n"}  # /etc/passwd is nowhere
    assert r.fetch_errors == {
        "missing.txt": "no such file",
        "pw": "not a regular file: a symbolic link (not followed)",
        "d/etc/passwd": "'d/etc' is a symbolic link (not followed)",
        "fifo": "not a regular file",
        "d": "not a regular file: a directory",
    }


def test_fetch_files_have_a_size_budget(dsec: Client) -> None:
    mib = 1 << 20
    r = dsec.fncall(
        language="bash",
        code=(
            "head -c 41943040 /dev/zero > c.bin; head -c 20971520 /dev/zero > a.bin;"
            " cp a.bin b.bin; echo small > small.txt"
        ),
        fetch_files=["c.bin", "a.bin", "b.bin", "small.txt"],
    )
    assert r.verdict == "OK", r
    assert set(r.files) == {"a.bin", "small.txt"}
    assert r.files["a.bin"] == bytes(20 * mib) and r.files["small.txt"] == b"small\n"
    assert r.fetch_errors == {
        "c.bin": "40 MiB, larger than the 32 MiB left of the 32 MiB limit",
        "b.bin": "20 MiB, larger than the 12 MiB left of the 32 MiB limit",
    }


# ------------------------------------------------------------------ batches


def test_batch_compiles_once(dsec: Client) -> None:
    src = (
        "#include <cstdio>\n#include <vector>\n#include <algorithm>\n"
        'int main(){ long n; scanf("%ld", &n); printf("%ld\\n", n * n); }\n// batch'
    )
    t = time.monotonic()
    results = list(
        dsec.fncall_many(
            [FunctionJob(language="cpp", code=src, stdin=str(i), job_id=f"c{i}") for i in range(30)]
        )
    )
    elapsed = time.monotonic() - t
    assert sorted(r.index for r in results) == list(range(30))
    assert all(r.verdict == "OK" and r.text == f"{r.index**2}\n" for r in results)
    assert all(r.job_id == f"c{r.index}" for r in results)
    # One compilation: 30 of them would take 10 s or more on this machine.
    assert elapsed < 6, elapsed
    bad = list(dsec.fncall_many([{"language": "cpp", "code": "nope", "stdin": "1"}] * 3))
    assert [r.verdict for r in bad] == ["COMPILE_ERROR"] * 3


def test_batch_streams_results_as_they_finish(dsec: Client) -> None:
    code = "import time\nn = int(input())\nif n == 0: time.sleep(1.5)\nprint(n)"
    arrival = [
        r.index
        for r in dsec.fncall_many(
            [FunctionJob(language="python", code=code, stdin=str(i)) for i in range(8)]
        )
    ]
    assert sorted(arrival) == list(range(8))
    assert arrival[-1] == 0  # the slow job came last; the others did not wait for it


def test_batch_mixes_languages(dsec: Client) -> None:
    jobs = [
        FunctionJob(language="python", code="print(1)"),
        FunctionJob(language="bash", code="echo 2"),
        FunctionJob(language="cpp", code=CPP_OK),
        FunctionJob(language="python", code="while True: pass", time_limit_s=0.3),
    ]
    by_index = {r.index: r for r in dsec.fncall_many(jobs)}
    assert [by_index[i].verdict for i in range(4)] == ["OK", "OK", "OK", "TIME_LIMIT"]
    assert by_index[1].text == "2\n"


# ------------------------------------------------------------------ bad input and auth


def test_bad_jobs_are_invalid_argument(dsec: Client) -> None:
    with pytest.raises(InvalidArgument) as e:
        dsec.fncall(language="cobol", code="DISPLAY 'HI'.")
    assert e.value.reason == "UNKNOWN_LANGUAGE"
    with pytest.raises(InvalidArgument):
        dsec.fncall(language="python", code="print(1)", memory_mb=1)
    with pytest.raises(InvalidArgument):
        dsec.fncall(language="python", code="print(1)", time_limit_s=-1)
    with pytest.raises(InvalidArgument):
        dsec.fncall(language="python", code="print(1)", files={"../etc/x": "y"})
    with pytest.raises(InvalidArgument):
        dsec.fncall(code="print(1)")  # neither a language nor a command
    with pytest.raises(InvalidArgument):
        list(dsec.fncall_many([FunctionJob(language="python", code="1"), {"language": "x"}]))


def test_concurrent_jobs_share_one_stream_and_keep_their_own_outcomes(
    fncall_cluster: LocalCluster,
) -> None:
    async def main() -> None:
        async with AsyncClient(fncall_cluster.apiserver, token=fncall_cluster.token) as c:
            calls = [c.fncall(language="python", code=f"print({i})") for i in range(40)]
            calls.append(c.fncall(language="cobol", code="x"))
            calls.append(c.fncall(language="bash", code="sleep 30", time_limit_s=60, timeout=1))
            t = time.monotonic()
            *ok, unknown, given_up = await asyncio.gather(*calls, return_exceptions=True)
            assert [getattr(r, "text", r) for r in ok] == [f"{i}\n" for i in range(40)]
            assert isinstance(unknown, InvalidArgument), unknown
            assert isinstance(given_up, DeadlineExceeded) and time.monotonic() - t < 20
            assert c._job_stream._state is not None  # one stream carried them all
            # and it goes on serving after an error and a timeout; the job given up was
            # stopped: the bash pool's one container is free at once, not in 30 s
            r = await c.fncall(language="python", code="print('again')")
            assert r.text == "again\n"
            t = time.monotonic()
            r = await c.fncall(language="bash", code="echo free")
            assert r.text == "free\n" and time.monotonic() - t < 10, r

    asyncio.run(main())


def test_the_caller_must_authenticate(fncall_cluster: LocalCluster) -> None:
    with Client(fncall_cluster.apiserver, token="not-a-token") as c, pytest.raises(Unauthenticated):
        c.fncall(language="python", code="print(1)")


def _caller_process(c: LocalCluster, code: str) -> subprocess.CompletedProcess[str]:
    """Runs `code` as a caller's own process (argv: the API server, a token); it must exit 0."""
    r = subprocess.run(
        [sys.executable, "-c", code, c.apiserver, c.token],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert r.returncode == 0, r.stderr
    return r


def test_a_closed_client_leaves_nothing_pending(fncall_cluster: LocalCluster) -> None:
    """Closing the sync Client ends its loop as asyncio.run does: gRPC's own per-call tasks
    are finished, not destroyed pending (a warning on the caller's stderr at exit, seen in
    about one run of four before)."""
    code = (
        "import sys\n"
        "from libdsec import Client\n"
        "for _ in range(6):\n"
        "    with Client(sys.argv[1], token=sys.argv[2]) as c:\n"
        "        assert c.fncall(language='bash', code='echo ok').text == 'ok\\n'\n"
    )
    r = _caller_process(fncall_cluster, code)
    assert "was destroyed but it is pending" not in r.stderr, r.stderr


def test_clients_on_several_event_loops_close_cleanly(fncall_cluster: LocalCluster) -> None:
    """A sync Client (its own loop) alive while AsyncClients come and go under asyncio.run:
    each close ends its job stream before its loop closes, so gRPC delivers no late event to
    a closed loop ("Event loop is closed" from gRPC's poller, 8 times in 18 closes before)."""
    code = (
        "import asyncio, sys\n"
        "from libdsec import AsyncClient, Client\n"
        "async def once():\n"
        "    async with AsyncClient(sys.argv[1], token=sys.argv[2]) as c:\n"
        "        rs = await asyncio.gather(*(c.fncall(language='bash', code='echo ok')\n"
        "                                    for _ in range(8)))\n"
        "        assert all(r.text == 'ok\\n' for r in rs)\n"
        "with Client(sys.argv[1], token=sys.argv[2]) as sync:\n"
        "    for _ in range(12):\n"
        "        assert sync.fncall(language='bash', code='echo ok').ok\n"
        "        asyncio.run(once())\n"
    )
    r = _caller_process(fncall_cluster, code)
    assert "Event loop is closed" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------ CLI


def test_cli(fncall_cluster: LocalCluster, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DSEC_TARGET": fncall_cluster.apiserver,
        "DSEC_TOKEN": fncall_cluster.token,
    }

    def dsec_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dsecctl", "fncall", *args],
            env=env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = dsec_cli("-l", "python", "-c", "print(input() * 2)", "--stdin", "ab")
    assert r.returncode == 0 and r.stdout == "abab\n" and "OK" in r.stderr
    r = dsec_cli("-l", "bash", "-c", "exit 5")
    assert r.returncode == 5 and "RUNTIME_ERROR" in r.stderr
    src = tmp_path / "sol.cpp"
    src.write_text(
        '#include <cstdio>\nint main(){int a,b;scanf("%d%d",&a,&b);printf("%d\\n",a+b);}'
    )
    for i, (inp, out) in enumerate([("1 2", "3"), ("5 5", "10"), ("2 2", "5")]):
        (tmp_path / f"{i}.in").write_text(inp)
        (tmp_path / f"{i}.out").write_text(out + "\n")
    r = dsec_cli("-l", "cpp", "-f", str(src), "--cases", str(tmp_path / "*.in"))
    assert r.returncode == 1, r.stderr  # case 2 expects a wrong answer
    lines = r.stdout.splitlines()
    assert [ln.split()[1] for ln in lines] == ["AC", "AC", "WA"]
    assert "2/3 cases passed" in r.stderr
    r = dsec_cli("--", "sh", "-c", "echo from-a-command")
    assert r.returncode == 0 and r.stdout == "from-a-command\n"
    # files the job wrote come back into --fetch-dir; a missing one is named
    out = tmp_path / "fetched"
    r = dsec_cli(
        "-l", "bash", "-c", "mkdir -p o; seq 3 > o/n.txt", "--fetch", "o/n.txt",
        "--fetch", "nope", "--fetch-dir", str(out),
    )  # fmt: skip
    assert r.returncode == 0 and (out / "o" / "n.txt").read_text() == "1\n2\n3\n", r.stderr
    assert "nope not fetched" in r.stderr
    r = dsec_cli("-l", "cpp", "-c", "int main(){", "--compile-time-limit-s", "20", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["verdict"] == "COMPILE_ERROR"


# ------------------------------------------------------------------ several edges


def test_bursts_and_batches_spread_over_the_edges(cluster_with: ClusterWith) -> None:
    """Two edges with two Python containers each: a burst of concurrent jobs right after one
    job (the API server still holds that placement answer) runs on both edges together, not
    queued on the first candidate while the other idles; a large batch is split over both."""
    env = {"DSEC_EDGE_FNCALL_POOLS": "python=2"}
    specs = [container_edge(e, env) for e in ("fa", "fb")]
    with cluster_with("fn2cluster", edges=specs) as c:

        async def burst() -> list[str]:
            async with AsyncClient(c.apiserver, token=c.token) as ac:
                for _ in range(60):  # until placement offers both edges (the watcher saw them)
                    seen = await asyncio.gather(
                        *(ac.fncall(language="python", code="pass") for _ in range(8))
                    )
                    if {r.edge_id for r in seen} == {"fa", "fb"}:
                        break
                    await asyncio.sleep(0.5)
                first = await ac.fncall(language="python", code="pass")
                assert first.ok, first
                results = await asyncio.gather(
                    *(
                        ac.fncall(language="python", code="import time; time.sleep(0.4)")
                        for _ in range(8)
                    )
                )
                assert all(r.ok for r in results), results
                return [r.edge_id for r in results]

        edges = asyncio.run(burst())
        assert edges.count("fa") == 4 and edges.count("fb") == 4, edges

        # A batch large enough is split over both edges; results keep the batch's indices.
        with Client(c.apiserver, token=c.token) as client:
            jobs = [FunctionJob(language="python", code=f"print({i} * 3)") for i in range(96)]
            got = list(client.fncall_many(jobs, parallelism=8))
            assert sorted(r.index for r in got) == list(range(96))
            assert all(r.ok and r.text == f"{r.index * 3}\n" for r in got), got
            by_edge = [r.edge_id for r in got]
            assert by_edge.count("fa") == 48 and by_edge.count("fb") == 48, by_edge
            # A bad job in the second edge's share is named by its index in the caller's batch.
            jobs[71] = FunctionJob(language="cobol", code="")
            with pytest.raises(InvalidArgument) as bad:
                list(client.fncall_many(jobs))
            assert "jobs[71]" in bad.value.message and bad.value.reason == "UNKNOWN_LANGUAGE"
            assert bad.value.metadata.get("job_index") == "71", bad.value.metadata


# ------------------------------------------------------------------ GPU


def test_gpu_pool(cluster_with: ClusterWith) -> None:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA GPU on this machine (nvidia-smi not found): GPU pools untestable")
    if shutil.which("nvidia-container-cli") is None:
        pytest.skip("GPU present but nvidia-container-cli (libnvidia-container) is not installed")
    with cluster_with("gpu0", edge_env={"DSEC_EDGE_FNCALL_POOLS": "python-gpu=1"}) as c:
        with Client(c.apiserver, token=c.token) as client:
            r = client.fncall(
                command=["nvidia-smi", "-L"], environment="python-gpu", time_limit_s=30
            )
            assert r.verdict == "OK" and b"GPU" in r.stdout, r

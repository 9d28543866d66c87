"""The toolkit build: content-addressed, idempotent, atomic, self-contained."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from edge.toolkit import APP_PACKAGES, build_toolkit, toolkit_argv, toolkit_image, toolkit_python

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_repo(tmp_path: Path) -> Path:
    """A repo root with just what the toolkit takes from it."""
    root = tmp_path / "repo"
    for pkg in APP_PACKAGES:
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "dsec").mkdir()
    for f in ("__init__.py", "wire_schema.py"):
        shutil.copy2(REPO / "dsec" / f, root / "dsec" / f)
    return root


def test_layout(toolkit_dir: Path) -> None:
    lib = toolkit_dir / "lib"
    py = lib / "python3.11"
    assert os.access(toolkit_dir / "bin" / "python3.11", os.X_OK)
    assert os.access(lib / "ld-linux-x86-64.so.2", os.X_OK)
    for so in (
        "libc.so.6",
        "libm.so.6",
        "libz.so.1",
        "libexpat.so.1",
        "libssl.so.3",
        "libffi.so.8",
    ):
        assert (lib / so).is_file(), so
    assert (py / "os.py").is_file() and (py / "lib-dynload").is_dir()
    for dropped in ("test", "idlelib", "tkinter", "ensurepip", "lib2to3", "turtledemo",
                    "pydoc_data", "distutils", "site-packages", "dist-packages"):  # fmt: skip
        assert not (py / dropped).exists(), dropped
    assert not list(py.glob("lib-dynload/_test*"))
    for pkg in ("aether", "chronus", "insandbox"):
        assert (py / pkg / "__init__.py").is_file(), pkg
    assert sorted(p.name for p in (py / "dsec").glob("*.py")) == ["__init__.py", "wire_schema.py"]
    manifest = json.loads((toolkit_dir / "toolkit.json").read_text())
    assert manifest["sha256"].startswith(toolkit_dir.name)
    assert manifest["argv_prefix"] == toolkit_argv("m")[:-2]
    assert toolkit_image(toolkit_dir).is_file()


def test_every_module_is_precompiled_unchecked(toolkit_dir: Path) -> None:
    py = toolkit_dir / "lib" / "python3.11"
    sources = [p for p in py.rglob("*.py")]
    assert len(sources) > 400
    for src in sources:
        pyc = src.parent / "__pycache__" / f"{src.stem}.cpython-311.pyc"
        assert pyc.is_file(), src
    flags = int.from_bytes((py / "__pycache__" / "os.cpython-311.pyc").read_bytes()[4:8], "little")
    assert flags == 0b01  # hash-based, check_source off: valid whatever the mtimes


def test_relocatable_and_needs_no_environment(toolkit_dir: Path) -> None:
    """The same argv form works from wherever the toolkit is (here its host path, not /.dsec)
    with an empty environment: prefix, stdlib and C extensions (_json) are found."""
    argv = toolkit_argv("json.tool", mount_point=str(toolkit_dir))
    r = subprocess.run(argv, input=b'{"a": 1}', capture_output=True, env={}, timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"a": 1}


def test_idempotent_and_content_addressed(small_repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = build_toolkit(out, small_repo, erofs=False)
    marker = (first / "toolkit.json").stat().st_mtime_ns
    assert build_toolkit(out, small_repo, erofs=False) == first
    assert (first / "toolkit.json").stat().st_mtime_ns == marker  # not rebuilt
    (small_repo / "aether" / "extra_module.py").write_text("X = 1\n")
    second = build_toolkit(out, small_repo, erofs=False)
    assert second != first
    assert (second / "lib" / "python3.11" / "aether" / "extra_module.py").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]  # atomic: no debris
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        [first.name, second.name]
    )


def test_missing_app_package_is_a_build_error(small_repo: Path, tmp_path: Path) -> None:
    from edge.runtime import ToolkitBuildError

    shutil.rmtree(small_repo / "chronus")
    with pytest.raises(ToolkitBuildError, match="chronus"):
        build_toolkit(tmp_path / "out", small_repo, erofs=False)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_confine_trampoline_is_static_and_reports_failures(
    toolkit_dir: Path, tmp_path: Path
) -> None:
    """bin/dsec-confine (chronus/confine.c) is built into the toolkit (the setup installs gcc and
    libc6-dev), statically (no loader: no LD_* or /etc/ld.so.preload is honoured before the
    command is confined), and reports where a start failed over its error descriptor."""
    confine = toolkit_dir / "bin" / "dsec-confine"
    assert os.access(confine, os.X_OK)
    assert (
        b"interpreter"
        not in subprocess.run(["file", "-b", str(confine)], capture_output=True).stdout
    )
    # its environment comes as arguments (NENV, then the variables): the process gets none
    args = ["-1", "-1", "-1", str(tmp_path), "-", "2", "PATH=/usr/bin:/bin", "A=1"]
    ok = subprocess.run(
        [str(confine), *args, "sh", "-c", 'pwd; echo "$A"'],
        capture_output=True,
        env={"GLIBC_TUNABLES": "x"},
    )
    assert ok.returncode == 0 and ok.stdout.decode().split() == [str(tmp_path), "1"]
    r, w = os.pipe()
    bad = subprocess.run(
        [str(confine), str(w), "-1", "-1", "/nonexistent-dir", "-", "0", "true"], pass_fds=[w]
    )
    os.close(w)
    assert bad.returncode == 127
    assert os.read(r, 4096).split(b"\0") == [b"chdir", b"2", b"/nonexistent-dir"]
    os.close(r)
    # CRED (ExecRequest.user): groups, gid and uid set before chdir and exec
    as_user = subprocess.run(
        [
            str(confine),
            "-1",
            "-1",
            "-1",
            "/",
            "65534:65533:65533,65532",
            "1",
            "PATH=/usr/bin:/bin",
            "sh",
            "-c",
            "id -u; id -g; id -G",
        ],
        capture_output=True,
    )
    assert as_user.returncode == 0, as_user.stderr
    assert as_user.stdout.decode().split() == ["65534", "65533", "65533", "65532"]
    r, w = os.pipe()
    malformed = subprocess.run(
        [str(confine), str(w), "-1", "-1", "/", "65534", "0", "true"], pass_fds=[w]
    )
    os.close(w)
    assert malformed.returncode == 127
    assert os.read(r, 4096).split(b"\0") == [b"user", b"22", b"65534"]
    os.close(r)


SPAWN_PROBE = r"""
import json, os, sys
from chronus import _spawn
from chronus.seccomp import program

tmp = sys.argv[1]
out = {}

def run(argv, cwd="/", fds=None, ruleset=-1, code=None, creds=None, env=None):
    r, w = os.pipe()
    env = env if env is not None else ["PATH=/usr/bin:/bin"]
    got = _spawn.spawn(argv[0].encode(), [a.encode() for a in argv], [e.encode() for e in env],
                       cwd.encode(), [(w, 1)] + (fds or []), ruleset, code, creds, None)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    if got[0] == 0:
        return list(got[1:])
    _, status = os.waitpid(got[0], 0)
    return [os.waitstatus_to_exitcode(status), data.decode()]

out["ok"] = run(["sh", "-c", "pwd; echo $A; exit 3"], cwd=tmp, env=["PATH=/usr/bin:/bin", "A=1"])
out["chdir"] = run(["true"], cwd="/nonexistent-dir")
out["missing"] = run(["no-such-program"])
out["user"] = run(["sh", "-c", "id -u; id -g; id -G"], creds=(65534, 65533, [65533, 65532]))
# the descriptor handed over as 5 is the one numbered 1 here (stdout): sources are copied
# away before any target is replaced
r, w = os.pipe()
os.dup2(w, 7, inheritable=False)  # close-on-exec, as all of chronus's are
out["fds"] = run(["sh", "-c", "echo via5 >&5; echo via7 >&7 2>/dev/null || echo 7closed"],
                 fds=[(7, 5)])
os.close(7); os.close(w)
out["fd5"] = os.read(r, 100).decode()
os.close(r)
# signals Python ignores are default again, and none is blocked
out["signals"] = run(["sh", "-c", "grep -E '^Sig(Ign|Blk)' /proc/self/status"])
out["session"] = run(["sh", "-c", "echo $$; cut -d' ' -f6 /proc/self/stat"])
# seccomp: the command filter refuses TIOCSTI
ioctl = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
         "fd = os.open('/dev/null', os.O_RDWR); "
         "print(libc.ioctl(fd, ctypes.c_ulong(0x5412), ctypes.c_char_p(bytes(8))), ctypes.get_errno())")
out["seccomp"] = run(["/usr/bin/python3", "-S", "-c", ioctl], code=program())
print(json.dumps(out))
"""


def test_spawn_extension_starts_commands_confined_in_one_exec(
    toolkit_dir: Path, tmp_path: Path
) -> None:
    """chronus._spawn (chronus/spawn.c) is built into the toolkit when the Python headers are
    there (the setup installs python3-dev), and starts a command as dsec-confine would, with
    no trampoline: cwd and environment, failures as (step, errno, detail) with the child
    reaped, credentials, descriptors handed over without one clobbering another, default
    signal dispositions and an empty mask, a new session, the seccomp filter."""
    py = toolkit_dir / "lib" / "python3.11" / "chronus"
    assert list(py.glob("_spawn.*.so")), "chronus._spawn not built"
    argv = [*toolkit_python(str(toolkit_dir)), "-c", SPAWN_PROBE, str(tmp_path)]
    r = subprocess.run(argv, capture_output=True, env={}, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] == [3, f"{tmp_path}\n1\n"]
    assert out["chdir"] == ["chdir", 2, "/nonexistent-dir"]
    assert out["missing"] == ["exec", 2, "no-such-program"]
    assert out["user"] == [0, "65534\n65533\n65533 65532\n"]
    assert out["fds"] == [0, "7closed\n"] and out["fd5"] == "via5\n"
    # /proc/self/status lists SigBlk before SigIgn: read them by name
    masks = dict(line.split(":") for line in out["signals"][1].splitlines())
    ign, blk = int(masks["SigIgn"], 16), int(masks["SigBlk"], 16)
    assert out["signals"][0] == 0
    # Python ignores SIGPIPE and SIGXFSZ: the command gets them back at their default (other
    # ignored dispositions survive exec, as with posix_spawn: e.g. SIGHUP under nohup)
    pipe, xfsz = 1 << (signal.SIGPIPE - 1), 1 << (signal.SIGXFSZ - 1)
    assert ign & (pipe | xfsz) == 0 and blk == 0, out["signals"]
    assert out["seccomp"][0] == 0 and out["seccomp"][1].split() == ["-1", "1"]  # EPERM
    leader, sid = out["session"][1].split()  # the shell leads a session of its own
    assert out["session"][0] == 0 and leader == sid


@pytest.mark.parametrize(
    ("argv", "status", "says"),
    [
        (["-g", "staff", "id"], 1, "option '-g' is not supported in a dsec sandbox"),
        (["--askpass", "id"], 1, "option '--askpass' is not supported"),
        (["-i", "-s", "id"], 1, "you may not specify both the -i and -s options"),
        (["-u"], 1, "option requires an argument -- 'u'"),
        ([], 1, "usage: sudo"),
        (["-V"], 0, "dsec-sudo"),
        (["-l"], 0, "NOPASSWD: ALL"),
        (["-k"], 0, ""),  # no cached credentials to forget
        (["-n"], 1, "usage: sudo"),
        (["-v"], 0, ""),
        # no service outside a sandbox with sudo users: it says so
        (["-n", "id"], 1, "sudo is not enabled in this sandbox"),
    ],
)
def test_dsec_sudo_is_static_and_answers_as_sudo(
    toolkit_dir: Path, argv: list[str], status: int, says: str
) -> None:
    """bin/dsec-sudo (chronus/sudo.c): sudo's options, refusing the ones it does not honour by
    name; what runs the command is chronus (tests/integration/test_sudo.py)."""
    sudo = toolkit_dir / "bin" / "dsec-sudo"
    assert (
        b"interpreter" not in subprocess.run(["file", "-b", str(sudo)], capture_output=True).stdout
    )
    r = subprocess.run([str(sudo), *argv], capture_output=True, text=True, timeout=10)
    assert r.returncode == status, (r.stdout, r.stderr)
    assert says in r.stdout + r.stderr

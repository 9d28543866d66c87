"""The toolkit build: content-addressed, idempotent, atomic, self-contained."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from edge.toolkit import APP_PACKAGES, build_toolkit, toolkit_argv, toolkit_image

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

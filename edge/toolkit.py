"""The toolkit layer: a relocatable Python + the in-sandbox agents, mounted read-only at /.dsec.

aether and chronus must run in ANY image, including one with no libc, no python and no /bin/sh.
So the toolkit carries its own: Debian's /usr/bin/python3.11, its dynamic loader and every shared
library the interpreter and the kept stdlib extension modules need (ldd), the stdlib, and the app
code (aether/, chronus/, insandbox/ -- what the two share --, and of the generated dsec package
only dsec/__init__.py and dsec/wire_schema.py: no protobuf/grpc inside sandboxes, DESIGN.md
"every megabyte counts").

Launch trick (`toolkit_argv`): pid 1 is the toolkit's own loader, asked to run the interpreter:

    /.dsec/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path /.dsec/lib \\
        /.dsec/bin/python3.11 -I -S -B -m <module>

- The loader is named explicitly, so the image's /lib64/ld-linux-x86-64.so.2 (if any) is never
  used; `--library-path` resolves every library from /.dsec/lib and `--inhibit-cache` ignores the
  image's /etc/ld.so.cache. These are loader *arguments*, not LD_LIBRARY_PATH: nothing is put in
  the environment, so processes chronus starts (the image's own bash, python, gcc) inherit no
  loader or Python variable of the toolkit and use the image's libc as they should.
- PYTHONHOME is ignored under -I, and is not needed: the loader passes the interpreter path as
  argv[0], so sys.executable is /.dsec/bin/python3.11 and CPython's getpath finds its landmark
  /.dsec/lib/python3.11/os.py one level up: sys.prefix = /.dsec, stdlib and lib-dynload found.
- The app packages live in /.dsec/lib/python3.11 next to the stdlib, so -I -S (no site, no
  user site, no script dir or cwd on sys.path, no PYTHON* variables) leaves nothing in the image
  able to shadow them: an agent cannot plant an `aether.py` in the working directory.
- All .pyc are precompiled as unchecked-hash (valid regardless of mtimes, which EROFS and copies
  may not keep) with /.dsec/... as co_filename, and -B stops any write attempt at runtime.

Caveat for in-sandbox code: /proc/self/exe of the toolkit Python is the loader, and
sys.executable cannot be exec'd directly in an image without /lib64/ld-linux-x86-64.so.2;
re-launch a toolkit Python with `toolkit_argv()` (also recorded in /.dsec/toolkit.json).

The build is content-addressed (sha256 of every input file and the build format), idempotent,
and atomic (built in a temporary directory, renamed into place under a lock). Next to the
directory it writes `<dir>.erofs` (lz4hc), which the runtime mounts once per node so all sandboxes
share the same inodes and page cache (probe item 11: ~15 MB PSS saved per Python process).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.runtime.errors import ToolkitBuildError

log = logging.getLogger(__name__)

# Bump when the layout or the build steps change: part of the content hash.
BUILD_FORMAT = "dsec-toolkit/1"
MOUNT_POINT = "/.dsec"
LOADER_NAME = "ld-linux-x86-64.so.2"
PY_VERSION = "3.11"
DEFAULT_PYTHON = Path("/usr/bin/python3.11")
DEFAULT_OUT_DIR = Path("/var/lib/dsec/toolkit")

#: The in-sandbox agents and the library they share (each one a directory at the repo root).
APP_PACKAGES = ("aether", "chronus", "insandbox")
APP_FILES = ("dsec/__init__.py", "dsec/wire_schema.py")

# Top-level stdlib entries not shipped: tests, GUI, installers, build-time files, 2to3, docs data,
# and third-party package dirs (the toolkit is stdlib-only by design).
STDLIB_EXCLUDE_TOP = frozenset(
    {
        "test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
        "pydoc_data",
        "distutils",
        "site-packages",
        "dist-packages",
        "venv",
        "config-3.11-x86_64-linux-gnu",
        "__pycache__",
    }
)
# Nested test suites inside kept packages (ctypes/test, sqlite3/test, unittest/test, ...).
STDLIB_EXCLUDE_ANY = frozenset({"test", "tests", "idle_test", "__pycache__"})
# Extension modules not shipped: test helpers, and nis (deprecated; pulls in Kerberos + tirpc).
DYNLOAD_EXCLUDE = re.compile(r"^(_test|_ctypes_test|_xxtestfuzz|xxlimited|nis\.)")
# Loaded by glibc with dlopen at runtime, so ldd never lists it: pthread_cancel / thread exit
# unwinding needs it.
EXTRA_LIBS = ("libgcc_s.so.1",)


def toolkit_argv(module: str, *, mount_point: str = MOUNT_POINT) -> list[str]:
    """argv that runs `python -m <module>` from the toolkit inside any image (see module doc)."""
    return [*toolkit_python(mount_point), "-m", module]


def toolkit_python(mount_point: str = MOUNT_POINT) -> list[str]:
    """argv of the toolkit's isolated Python inside any image, before its `-m`/`-c` argument."""
    return [
        f"{mount_point}/lib/{LOADER_NAME}",
        "--inhibit-cache",
        "--library-path",
        f"{mount_point}/lib",
        f"{mount_point}/bin/python{PY_VERSION}",
        "-I",
        "-S",
        "-B",
    ]


def toolkit_image(toolkit_dir: Path) -> Path:
    """The EROFS image built next to a toolkit directory."""
    return toolkit_dir.with_name(toolkit_dir.name + ".erofs")


@dataclass(frozen=True)
class _Input:
    dest: str  # path inside the toolkit
    src: Path
    mode: int


def _run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    except OSError as exc:
        raise ToolkitBuildError(f"{argv[0]}: {exc}") from exc
    if r.returncode != 0:
        raise ToolkitBuildError(
            f"{' '.join(argv[:3])} ... failed ({r.returncode}): {r.stderr.strip()}"
        )
    result: subprocess.CompletedProcess[str] = r
    return result


def _python_paths(python: Path) -> tuple[Path, Path]:
    """(stdlib dir, lib-dynload dir) of the target interpreter, asked from itself."""
    out = _run(
        [
            os.fspath(python),
            "-I",
            "-S",
            "-c",
            "import sys, sysconfig; assert sys.version_info[:2] == (3, 11), sys.version;"
            "print(sysconfig.get_path('stdlib')); "
            "import _json, os; print(os.path.dirname(_json.__file__))",
        ]
    ).stdout.split("\n")
    return Path(out[0]), Path(out[1])


_LDD_LINE = re.compile(r"^\s*(\S+)\s+=>\s+(\S+)\s+\(0x[0-9a-f]+\)\s*$")
_LDD_LOADER = re.compile(r"^\s*(/\S*ld-linux[^\s]*)\s+\(0x[0-9a-f]+\)\s*$")


def _shared_libs(objects: list[Path]) -> tuple[dict[str, Path], Path]:
    """soname -> resolved file for every library `objects` need, and the dynamic loader."""
    out = _run(["ldd", *map(os.fspath, objects)]).stdout
    libs: dict[str, Path] = {}
    loader: Path | None = None
    for line in out.splitlines():
        if "not found" in line:
            raise ToolkitBuildError(f"ldd: unresolved library: {line.strip()}")
        m = _LDD_LINE.match(line)
        if m:
            libs[m.group(1)] = Path(m.group(2)).resolve()
            continue
        m = _LDD_LOADER.match(line)
        if m:
            loader = Path(m.group(1)).resolve()
    if loader is None:
        raise ToolkitBuildError("ldd did not report the dynamic loader of the interpreter")
    libdir = next(iter(libs.values())).parent if libs else loader.parent
    for extra in EXTRA_LIBS:
        p = libdir / extra
        if p.exists():
            libs.setdefault(extra, p.resolve())
    libs.pop(LOADER_NAME, None)
    return libs, loader


def _walk(root: Path, top_exclude: frozenset[str], any_exclude: frozenset[str]) -> Iterator[Path]:
    """Files (and symlinks) under root, relative, pruned; deterministic order."""
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in any_exclude and not (rel == Path(".") and d in top_exclude)
        )
        for f in sorted(filenames):
            if f.endswith((".pyc", ".pyo")):
                continue
            yield rel / f


def _collect(repo_root: Path, python: Path) -> list[_Input]:
    python = python.resolve()
    if not python.is_file():
        raise ToolkitBuildError(f"interpreter {python} not found")
    stdlib, dynload = _python_paths(python)
    inputs: list[_Input] = [_Input(f"bin/python{PY_VERSION}", python, 0o755)]

    dynload_rel = dynload.relative_to(stdlib)
    ext_modules = []
    for rel in _walk(stdlib, STDLIB_EXCLUDE_TOP, STDLIB_EXCLUDE_ANY):
        if rel.parent == dynload_rel:
            if DYNLOAD_EXCLUDE.match(rel.name):
                continue
            ext_modules.append(stdlib / rel)
        src = stdlib / rel
        if src.is_symlink() and not src.exists():
            continue
        inputs.append(
            _Input(f"lib/python{PY_VERSION}/{rel}", src, 0o644 if rel.suffix != ".so" else 0o755)
        )

    libs, loader = _shared_libs([python, *ext_modules])
    inputs.append(_Input(f"lib/{LOADER_NAME}", loader, 0o755))
    for soname, path in sorted(libs.items()):
        inputs.append(_Input(f"lib/{soname}", path, 0o755))

    for pkg in APP_PACKAGES:
        src_root = repo_root / pkg
        if not src_root.is_dir():
            raise ToolkitBuildError(f"app package {src_root} not found")
        for rel in _walk(src_root, frozenset(), frozenset({"__pycache__"})):
            inputs.append(_Input(f"lib/python{PY_VERSION}/{pkg}/{rel}", src_root / rel, 0o644))
    for f in APP_FILES:
        if not (repo_root / f).is_file():
            raise ToolkitBuildError(f"app file {repo_root / f} not found")
        inputs.append(_Input(f"lib/python{PY_VERSION}/{f}", repo_root / f, 0o644))
    return inputs


def _digest(inputs: list[_Input]) -> str:
    h = hashlib.sha256(BUILD_FORMAT.encode() + b"\0")
    for item in sorted(inputs, key=lambda i: i.dest):
        h.update(f"{item.dest}\0{item.mode:o}\0".encode())
        with open(item.src, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def _populate(tmp: Path, inputs: list[_Input], python: Path, digest: str) -> None:
    for item in inputs:
        dst = tmp / item.dest
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(item.src, dst)
        os.chmod(dst, item.mode)
    manifest = {
        "format": BUILD_FORMAT,
        "sha256": digest,
        "python": PY_VERSION,
        "argv_prefix": toolkit_python(),
    }
    (tmp / "toolkit.json").write_text(json.dumps(manifest, indent=1) + "\n")
    # Compile with the target interpreter itself (its magic number), naming the files by their
    # in-sandbox paths so tracebacks point at /.dsec/...; unchecked-hash: never revalidated.
    _run(
        [
            os.fspath(python),
            "-I",
            "-S",
            "-c",
            "import compileall, py_compile, sys; ok = compileall.compile_dir("
            "sys.argv[1], quiet=1, workers=0, stripdir=sys.argv[2], prependdir=sys.argv[3], "
            "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH); "
            "sys.exit(0 if ok else 1)",
            os.fspath(tmp / "lib" / f"python{PY_VERSION}"),
            os.fspath(tmp),
            MOUNT_POINT,
        ]
    )
    _build_programs(tmp)
    for p in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        os.chmod(p, 0o755)


#: The toolkit's C programs: bin/<name> from its source under lib/python3.11/.
PROGRAMS = {"dsec-confine": "chronus/confine.c", "dsec-sudo": "chronus/sudo.c"}
#: Where dsec-sudo is, relative to the toolkit (/.dsec in a sandbox).
SUDO_SHIM = "bin/dsec-sudo"
# Static (no loader: no LD_* or /etc/ld.so.preload is honoured before the command is confined),
# position-independent, hardened: it parses arguments while still unconfined.
_HARDENED = (
    "-fstack-protector-strong",
    "-fstack-clash-protection",
    "-D_FORTIFY_SOURCE=2",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-s",
)
CONFINE_CFLAGS = ("-O2", "-static-pie", *_HARDENED)
_QUIET: dict[str, Any] = {"capture_output": True, "text": True}


def _compiler() -> str | None:
    return shutil.which("gcc") or shutil.which("cc")


#: The toolkit's C extension modules: lib/python3.11/<module path><EXT_SUFFIX> from its source.
#: chronus._spawn starts commands confined in one exec (chronus/spawn.c); without it (no
#: compiler, no Python headers) chronus starts them through bin/dsec-confine.
EXTENSIONS = {"chronus/_spawn": "chronus/spawn.c"}
EXTENSION_CFLAGS = ("-O2", "-shared", "-fPIC", *_HARDENED)


def _python_headers() -> Path | None:
    """The directory of Python.h for the interpreter the toolkit ships (this one)."""
    include = Path(sysconfig.get_paths()["include"])
    return include if (include / "Python.h").is_file() else None


def _compiler_id() -> str:
    """What the trampoline is built with, for the toolkit's hash: a toolkit built without a
    compiler (no dsec-confine) or with another one is another toolkit."""
    cc = _compiler()
    if cc is None:
        return "no-compiler"
    version = subprocess.run([cc, "--version"], **_QUIET).stdout.splitlines()[:1]
    libc = subprocess.run([cc, "-print-file-name=libc.a"], **_QUIET).stdout.strip()
    libc_id = ""
    if os.path.isfile(libc):
        st = os.stat(libc)
        libc_id = f"{libc}:{st.st_size}:{st.st_mtime_ns}"
    headers = _python_headers()
    headers_id = ""
    if headers is not None:
        st = (headers / "Python.h").stat()
        headers_id = f"{headers}:{st.st_size}:{st.st_mtime_ns}"
    return "|".join([*version, libc_id, *CONFINE_CFLAGS, headers_id, *EXTENSION_CFLAGS])


def _build_programs(tmp: Path) -> None:
    """The static programs of PROGRAMS. bin/dsec-confine is the trampoline chronus starts
    commands through (vfork-cheap and confined in a domain of their own: chronus/confine.c,
    chronus/proc.py); bin/dsec-sudo is sudo in a sandbox (chronus/sudo.c, chronus/sudo.py).
    Without a C compiler the toolkit has neither: chronus forks each command instead (slower,
    as safe), and the backend does not offer sudo (SandboxSpec.sudo_users is refused)."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler: the toolkit has no dsec-confine (chronus will fork commands)"
                    " and no dsec-sudo (no sudo in sandboxes)")  # fmt: skip
        return
    for name, source in PROGRAMS.items():
        src = tmp / "lib" / f"python{PY_VERSION}" / source
        out = tmp / "bin" / name
        r = subprocess.run([cc, *CONFINE_CFLAGS, "-o", os.fspath(out), os.fspath(src)], **_QUIET)
        if r.returncode != 0:
            log.warning("%s not built: %s", name, r.stderr.strip())
            out.unlink(missing_ok=True)
            continue
        os.chmod(out, 0o755)
    headers = _python_headers()
    if headers is None:
        log.warning("no Python headers (python3-dev): chronus starts commands through "
                    "dsec-confine (one exec more per command)")  # fmt: skip
        return
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for module, source in EXTENSIONS.items():
        src = tmp / "lib" / f"python{PY_VERSION}" / source
        out = tmp / "lib" / f"python{PY_VERSION}" / f"{module}{suffix}"
        argv = [cc, *EXTENSION_CFLAGS, f"-I{headers}", "-o", os.fspath(out), os.fspath(src)]
        r = subprocess.run(argv, **_QUIET)
        if r.returncode != 0:
            log.warning("%s not built: %s", module, r.stderr.strip())
            out.unlink(missing_ok=True)
            continue
        os.chmod(out, 0o755)


def build_toolkit(
    out_dir: Path = DEFAULT_OUT_DIR,
    repo_root: Path | None = None,
    *,
    python: Path = DEFAULT_PYTHON,
    erofs: bool = True,
) -> Path:
    """Build (or find) the toolkit for the current inputs; returns `out_dir/<sha12>`.

    Also makes `out_dir/<sha12>.erofs` unless erofs=False. Cheap when nothing changed: it hashes
    the inputs (~30 MB) and returns the existing directory.
    """
    repo_root = Path(repo_root) if repo_root else Path(__file__).resolve().parent.parent
    out_dir = Path(out_dir)
    inputs = _collect(repo_root, python)
    digest = hashlib.sha256(f"{_digest(inputs)}\0{_compiler_id()}".encode()).hexdigest()
    final = out_dir / digest[:12]
    image = toolkit_image(final)
    if final.is_dir() and (image.is_file() or not erofs):
        return final
    out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir / ".lock"):
        if not final.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest[:12]}-", dir=out_dir))
            try:
                _populate(tmp, inputs, python.resolve(), digest)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            log.info("built toolkit %s (%d files)", final, len(inputs))
        if erofs and not image.is_file():
            tmp_image = out_dir / f".tmp-{digest[:12]}-{os.getpid()}.erofs"
            try:
                _run(
                    [
                        "mkfs.erofs",
                        "--quiet",
                        "-zlz4hc",
                        "--all-root",
                        # Reproducible: the same toolkit is the same bytes on every edge, so
                        # a VM template saved with one edge's toolkit serves every edge's
                        # clones (their page cache holds its blocks).
                        "-T0",
                        f"-U{uuid.UUID(digest[:32])}",
                        os.fspath(tmp_image),
                        os.fspath(final),
                    ]
                )
                os.rename(tmp_image, image)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp_image.unlink()
    return final


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

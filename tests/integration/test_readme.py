"""The README's examples, run as a user runs them.

Every fenced ``python``, ``sh`` and ``bash`` block of README.md and docs/*.md runs, in document
order, against a cluster started here the way `dsec up` starts one (TCP on loopback, fixed
ports from a port base of its own): Python blocks with the project's virtualenv interpreter
(the README's `source .venv/bin/activate`), shell blocks with `bash -e -o pipefail` and the
virtualenv first on PATH; ``$DSEC_HOME`` is the test cluster's, so `Client()` and `dsec` find it
as they find `dsec up`'s. The working directory is a scratch directory with links to the
repository's examples/ and bench/ (the README's commands run from the repository's root).
Blocks without a language are output or listings and are not run.

A block that is not meant to run says why on the line above it, and the test honours it:

    <!-- readme-test: skip: <why> -->

The only substitutions are the ones the README states: `dsec up`'s ports (7100, 7130, 7131, ...)
move with ``--port-base`` (:data:`PORT_BASE` here), and ``~/.dsec`` is ``$DSEC_HOME``.

Names resolve in a private internet: the edge's DNS upstream is a resolver in a network
namespace this test creates (tests/adversarial/netlab.py), with listeners for pypi.org,
files.pythonhosted.org and registry.npmjs.org; no traffic leaves the machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsecctl.cluster import EdgeSpec, LocalCluster
from tests.adversarial.netlab import NetLab, remove_bridge

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IMAGES = Path(os.environ.get("DSEC_IMAGE_DIR", "/var/lib/dsec/images"))
VENV_BIN = Path(sys.executable).parent
#: The test cluster's port base (`dsec up --port-base`): the README's 71NN is 7600 + NN.
PORT_BASE = 7600
INDEX = 200 + os.getpid() % 50
BRIDGE = f"dsr{os.getpid() % 100000}"
PIN_DIR = Path(f"/sys/fs/bpf/dsec-readme-{os.getpid()}")
MARKER = re.compile(r"^<!-- readme-test: skip: (?P<why>.+?) -->$")
LANGS = {"python": "python", "sh": "sh", "bash": "sh"}
BLOCK_TIMEOUT_S = 600
#: Variables bash sets for itself: not carried from one shell block to the next.
SHELL_OWN = frozenset({"_", "SHLVL", "PWD", "OLDPWD", "BASH_EXECUTION_STRING"})

pytestmark = pytest.mark.images("busybox", "bookworm", "python", "e2b-base")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str  # "python" or "sh"
    body: str
    skip: str  # why it is not run ("" = it runs)

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """The runnable fenced blocks of ``doc``, in order, each with its marker if any."""
    found: list[Block] = []
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        i = end + 1
        if lang not in LANGS:
            continue
        above = lines[start - 1] if start > 0 else ""
        marker = MARKER.match(above)
        found.append(
            Block(
                doc,
                start + 1,
                LANGS[lang],
                "\n".join(lines[start + 1 : end]) + "\n",
                marker.group("why") if marker else "",
            )
        )
    return found


ALL = [b for doc in DOCS for b in blocks(doc)]


def substitute(text: str, home: Path) -> str:
    """The README's stated substitutions: its ports and its $DSEC_HOME."""
    text = re.sub(r"127\.0\.0\.1:71(\d\d)\b", lambda m: f"127.0.0.1:{PORT_BASE + int(m[1])}", text)
    return text.replace("~/.dsec", str(home))


@dataclass
class Readme:
    cluster: LocalCluster
    env: dict[str, str]
    workdir: Path


@pytest.fixture(scope="module")
def readme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Readme]:
    net = NetLab(
        INDEX,
        {
            "pypi.org": f"10.199.{INDEX}.3",
            "registry.npmjs.org": f"10.199.{INDEX}.4",
            "files.pythonhosted.org": f"10.199.{INDEX}.5",
        },
        tag="r",
    )
    home = tmp_path_factory.mktemp("readme")
    workdir = tmp_path_factory.mktemp("readme-cwd")
    for d in ("examples", "bench"):
        (workdir / d).symlink_to(ROOT / d)
    cluster = None
    try:
        net.start()
        cluster = LocalCluster(
            home,
            fixed_ports=True,
            port_base=PORT_BASE,
            edges=[
                EdgeSpec(
                    edge_id="edge0",
                    runtime="container",
                    extra_env={
                        "DSEC_EDGE_IMAGE_DIR": str(IMAGES),
                        "DSEC_EDGE_FNCALL_POOLS": "python=1,cpp=1,bash=1",
                        "DSEC_EDGE_NET_BRIDGE": BRIDGE,
                        "DSEC_EDGE_NET_SUBNET": f"10.234.{INDEX}.0/24",
                        "DSEC_EDGE_DNS_UPSTREAM": net.dns,
                        "DSEC_EDGE_BPF_PIN_DIR": str(PIN_DIR),
                        "DSEC_EDGE_CGROUP_PARENT": f"dsec-readme-{os.getpid()}",
                        "DSEC_EDGE_PAUSE_SWAP_MB": "1024",
                    },
                )
            ],
        )
        cluster.start(timeout_s=120)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DSEC_", "E2B_", "PYTEST_")) and k != "VIRTUAL_ENV"
        }
        env.update(
            DSEC_HOME=str(home),
            PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
            VIRTUAL_ENV=str(VENV_BIN.parent),
            PYTHONPATH=str(ROOT),
        )
        yield Readme(cluster, env, workdir)
    finally:
        if cluster is not None:
            cluster.stop()
        net.close()
        remove_bridge(BRIDGE)
        shutil.rmtree(PIN_DIR, ignore_errors=True)


def test_every_runnable_block_is_found() -> None:
    """The parser sees the README's examples (a broken fence would silently drop them)."""
    readme_blocks = [b for b in ALL if b.doc.name == "README.md"]
    assert len(readme_blocks) >= 20, [b.name for b in readme_blocks]
    assert all(b.skip for b in ALL if "make up" in b.body)  # the set-up itself is not re-run
    # A block not run names what covers it instead (a test, or why nothing here can).
    for b in ALL:
        assert not b.skip or len(b.skip) > 20, (b.name, b.skip)


#: Every block that runs, twice: the whole sequence again after the first (the examples clean
#: up after themselves, and a reader may run one again). The marked ones are not test cases.
RUNS = [(b, n) for n in (1, 2) for b in ALL if not b.skip]


@pytest.mark.parametrize(
    ("block", "round_"), RUNS, ids=[b.name + (" again" if n == 2 else "") for b, n in RUNS]
)
def test_block(block: Block, round_: int, readme: Readme) -> None:
    body = substitute(block.body, readme.cluster.home)
    saved = readme.workdir / ".env"
    if block.lang == "python":
        argv = [str(VENV_BIN / "python"), "-c", body]
    else:  # what it exports reaches the blocks after it, as in one shell session
        trap = f"trap 'env -0 > {saved}' EXIT\n"
        argv = ["bash", "-e", "-o", "pipefail", "-c", trap + body]
    r = subprocess.run(
        argv,
        cwd=readme.workdir,
        env=readme.env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    if block.lang == "sh" and r.returncode == 0:
        pairs = (item.split("=", 1) for item in saved.read_text().split("\0") if "=" in item)
        readme.env.clear()
        readme.env.update((k, v) for k, v in pairs if k not in SHELL_OWN)
    assert r.returncode == 0, (
        f"{block.name} ({block.lang}) exited {r.returncode}\n--- stdout\n{r.stdout[-3000:]}"
        f"\n--- stderr\n{r.stderr[-5000:]}"
    )


def test_dsec_is_on_the_path_and_the_venv_has_libdsec() -> None:
    """What the README's Start says after the set-up (`make test` runs it first): `dsec` on a
    plain login PATH, and libdsec in the virtualenv the README activates."""
    plain = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
    }
    r = subprocess.run(
        ["bash", "-c", "command -v dsec && dsec --version"],
        env=plain,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("dsec "), r
    r = subprocess.run(
        [
            "bash",
            "-c",
            "source .venv/bin/activate && python -c 'import libdsec, e2b, sandbox_fusion'",
        ],
        cwd=ROOT,
        env=plain,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr

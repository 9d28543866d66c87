"""The E2B-compatible API (compat/) against libdsec on the same cluster, same run.

1. create -> first command: ``Sandbox.create()`` + ``commands.run("true")`` through the real
   e2b SDK, vs ``create(image="bookworm")`` + ``run("true")`` through libdsec (same image,
   cpu and memory; alternated rounds), p50/p99.
2. ``commands.run("true")`` on a running sandbox, vs libdsec ``run("true")`` and vs libdsec
   running what the SDK runs (``/bin/bash -l -c true``: a login shell reads the profile).
3. A 256 MB upload and download (generated data, never on disk): ``files.write`` /
   ``files.read(format="stream")`` vs libdsec ``files.upload`` / ``iter_download``.
4. A template build of a small Dockerfile (E2B's base, a ``pip install`` of a local wheel, a
   COPY) through E2B's ``Template.build`` vs ``docker build --no-cache`` of the same
   Dockerfile on the local engine (its base: the e2b-base image, which dsec's ``e2b-base``
   environment is imported from; no registry); then create -> first command from that
   template vs from ``base``.

Target (the issue): within 2x of libdsec on each.

usage: python bench/bench_e2b.py [--rounds 10] [--runs 100] [--mb 256] [--builds 3]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import IMAGES, cluster, pct, table
from dsecctl.cluster import EdgeSpec
from libdsec import Client

MIB = 1 << 20


class Generated(io.RawIOBase):
    """``size`` bytes of a repeating pattern, produced as read (a file object for both SDKs)."""

    def __init__(self, size: int) -> None:
        self.left = size
        self.block = (b"dsec-e2b-bench-" * 70000)[:MIB]

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def, override]
        n = min(len(b), self.left, MIB)
        b[:n] = self.block[:n]
        self.left -= n
        return n


#: The Docker engine's copy of the image dsec's e2b-base environment comes from.
DOCKER_BASE = "dsec/e2b-base:latest"
WHEEL = "dsec_bench_pkg-1.0-py3-none-any.whl"
DOCKERFILE = f"""FROM {{base}}
COPY {WHEEL} /opt/pkgs/
RUN pip install --no-index --break-system-packages /opt/pkgs/{WHEEL}
COPY app /opt/app
"""


def build_context(root: Path) -> None:
    """A local wheel (a module and its metadata) and an app directory to COPY."""
    with zipfile.ZipFile(root / WHEEL, "w") as z:
        z.writestr("dsec_bench_pkg.py", "VALUE = 42\n")
        info = "dsec_bench_pkg-1.0.dist-info/"
        z.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: dsec-bench-pkg\nVersion: 1.0\n")
        z.writestr(
            info + "WHEEL",
            "Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(info + "RECORD", "")
    (root / "app").mkdir()
    for i in range(20):
        (root / "app" / f"mod{i}.py").write_text(f"X = {i}\n" * 100)


def template_builds(rounds: int, builds: int) -> dict[str, list[float]]:
    """E2B Template.build vs docker build of the same Dockerfile; creates from the template
    vs from base. The E2B_* variables are set."""
    from e2b import Sandbox, Template

    out: dict[str, list[float]] = {"e2b": [], "docker": [], "tpl": [], "base": []}
    with tempfile.TemporaryDirectory(prefix="bench-e2b-tpl-") as d:
        root = Path(d)
        build_context(root)
        (root / "Dockerfile").write_text(DOCKERFILE.format(base=DOCKER_BASE))
        e2b_file = DOCKERFILE.format(base="e2bdev/base")
        for i in range(builds):
            t = time.perf_counter()
            Template.build(
                Template(file_context_path=str(root)).from_dockerfile(e2b_file),
                "bench-tpl",
                cpu_count=1,
                memory_mb=512,
                skip_cache=True,
            )
            out["e2b"].append(time.perf_counter() - t)
            t = time.perf_counter()
            subprocess.run(
                [
                    "docker",
                    "build",
                    "--no-cache",
                    "--network",
                    "none",
                    "-q",
                    "-t",
                    f"bench-tpl:{i}",
                    str(root),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            out["docker"].append(time.perf_counter() - t)
        for i in range(builds):
            subprocess.run(["docker", "rmi", "-f", f"bench-tpl:{i}"], stdout=subprocess.DEVNULL)
        probe = Sandbox.create("bench-tpl")
        assert (
            probe.commands.run("python3 -c 'import dsec_bench_pkg as m; print(m.VALUE)'").stdout
            == "42\n"
        )
        probe.kill()
        for _ in range(rounds):
            for which, template in (("tpl", "bench-tpl"), ("base", "base")):
                t = time.perf_counter()
                sb = Sandbox.create(template, timeout=300)
                sb.commands.run("true")
                out[which].append(time.perf_counter() - t)
                sb.kill()
    return out


def ms(values: list[float]) -> tuple[float, float]:
    return pct([v * 1000 for v in values], 50), pct([v * 1000 for v in values], 99)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--builds", type=int, default=3)
    args = ap.parse_args()
    edge = EdgeSpec(
        edge_id="bench",
        runtime="container",
        extra_env={"DSEC_EDGE_IMAGE_DIR": str(IMAGES), "DSEC_EDGE_FNCALL_POOLS": ""},
    )
    with cluster(edges=[edge]) as c, Client(c.apiserver, token=c.token) as admin:
        key = admin.create_token("bench-e2b", agent=True).secret
        os.environ.update(E2B_API_URL=c.compat_url, E2B_SANDBOX_URL=c.compat_url, E2B_API_KEY=key)
        from e2b import Sandbox  # after the variables: the SDK reads them per call anyway

        with Client(c.apiserver, token=key) as dsec:
            # warm-up: the image's first use on the node, both paths' connections
            dsec.create(image="bookworm").stop(grace_s=0)
            Sandbox.create().kill()

            created: dict[str, list[float]] = {"e2b": [], "libdsec": []}
            for _ in range(args.rounds):
                t = time.perf_counter()
                sb = dsec.create(image="bookworm", cpu=1, memory_mb=512, ttl_s=300)
                sb.run("true")
                created["libdsec"].append(time.perf_counter() - t)
                sb.stop(grace_s=0)
                t = time.perf_counter()
                es = Sandbox.create(timeout=300)
                es.commands.run("true")
                created["e2b"].append(time.perf_counter() - t)
                es.kill()

            sb = dsec.create(image="bookworm", cpu=1, memory_mb=512, ttl_s=600)
            es = Sandbox.create(timeout=600)
            runs: dict[str, list[float]] = {"e2b": [], "libdsec": [], "libdsec bash -l": []}
            for _ in range(args.runs):
                t = time.perf_counter()
                es.commands.run("true")
                runs["e2b"].append(time.perf_counter() - t)
                t = time.perf_counter()
                sb.run("true")
                runs["libdsec"].append(time.perf_counter() - t)
                t = time.perf_counter()
                sb.run(["/bin/bash", "-l", "-c", "true"])
                runs["libdsec bash -l"].append(time.perf_counter() - t)

            size = args.mb * MIB
            t = time.perf_counter()
            sb.files.upload(Generated(size), "/tmp/big.bin")
            up_dsec = time.perf_counter() - t
            t = time.perf_counter()
            es.files.write("/tmp/big.bin", Generated(size))
            up_e2b = time.perf_counter() - t
            t = time.perf_counter()
            n_dsec = sum(len(x) for x in sb.files.iter_download("/tmp/big.bin"))
            down_dsec = time.perf_counter() - t
            t = time.perf_counter()
            n_e2b = sum(len(x) for x in es.files.read("/tmp/big.bin", format="stream"))
            down_e2b = time.perf_counter() - t
            assert n_e2b == size and n_dsec == size, (n_e2b, n_dsec)
            sb.stop(grace_s=0)
            es.kill()
            tpl = template_builds(args.rounds, args.builds)

    rows = []
    for what, e2b_vals, dsec_vals in (
        ("create -> first command", created["e2b"], created["libdsec"]),
        ('run("true")', runs["e2b"], runs["libdsec"]),
        ('run("true") vs bash -l -c true', runs["e2b"], runs["libdsec bash -l"]),
    ):
        (e50, e99), (d50, d99) = ms(e2b_vals), ms(dsec_vals)
        rows.append([what, e50, e99, d50, d99, f"{e50 / d50:.2f}x", f"{e99 / d99:.2f}x"])
    table(
        f"E2B SDK through compat vs libdsec (same cluster, {args.rounds} creates, {args.runs} runs)",
        ["", "e2b p50 ms", "e2b p99 ms", "libdsec p50 ms", "libdsec p99 ms", "p50", "p99"],
        rows,
    )
    table(
        f"{args.mb} MB transfer (generated data)",
        ["", "e2b s", "libdsec s", "e2b MB/s", "libdsec MB/s", "ratio"],
        [
            [
                "upload",
                up_e2b,
                up_dsec,
                size / up_e2b / 1e6,
                size / up_dsec / 1e6,
                f"{up_e2b / up_dsec:.2f}x",
            ],
            [
                "download",
                down_e2b,
                down_dsec,
                size / down_e2b / 1e6,
                size / down_dsec / 1e6,
                f"{down_e2b / down_dsec:.2f}x",
            ],
        ],
    )
    (b50, b99), (k50, k99) = ms(tpl["e2b"]), ms(tpl["docker"])
    (t50, t99), (s50, s99) = ms(tpl["tpl"]), ms(tpl["base"])
    table(
        f"Template build ({args.builds} builds, no cache) and create from it ({args.rounds})",
        ["", "p50 ms", "p99 ms", "vs p50 ms", "vs p99 ms", "p50", "p99"],
        [
            [
                "E2B build vs docker build",
                b50,
                b99,
                k50,
                k99,
                f"{b50 / k50:.2f}x",
                f"{b99 / k99:.2f}x",
            ],
            [
                "create+run: template vs base",
                t50,
                t99,
                s50,
                s99,
                f"{t50 / s50:.2f}x",
                f"{t99 / s99:.2f}x",
            ],
        ],
    )


if __name__ == "__main__":
    main()

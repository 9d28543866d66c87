"""Operator commands on a layer store, without a running edge (offline maintenance).

    python -m edge.layers [--store DIR] import-base [NAME ...]   flat base images -> environments
    python -m edge.layers [--store DIR] import SOURCE [--name N] [--kind K] [--base B]
    python -m edge.layers [--store DIR] list | layers
    python -m edge.layers [--store DIR] collapse NAME [--threshold-mb 64] [--as NEW]
    python -m edge.layers [--store DIR] gc [--grace-s 3600]
    python -m edge.layers [--store DIR] verify NAME        hash every layer of an environment

Defaults follow the edge's configuration (DSEC_EDGE_LAYER_STORE, DSEC_EDGE_IMAGE_DIR); the
node cache is a directory of its own (--cache), so these commands never touch a running edge's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from edge.layers.model import LayerKind
from edge.layers.node import check_blob
from edge.layers.service import Environments, LayerSettings
from libdsec.errors import DSecError


def _settings(args: argparse.Namespace) -> LayerSettings:
    return LayerSettings(
        store_root=args.store,
        cache_dir=args.cache,
        node_id=args.node,
        image_dir=args.image_dir,
        gc_grace_s=getattr(args, "grace_s", 3600.0),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edge.layers", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--store",
        type=Path,
        default=Path(os.environ.get("DSEC_EDGE_LAYER_STORE", "/var/lib/dsec/store")),
    )
    ap.add_argument("--cache", type=Path, default=Path("/var/lib/dsec/layer-tool-cache"))
    ap.add_argument(
        "--image-dir",
        type=Path,
        default=Path(os.environ.get("DSEC_EDGE_IMAGE_DIR", "/var/lib/dsec/images")),
    )
    ap.add_argument("--node", default="tool")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ib = sub.add_parser("import-base")
    ib.add_argument("names", nargs="*")
    im = sub.add_parser("import")
    im.add_argument("source")
    im.add_argument("--name", default="")
    im.add_argument("--kind", default="")
    im.add_argument("--base", default="")
    sub.add_parser("list")
    sub.add_parser("layers")
    co = sub.add_parser("collapse")
    co.add_argument("name")
    co.add_argument("--threshold-mb", type=float, default=64.0)
    co.add_argument("--as", dest="new_name", default="")
    gc = sub.add_parser("gc")
    gc.add_argument("--grace-s", type=float, default=3600.0)
    ve = sub.add_parser("verify")
    ve.add_argument("name")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    envs = Environments(_settings(args))
    try:
        envs.recover()
        t0 = time.monotonic()
        if args.cmd == "import-base":
            for env in envs.import_base_images(args.names or None):
                print(f"{env.name:<32} {len(env.layers)} layer(s)  {env.layers[-1].digest}")
        elif args.cmd == "import":
            env = envs.import_source(
                args.source,
                args.name,
                kind=LayerKind.parse(args.kind) if args.kind else None,
                base=args.base,
            )
            print(f"{env.name}: {[r.digest for r in env.layers]}")
        elif args.cmd == "list":
            for env in envs.list_environments():
                print(f"{env.name:<48} {len(env.layers)} layer(s)")
        elif args.cmd == "layers":
            for info in envs.list_layers():
                print(f"{info.digest}  {info.kind.value:<9} {info.size_bytes:>12}  {info.source}")
        elif args.cmd == "collapse":
            env = envs.collapse(args.name, int(args.threshold_mb * (1 << 20)), args.new_name)
            print(f"{env.name}: {len(env.layers)} layer(s)")
        elif args.cmd == "gc":
            envs.node.refresh_leases()
            report = envs.store.gc(args.grace_s, pinned=envs.node.pins())
            print(
                f"removed {len(report.removed_layers)} layers ({report.freed_bytes} bytes), "
                f"marked {len(report.marked)}, kept {len(report.kept_leased)} leased, "
                f"removed {len(report.removed_tmp)} staging dirs"
            )
        elif args.cmd == "verify":
            env = envs.get_environment(args.name)
            for ref in env.layers:
                desc = envs.store.descriptor(ref.digest)
                check_blob(ref.digest, envs.store.blob_path(ref.digest), desc)
                print(f"ok {ref.digest}")
        print(f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)
        return 0
    except DSecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if envs.store.reachable():
            envs.store.set_leases([])  # the tool holds nothing once it exits
        envs.close()


if __name__ == "__main__":
    sys.exit(main())

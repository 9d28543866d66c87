"""``dsec sandbox screenshot`` and ``dsec sandbox view``: a desktop sandbox's screen from the
shell (computer use; see libdsec's ``sb.display``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsecctl.cli_common import client, json_option, print_json


def cmd_screenshot(args: argparse.Namespace) -> int:
    """The screen as PNG, to ``-o FILE`` or to stdout; never PNG bytes onto a terminal."""
    if not args.output and sys.stdout.isatty():
        print(
            "dsec sandbox screenshot: stdout is a terminal; redirect it "
            f"(dsec sandbox screenshot {args.sandbox_id} > shot.png) or use -o FILE",
            file=sys.stderr,
        )
        return 2
    with client() as c:
        png = c.get(args.sandbox_id).display.screenshot()
    if args.output:
        Path(args.output).write_bytes(png)
    else:
        sys.stdout.buffer.write(png)
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    """The live view's URL (the API server's noVNC page, with this client's token)."""
    with client() as c:
        url = c.get(args.sandbox_id).display.viewer_url()
    if args.json:
        print_json({"sandbox_id": args.sandbox_id, "url": url})
    else:
        print(url)
    return 0


def add_display_parsers(ssub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    shot = ssub.add_parser(
        "screenshot",
        help="the screen of a sandbox with a display, as PNG (-o FILE or stdout)",
        description=(
            "Takes the whole screen of a sandbox with a display (backend vm, image desktop) "
            "as PNG: `dsec sandbox screenshot ID > shot.png` or `-o shot.png`. Refuses to "
            "write PNG bytes to a terminal."
        ),
    )
    shot.add_argument("sandbox_id", help="the sandbox's id (sb-...)")
    shot.add_argument("-o", "--output", default="", metavar="FILE", help="write the PNG here")
    shot.set_defaults(fn=cmd_screenshot)

    view = ssub.add_parser(
        "view",
        help="print the URL of the live view (watch or take over the screen in a browser)",
        description=(
            "Prints the API server's live-view page of the sandbox with your token in it "
            "(?token=...): whoever opens that URL acts as you on the sandbox's screen."
        ),
    )
    view.add_argument("sandbox_id", help="the sandbox's id (sb-...)")
    json_option(view, "print {sandbox_id, url} as one JSON object")
    view.set_defaults(fn=cmd_view)

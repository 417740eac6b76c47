"""`elflow view`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import sys
from pathlib import Path

from elflow.experiments.viewer import read_trajectory, write_page
from elflow.lifecycle.outputs import check_out


# ----------------------------------------------------------------------------------------------------------
# `elflow view`
def add_arguments(p) -> None:
    p.add_argument("trajectory", metavar="TRAJECTORY.json",
                   help="a trajectory written by `elflow sample RUN --trajectory` (OUT.trajectory.json)")
    p.add_argument("--out", default=None, help="the HTML page to write (default: TRAJECTORY with .html)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def run(args) -> int:
    out = Path(args.out) if args.out else Path(args.trajectory).with_suffix(".html")
    doc = read_trajectory(args.trajectory)  # the input first: a device or a non-trajectory writes nothing
    check_out(out, args.overwrite)
    write_page(doc, out, args.overwrite)
    print(f"wrote {out} ({len(doc['samples'])} samples x {len(doc['steps'])} steps); open it in a browser",
          file=sys.stderr)
    return 0

"""`elflow convert`: its flags and its run (the work is the library's)."""

from __future__ import annotations

from elflow.cli.common import check_counts
from elflow.lifecycle.outputs import check_out
from elflow.runs.load import convert_released
from elflow.util.budget import LENGTH_BOUND


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="the released checkpoint_<step> file, or a folder holding one")
    p.add_argument("out", help="the elflow run folder to write (its run.json and checkpoints/step_N)")
    p.add_argument("--max-length", type=int, default=None,
                   help="longest sequence the converted model samples (default: its release's, else 1024)")


def run(args) -> int:
    check_counts(args, max_length=LENGTH_BOUND)
    out = check_out(args.out, folder=True)
    out = convert_released(args.checkpoint, out, args.max_length)
    print(f"wrote {out}")
    return 0

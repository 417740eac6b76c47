"""The argument rules the benchmark scripts share with the elflow CLI: every flag is checked when the command
line is read, before any stage starts; a bad one is one line `SCRIPT: error: ...` and exit 2.

    ap = parser("few_step_text", __doc__)        # argparse's own refusals are one line too
    ...
    args = ap.parse_args(argv)
    check(args, counts={"num": SAMPLES}, scales={"lr": RATE}, seeds=("seeds",), folders=("out",),
          files=("copy_png",))

The counts, scales and seeds go through the CLI's own checks (elflow.cli.common.check_counts / check_scales,
elflow.util.errors.check_seed), the outputs through elflow.util.files.check_output, so that a script refuses
what `elflow` refuses, in the same words.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from elflow.cli.common import check_counts, check_scales
from elflow.util.budget import MAX_BATCH, MAX_SAMPLES, MAX_SAMPLING_STEPS, MAX_TRAINING_STEPS
from elflow.util.errors import ELFError, check_seed
from elflow.util.files import check_output

# (limit, why[, low]) of the counts the scripts take, as elflow.cli.common.check_counts reads them
STEPS = (MAX_TRAINING_STEPS, "ELF-B trains 95,000 steps")
ROWS = (MAX_BATCH, "the paper's batch is 512")
SAMPLES = (MAX_SAMPLES, "the paper scores 5,000 samples per setting")
SAMPLING_STEPS = (MAX_SAMPLING_STEPS, "the released recipe samples with at most 64 steps")
# (check, what) of the scales
RATE = (lambda v: math.isfinite(v) and v > 0, "a number > 0")
DECAY = (lambda v: math.isfinite(v) and 0 <= v < 1, "a number in [0, 1)")
GUIDANCE = (lambda v: math.isfinite(v) and 0 <= v <= 100, "a number from 0 to 100")


class Parser(argparse.ArgumentParser):
    """argparse's refusals (an unknown flag, a value that is no number) as one line naming the script."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (`python {sys.argv[0]} --help` lists the flags)", file=sys.stderr)
        raise SystemExit(2)


def parser(name: str, doc: str) -> Parser:
    return Parser(prog=name, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def check(args, *, counts: dict = {}, scales: dict = {}, seeds: tuple = (), folders: tuple = (),
          files: tuple = ()) -> None:
    """ELFError naming the first flag of `args` that is out of its range: the counts (name -> (limit, why[,
    low])), the scales (name -> (check, what)), the seeds (names; a list is checked value by value), the
    output folders and files (names; what stands there may be replaced, as the scripts continue a stopped
    run), and --deadline where the script has one (a unix time still to come)."""
    check_counts(args, **counts)
    check_scales(args, **scales)
    for name in seeds:
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None:
                check_seed(v, f"--{name.replace('_', '-')}")
    for name, folder in [(n, True) for n in folders] + [(n, False) for n in files]:
        value = getattr(args, name, None)
        if value is not None:
            check_output(value, overwrite=True, flag=f"--{name.replace('_', '-')}", folder=folder)
    deadline = getattr(args, "deadline", None)
    if deadline is not None and not (math.isfinite(deadline) and deadline > time.time()):
        raise ELFError(f"--deadline {deadline:g} is not a unix time still to come (now {time.time():.0f}): no stage "
                       "would start; pass a later time, or leave --deadline out")


def main_of(name: str, run) -> int:
    """`run()`'s exit code; an ELFError (bad input, found before any stage or by one) as one line, exit 2."""
    try:
        return run()
    except ELFError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2

"""`elflow claims`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import math
from pathlib import Path

from elflow.cli.common import check_counts
from elflow.experiments.claims import (
    DEFAULT_MINUTES,
    DEFAULT_SEEDS,
    NAMES,
    QUICK,
    QUICK_SEEDS,
    run_claims,
    select_claims,
)
from elflow.util.budget import SAMPLES_BOUND, TRAINING_STEPS_BOUND
from elflow.util.devices import check_device
from elflow.util.errors import ELFError


# ----------------------------------------------------------------------------------------------------------
# command line
def add_arguments(p) -> None:
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help=f"run these claims only (default: all of them): {', '.join(NAMES)}")
    p.add_argument("--quick", action="store_true",
                   help=f"the claims that need at most one training besides the base ({', '.join(QUICK)}), at "
                        f"{QUICK_SEEDS} seeds (default: off)")
    p.add_argument("--seeds", type=int, default=None,
                   help=f"seeds per variant (default: {DEFAULT_SEEDS}; {QUICK_SEEDS} with --quick)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--minutes", type=float, default=None,
                   help=f"training wall clock per variant and seed (default: {DEFAULT_MINUTES:g})")
    g.add_argument("--steps", type=int, default=None,
                   help="a step budget per variant instead (the same tokens for every variant, whatever the load "
                        "of the machine; default: none)")
    p.add_argument("--num", type=int, default=32, help="samples per figure (default: 32)")
    p.add_argument("--data", default="builtin", help="training text of every variant (default: builtin)")
    p.add_argument("--out", default="runs/claims", help="output folder; a rerun reuses its finished variants "
                   "(default: runs/claims)")
    p.add_argument("--cache-dir", default=None, help="tokenization and judge cache (default: $ELFLOW_CACHE or "
                   "~/.cache/elflow)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--verbose", action="store_true", help="show the training progress bars too")
    p.add_argument("--quiet", action="store_true", help="no progress bar over the variants")


def run(args) -> int:
    import sys


    claims = select_claims(args.only, args.quick)
    seeds = args.seeds if args.seeds is not None else (QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
    if seeds < 1 or args.num < 1:
        raise ELFError(f"--seeds and --num must be >= 1, got {seeds} and {args.num}")
    check_counts(args, steps=TRAINING_STEPS_BOUND, num=SAMPLES_BOUND)
    minutes = args.minutes if args.minutes is not None else DEFAULT_MINUTES
    if not (math.isfinite(minutes) and minutes > 0):
        raise ELFError(f"--minutes must be a positive number, got {minutes}")
    device = check_device(args.device)
    command = "elflow " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["claims"] else "elflow claims"
    run_claims(claims, args.out, seeds=seeds, minutes=minutes, steps=args.steps, num=args.num,
               base={"data": args.data}, cache_dir=args.cache_dir, device=device, quiet=not args.verbose,
               command=command, progress=not args.quiet)
    print(f"results: {Path(args.out) / 'claims.json'}, {Path(args.out) / 'claims.md'}; one plot per claim there")
    return 0

"""`elflow schedules`: its flags and its run (the work is the library's)."""

from __future__ import annotations

from elflow.experiments.schedules import EXPECTED, check_schedules, plot_schedules, schedule_statistics
from elflow.lifecycle.outputs import check_out
from elflow.util.errors import ELFError


def add_arguments(p) -> None:
    p.add_argument("--out", default="schedules.png", help="where to write the PNG")
    p.add_argument("--samples", type=int, default=200_000, help="Monte-Carlo draws per distribution")
    p.add_argument("--seed", type=int, default=0, help="seed of the Monte-Carlo draws")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")


def run(args) -> int:
    if args.samples < 2:
        raise ELFError(f"--samples must be at least 2 (medians and shares need draws), got {args.samples}")
    check_schedules(args.samples)
    check_out(args.out, args.overwrite)
    stats = schedule_statistics(n=args.samples, seed=args.seed)
    print(f"{'statistic':<22}{'measured':>10}{'expected':>11}")
    for k, v in stats.items():
        ref = EXPECTED.get(k)
        print(f"{k:<22}{v:>10.3f}{'' if ref is None else f'{ref:>11.3f}'}")
    plot_schedules(args.out, seed=args.seed, overwrite=args.overwrite)
    print(f"wrote {args.out}")
    return 0

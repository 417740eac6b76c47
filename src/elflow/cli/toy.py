"""`elflow toy`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import math

from elflow.experiments.toy import distillation_table, grid_mixture, plot_toy, ring_mixture, run_toy
from elflow.flow import SAMPLERS
from elflow.util.errors import ELFError
from elflow.util.files import check_output


def add_arguments(p) -> None:
    p.add_argument("--layout", choices=["ring", "grid"], default="ring", help="where the clusters sit")
    p.add_argument("--clusters", type=int, default=8, help="clusters on the ring (or per side of the grid)")
    p.add_argument("--num", type=int, default=44, help="samples per step count")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="step counts N")
    p.add_argument("--sampler", choices=SAMPLERS, default="ode",
                   help="ode: Euler; sde: the released step; vc: variance-consistent re-noising")
    p.add_argument("--gamma", type=float, default=1.5, help="SDE back-off scale (sde/vc only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the starting noise")
    p.add_argument("--distill", action="store_true",
                   help="also train a small network on the mixture as a teacher, distil it progressively to 4, 2 and "
                        "1 steps (teacher path: 16 Euler steps), and add their rows (about 3 CPU-minutes)")
    p.add_argument("--out", default="toy.png", help="where to write the PNG")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")


def run(args) -> int:
    if args.num < 1 or args.clusters < 1 or min(args.steps) < 1:
        raise ELFError("--num, --clusters and every --steps value must be >= 1")
    if not (math.isfinite(args.gamma) and args.gamma >= 0):
        raise ELFError(f"--gamma must be a finite number >= 0, got {args.gamma}")
    check_output(args.out, args.overwrite)
    mix = ring_mixture(args.clusters) if args.layout == "ring" else grid_mixture(args.clusters)
    gamma = 0.0 if args.sampler == "ode" else args.gamma
    res = run_toy(mix, args.steps, args.num, args.seed, args.sampler, gamma)
    print(f"{'N':>4}  inside a cluster (of {args.num})")
    for n, r in res.items():
        print(f"{n:>4}  {r['inside']:>4}  {'#' * round(40 * r['inside'] / args.num)}")
    if args.distill:
        rows = distillation_table(mix, args.num, args.seed)
        cols = ["N=1", "N=2", "N=4", "N=16"]
        print(f"\n{'model':<22}" + "".join(f"{c:>7}" for c in cols) + f"   inside a cluster (of {args.num}), ODE")
        for r in rows:
            print(f"{r['model']:<22}" + "".join(f"{r.get(c, ''):>7}" for c in cols))
        res = {**res, **{f"student {n}": r["results"][n] for r, n in zip(rows[2:], (4, 2, 1))},
               "teacher 1": rows[1]["results"][1]}
    models = "the exact denoiser" if not args.distill else "the exact denoiser, the trained teacher and its students"
    plot_toy(mix, res, args.out, f"{args.clusters}-cluster {args.layout}: {args.sampler} sampling with {models}, "
                                 "from the same starting noise", args.overwrite)
    print(f"wrote {args.out}")
    return 0

"""`elflow toy`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import json

from elflow.cli.common import check_scales
from elflow.experiments import toy_distill
from elflow.experiments.toy import grid_mixture, plot_toy, ring_mixture, run_toy
from elflow.experiments.toy_distill import TABLE_STEPS, distillation_table, energy_floor, energy_rows
from elflow.flow import SAMPLERS, SAMPLING_RANGES
from elflow.lifecycle.outputs import check_out
from elflow.util.budget import check_toy
from elflow.util.errors import ELFError
from elflow.util.files import check_stdout_open, print_result

# sizes past which a run cannot fit in a few minutes and a few hundred MB, refused before any work
MAX_NUM = 1_000_000  # samples per step count: each keeps its whole path for the figure
MAX_STEPS = 10_000  # per step count: the steps run one after another, every sample's point kept at each
MAX_STEP_COUNTS = 12  # --steps values: one panel each
MAX_CLUSTERS = {"ring": 64, "grid": 16}  # on the ring, per side of the grid (16 x 16 = 256 clusters)
MAX_KEPT = 20_000_000  # --num x the sum of --steps: the points kept for the figure (16 bytes each, 320 MB)
MAX_WORK = 1_000_000_000  # samples x steps x clusters of the exact denoiser: about one to two CPU-minutes


def add_arguments(p) -> None:
    p.add_argument("--layout", choices=["ring", "grid"], default="ring", help="where the clusters sit")
    p.add_argument("--clusters", type=int, default=8,
                   help=f"clusters on the ring (at most {MAX_CLUSTERS['ring']}), or per side of the grid "
                        f"(at most {MAX_CLUSTERS['grid']})")
    p.add_argument("--num", type=int, default=44, help=f"samples per step count in the figure (at most {MAX_NUM:,})")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help=f"step counts N (each at most {MAX_STEPS:,}, at most {MAX_STEP_COUNTS} of them)")
    p.add_argument("--sampler", choices=SAMPLERS, default="ode",
                   help="ode: Euler; sde: the released step; vc: variance-consistent re-noising")
    p.add_argument("--gamma", type=float, default=1.5, help="SDE back-off scale (sde/vc only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the starting noise")
    p.add_argument("--distill", action="store_true",
                   help="also train a small network on the mixture as a teacher, distil it progressively to 4, 2 and "
                        "1 steps (teacher path: 16 Euler steps) and into one flow-map student for as many training "
                        "steps, and add their rows: energy distances to the mixture at 1, 2, 4 (16, 64) steps "
                        "(about 3 CPU-minutes)")
    p.add_argument("--json", action="store_true",
                   help=f"print one JSON object: rows of energy distances of {toy_distill.ENERGY_SAMPLES:,} samples "
                        "to the mixture, Euler ODE whatever --sampler draws (the exact denoiser at each --steps; with "
                        "--distill every model)")
    p.add_argument("--out", default="toy.png", help="where to write the PNG")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")


def check_sizes(args) -> None:
    """ELFError, one line, for counts past their bounds or sizes that cannot fit (before any work)."""
    if args.num < 1 or args.clusters < 1 or min(args.steps) < 1:
        raise ELFError("--num, --clusters and every --steps value must be >= 1")
    if args.num > MAX_NUM:
        raise ELFError(f"--num {args.num:,} is above the limit of {MAX_NUM:,}: every sample's path is kept and "
                       "drawn in the figure; ask for fewer samples")
    if max(args.steps) > MAX_STEPS:
        raise ELFError(f"--steps {max(args.steps):,} is above the limit of {MAX_STEPS:,}: the steps run one after "
                       "another and every sample's point is kept at each; ask for fewer steps")
    if len(args.steps) > MAX_STEP_COUNTS:
        raise ELFError(f"{len(args.steps)} --steps values are more than the limit of {MAX_STEP_COUNTS}: each is a "
                       "panel of the figure; give fewer")
    limit = MAX_CLUSTERS[args.layout]
    if args.clusters > limit:
        where = "on the ring" if args.layout == "ring" else "per side of the grid"
        raise ELFError(f"--clusters {args.clusters} is above the limit of {limit} {where}: the exact denoiser's "
                       "cost grows with every cluster; ask for fewer")
    kept = args.num * sum(args.steps)
    if kept > MAX_KEPT:
        raise ELFError(f"--num x the sum of --steps is {kept:,}, above the limit of {MAX_KEPT:,} points kept for "
                       "the figure (16 bytes each); lower --num or --steps")
    clusters = args.clusters if args.layout == "ring" else args.clusters ** 2
    energy = toy_distill.ENERGY_SAMPLES
    work = (args.num + energy * (args.json or args.distill)) * sum(args.steps) * clusters
    work += energy * sum(TABLE_STEPS) * clusters * args.distill
    if work > MAX_WORK:
        raise ELFError(f"the exact denoiser would run {work:,} sample-steps x clusters, above the limit of "
                       f"{MAX_WORK:,} (about two CPU-minutes); lower --num, --steps or --clusters")
    check_toy(args.num, args.steps, args.clusters, args.layout)  # and what they hold, against the memory


def run(args) -> int:
    if args.json:
        check_stdout_open("--json")
    check_sizes(args)
    check_scales(args, gamma=SAMPLING_RANGES["gamma"])
    check_out(args.out, args.overwrite)
    mix = ring_mixture(args.clusters) if args.layout == "ring" else grid_mixture(args.clusters)
    gamma = 0.0 if args.sampler == "ode" else args.gamma
    res = run_toy(mix, args.steps, args.num, args.seed, args.sampler, gamma)
    if not args.json:
        print(f"{'N':>4}  inside a cluster (of {args.num})")
        for n, r in res.items():
            print(f"{n:>4}  {r['inside']:>4}  {'#' * round(40 * r['inside'] / args.num)}")
    out = {"layout": args.layout, "clusters": args.clusters, "seed": args.seed,
           "samples": toy_distill.ENERGY_SAMPLES, "rows": [], "floor": None}
    figure = [res]
    if args.distill:  # every model at TABLE_STEPS on the ODE; the exact denoiser's other --steps below
        table = distillation_table(mix, args.num, args.seed)
        out.update(rows=table["rows"], floor=table["floor"], sizes=table["sizes"], cpu_seconds=table["cpu_seconds"])
        figure += table["figure"]
    if args.json or args.distill:  # the rows are the Euler ODE's whatever --sampler draws the figure
        done = {r["steps"] for r in out["rows"]}
        extra = [n for n in args.steps if n not in done]
        out["rows"] = sorted(out["rows"] + energy_rows(mix, [("exact", extra, None, None)], seed=args.seed),
                             key=_row_order)
        if out["floor"] is None:
            out["floor"] = energy_floor(mix, seed=args.seed)
        if args.sampler == "ode":  # the panels of the exact denoiser show their energy distance
            for r in out["rows"]:
                if r["name"] == "exact" and r["steps"] in res:
                    res[r["steps"]]["energy"] = r["energy_distance"]
    if args.distill and not args.json:
        print_table(out["rows"], out["floor"], table)
    models = "the exact denoiser" if not args.distill else \
        "the exact denoiser; a trained teacher, its progressive students and its flow-map student (ODE)"
    plot_toy(mix, figure, args.out, f"{args.clusters}-cluster {args.layout}: {args.sampler} sampling with {models}, "
                                    "from the same starting noise", args.overwrite)
    if args.json:
        print_result(json.dumps({**out, "figure": str(args.out)}), f"wrote {args.out}")
    else:
        print(f"wrote {args.out}")
    return 0


NAMES = {"exact": "exact denoiser", "teacher": "trained teacher", "pd": "PD student (N steps)",
         "flow-map": "flow-map student"}


def _row_order(r):
    return list(NAMES).index(r["name"]), r["steps"]


def print_table(rows: list[dict], floor: float, table: dict) -> None:
    """The energy distances as a table of model x step count, and the panels' inside counts."""
    steps = sorted({r["steps"] for r in rows})
    by = {(r["name"], r["steps"]): r["energy_distance"] for r in rows}
    sizes = table["sizes"]
    print(f"\nenergy distance to the mixture ({sizes['energy_samples']:,} samples; two draws of the mixture give "
          f"{floor:.4f}), Euler ODE or flow-map jumps on a uniform grid")
    print(f"{'model':<22}" + "".join(f"{'N=' + str(n):>9}" for n in steps))
    for name, label in NAMES.items():
        print(f"{label:<22}" + "".join(f"{by[(name, n)]:>9.4f}" if (name, n) in by else f"{'':>9}" for n in steps))
    print(f"student training: {sizes['student_steps']:,} steps of batch {sizes['batch']} each for PD "
          f"({sizes['pd_steps_per_round']:,} per round, rounds {sizes['pd_rounds']}) and the flow map; teacher "
          f"{sizes['teacher_steps']:,} steps; {table['cpu_seconds']['total']:.0f} CPU-seconds")

"""`elflow sweep`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import os
from pathlib import Path

from elflow.cli.common import add_arguments as add_tracking
from elflow.cli.common import check_scales
from elflow.eval.mauve import clusters_for
from elflow.eval.metrics import PROTOCOL_ALIASES, PROTOCOLS
from elflow.eval.scoring import heldout_texts, read_real_texts
from elflow.experiments.sweep import _FLOAT, COLUMNS, plot_sweep, read_csv, run_sweep
from elflow.flow import DEFAULT_GRID, GRIDS, SAMPLERS, SAMPLING_RANGES
from elflow.lifecycle.outputs import check_out, default_folder, own_run
from elflow.methods import get_method
from elflow.methods.baseline import KNOB_RANGES
from elflow.runs.load import method_of
from elflow.runs.tracking import Tracker, require_wandb
from elflow.util.budget import check_sweep
from elflow.util.devices import AUTOCAST_DTYPES, check_device
from elflow.util.errors import ELFError
from elflow.util.files import FolderHold, read_json


def add_arguments(p) -> None:
    p.add_argument("checkpoint", nargs="?", help="run folder, checkpoint or hub id (not needed with --plot-only)")
    p.add_argument("--omega", type=float, nargs="+", default=None, help=f"ELF (default {SWEEP_DEFAULTS['omega']})")
    p.add_argument("--steps", type=int, nargs="+", default=None,
                   help=f"ELF and MDLM sampling steps (default {SWEEP_DEFAULTS['steps']})")
    p.add_argument("--sampler", choices=SAMPLERS, nargs="+", default=None,
                   help=f"ELF (default {SWEEP_DEFAULTS['sampler']})")
    p.add_argument("--temperature", type=float, nargs="+", default=None,
                   help=f"AR baselines: the temperatures swept (default {SWEEP_DEFAULTS['temperature']})")
    p.add_argument("--top-p", type=float, default=None, help="AR baselines: nucleus mass of every cell (default 1)")
    p.add_argument("--gamma", type=float, default=1.5, help="SDE noise re-injection")
    p.add_argument("--num", type=int, default=1000, help="samples per cell")
    p.add_argument("--length", type=int, default=None, help="positions per sample (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--grid", default=DEFAULT_GRID, choices=GRIDS, help="sampling time grid")
    p.add_argument("--judge", default="gpt2-large", help="hub id or folder (offline: `elflow train-judge`)")
    p.add_argument("--judge-dtype", choices=AUTOCAST_DTYPES, default="fp32", help="judge precision")
    p.add_argument("--batch-size", type=int, default=8, help="judge batch size")
    p.add_argument("--gen-batch-size", type=int, default=8, help="sampling batch size")
    p.add_argument("--protocol", choices=(*PROTOCOLS, *PROTOCOL_ALIASES), default="elf",
                   help="counting rules (see elflow eval --help)")
    p.add_argument("--mauve", action="store_true",
                   help="also MAUVE of each cell's samples against real text (--references, else --num held-out rows "
                        "of the run's training data), a column of sweep.csv")
    p.add_argument("--references", default=None,
                   help="--mauve's real texts: a .jsonl file (its `text` field) or one text per line")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default=None,
                   help="output folder (default: RUN/sweep, RUN/sweep/CKPT for a checkpoint folder CKPT of RUN, or "
                        "./sweep); never inside a run folder but the swept run's own sweep/")
    p.add_argument("--plot-only", action="store_true", help="redraw the plot from OUT/sweep.csv")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new sweep in an OUT that holds one of another checkpoint, judge or protocol")

    add_tracking(p)


# the values a sweep takes of each knob not given
SWEEP_DEFAULTS = {"omega": [0.5, 1.0, 2.0, 3.0, 4.0], "steps": [8, 16, 32], "sampler": ["ode", "sde"],
                  "temperature": [0.7, 0.85, 1.0], "top_p": 1.0}


SWEEP_FLAGS = ("omega", "steps", "sampler", "temperature", "top_p")  # the knob flags without a parser default


def _references(args) -> list[str]:
    """--mauve's real texts: --references, else --num held-out rows of the run's training data."""
    if args.references:
        return read_real_texts(args.references, "text")
    try:
        refs = [t for t in heldout_texts(args.checkpoint, args.num)[0] if t.strip()]
    except ELFError as e:
        raise ELFError(f"--mauve has no held-out text to compare with ({e}); pass --references FILE") from None
    if not refs:
        raise ELFError("--mauve has no held-out text to compare with (the rows are all empty); pass --references FILE")
    return refs


def _method_grid(args, method) -> tuple[dict, dict]:
    """(grid, fixed) of the method's sweep from the flags; a knob flag the method's sweep does not take is a
    one-line error."""
    takes = method.sweep_axes + method.sweep_fixed
    for name in SWEEP_FLAGS:
        if getattr(args, name) is not None and name not in takes:
            raise ELFError(f"--{name.replace('_', '-')} does not apply to {method.title}; its sweep takes "
                           f"{', '.join('--' + k.replace('_', '-') for k in takes)}")
    value = lambda name: SWEEP_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)  # noqa: E731
    grid = {name: value(name) for name in method.sweep_axes}
    fixed = {name: value(name) for name in method.sweep_fixed}
    return ({k: [float(x) if k in _FLOAT else x for x in v] for k, v in grid.items()},
            {k: float(v) if k in _FLOAT else v for k, v in fixed.items()})


def _check_continuation(out: Path, args) -> dict:
    """A rerun continues OUT/sweep.csv only for the same checkpoint, judge and protocol (the rows do not record
    the checkpoint: OUT/sweep.json does)."""
    wanted = {"checkpoint": str(args.checkpoint), "judge": str(args.judge), "protocol": args.protocol,
              **({"mauve": args.references or "held-out text"} if args.mauve else {})}
    meta = out / "sweep.json"
    stored = read_json(meta) if os.path.lexists(meta) else {}
    rows = read_csv(out / "sweep.csv") if os.path.lexists(out / "sweep.csv") else []
    seen = {**{k: rows[0].get(k) for k in ("judge", "protocol") if rows}, **stored}
    diff = [f"{k} {seen[k]!r} (now {v!r})" for k, v in wanted.items() if k in seen and str(seen[k]) != v]
    if diff and not args.overwrite:
        raise ELFError(f"{out} holds a sweep of another {', '.join(diff)}; choose another --out, or pass "
                       "--overwrite to replace it")
    return wanted


def _track(args, out: Path, rows: list[dict], png: Path) -> None:
    """The sweep in a W&B run (--wandb): its settings as the run's config, every cell as a row of the table
    "sweep", the trade-off plot as an image, the best cell's figures as the summary."""
    config = {"checkpoint": args.checkpoint, "judge": str(rows[0].get("judge") or args.judge),
              "protocol": args.protocol, "num": args.num, "seed": args.seed, "cells": len(rows)}
    tracker = Tracker.start(args.wandb, args.wandb_run, out, config, job_type="sweep")
    try:
        columns = [c for c in COLUMNS if any(c in r for r in rows)]
        tracker.table("sweep", columns, [[r.get(c) for c in columns] for r in rows])
        tracker.image("tradeoff", png)
        best = min(rows, key=lambda r: float(r["gen_ppl"]))
        tracker.summary({f"best_{k}": best[k] for k in columns if k in ("gen_ppl", "entropy", "sampler", "steps",
                                                                        "omega", "temperature")})
    finally:
        tracker.finish()


def _out_folder(args) -> Path:
    """--out, else the model's own sweep folder (outputs.default_folder), checked as a folder output: no link,
    device or file, and not inside a run folder but under the swept run's own RUN/sweep."""
    run = own_run(args.checkpoint) if args.checkpoint else None
    if args.out:
        return check_out(args.out, flag="--out", folder=True, allowed=run / "sweep" if run is not None else None)
    out = default_folder(args.checkpoint, "sweep", Path("sweep")) if args.checkpoint else Path("sweep")
    return check_out(out, flag="--out", folder=True, allowed=run / "sweep" if run is not None else None)


def run(args) -> int:
    if args.wandb:
        require_wandb()
    out = _out_folder(args)
    if args.plot_only:
        if not os.path.lexists(out / "sweep.csv"):
            raise ELFError(f"{out / 'sweep.csv'} does not exist; run the sweep first or pass --out")
        rows = read_csv(out / "sweep.csv")
        png = plot_sweep(rows, out / "tradeoff.png", title=f"judge: {rows[0].get('judge') or args.judge}")
    else:
        if not args.checkpoint:
            raise ELFError("pass the run folder, checkpoint or hub id to sweep (or --plot-only)")

        check_scales(args, omega=SAMPLING_RANGES["omega"], gamma=SAMPLING_RANGES["gamma"], **KNOB_RANGES)
        method = method_of(args.checkpoint)
        grid, fixed = _method_grid(args, get_method(method))
        if args.num < 1 or min(grid.get("steps", [1])) < 1:
            raise ELFError("--num and every --steps value must be at least 1")
        check_sweep(grid, args.num)  # the cells x --num, before anything is read
        for flag, value in (("--batch-size", args.batch_size), ("--gen-batch-size", args.gen_batch_size)):
            if value < 1:
                raise ELFError(f"{flag} must be an integer >= 1, got {value}")

        args.device = check_device(args.device)
        references = _references(args) if args.mauve else None
        if references is not None:
            clusters_for(args.num, len(references), "auto")  # too few texts: said before any cell is sampled
        fresh = args.overwrite and os.path.lexists(out / "sweep.csv")
        wanted = _check_continuation(out, args)
        with FolderHold(out, "elflow sweep"):
            rows = run_sweep(args.checkpoint, grid, fixed, out, num=args.num, seed=args.seed, length=args.length,
                             judge=args.judge, judge_dtype=args.judge_dtype, batch_size=args.batch_size,
                             gen_batch_size=args.gen_batch_size, protocol=args.protocol, device=args.device,
                             fresh=fresh, method=method, record=wanted, references=references)
            png = plot_sweep(rows, out / "tradeoff.png", title=f"judge: {rows[0].get('judge') or args.judge}")
    print(f"{len(rows)} cells in {out / 'sweep.csv'}; plot: {png}")
    if args.wandb:
        _track(args, out, rows, png)
    return 0

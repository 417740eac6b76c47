"""Sampler x steps x omega sweeps, judged cell by cell, and the paper's Figure 3 trade-off plot.

`elflow sweep RUN --omega 0.5 1 2 3 4 --steps 8 16 32 --sampler ode sde` samples every cell with
`elflow.generate`, judges it with `elflow.evaluate.generative_perplexity`, appends a row to
OUT/sweep.csv after each cell (a rerun skips finished cells) and draws OUT/tradeoff.png: generative
perplexity against unigram entropy, one curve per sampler and step count, each point labelled by omega.

A token-level baseline's run sweeps its own knob instead, one curve per run: an AR model its temperature
(`--temperature 0.7 0.85 1`, at one `--top-p`), an MDLM model its reverse steps (`--steps 16 64 256`).
"""

from __future__ import annotations

import csv
import itertools
import math
import sys
import time
from pathlib import Path

from elflow.flow import SAMPLERS
from elflow.methods import get_method
from elflow.utils import ELFError, atomic_write_json, atomic_write_text, read_json

__all__ = ["COLUMNS", "write_csv", "read_csv", "curves", "plot_sweep", "run_sweep"]

COLUMNS = ["sampler", "steps", "omega", "gamma", "seed", "num", "gen_ppl", "entropy", "num_samples", "num_empty",
           "num_tokens", "protocol", "judge", "seconds", "method", "temperature", "top_p"]
_INT = {"steps", "seed", "num", "num_samples", "num_empty", "num_tokens"}
_FLOAT = {"omega", "gamma", "gen_ppl", "entropy", "seconds", "temperature", "top_p"}


def write_csv(path: str | Path, rows: list[dict]) -> Path:
    """Rows as CSV with the sweep's columns (missing fields left empty), written atomically."""
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in COLUMNS})
    atomic_write_text(path, buf.getvalue())
    return Path(path)


def read_csv(path: str | Path) -> list[dict]:
    """The rows of a sweep CSV, numbers parsed back."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = {}
            for k, v in r.items():
                if v == "" or v is None:
                    row[k] = None
                elif k in _INT:
                    row[k] = int(float(v))
                elif k in _FLOAT:
                    row[k] = float(v)
                else:
                    row[k] = v
            rows.append(row)
    return rows


def curves(rows: list[dict]) -> list[dict]:
    """The rows of a sweep as evaluate.plot_tradeoff curves: one per method and value of the knobs its
    curves are drawn by (ELF: sampler and steps), its points in the order of the knob it runs along (ELF:
    omega), each labelled by that knob's value."""
    groups: dict[tuple, list] = {}
    for r in rows:
        if r.get("gen_ppl") is not None and r.get("entropy") is not None:
            method = get_method(r.get("method") or "elf")
            groups.setdefault((method.name, *[r[a] for a in method.sweep_axes[:-1]]), []).append(r)
    out = []
    for key in sorted(groups, key=str):
        method = get_method(key[0])
        swept, by = method.sweep_axes[-1], method.sweep_axes[:-1]
        pts = sorted(groups[key], key=lambda r: r[swept])
        label = (", ".join(v.upper() if isinstance(v, str) else f"{v} {a}" for a, v in zip(by, key[1:])) if by
                 else f"{method.name.upper()} (labels: {swept})")
        out.append({"label": label, "points": [(p["entropy"], p["gen_ppl"], f"{p[swept]:g}") for p in pts],
                    "dashed": pts[0].get("sampler") not in (None, "sde")})
    return out


def plot_sweep(rows: list[dict], path: str | Path, title: str | None = None) -> Path:
    """Gen-PPL (y) against entropy (x) of a sweep's rows (see `curves`), the paper's degenerate entropy range
    (below 5) shaded."""
    from elflow.evaluate import plot_tradeoff

    drawn = curves(rows)
    if not drawn:
        raise ELFError("no finished sweep cells to plot")
    return plot_tradeoff(drawn, path, title=title or "Gen-PPL vs entropy (labels: omega)",
                         xlabel="unigram entropy (mean over samples)", ylabel="generative perplexity",
                         shade_below=5.0)


def _key(r: dict) -> tuple:
    num = lambda k, t: None if r.get(k) in (None, "") else t(r[k])  # noqa: E731
    return (r.get("method") or "elf", r.get("sampler") or "", num("steps", int), num("omega", float),
            num("gamma", float), num("temperature", float), num("top_p", float), int(r["seed"]), int(r["num"]))


def run_sweep(checkpoint: str, grid: dict, fixed: dict, out: str | Path, num: int = 1000, seed: int = 0,
              length: int | None = None, judge: str = "gpt2-large", judge_dtype: str = "fp32", batch_size: int = 8,
              gen_batch_size: int = 8, protocol: str = "elf", device: str | None = None, progress: bool = True,
              fresh: bool = False, method: str = "elf", record: dict | None = None) -> list[dict]:
    """Run (or finish) the grid; returns all rows of OUT/sweep.csv. Samples go to OUT/samples/<cell>.jsonl.
    `grid` maps each of the method's sweep axes to its values (the cells are their product, in that order),
    `fixed` its other knobs to one value. `fresh`: ignore the rows of an existing sweep.csv (it is replaced
    when the first cell is done). `record` is written to OUT/sweep.json with the first row written (a sweep that
    fails before its first row leaves no record behind). The checkpoint is read before the judge."""
    from elflow.checkpoint import load_for_sampling
    from elflow.evaluate import judge_score, load_judge, sample_and_score

    chosen = get_method(method)
    out = Path(out)
    csv_path = out / "sweep.csv"
    rows = read_csv(csv_path) if csv_path.exists() and not fresh else []
    done = {_key(r) for r in rows}
    defaults = {k: v for k, v in getattr(chosen, "defaults", {}).items() if k in COLUMNS}
    cells = [{"method": chosen.name, **defaults, **dict(zip(grid, values)), **fixed}
             for values in itertools.product(*grid.values())]
    todo = [c for c in cells if _key({**c, "seed": seed, "num": num}) not in done]
    if todo:
        loaded, space = load_for_sampling(checkpoint, device=device)
        if loaded.method != chosen.name:
            raise ELFError(f"{checkpoint} holds a {loaded.method} model, not {chosen.name}")
        model, tok = load_judge(judge, judge_dtype, device)
        score = judge_score(model, tok, batch_size, protocol, progress=progress)
    from tqdm.auto import tqdm

    cells_bar = tqdm(total=len(todo), desc="sweep", unit="cell", disable=not progress or not todo,
                     file=sys.stderr)
    for k, cell in enumerate(todo):
        t0 = time.time()
        knobs = {n: v for n, v in cell.items() if n in chosen.knobs}
        settings = chosen.settings(loaded, seed=seed, batch_size=gen_batch_size, **knobs)
        name = f"{settings.tag()}_seed{seed}"
        _, res = sample_and_score(chosen, loaded.net, space, num, settings, score, out / "samples" / f"{name}.jsonl",
                                  {"checkpoint": str(checkpoint)}, length, progress=progress)
        if not math.isfinite(res["gen_ppl"]):  # e.g. every sample empty: no number, and no row that holds NaN
            raise ELFError(f"cell {name}: its {num} samples give no finite perplexity ({res['num_empty']} empty); "
                           f"they are in {out / 'samples' / (name + '.jsonl')}")
        row = {**{n: v for n, v in cell.items() if n in COLUMNS}, "seed": seed, "num": num, "protocol": protocol,
               "judge": str(judge), "seconds": round(time.time() - t0, 2),
               **{k2: res[k2] for k2 in ("gen_ppl", "entropy", "num_samples", "num_empty", "num_tokens")}}
        rows.append(row)
        write_csv(csv_path, rows)
        if record is not None and k == 0:
            atomic_write_json(out / "sweep.json", record)
        cells_bar.update(1)
        if progress:
            cells_bar.write(f"[{k + 1}/{len(todo)}] {settings.describe()}: gen_ppl {row['gen_ppl']:.2f} "
                            f"entropy {row['entropy']:.3f}", file=sys.stdout)
    cells_bar.close()
    return rows


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
    p.add_argument("--grid", default="logit_normal", help="sampling time grid: logit_normal or uniform")
    p.add_argument("--judge", default="gpt2-large", help="hub id or folder (offline: `elflow train-judge`)")
    p.add_argument("--judge-dtype", choices=("fp32", "bf16"), default="fp32", help="judge precision")
    p.add_argument("--batch-size", type=int, default=8, help="judge batch size")
    p.add_argument("--gen-batch-size", type=int, default=8, help="sampling batch size")
    p.add_argument("--protocol", choices=("elf", "elf-official", "mdlm"), default="elf", help="counting rules (see elflow eval --help)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default=None, help="output folder (default: RUN/sweep, or ./sweep)")
    p.add_argument("--plot-only", action="store_true", help="redraw the plot from OUT/sweep.csv")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new sweep in an OUT that holds one of another checkpoint, judge or protocol")
    from elflow.tracking import add_arguments as add_tracking

    add_tracking(p)


# the values a sweep takes of each knob not given
SWEEP_DEFAULTS = {"omega": [0.5, 1.0, 2.0, 3.0, 4.0], "steps": [8, 16, 32], "sampler": ["ode", "sde"],
                  "temperature": [0.7, 0.85, 1.0], "top_p": 1.0}
SWEEP_FLAGS = ("omega", "steps", "sampler", "temperature", "top_p")  # the knob flags without a parser default


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
    wanted = {"checkpoint": str(args.checkpoint), "judge": str(args.judge), "protocol": args.protocol}
    meta = out / "sweep.json"
    stored = read_json(meta) if meta.exists() else {}
    rows = read_csv(out / "sweep.csv") if (out / "sweep.csv").exists() else []
    seen = {**{k: rows[0].get(k) for k in ("judge", "protocol") if rows}, **stored}
    diff = [f"{k} {seen[k]!r} (now {v!r})" for k, v in wanted.items() if k in seen and str(seen[k]) != v]
    if diff and not args.overwrite:
        raise ELFError(f"{out} holds a sweep of another {', '.join(diff)}; choose another --out, or pass "
                       "--overwrite to replace it")
    from elflow.utils import check_output

    check_output(out, folder=True)
    return wanted


def _track(args, out: Path, rows: list[dict], png: Path) -> None:
    """The sweep in a W&B run (--wandb): its settings as the run's config, every cell as a row of the table
    "sweep", the trade-off plot as an image, the best cell's figures as the summary."""
    from elflow.tracking import Tracker

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


def run(args) -> int:
    if args.wandb:
        from elflow.tracking import require

        require()
    if args.out:
        out = Path(args.out)
    elif args.checkpoint and Path(args.checkpoint).expanduser().is_dir():
        out = Path(args.checkpoint).expanduser() / "sweep"
    else:
        out = Path("sweep")
    if args.plot_only:
        if not (out / "sweep.csv").exists():
            raise ELFError(f"{out / 'sweep.csv'} does not exist; run the sweep first or pass --out")
        rows = read_csv(out / "sweep.csv")
        png = plot_sweep(rows, out / "tradeoff.png", title=f"judge: {rows[0].get('judge') or args.judge}")
    else:
        if not args.checkpoint:
            raise ELFError("pass the run folder, checkpoint or hub id to sweep (or --plot-only)")
        from elflow.checkpoint import method_of

        method = method_of(args.checkpoint)
        grid, fixed = _method_grid(args, get_method(method))
        if args.num < 1 or min(grid.get("steps", [1])) < 1:
            raise ELFError("--num and every --steps value must be at least 1")
        from elflow.utils import FolderHold, check_device

        args.device = check_device(args.device)
        fresh = args.overwrite and (out / "sweep.csv").exists()
        wanted = _check_continuation(out, args)
        with FolderHold(out, "elflow sweep"):
            rows = run_sweep(args.checkpoint, grid, fixed, out, num=args.num, seed=args.seed, length=args.length,
                             judge=args.judge, judge_dtype=args.judge_dtype, batch_size=args.batch_size,
                             gen_batch_size=args.gen_batch_size, protocol=args.protocol, device=args.device,
                             fresh=fresh, method=method, record=wanted)
            png = plot_sweep(rows, out / "tradeoff.png", title=f"judge: {rows[0].get('judge') or args.judge}")
    print(f"{len(rows)} cells in {out / 'sweep.csv'}; plot: {png}")
    if args.wandb:
        _track(args, out, rows, png)
    return 0

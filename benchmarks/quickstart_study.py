"""What makes the offline default (`elflow quickstart`, the `demo` preset in MiniLM space) learn within its
budget: train named configurations for a fixed budget and measure each on the held-out split.

Every configuration starts from the quickstart's own TrainConfig (`quickstart.demo_config`) and changes a
few TrainConfig fields and Recipe fields. The budget is a number of optimiser steps (`--steps`) at the
quickstart's batch 32 and L = 64; configurations that change the batch or the length scale the steps (batch
16: twice the steps) or the batch (L 32: batch 64) so that every run of a screen sees the same number of
training tokens (steps x batch x L). Wall-clock time is recorded beside every figure but is not the budget:
the machine is shared, so fixed steps and tokens are the comparison that can be repeated.

Measured per configuration, on the held-out split:
- the denoising loss (v-space MSE, as the quickstart reports it) of the network and of the per-dimension
  Gaussian posterior-mean baseline, in each time bin of `flow.TIME_BINS`, with the same rows, noise and
  times (t uniform inside each bin) for every configuration, at the configuration's own noise scale;
- `diagnostics.validation_report`: the same figures over the quickstart's logit-normal time draw, and the
  decode accuracy at p = 1.0 / 0.9 / 0.7;
- 32 samples with the quickstart's sampler settings (vc, 32 steps, omega 3, seed 0, batches of 16, drawn as
  `generate.generate` draws them, but with the run's recipe so that a changed noise scale reaches the
  sampler) and their `diagnostics.word_stats` beside the same figures for 32 held-out rows.

EMA decays are measured without extra training: the training run of a group of configurations that differ
only in `ema_decay` keeps one EMA per decay (an EMA only reads the weights), and each configuration is
measured with its own. Decay 0.0 is the raw weights.

Resumable: a configuration whose JSON exists is skipped; a training run whose final checkpoint and EMA file
exist is not trained again.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quickstart_study.py --list
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quickstart_study.py --floors
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quickstart_study.py screen --steps 100
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quickstart_study.py full
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quickstart_study.py full-ref rt-wide384
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quickstart_study.py round2
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quickstart_study.py rt-skip rt-skip-ts1000 ts-mod --fine-bins
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quickstart_study.py ts-mod --samplers vc:32 vc:64 vc:16 ode:32
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quickstart_study.py round3
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quickstart_study.py ts-mod --readout 0 0.5 1 2 3
    PYTHONPATH=src python benchmarks/quickstart_study.py --table-only screen --table table-screen.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent

def round3(note: str, steps: int = 250, model: dict | None = None, **recipe) -> dict:
    """A round-3 configuration: ts-mod (the quickstart's settings) with ELFConfig and Recipe overrides."""
    return {"group": "round3", "note": note, "steps": steps, "recipe": recipe,
            "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
            "model": {"skip": "gaussian", "time_scale": 1000.0, "head_modulation": True, **(model or {})}}


# name -> {"group", "note", "train": TrainConfig overrides, "recipe": Recipe overrides, "model": ELFConfig
# overrides, "steps_scale": steps = round(--steps x steps_scale), or "steps": an absolute step count}
CONFIGS: dict[str, dict] = {
    # ---- the screen: one change at a time from the quickstart's settings
    "base": {"group": "screen", "note": "the quickstart's settings"},
    "ema-0.95": {"group": "screen", "note": "EMA 0.95", "train": {"ema_decay": 0.95}},
    "ema-0.99": {"group": "screen", "note": "EMA 0.99", "train": {"ema_decay": 0.99}},
    "ema-0": {"group": "screen", "note": "raw weights (no EMA)", "train": {"ema_decay": 0.0}},
    "tmean-0.5": {"group": "screen", "note": "t_mean -0.5", "recipe": {"t_mean": -0.5}},
    "tmean0": {"group": "screen", "note": "t_mean 0.0", "recipe": {"t_mean": 0.0}},
    "noise1": {"group": "screen", "note": "noise_scale 1.0", "recipe": {"noise_scale": 1.0}},
    "lr2e-3": {"group": "screen", "note": "lr 2e-3", "train": {"lr": 2e-3}},
    "lr3e-3": {"group": "screen", "note": "lr 3e-3", "train": {"lr": 3e-3}},
    "warmup10": {"group": "screen", "note": "warm-up 10", "train": {"warmup": 10}},
    "batch16": {"group": "screen", "note": "batch 16, 2x steps", "train": {"batch": 16}, "steps_scale": 2.0},
    "len32": {"group": "screen", "note": "L 32, batch 64", "train": {"length": 32, "batch": 64}},
    "hidden128": {"group": "screen", "note": "width 128", "model": {"hidden": 128}},
    "hidden384": {"group": "screen", "note": "width 384 (6 heads)", "model": {"hidden": 384, "heads": 6}},
    # ---- not run in the recorded study: the width limit's parts, for a longer study
    "bottleneck384": {"group": "extra", "note": "input bottleneck 384 (= dim, no compression)",
                      "model": {"bottleneck": 384}},
    "wide384": {"group": "extra", "note": "width 384 (6 heads), bottleneck 384",
                "model": {"hidden": 384, "heads": 6, "bottleneck": 384}},
    "token-table": {"group": "screen", "note": "space token-table:minilm", "train": {"space": "token-table:minilm"}},
    "random-table": {"group": "screen", "note": "space random-table:minilm",
                     "train": {"space": "random-table:minilm"}},
    # ---- a probe of the width limit of the top time bin, at the screen's budget
    "rt-wide384": {"group": "screen2",
                   "note": "random-table, lr 3e-3, EMA 0.95, width 384 (6 heads), bottleneck 384",
                   "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
                   "model": {"hidden": 384, "heads": 6, "bottleneck": 384}},
    # ---- the combination of the screen's best settings, at the quickstart's full budget (250 x 32 x 64)
    "combined": {"group": "full", "note": "random-table, lr 3e-3, EMA 0.95", "steps": 250,
                 "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95}},
    "combined-ema0.98": {"group": "full", "note": "random-table, lr 3e-3, EMA 0.98", "steps": 250,
                         "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.98}},
    "combined-raw": {"group": "full", "note": "random-table, lr 3e-3, raw weights", "steps": 250,
                     "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.0}},
    # ---- round 2, all at the full budget (250 x 32 x 64) from `combined` (random table, lr 3e-3, EMA 0.95):
    # lower-dimensional random tables (no rank floor: dim <= width; no input compression: dim <= bottleneck)
    "rt128": {"group": "round2", "note": "random-table 128-dim, lr 3e-3, EMA 0.95", "steps": 250,
              "train": {"space": {"kind": "random-table", "name": "minilm", "dim": 128}, "lr": 3e-3, "ema_decay": 0.95}},
    "rt64": {"group": "round2", "note": "random-table 64-dim, lr 3e-3, EMA 0.95", "steps": 250,
             "train": {"space": {"kind": "random-table", "name": "minilm", "dim": 64}, "lr": 3e-3, "ema_decay": 0.95}},
    # the network options for short runs (Gaussian skip, time scale, head modulation), the time draw, the
    # decode branch (corruption scale, share of rows) and the lr decay
    "rt-skip": {"group": "round2", "note": "random-table, lr 3e-3, EMA 0.95, Gaussian skip", "steps": 250,
                "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
                "model": {"skip": "gaussian"}},
    "minilm-skip": {"group": "round2", "note": "MiniLM, lr 3e-3, EMA 0.95, Gaussian skip", "steps": 250,
                    "train": {"lr": 3e-3, "ema_decay": 0.95}, "model": {"skip": "gaussian"}},
    "rt-skip-cos": {"group": "round2", "note": "random-table, lr 3e-3 cosine, EMA 0.95, Gaussian skip", "steps": 250,
                    "train": {"space": "random-table:minilm", "lr": 3e-3, "lr_decay": "cosine", "ema_decay": 0.95},
                    "model": {"skip": "gaussian"}},
    "rt-skip-cos-dec0.4": {"group": "round2", "note": "random-table, lr 3e-3 cosine, EMA 0.95, Gaussian skip, "
                           "decode rows 40%", "steps": 250,
                           "train": {"space": "random-table:minilm", "lr": 3e-3, "lr_decay": "cosine",
                                     "ema_decay": 0.95}, "recipe": {"decode_prob": 0.4},
                           "model": {"skip": "gaussian"}},
    "rt-skip-ts1000": {"group": "round2", "note": "random-table, lr 3e-3, EMA 0.95, Gaussian skip, time scale 1000",
                       "steps": 250, "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
                       "model": {"skip": "gaussian", "time_scale": 1000.0}},
    "rt-skip-tmean-2": {"group": "round2", "note": "random-table, lr 3e-3, EMA 0.95, Gaussian skip, t_mean -2",
                        "steps": 250, "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
                        "recipe": {"t_mean": -2.0}, "model": {"skip": "gaussian"}},
    "ts-dn1": {"group": "round2", "note": "random-table, lr 3e-3, EMA 0.95, Gaussian skip, time scale 1000, decode "
               "noise 1", "steps": 250, "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
               "recipe": {"decode_noise_scale": 1.0}, "model": {"skip": "gaussian", "time_scale": 1000.0}},
    "ts-dn1-ema0.98": {"group": "round2", "note": "as ts-dn1, EMA 0.98", "steps": 250,
                       "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.98},
                       "recipe": {"decode_noise_scale": 1.0}, "model": {"skip": "gaussian", "time_scale": 1000.0}},
    "ts-dn1-dec0.4": {"group": "round2", "note": "as ts-dn1, decode rows 40%", "steps": 250,
                      "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
                      "recipe": {"decode_noise_scale": 1.0, "decode_prob": 0.4},
                      "model": {"skip": "gaussian", "time_scale": 1000.0}},
    "ts-tmean-2": {"group": "round2", "note": "random-table, lr 3e-3, EMA 0.95, Gaussian skip, time scale 1000, "
                   "t_mean -2", "steps": 250, "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
                   "recipe": {"t_mean": -2.0}, "model": {"skip": "gaussian", "time_scale": 1000.0}},
    "ts-tmean-2-dn2-dec0.3": {"group": "round2", "note": "as ts-tmean-2, decode noise 2, decode rows 30%",
                              "steps": 250,
                              "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
                              "recipe": {"t_mean": -2.0, "decode_noise_scale": 2.0, "decode_prob": 0.3},
                              "model": {"skip": "gaussian", "time_scale": 1000.0}},
    "ts-mod": {"group": "round2", "note": "random-table, lr 3e-3, EMA 0.95, Gaussian skip, time scale 1000, head "
               "modulation", "steps": 250, "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
               "model": {"skip": "gaussian", "time_scale": 1000.0, "head_modulation": True}},
    "ts-mod-dn1": {"group": "round2", "note": "as ts-mod, decode noise 1", "steps": 250,
                   "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
                   "recipe": {"decode_noise_scale": 1.0},
                   "model": {"skip": "gaussian", "time_scale": 1000.0, "head_modulation": True}},
    "ts-mod-dn1-dec0.3": {"group": "round2", "note": "as ts-mod, decode noise 1, decode rows 30%", "steps": 250,
                          "train": {"space": "random-table:minilm", "lr": 3e-3, "ema_decay": 0.95},
                          "recipe": {"decode_noise_scale": 1.0, "decode_prob": 0.3},
                          "model": {"skip": "gaussian", "time_scale": 1000.0, "head_modulation": True}},
    # ---- round 3: a readout that is exact on clean embeddings and still reads the sampler's blends in context
    "ts-mod-clean0.1": round3("as ts-mod, 10% of decode tokens clean", decode_clean_prob=0.1),
    "ts-mod-clean0.2": round3("as ts-mod, 20% of decode tokens clean", decode_clean_prob=0.2),
    "ts-mod-readout": round3("as ts-mod, table readout 1", model={"table_readout": 1.0}),
    # ---- references at the full budget: the quickstart itself, and the combination in MiniLM space
    "base-full": {"group": "full-ref", "note": "the quickstart's settings", "steps": 250},
    "minilm-combined": {"group": "full-ref", "note": "MiniLM, lr 3e-3, EMA 0.95", "steps": 250,
                        "train": {"lr": 3e-3, "ema_decay": 0.95}},
    "minilm-combined-ema0.98": {"group": "full-ref", "note": "MiniLM, lr 3e-3, EMA 0.98", "steps": 250,
                                "train": {"lr": 3e-3, "ema_decay": 0.98}},
}


# ----------------------------------------------------------------------------------------------------------
# configurations


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


# where every configuration starts: the quickstart's settings before this study (round 1's `base`)
STUDY_BASE = dict(space="minilm", lr=1e-3, ema_decay=0.98, network={}, short_run={}, recipe={})


def train_config(spec: dict, steps: int, seed: int = 0):
    """The study's base TrainConfig with the configuration's overrides; checkpoints at the end only."""
    from elflow.experiments.quickstart import demo_config

    over = dict(spec.get("train", {}))
    n = spec.get("steps") or max(1, round(steps * spec.get("steps_scale", 1.0)))
    args = SimpleNamespace(length=over.pop("length", 64), batch=over.pop("batch", 32), steps=n, lr=None, space=None,
                           seed=seed, sample_steps=32, sampler="vc", omega=3.0)
    cfg = demo_config(args)
    for k, v in STUDY_BASE.items():
        setattr(cfg, k, dict(v) if isinstance(v, dict) else v)
    for k, v in over.items():
        if not hasattr(cfg, k):
            raise SystemExit(f"TrainConfig has no field {k!r}")
        setattr(cfg, k, v)
    cfg.recipe = {**cfg.recipe, **spec.get("recipe", {})}
    # a configuration's "model" holds network settings and short-run options alike: each goes to its part
    model = spec.get("model", {})
    from elflow.model import ShortRunOptions

    options = {k: v for k, v in model.items() if k in ShortRunOptions.__dataclass_fields__}
    network = {k: v for k, v in model.items() if k not in options}
    cfg = type(cfg).from_dict({**cfg.to_dict(), "network": {**cfg.network, **network},
                               "short_run": {**cfg.short_run, **options}})
    cfg.sample_every = 0
    cfg.ckpt_every = n
    cfg.keep = 1
    cfg.log_every = 10
    return cfg


def run_key(cfg) -> str:
    """Configurations with the same key share one training run (they differ only in the EMA decay)."""
    d = {k: v for k, v in cfg.to_dict().items() if k != "ema_decay"}
    return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:10]


# ----------------------------------------------------------------------------------------------------------
# training with several EMAs


@contextmanager
def several_emas(decays):
    """While active, the EMA that `train` builds also keeps an average for each decay in `decays`."""
    import elflow.train as T
    from elflow.optim import EMA

    made = []

    class SeveralEMA(EMA):
        def __init__(self, module, decay):
            super().__init__(module, decay)
            self.extra = {float(d): [s.clone() for s in self.shadow] for d in decays if float(d) != float(decay)}
            made.append(self)

        @torch.no_grad()
        def update(self, module):
            super().update(module)
            params = [p.detach().float() for p in module.parameters()]
            for d, shadow in self.extra.items():
                torch._foreach_lerp_(shadow, params, 1.0 - d)

    original = T.EMA
    T.EMA = SeveralEMA
    try:
        yield made
    finally:
        T.EMA = original


def ensure_trained(cfg, decays: set[float], run_dir: Path, cache_dir=None) -> dict:
    """Train (unless a finished run with every needed EMA is there); returns the run's training record."""
    from elflow.train import train

    done_file = run_dir / "study_run.json"
    if done_file.exists():
        rec = json.loads(done_file.read_text())
        if set(map(float, rec["decays"])) >= decays:
            print(f"  training run {run_dir.name}: already trained", flush=True)
            return rec
    print(f"  training run {run_dir.name}: {cfg.steps} steps, batch {cfg.batch}, L {cfg.length}, "
          f"EMA decays {sorted(decays)}", flush=True)
    t0 = time.perf_counter()
    with several_emas(decays) as made:
        summary = train(cfg, run_dir, overwrite=True, quiet=True, cache_dir=cache_dir)
    seconds = time.perf_counter() - t0
    ema = made[-1]
    torch.save({d: dict(zip(ema.names, s)) for d, s in ema.extra.items()}, run_dir / "study_emas.pt")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_s = sum(m["elapsed"] for m in metrics if m.get("kind", "train") == "train")
    rec = {"decays": sorted(decays), "seconds": seconds, "train_loop_seconds": train_s,
           "tokens_per_s": cfg.steps * cfg.batch * cfg.length / train_s, "last": summary.get("last"),
           "machine": machine()}
    done_file.write_text(json.dumps(rec, indent=1))
    print(f"  trained in {seconds / 60:.1f} min ({rec['tokens_per_s']:.0f} training tokens/s), last loss "
          f"{rec['last']['loss']:.3f}", flush=True)
    return rec


# ----------------------------------------------------------------------------------------------------------
# measuring


@torch.no_grad()
def binned_loss(net, space, dataset, recipe, moments, rows: int = 128, batch: int = 32, seed: int = 0) -> list:
    """Held-out denoising loss per time bin, network vs the Gaussian posterior mean, t uniform in each bin.
    The same rows, times and noise for every network of a given length and width of space."""
    from elflow.flow import TIME_BINS, time_bin_labels
    from elflow.model import gaussian_posterior

    mu, var = moments
    n = min(rows, len(dataset))
    nb = len(TIME_BINS) - 1
    gens = [torch.Generator().manual_seed(seed * 1000 + k) for k in range(nb)]
    sums = {"model": [0.0] * nb, "baseline": [0.0] * nb}
    for i in range(0, n, batch):
        b = dataset.batch(torch.arange(i, min(i + batch, n)))
        mask = b["mask"].float()
        x = space.encode(b["tokens"], attention_mask=b.get("attention_mask")).float()
        B, L, C = x.shape
        for k in range(nb):
            lo, hi = TIME_BINS[k], TIME_BINS[k + 1]
            t = lo + (hi - lo) * torch.rand(B, generator=gens[k])
            eps = torch.randn(B, L, C, generator=gens[k])
            tt = t[:, None, None]
            z = tt * x + (1 - tt) * recipe.noise_scale * eps
            clip = (1 - tt).clamp_min(recipe.t_eps)
            preds = {"model": net(z, t, torch.ones(B)).float(),
                     "baseline": gaussian_posterior(z, t, mu, var, recipe.noise_scale)[0]}
            for name, pred in preds.items():
                err = ((pred - x) / clip).pow(2).mean(-1)
                sums[name][k] += ((err * mask).sum(-1) / mask.sum(-1).clamp_min(1)).double().sum().item()
    out = [{"t": time_bin_labels()[k], "rows": n, "model": sums["model"][k] / n, "baseline": sums["baseline"][k] / n}
           for k in range(nb)]
    return out


@torch.no_grad()
def draw_samples(net, space, recipe, num: int, length: int, steps: int = 32, sampler: str = "vc",
                 omega: float = 3.0, seed: int = 0, batch_size: int = 16) -> list[str]:
    """`generate.generate`'s draws (batch b seeded by seed * 100003 + b) with the run's recipe."""
    from elflow.sampler import generate_tokens

    texts = []
    for b, start in enumerate(range(0, num, batch_size)):
        bs = min(batch_size, num - start)
        g = torch.Generator().manual_seed(seed * 100_003 + b)
        ids, _ = generate_tokens(net, bs, length, steps, sampler, omega=omega, generator=g, recipe=recipe)
        texts += space.decode(ids)
    return texts


def measure(name: str, spec: dict, cfg, run_dir: Path, train_rec: dict, rows: int, num: int, cache_dir=None) -> dict:
    from elflow.data.datasets import build_dataset
    from elflow.eval.diagnostics import validation_report, word_stats
    from elflow.flow import Recipe
    from elflow.runs.load import load_for_sampling
    from elflow.space import latent_moments

    t0 = time.perf_counter()
    loaded, space = load_for_sampling(run_dir, device="cpu")
    net = loaded.net
    trained_decay = float(json.loads((run_dir / "run.json").read_text())["train"]["ema_decay"])
    if float(cfg.ema_decay) != trained_decay:
        shadow = torch.load(run_dir / "study_emas.pt")[float(cfg.ema_decay)]
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(shadow[n])
    net.eval()
    recipe = Recipe.from_dict(cfg.recipe)
    length = cfg.length
    train_set, val_set = build_dataset(cfg.data, space, length, layout=cfg.layout, val_fraction=cfg.val_fraction,
                                       seed=cfg.seed, cache_dir=cache_dir)
    moments = latent_moments(space, val_set)
    bins = binned_loss(net, space, val_set, recipe, moments, rows=rows)
    val = validation_report(net, space, val_set, recipe=recipe, moments=moments)
    texts = draw_samples(net, space, recipe, num, length)
    real = space.decode(val_set.tokens[:num])
    vocab = training_vocabulary(space, train_set)
    return {"name": name, "note": spec.get("note", ""), "group": spec.get("group"),
            "train_config": cfg.to_dict(), "run": run_dir.name, "training": train_rec,
            "tokens_seen": cfg.steps * cfg.batch * cfg.length, "bins": bins, "validation": val,
            "num": num, "samples": word_stats(texts, vocab), "real_text": word_stats(real, vocab),
            "sample_texts": texts[:8],
            "measure_seconds": time.perf_counter() - t0, "machine": machine()}


@torch.no_grad()
def rank_floors(spaces=("minilm", "random-table:minilm"), length: int = 64, rows: int = 128, ranks=(128, 256, 384),
                cache_dir=None) -> list[dict]:
    """A lower bound on the denoising loss of the top time bin that no training can beat. The denoise head is
    one Linear(hidden -> dim), so x_pred lies in an affine subspace of rank <= hidden: its squared error per
    dimension is at least the held-out variance of x outside x's top-`hidden` principal components, and the
    v-space loss multiplies that by 1 / max(1 - t, t_eps)^2, whose mean over t uniform in [0.5, 1) is 76."""
    from elflow.data.datasets import build_dataset
    from elflow.flow import Recipe
    from elflow.space import build_space

    t_eps = Recipe().t_eps
    weight = ((1 / t_eps - 1 / 0.5) + t_eps / t_eps ** 2) / 0.5  # mean of max(1 - t, t_eps)^-2, t ~ U[0.5, 1)
    out = []
    for name in spaces:
        space = build_space(name)
        _, val = build_dataset("builtin", space, length, val_fraction=0.02, seed=0, cache_dir=cache_dir)
        x = space.encode(val.tokens[:rows]).reshape(-1, space.dim).double()
        x = x - x.mean(0)
        ev = torch.linalg.eigvalsh(x.T @ x / len(x)).flip(0)
        for k in ranks:
            rest = ev[k:].sum().item() / space.dim
            out.append({"space": name, "rank": k, "variance_outside": rest, "floor_t0.5-1.0": rest * weight})
    return out


def trained_run(name: str, cfg, work: Path) -> Path:
    """The run folder a measured configuration was trained in (as its JSON records), else its key's."""
    measured = ROOT / "results" / "quickstart_study" / f"{name}.json"
    if measured.exists():
        return work / json.loads(measured.read_text())["run"]
    return work / run_key(cfg)


def measured_run(name: str, work: Path, cache_dir=None) -> SimpleNamespace:
    """A measured configuration's trained network (EMA, CPU) with its space, recipe and data splits."""
    from elflow.data.datasets import build_dataset
    from elflow.flow import Recipe
    from elflow.runs.load import load_for_sampling

    cfg = train_config(CONFIGS[name], 100)
    run_dir = trained_run(name, cfg, work)
    loaded, space = load_for_sampling(run_dir, device="cpu")
    train_set, val_set = build_dataset(cfg.data, space, cfg.length, layout=cfg.layout, val_fraction=cfg.val_fraction,
                                       seed=cfg.seed, cache_dir=cache_dir)
    return SimpleNamespace(cfg=cfg, run_dir=run_dir, net=loaded.net.eval(), space=space,
                           recipe=Recipe.from_dict(cfg.recipe), train_set=train_set, val_set=val_set)


def training_vocabulary(space, train_set) -> set:
    """The words of (up to 4,000 rows of) the training split, as the samples' corpus-word share counts them."""
    from elflow.eval.diagnostics import corpus_vocabulary

    return corpus_vocabulary(space.decode(train_set.tokens[: min(len(train_set), 4000)]))


def sampler_sweep(name: str, specs: list[str], seeds=(0, 1), num: int = 32, work: Path = Path("runs/quickstart_study"),
                  cache_dir=None) -> dict:
    """Word statistics of one trained configuration's samples under other sampler settings
    ("SAMPLER:STEPS[:OMEGA]"), each with several seeds: no training."""
    from elflow.eval.diagnostics import word_stats

    run = measured_run(name, work, cache_dir)
    cfg, net, space, recipe, val_set = run.cfg, run.net, run.space, run.recipe, run.val_set
    vocab = training_vocabulary(space, run.train_set)
    rows = []
    for spec in specs:
        sampler, steps, *rest = spec.split(":")
        omega = float(rest[0]) if rest else 3.0
        for seed in seeds:
            texts = draw_samples(net, space, recipe, num, cfg.length, steps=int(steps), sampler=sampler, omega=omega,
                                 seed=seed)
            rows.append({"sampler": sampler, "steps": int(steps), "omega": omega, "seed": seed,
                         **word_stats(texts, vocab), "first": texts[0][:200]})
            print(f"  {sampler} {steps} steps omega {omega:g} seed {seed}: word entropy "
                  f"{rows[-1]['word_entropy']:.2f}, corpus words {rows[-1]['corpus_word_share']:.1%}", flush=True)
    return {"name": name, "run": run.run_dir.name, "rows": rows,
            "real_text": word_stats(space.decode(val_set.tokens[:num]), vocab), "machine": machine()}


@torch.no_grad()
def readout_sweep(name: str, weights: list[float], seeds=(0, 1), num: int = 32, steps: int = 64,
                  work: Path = Path("runs/quickstart_study"), cache_dir=None) -> dict:
    """One trained configuration read out with other table-readout weights: decode accuracy on the held-out
    rows (diagnostics.validation_report) and the word statistics of samples (vc, `steps` steps, omega 3, each
    seed). The readout weight does not change training, so the trained weights serve every weight."""
    from elflow.eval.diagnostics import validation_report, word_stats
    from elflow.model import build_network
    from elflow.space import latent_moments, token_vectors

    run = measured_run(name, work, cache_dir)
    cfg, space, recipe, train_set, val_set = run.cfg, run.space, run.recipe, run.train_set, run.val_set
    vocab = training_vocabulary(space, train_set)
    moments = latent_moments(space, val_set)
    trained = {k: v for k, v in run.net.state_dict().items() if k != "readout_table"}
    table = token_vectors(space, run.net.config.vocab_size)
    # clean held-out tokens grouped by how often the training split holds them
    counts = torch.bincount(train_set.tokens.flatten(), minlength=run.net.config.vocab_size)
    held = val_set.tokens[:128]
    seen = counts[held]
    groups = {f"[{lo}, {hi})": (seen >= lo) & (seen < hi) for lo, hi in ((0, 10), (10, 100), (100, 1000), (1000, 10**9))}
    rows = []
    for w in weights:
        net = build_network(run.net.config, {**run.net.options.to_dict(), "table_readout": float(w)})
        net.load_state_dict(trained, strict=False)
        if w:
            net.set_readout_table(table)
        net.eval()
        val = validation_report(net, space, val_set, recipe=recipe, moments=moments)
        right = torch.cat([net.decode(space.encode(held[i:i + 32]), torch.ones(len(held[i:i + 32]))).argmax(-1)
                           for i in range(0, len(held), 32)]) == held
        by_count = {k: {"share": m.float().mean().item(), "accuracy": right[m].float().mean().item()}
                    for k, m in groups.items() if m.any()}
        for seed in seeds:
            texts = draw_samples(net, space, recipe, num, cfg.length, steps=steps, seed=seed)
            rows.append({"weight": w, "seed": seed, "steps": steps, "decode_accuracy": val["decode_accuracy"],
                         "clean_accuracy_by_training_count": by_count, **word_stats(texts, vocab),
                         "first": texts[0][:200]})
            print(f"  readout weight {w:g}, seed {seed}: decode p=1 {val['decode_accuracy']['p=1.0']:.1%}, word "
                  f"entropy {rows[-1]['word_entropy']:.2f}, corpus words {rows[-1]['corpus_word_share']:.1%}",
                  flush=True)
    return {"name": name, "run": run.run_dir.name, "rows": rows, "real_text": word_stats(space.decode(val_set.tokens[:num]),
                                                                                     vocab), "machine": machine()}


@torch.no_grad()
def fine_bins(name: str, edges=(0.0, 0.005, 0.02, 0.05, 0.1, 0.15, 0.2), rows: int = 128,
              work: Path = Path("runs/quickstart_study"), cache_dir=None) -> list[dict]:
    """The low-t end in finer bins for one trained configuration: its loss, the baseline's, and the variance
    per dimension of what the network adds to its own Gaussian skip (a skip network's correction)."""
    from elflow.model import gaussian_posterior
    from elflow.space import latent_moments

    run = measured_run(name, work, cache_dir)
    net, space, recipe, val_set = run.net, run.space, run.recipe, run.val_set
    mu, var = latent_moments(space, val_set)
    x = space.encode(val_set.tokens[:rows]).float()
    g = torch.Generator().manual_seed(1)
    out = []
    for lo, hi in zip(edges, edges[1:]):
        t = lo + (hi - lo) * torch.rand(len(x), generator=g)
        tt = t[:, None, None]
        z = tt * x + (1 - tt) * recipe.noise_scale * torch.randn(x.shape, generator=g)
        pred = torch.cat([net(z[i:i + 32], t[i:i + 32], torch.ones(len(t[i:i + 32])))
                          for i in range(0, len(x), 32)])
        loss = lambda p: (((p - x) / (1 - tt).clamp_min(recipe.t_eps)) ** 2).mean().item()  # noqa: E731
        row = {"t": f"{lo}-{hi}", "model": loss(pred),
               "baseline": loss(gaussian_posterior(z, t, mu, var, recipe.noise_scale)[0])}
        if getattr(net, "options", None) is not None and net.options.skip == "gaussian":
            own = gaussian_posterior(z, t, net.skip_mean, net.skip_var, net.skip_noise)[0]
            row["correction_variance"] = (pred - own).var((0, 1)).mean().item()
        out.append(row)
        print(f"  t {lo}-{hi}: model {row['model']:.4f}, baseline {row['baseline']:.4f}"
              + (f", correction variance {row['correction_variance']:.4f}" if "correction_variance" in row else ""))
    return out


# ----------------------------------------------------------------------------------------------------------
# the table


def table(results: list[dict]) -> str:
    from elflow.flow import time_bin_labels

    labels = time_bin_labels()
    head = ("| config | change | steps x batch x L | train min | " + " | ".join(
        f"t {lab[1:]}" for lab in labels) + " | all (logit-normal t) | bins won | decode p=1 / 0.9 / 0.7 | "
        "word entropy | corpus words | distinct | samples with words |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    reals = {}
    for r in results:
        tc = r["train_config"]
        cells = []
        won = 0
        for b in r["bins"]:
            cells.append(f"{b['model']:.3f} / {b['baseline']:.3f}")
            won += b["model"] < b["baseline"]
        v = r["validation"]
        acc = " / ".join(f"{a:.1%}" for a in v["decode_accuracy"].values())
        s = r["samples"]
        lines.append(f"| {r['name']} | {r['note']} | {tc['steps']} x {tc['batch']} x {tc['length']} | "
                     f"{r['training']['train_loop_seconds'] / 60:.1f} | " + " | ".join(cells)
                     + f" | {v['model_loss']:.3f} / {v['baseline_loss']:.3f} | {won}/{len(r['bins'])} | {acc} | "
                     f"{s['word_entropy']:.2f} | {s['corpus_word_share']:.1%} | {s['distinct_ratio']:.2f} | "
                     f"{s['texts']}/{r.get('num', 32)} |")
        reals[(tc["length"], tc["space"])] = r["real_text"]
    for (length, space), s in sorted(reals.items()):
        lines.append(f"| held-out text | L {length}, {space} | | | " + " | ".join("" for _ in labels)
                     + f" | | | | {s['word_entropy']:.2f} | {s['corpus_word_share']:.1%} | {s['distinct_ratio']:.2f} | "
                     f"{s['texts']}/{s['texts']} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="configurations or groups (screen, full); default: screen")
    p.add_argument("--steps", type=int, default=100, help="the screen's optimiser steps at batch 32, L 64")
    p.add_argument("--out", default=str(ROOT / "results" / "quickstart_study"), help="JSON and table folder")
    p.add_argument("--work", default="runs/quickstart_study", help="training runs (checkpoints)")
    p.add_argument("--rows", type=int, default=128, help="held-out rows per time bin")
    p.add_argument("--num", type=int, default=32, help="samples per configuration")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--list", action="store_true")
    p.add_argument("--floors", action="store_true", help="the rank floors of the top time bin (no training)")
    p.add_argument("--table-only", action="store_true", help="rewrite the table from the JSON files")
    p.add_argument("--fine-bins", action="store_true",
                   help="the low-t end in finer bins for the configurations named (trained already)")
    p.add_argument("--samplers", nargs="+", default=None, metavar="SAMPLER:STEPS[:OMEGA]",
                   help="sample the one configuration named with these settings (seeds 0 and 1), no training")
    p.add_argument("--readout", nargs="+", type=float, default=None, metavar="W",
                   help="read the one configuration named out with these table-readout weights (no training)")
    p.add_argument("--table", default=None, help="the table's file name in --out (default table-<names>.md)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.list:
        for n, spec in CONFIGS.items():
            print(f"{n:<16}{spec['group']:<10}{spec.get('note', '')}")
        return 0
    if args.floors:
        floors = rank_floors(cache_dir=args.cache_dir)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rank_floors.json").write_text(json.dumps({"floors": floors, "machine": machine()}, indent=1))
        for f in floors:
            print(f"{f['space']:<22} rank {f['rank']:>4}: variance per dim outside {f['variance_outside']:.4f}, "
                  f"floor of the t in [0.5, 1) bin {f['floor_t0.5-1.0']:.2f}")
        return 0
    for flag, sweep, prefix in (("samplers", sampler_sweep, "samplers"), ("readout", readout_sweep, "readout")):
        if getattr(args, flag):  # one trained configuration, measured again under other settings
            if len(args.names) != 1 or args.names[0] not in CONFIGS:
                raise SystemExit(f"--{flag} needs exactly one configuration name")
            res = sweep(args.names[0], getattr(args, flag), num=args.num, work=Path(args.work), cache_dir=args.cache_dir)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{prefix}-{args.names[0]}.json").write_text(json.dumps(res, indent=1))
            return 0
    if args.fine_bins:
        res = {}
        for n in args.names:
            print(n)
            res[n] = fine_bins(n, work=Path(args.work), cache_dir=args.cache_dir)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fine_bins.json").write_text(json.dumps({"bins": res, "machine": machine()}, indent=1))
        return 0
    wanted = args.names or ["screen"]
    names = []
    for w in wanted:
        group = [n for n, s in CONFIGS.items() if s["group"] == w]
        if group:
            names += group
        elif w in CONFIGS:
            names.append(w)
        else:
            raise SystemExit(f"unknown configuration or group {w!r}; see --list")
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    cfgs = {n: train_config(CONFIGS[n], args.steps) for n in names}
    if not args.table_only:
        decays: dict[str, set] = {}
        for n, cfg in cfgs.items():
            decays.setdefault(run_key(cfg), set()).add(float(cfg.ema_decay))
        todo = [n for n in names if not (out / f"{n}.json").exists()]
        print(f"{len(names)} configurations, {len(todo)} to measure; machine: {machine()}", flush=True)
        for i, n in enumerate(todo):
            cfg = cfgs[n]
            key = run_key(cfg)
            print(f"[{i + 1}/{len(todo)}] {n}: {CONFIGS[n].get('note', '')}", flush=True)
            run_dir = work / key
            rec = ensure_trained(cfg, decays[key], run_dir, args.cache_dir)
            res = measure(n, CONFIGS[n], cfg, run_dir, rec, args.rows, args.num, args.cache_dir)
            (out / f"{n}.json").write_text(json.dumps(res, indent=1))
            won = sum(b["model"] < b["baseline"] for b in res["bins"])
            print(f"  measured in {res['measure_seconds']:.0f} s: bins won {won}/{len(res['bins'])}, all "
                  f"{res['validation']['model_loss']:.3f} vs {res['validation']['baseline_loss']:.3f}, decode p=1 "
                  f"{res['validation']['decode_accuracy']['p=1.0']:.1%}, word entropy "
                  f"{res['samples']['word_entropy']:.2f} (real {res['real_text']['word_entropy']:.2f}), corpus "
                  f"words {res['samples']['corpus_word_share']:.1%}", flush=True)
            print("    " + res["sample_texts"][0][:200].replace("\n", " "), flush=True)
    results = [json.loads((out / f"{n}.json").read_text()) for n in names if (out / f"{n}.json").exists()]
    text = table(results)
    (out / (args.table or f"table-{'-'.join(wanted)}.md")).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Is the model learning? Held-out denoising loss per time bin against the per-dimension Gaussian posterior
mean (a baseline that learns nothing), decode accuracy, and word statistics of samples against real text."""

from __future__ import annotations

import math
import re
from collections import Counter

import torch

from elflow.flow import TIME_BINS, Recipe, draw_time, time_bin, time_bin_labels
from elflow.model import gaussian_posterior
from elflow.space import latent_moments

WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


@torch.no_grad()
def validation_report(net, space, dataset, recipe: Recipe = Recipe(), moments=None, rows: int = 128,
                      batch: int = 32, seed: int = 0, decode_levels=(1.0, 0.9, 0.7), device="cpu") -> dict:
    """Held-out denoising loss per time bin (network vs Gaussian baseline) and decode accuracy."""
    mu, var = moments if moments is not None else latent_moments(space, dataset, device=device)
    g = torch.Generator().manual_seed(seed)
    nb = len(TIME_BINS) - 1
    sums = {"model": torch.zeros(nb, dtype=torch.float64), "baseline": torch.zeros(nb, dtype=torch.float64)}
    counts = torch.zeros(nb, dtype=torch.float64)
    correct = {p: 0.0 for p in decode_levels}
    total_tokens = 0.0
    n = min(rows, len(dataset))
    for i in range(0, n, batch):
        b = dataset.batch(torch.arange(i, min(i + batch, n)))
        tokens = b["tokens"].to(device)
        mask = b["mask"].to(device).float()
        x = space.encode(tokens, attention_mask=b.get("attention_mask")).float()
        B, L, C = x.shape
        t = draw_time(B, g).to(device)
        eps = torch.randn(B, L, C, generator=g).to(device)
        tt = t[:, None, None]
        z = tt * x + (1 - tt) * recipe.noise_scale * eps
        clip = (1 - tt).clamp_min(recipe.t_eps)
        x_model = net(z, t, torch.ones(B, device=device)).float()  # unconditional prediction, omega = 1
        x_base = gaussian_posterior(z, t, mu, var, recipe.noise_scale)[0]
        bins = time_bin(t.cpu())
        for name, pred in (("model", x_model), ("baseline", x_base)):
            err = ((pred - x) / clip).pow(2).mean(-1)  # (B, L)
            row = ((err * mask).sum(-1) / mask.sum(-1).clamp_min(1)).double().cpu()
            sums[name].index_add_(0, bins, row)
        counts.index_add_(0, bins, torch.ones(B, dtype=torch.float64))
        for p in decode_levels:
            noisy = p * x + (1 - p) * recipe.decode_noise_scale * torch.randn(B, L, C, generator=g).to(device)
            pred = net.decode(noisy, torch.ones(B, device=device)).argmax(-1)
            correct[p] += ((pred == tokens).float() * mask).sum().item()
        total_tokens += mask.sum().item()
    out = {"bins": [], "decode_accuracy": {f"p={p}": correct[p] / max(total_tokens, 1) for p in decode_levels}}
    for k in range(nb):
        if counts[k] > 0:
            out["bins"].append({"t": time_bin_labels()[k], "rows": int(counts[k]),
                                "model": (sums["model"][k] / counts[k]).item(),
                                "baseline": (sums["baseline"][k] / counts[k]).item()})
    tot = counts.sum()
    out["model_loss"] = (sums["model"].sum() / tot).item()
    out["baseline_loss"] = (sums["baseline"].sum() / tot).item()
    return out


def corpus_vocabulary(texts) -> set[str]:
    vocab = set()
    for t in texts:
        vocab.update(WORD.findall(t.lower()))
    return vocab


def word_stats(texts: list[str], vocab: set[str]) -> dict:
    """Mean per-text unigram entropy of words (nats), share of words found in `vocab`, distinct-word ratio."""
    ents, known, total, distinct = [], 0, 0, []
    for t in texts:
        words = WORD.findall(t.lower())
        if not words:
            continue
        c = Counter(words)
        n = len(words)
        ents.append(-sum(k / n * math.log(k / n) for k in c.values()))
        known += sum(v for w, v in c.items() if w in vocab)
        total += n
        distinct.append(len(c) / n)
    return {"texts": len(ents), "word_entropy": sum(ents) / max(len(ents), 1),
            "corpus_word_share": known / max(total, 1), "distinct_ratio": sum(distinct) / max(len(distinct), 1)}

"""The optimiser recipe's settings, without the optimiser: which optimisers and update rules exist, the base
learning rates, the EMA decay and the learning-rate schedule. elflow.config (and so every run's record) reads
them from here, so that loading a model to sample never imports the optimiser (elflow.optim)."""

from __future__ import annotations

import math

OPTIMIZERS = ("muon", "adamw")
# how Muon + Adam step the weights; "released" is the released update, the others are the updates of earlier
# elflow runs, kept so that those runs resume exactly
UPDATE_RULES = ("released", "torch-fan", "torch-head-transposed")
UPDATE_RULE_HELP = {
    "released": "the released update: bias-corrected Nesterov momentum, fp32 Newton-Schulz on G / (|G| + 1e-8), "
                "every matrix scaled by sqrt(max(1, fan_out / fan_in)); Nesterov-Adam on the rest; a parameter "
                "without a gradient stepped with a zero one",
    "torch-fan": "torch.optim.Muon (no bias correction) with the fan rule on every matrix, torch.optim.Adam on "
                 "the rest: the update of runs made with --muon-scale fan or before that setting",
    "torch-head-transposed": "torch-fan with the decode head's two matrices scaled as their (in, out) "
                             "transposes, sqrt(max(1, fan_in / fan_out)): the update of runs made with "
                             "--muon-scale released",
}
ADAMW_BLR = 5e-5  # AdamW's lr per 256 rows: the paper's tuned 1e-4 for ELF-B at batch 512
MUON_BLR = 1e-3  # Muon's lr per 256 rows: 2e-3 at the paper's batch of 512
EMA_DECAY = 0.9999  # the paper's EMA of the weights, updated every optimiser step


def base_lr(batch: int, blr: float = MUON_BLR) -> float:
    """lr = blr * global batch / 256 (2e-3 at the paper's batch of 512; AdamW's ADAMW_BLR gives 1e-4)."""
    return blr * batch / 256


LR_DECAYS = ("constant", "cosine")
# where the warm-up starts: "released" runs optimiser step k (from 0) at lr k / W, so that the first step only
# fills the momentum and Adam moments, and starts the cosine at step W; "one-ahead" runs step k at lr (k + 1) / W
# and starts the cosine one step earlier: the schedule of earlier elflow runs, kept so that they resume exactly
LR_SCHEDULES = ("released", "one-ahead")


def lr_at(step: int, lr: float, warmup: int, decay: str = "constant", total: int | None = None,
          schedule: str = "released") -> float:
    """The learning rate of optimiser step `step` (counted from 0): a linear warm-up over `warmup` steps, then
    constant (the paper's) or, with decay="cosine", a half cosine from lr down to 0 at step `total`.

        released   k < W: lr k / W;      then lr (1 + cos(pi min(1, (k - W) / (total - W)))) / 2
        one-ahead  k < W: lr (k + 1) / W; then the same with k + 1 in place of k"""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_at: schedule must be one of {', '.join(LR_SCHEDULES)}; got {schedule!r}")
    k = step + 1 if schedule == "one-ahead" else step
    if step < warmup:
        return lr * k / warmup
    if decay == "constant":
        return lr
    if decay != "cosine" or not total:
        raise ValueError(f"lr_at: decay must be 'constant', or 'cosine' with a total step count; got {decay!r}")
    done = min(1.0, (k - warmup) / max(total - warmup, 1))
    return lr * 0.5 * (1.0 + math.cos(math.pi * done))

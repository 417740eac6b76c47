"""The training methods by name, and a small trainer for the token-level baselines.

    METHOD_NAMES                      ("elf", "ar", "mdlm")
    get_method(name)                  the baseline's module (elflow.ar or elflow.mdlm), None for "elf" (which
                                      elflow.train runs); an unknown name is a one-line ELFError
    make_optimizer(model, lr)         ELF's optimiser for a TokenTransformer: Muon on the blocks' matrices, Adam
                                      on norms, biases and the token tables (as ELF's heads under adam_heads)
    train_baseline(name, model, batches, steps, ...)   optimiser steps on data.Batches, with an EMA
    heldout_loss(name, model, dataset, ...)            token-weighted held-out loss (AR: NLL, MDLM: NELBO)
    sample_texts(name, model, space, num, length, settings, seed)   decoded samples

Every baseline module exposes the same interface (described in elflow.ar): build(config, space),
loss(model, tokens, mask, generator), sample_tokens(model, batch, length, settings, generator), SETTINGS and
fit_config(target, space, base).
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext

import torch

from elflow import ar, mdlm
from elflow.optim import EMA, ELFOptimizer, lr_at
from elflow.utils import ELFError

__all__ = ["METHOD_NAMES", "BASELINES", "get_method", "make_optimizer", "train_baseline", "heldout_loss",
           "sample_texts", "step_seed"]

BASELINES = {"ar": ar, "mdlm": mdlm}
METHOD_NAMES = ("elf", *BASELINES)


def get_method(name: str):
    """The module of a baseline method; None for "elf"."""
    if name not in METHOD_NAMES:
        raise ELFError(f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)}")
    return BASELINES.get(name)


def _baseline(name: str):
    module = get_method(name)
    if module is None:
        raise ELFError(f"method {name!r} is not a token-level baseline; ELF trains through elflow.train")
    return module


def step_seed(seed: int, step: int) -> int:
    """A generator seed for one step of one run, independent of everything else."""
    return int.from_bytes(hashlib.sha256(f"elflow-baseline:{seed}:{step}".encode()).digest()[:8], "little") >> 1


def make_optimizer(model, lr: float, muon_tables: bool = False) -> ELFOptimizer:
    """ELFOptimizer over a TokenTransformer. The token tables (input embedding, untied read-out) join its Adam
    group unless `muon_tables`, as ELF's output heads and embedders do with adam_heads."""
    tables = [model.embed.weight] + ([model.lm_head.weight] if model.lm_head is not None else [])
    table_ids = {id(p) for p in tables}
    named = [(n, p) for n, p in model.named_parameters() if muon_tables or id(p) not in table_ids]
    opt = ELFOptimizer(named, lr=lr)
    if not muon_tables:
        adam = next(o for o in opt.optimizers if isinstance(o, torch.optim.Adam))  # norms and biases are there
        adam.add_param_group({"params": tables})
        opt.adam_names += [n for n, p in model.named_parameters() if id(p) in table_ids]
    return opt


def _autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if dtype != "fp32":
        raise ELFError(f"dtype must be fp32 or bf16, got {dtype!r}")
    return nullcontext()


def train_baseline(name: str, model, batches, steps: int, lr: float = 1e-3, warmup: int = 0,
                   ema_decay: float = 0.99, seed: int = 0, grad_clip: float = 1.0, muon_tables: bool = False,
                   dtype: str = "fp32", optimizer: ELFOptimizer | None = None, ema: EMA | None = None,
                   start: int = 0, callback=None) -> dict:
    """`steps` optimiser steps of a baseline on batches from `batches` (a data.Batches or any iterator of
    {"tokens", "mask"} dicts), ELF's learning-rate schedule (linear warm-up, then constant). Each step's
    randomness comes from a generator seeded by (seed, step). `callback(step, metrics)` sees every step.
    Returns {"optimizer", "ema", "losses", "tokens_seen"}; pass optimizer, ema and start back to continue."""
    method = _baseline(name)
    device = model.embed.weight.device
    optimizer = optimizer or make_optimizer(model, lr, muon_tables)
    ema = ema or EMA(model, ema_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    losses, seen = [], 0
    model.train()
    for step in range(start, start + steps):
        batch = next(batches)
        tokens = batch["tokens"].to(device)
        mask = batch.get("mask")
        mask = mask.to(device) if mask is not None else None
        g = torch.Generator(device=device).manual_seed(step_seed(seed, step))
        with _autocast(device, dtype):
            loss, metrics = method.loss(model, tokens, mask, g)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        if not torch.isfinite(grad_norm) or not torch.isfinite(loss):
            raise ELFError(f"{name}: non-finite loss or gradient at step {step}; try a lower lr or fp32")
        optimizer.set_lr(lr_at(step, lr, warmup))
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
        losses.append(float(loss.detach()))
        seen += tokens.numel()
        if callback is not None:
            callback(step, metrics)
    return {"optimizer": optimizer, "ema": ema, "losses": losses, "tokens_seen": seen}


@torch.no_grad()
def heldout_loss(name: str, model, dataset, batch: int = 32, rows: int = 256, seed: int = 0) -> float:
    """Sum of the loss terms over the scored positions of the first `rows` rows, per scored position: the
    AR NLL, or the MDLM NELBO (its times and masks drawn from `seed`, so two models see the same ones)."""
    method = _baseline(name)
    device = model.embed.weight.device
    was_training = model.training
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    total = count = 0.0
    n = min(rows, len(dataset))
    for i in range(0, n, batch):
        b = dataset.batch(torch.arange(i, min(i + batch, n)))
        _, metrics = method.loss(model, b["tokens"].to(device), b["mask"].to(device), g)
        total += float(metrics["nll_sum"])
        count += float(metrics["tokens"])
    model.train(was_training)
    return total / max(count, 1.0)


@torch.no_grad()
def sample_texts(name: str, model, space, num: int, length: int, settings=None, seed: int = 0,
                 batch_size: int = 16) -> list[str]:
    """`num` samples decoded by the space's tokenizer (cut at the first EOS), drawn in batches from one
    generator seeded by `seed`."""
    method = _baseline(name)
    settings = settings if settings is not None else method.SETTINGS()
    device = model.embed.weight.device
    was_training = model.training
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    texts = []
    for i in range(0, num, batch_size):
        ids = method.sample_tokens(model, min(batch_size, num - i), length, settings, g)
        texts += space.decode(ids.cpu())
    model.train(was_training)
    return texts

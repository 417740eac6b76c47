"""The paper's optimiser recipe: Muon on 2-D weight matrices (torch.optim.Muon, the decode head's two stepped
at the released port's scale: `muon_lr_scale`), Adam on the rest, linear warm-up then constant (or cosine)
learning rate, and the EMA of the weights. How Muon's Newton-Schulz polynomial is evaluated fast on a CPU is
elflow.newton_schulz."""

from __future__ import annotations

import math

import torch

from elflow.newton_schulz import default_ns_dtype, ns_precision, resolve_ns_method

OPTIMIZERS = ("muon", "adamw")
MUON_SCALES = ("released", "fan")  # the decode head's Muon step scale: the released port's, or the fan rule's
# the matrices the released port stores as (in, out) kernels, the transposes of elflow's nn.Linear weights
RELEASED_KERNELS = ("decode_head.proj.weight", "decode_head.unembed.weight")


ADAMW_BLR = 5e-5  # AdamW's lr per 256 rows: the paper's tuned 1e-4 for ELF-B at batch 512


def muon_lr_scale(name: str, shape, muon_scale: str = "released") -> float:
    """The factor on the learning rate of the Muon parameter `name` of `shape` (out, in) that turns torch's
    scale sqrt(max(1, out / in)) into the one of `muon_scale`: under "released", on RELEASED_KERNELS,
    sqrt(max(1, in / out)) / sqrt(max(1, out / in)) (the rows / columns rule read on the (in, out) kernel the
    released port stores); 1 on every other matrix and under "fan" (docs/method.md)."""
    if muon_scale not in MUON_SCALES:
        raise ValueError(f"muon_scale must be one of {', '.join(MUON_SCALES)}, got {muon_scale!r}")
    if muon_scale == "fan" or not name.endswith(RELEASED_KERNELS) or len(shape) != 2:
        return 1.0
    fan_out, fan_in = shape
    return math.sqrt(max(1.0, fan_in / fan_out)) / math.sqrt(max(1.0, fan_out / fan_in))


def base_lr(batch: int, blr: float = 1e-3) -> float:
    """lr = blr * global batch / 256 (2e-3 at the paper's batch of 512; AdamW's ADAMW_BLR gives 1e-4)."""
    return blr * batch / 256


LR_DECAYS = ("constant", "cosine")


def lr_at(step: int, lr: float, warmup: int, decay: str = "constant", total: int | None = None) -> float:
    """Linear warm-up over `warmup` optimiser steps, then constant (the paper's schedule) or, with
    decay="cosine", a half cosine from lr down to 0 at step `total` (steps counted from 0)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if decay == "constant":
        return lr
    if decay != "cosine" or not total:
        raise ValueError(f"lr_at: decay must be 'constant', or 'cosine' with a total step count; got {decay!r}")
    done = min(1.0, (step - warmup + 1) / max(total - warmup, 1))
    return lr * 0.5 * (1.0 + math.cos(math.pi * done))


class ELFOptimizer:
    """Muon + Adam behind one step/zero_grad/state_dict interface."""

    def __init__(self, named_params, lr: float, betas=(0.9, 0.999),
                 eps: float = 1e-8, momentum: float = 0.95, ns_steps: int = 5, ns_dtype: torch.dtype | None = None,
                 ns_method: str = "auto", adam=(), kind: str = "muon", weight_decay: float = 0.0,
                 muon_scale: str = "released"):
        """`adam`: names of parameters that go to Adam whatever their shape (besides the 1-D ones and a trainable
        space's "space."-named ones). `kind="adamw"`: AdamW on every parameter instead. `muon_scale`: the decode
        head's Muon step scale (`muon_lr_scale`): a Muon matrix whose factor is not 1 gets a group of its own."""
        if kind not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
        if muon_scale not in MUON_SCALES:
            raise ValueError(f"muon_scale must be one of {', '.join(MUON_SCALES)}, got {muon_scale!r}")
        self.kind = kind
        forced = set(adam)
        muon, adam = [], []
        self.muon_names, self.adam_names = [], []
        scaled = []  # (param, lr factor) of Muon matrices stepped at a scale of their own
        named_params = list(named_params)
        device = named_params[0][1].device if named_params else torch.device("cpu")
        self.ns_dtype = ns_dtype or default_ns_dtype(device)
        self.ns_method = resolve_ns_method(ns_method, self.ns_dtype, device)
        for name, p in named_params:
            if not p.requires_grad:
                continue
            to_muon = kind == "muon" and p.ndim == 2 and name not in forced and not name.startswith("space.")
            scale = muon_lr_scale(name, p.shape, muon_scale) if to_muon else 1.0
            if scale != 1.0:
                scaled.append((p, scale))
            else:
                (muon if to_muon else adam).append(p)
            (self.muon_names if to_muon else self.adam_names).append(name)
        self.optimizers = []
        if muon or scaled:
            # a scaled group's weight decay is divided by its factor: the decay stays lr * weight_decay
            groups = [{"params": muon}] * bool(muon) + [
                {"params": [p], "lr_scale": f, "weight_decay": weight_decay / f} for p, f in scaled]
            self.optimizers.append(torch.optim.Muon(groups, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                                    nesterov=True, ns_steps=ns_steps, adjust_lr_fn="original"))
        if adam:
            fused = all(p.is_cuda for p in adam) or None
            if kind == "adamw" or weight_decay:  # decoupled decay; at 0 the recipe's Adam
                self.optimizers.append(torch.optim.AdamW(adam, lr=lr, betas=betas, eps=eps,
                                                         weight_decay=weight_decay, fused=fused))
            else:
                self.optimizers.append(torch.optim.Adam(adam, lr=lr, betas=betas, eps=eps, weight_decay=0.0,
                                                        fused=fused))
        self.set_lr(lr)

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = lr * g.get("lr_scale", 1.0)

    def step(self) -> None:
        with ns_precision(self.ns_dtype, self.ns_method):
            for opt in self.optimizers:
                opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> list:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list) -> None:
        if len(states) != len(self.optimizers):
            raise ValueError(f"optimiser state has {len(states)} parts, expected {len(self.optimizers)} "
                             "(was the run made with a different --adam-heads setting?)")
        for opt, s in zip(self.optimizers, states):
            opt.load_state_dict(s)


class EMA:
    """An exponential moving average of the weights, kept in fp32, starting from the initial weights."""

    def __init__(self, module: torch.nn.Module, decay: float = 0.9999):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must lie in [0, 1), got {decay}")
        self.decay = decay
        self.names = [n for n, p in module.named_parameters()]
        self.shadow = [p.detach().float().clone() for p in module.parameters()]

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        params = [p.detach().float() for p in module.parameters()]
        torch._foreach_lerp_(self.shadow, params, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow))

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in sd]
        if missing:
            raise KeyError(f"EMA weights lack {missing[:5]}")
        for n, s in zip(self.names, self.shadow):
            s.copy_(sd[n])

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module) -> None:
        for p, s in zip(module.parameters(), self.shadow):
            p.copy_(s)

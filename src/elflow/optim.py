"""The paper's optimiser recipe: Muon on 2-D weight matrices, Adam on the rest, warm-up then constant, EMA.

    Muon  every 2-D weight (decode head and embedder MLPs included, as the authors do); momentum 0.95,
          Nesterov, 5 Newton-Schulz steps (3.4445, -4.7750, 2.0315), lr scaled by sqrt(max(1, fan_out/fan_in))
    Adam  biases, norms, prefix tokens, learned embedding tables; betas (0.9, 0.999), eps 1e-8
    both  weight decay 0, lr = 1e-3 * batch / 256, linear warm-up then constant

`adam_heads=True` moves the output heads and the input/scalar embedders to Adam (the usual Muon practice,
and far cheaper on a CPU: Newton-Schulz on the 512 x 32,100 readout alone is ~170 GFLOP per step).
"""

from __future__ import annotations

import torch

__all__ = ["ELFOptimizer", "EMA", "base_lr", "lr_at", "HEAD_PREFIXES"]

HEAD_PREFIXES = ("x_head.", "decode_head.", "self_cond_proj.", "bottleneck_in.", "bottleneck_out.",
                 "time_embed.", "omega_embed.")


def base_lr(batch: int, blr: float = 1e-3) -> float:
    """lr = blr * global batch / 256 (2e-3 at the paper's batch of 512)."""
    return blr * batch / 256


def lr_at(step: int, lr: float, warmup: int) -> float:
    """Linear warm-up over `warmup` optimiser steps, then constant."""
    if warmup <= 0:
        return lr
    return lr * min(1.0, (step + 1) / warmup)


class ELFOptimizer:
    """Muon + Adam behind one step/zero_grad/state_dict interface."""

    def __init__(self, named_params, lr: float, adam_heads: bool = False, betas=(0.9, 0.999),
                 eps: float = 1e-8, momentum: float = 0.95, ns_steps: int = 5):
        muon, adam = [], []
        self.muon_names, self.adam_names = [], []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            to_muon = p.ndim == 2 and not name.startswith("space.") and not (
                adam_heads and name.startswith(HEAD_PREFIXES))
            (muon if to_muon else adam).append(p)
            (self.muon_names if to_muon else self.adam_names).append(name)
        self.optimizers = []
        if muon:
            self.optimizers.append(torch.optim.Muon(muon, lr=lr, weight_decay=0.0, momentum=momentum,
                                                    nesterov=True, ns_steps=ns_steps, adjust_lr_fn="original"))
        if adam:
            fused = all(p.is_cuda for p in adam)
            self.optimizers.append(torch.optim.Adam(adam, lr=lr, betas=betas, eps=eps, weight_decay=0.0,
                                                    fused=fused or None))
        self.set_lr(lr)

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = lr

    def step(self) -> None:
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

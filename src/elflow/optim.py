"""The paper's optimiser recipe: Muon on every 2-D weight matrix and Nesterov-Adam on the rest, exactly as the
authors' released code steps them (`ReleasedMuonAdam`), a linear warm-up then a constant (or cosine) learning
rate, and the EMA of the weights. `ELFOptimizer` also keeps the two earlier updates, built on torch.optim.Muon
and torch.optim.Adam, so that runs trained with them resume exactly (UPDATE_RULES). How the Newton-Schulz
polynomial is evaluated fast on a CPU is elflow.newton_schulz."""

from __future__ import annotations

import math

import torch

from elflow.newton_schulz import default_ns_dtype, newton_schulz, ns_precision, resolve_ns_method

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
# the matrices whose step "torch-head-transposed" rescales
DECODE_HEAD_MATRICES = ("decode_head.proj.weight", "decode_head.unembed.weight")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_MOMENTUM = 0.95
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
NS_EPS = 1e-8  # the released normalisation: G / (|G|_F + NS_EPS)

ADAMW_BLR = 5e-5  # AdamW's lr per 256 rows: the paper's tuned 1e-4 for ELF-B at batch 512
MUON_BLR = 1e-3  # Muon's lr per 256 rows: 2e-3 at the paper's batch of 512
EMA_DECAY = 0.9999  # the paper's EMA of the weights, updated every optimiser step


def fan_scale(shape, in_out: bool = False) -> float:
    """sqrt(max(1, fan_out / fan_in)) of a matrix stored (out, in) as nn.Linear stores it, or (in, out)."""
    fan_out, fan_in = (shape[1], shape[0]) if in_out else (shape[0], shape[1])
    return math.sqrt(max(1.0, fan_out / fan_in))


def head_transposed_factor(name: str, shape, rule: str) -> float:
    """The factor on the learning rate of the Muon matrix `name` (stored (out, in)) that turns torch's fan
    scale into the one of `rule`: on DECODE_HEAD_MATRICES under "torch-head-transposed", the scale of the
    transpose over the scale of the matrix; 1 otherwise."""
    if rule != "torch-head-transposed" or not name.endswith(DECODE_HEAD_MATRICES) or len(shape) != 2:
        return 1.0
    return fan_scale(shape, in_out=True) / fan_scale(shape)


def base_lr(batch: int, blr: float = MUON_BLR) -> float:
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


class ReleasedMuonAdam(torch.optim.Optimizer):
    """The released update, one optimiser for both kinds of parameter. A group is {"params", "muon": bool,
    "in_out": bool (its matrices are stored (in, out))}; every parameter keeps "step" (t, from 1), "m" and, for
    Adam, "v", in fp32. Per step, g the gradient (zero where a parameter got none, so t is the global step):

        Muon   m <- m + (1 - b)(g - m);  u = b m / (1 - b^(t+1)) + (1 - b) g / (1 - b^t)
               X = NS5(u / (|u|_F + 1e-8)) in fp32;  p <- p - lr sqrt(max(1, fan_out / fan_in)) X
        Adam   m, v as Adam's;  m^ = b1 m / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t);  v^ = v / (1 - b2^t)
               p <- p - lr m^ / (sqrt(v^) + eps)

    `weight_decay` (0 in the recipe) is decoupled: p <- p (1 - lr wd) before the step."""

    def __init__(self, groups, lr: float, momentum: float = MUON_MOMENTUM, betas=ADAM_BETAS, eps: float = ADAM_EPS,
                 ns_steps: int = 5, ns_dtype: torch.dtype = torch.float32, ns_method: str = "iterate",
                 weight_decay: float = 0.0):
        defaults = dict(lr=lr, momentum=momentum, betas=tuple(betas), eps=eps, ns_steps=ns_steps,
                        weight_decay=weight_decay, muon=False, in_out=False)
        super().__init__(groups, defaults)
        self.ns_dtype, self.ns_method = ns_dtype, ns_method

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group["params"]]
            if group["weight_decay"]:
                torch._foreach_mul_(group["params"], 1 - group["lr"] * group["weight_decay"])
            (self._muon if group["muon"] else self._adam)(group, grads)

    def _state(self, p: torch.Tensor, adam: bool) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float64)
            state["m"] = torch.zeros_like(p, dtype=torch.float32)
            if adam:
                state["v"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        return state

    def _muon(self, group: dict, grads: list) -> None:
        b = group["momentum"]
        for p, g in zip(group["params"], grads):
            if p.ndim != 2:
                raise ValueError(f"Muon steps matrices; a parameter of shape {tuple(p.shape)} is in its group")
            s = self._state(p, adam=False)
            t = s["step"].item()
            g = g.float()
            s["m"].lerp_(g, 1 - b)
            u = s["m"] * (b / (1 - b ** (t + 1))) + g * ((1 - b) / (1 - b ** t))
            x = newton_schulz(u, NS_COEFFICIENTS, group["ns_steps"], NS_EPS, self.ns_dtype, self.ns_method,
                              added_eps=True)
            p.add_(x.to(p.dtype), alpha=-group["lr"] * fan_scale(p.shape, group["in_out"]))

    def _adam(self, group: dict, grads: list) -> None:
        b1, b2 = group["betas"]
        states = [self._state(p, adam=True) for p in group["params"]]
        t = states[0]["step"].item()  # every parameter steps every step: one count
        g32 = [g.float() for g in grads]
        ms, vs = [s["m"] for s in states], [s["v"] for s in states]
        torch._foreach_lerp_(ms, g32, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, g32, g32, value=1 - b2)
        m_hat = torch._foreach_add(torch._foreach_mul(ms, b1 / (1 - b1 ** (t + 1))), g32,
                                   alpha=(1 - b1) / (1 - b1 ** t))
        denom = torch._foreach_add(torch._foreach_sqrt(torch._foreach_div(vs, 1 - b2 ** t)), group["eps"])
        steps = torch._foreach_div(m_hat, denom)
        torch._foreach_add_(group["params"], [s.to(p.dtype) for s, p in zip(steps, group["params"])],
                            alpha=-group["lr"])


class ELFOptimizer:
    """Muon + Adam (or AdamW alone) behind one step/zero_grad/state_dict interface."""

    def __init__(self, named_params, lr: float, betas=ADAM_BETAS, eps: float = ADAM_EPS,
                 momentum: float = MUON_MOMENTUM, ns_steps: int = 5, ns_dtype: torch.dtype | None = None,
                 ns_method: str = "auto", adam=(), kind: str = "muon", weight_decay: float = 0.0,
                 update_rule: str = "released", in_out=()):
        """`adam`: names of parameters that go to Adam whatever their shape (besides the 1-D ones and a trainable
        space's "space."-named ones). `kind="adamw"`: AdamW on every parameter instead. `update_rule` (one of
        UPDATE_RULES): how Muon + Adam step. `in_out`: names of matrices stored (in, out), the transpose of
        nn.Linear's layout (their fan-out and fan-in read accordingly). `ns_dtype`: the Newton-Schulz precision
        (None: fp32 for the released rule; the earlier rules' bf16 on devices with fast bf16 matmuls)."""
        if kind not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
        if update_rule not in UPDATE_RULES:
            raise ValueError(f"update_rule must be one of {', '.join(UPDATE_RULES)}, got {update_rule!r}")
        self.kind, self.update_rule = kind, update_rule
        forced, in_out = set(adam), set(in_out)
        named_params = [(n, p) for n, p in named_params if p.requires_grad]
        device = named_params[0][1].device if named_params else torch.device("cpu")
        released = update_rule == "released"
        self.ns_dtype = ns_dtype or (torch.float32 if released else default_ns_dtype(device))
        self.ns_method = resolve_ns_method(ns_method, self.ns_dtype, device)
        self.muon_names, self.adam_names = [], []
        for name, p in named_params:
            to_muon = kind == "muon" and p.ndim == 2 and name not in forced and not name.startswith("space.")
            (self.muon_names if to_muon else self.adam_names).append(name)
        muon = [(n, p) for n, p in named_params if n in set(self.muon_names)]
        adam = [p for n, p in named_params if n in set(self.adam_names)]
        if kind == "adamw":
            self.optimizers = [torch.optim.AdamW(adam, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                                 fused=all(p.is_cuda for p in adam) or None)]
        elif released:
            groups = [{"params": [p for n, p in muon if n not in in_out], "muon": True},
                      {"params": [p for n, p in muon if n in in_out], "muon": True, "in_out": True},
                      {"params": adam}]
            self.optimizers = [ReleasedMuonAdam([g for g in groups if g["params"]], lr, momentum, betas, eps,
                                                ns_steps, self.ns_dtype, self.ns_method, weight_decay)]
        else:
            self.optimizers = self._torch_optimizers(muon, adam, lr, betas, eps, momentum, ns_steps, weight_decay,
                                                     in_out)
        self.set_lr(lr)

    def _torch_optimizers(self, muon, adam, lr, betas, eps, momentum, ns_steps, weight_decay, in_out) -> list:
        """The earlier rules: torch.optim.Muon, whose scale sqrt(max(1, rows / columns)) is the fan rule on
        (out, in) matrices; a matrix whose factor is not 1 gets a group of its own at that lr factor."""
        plain, scaled = [], []
        if in_out:
            raise ValueError(f"update rule {self.update_rule} steps (out, in) matrices only; {sorted(in_out)[0]!r} "
                             "is stored (in, out)")
        for n, p in muon:
            f = head_transposed_factor(n, p.shape, self.update_rule)
            (scaled.append((p, f)) if f != 1.0 else plain.append(p))
        optimizers = []
        if muon:
            # a scaled group's weight decay is divided by its factor: the decay stays lr * weight_decay
            groups = [{"params": plain}] * bool(plain) + [
                {"params": [p], "lr_scale": f, "weight_decay": weight_decay / f} for p, f in scaled]
            optimizers.append(torch.optim.Muon(groups, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                               nesterov=True, ns_steps=ns_steps, adjust_lr_fn="original"))
        if adam:
            fused = all(p.is_cuda for p in adam) or None
            if weight_decay:  # decoupled decay; at 0 the recipe's Adam
                optimizers.append(torch.optim.AdamW(adam, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                                    fused=fused))
            else:
                optimizers.append(torch.optim.Adam(adam, lr=lr, betas=betas, eps=eps, fused=fused))
        return optimizers

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = lr * g.get("lr_scale", 1.0)

    def step(self) -> None:
        if self.update_rule == "released" or self.kind == "adamw":
            for opt in self.optimizers:
                opt.step()
            return
        with ns_precision(self.ns_dtype, self.ns_method):
            for opt in self.optimizers:
                opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> list:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list) -> None:
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            n = len(states) if isinstance(states, list) else "?"
            raise ValueError(f"optimiser state has {n} parts, expected {len(self.optimizers)} (was the run made "
                             "with a different --adam-heads or --update-rule setting?)")
        for opt, s in zip(self.optimizers, states):
            opt.load_state_dict(s)


class EMA:
    """An exponential moving average of the weights, kept in fp32, starting from the initial weights."""

    def __init__(self, module: torch.nn.Module, decay: float = EMA_DECAY):
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

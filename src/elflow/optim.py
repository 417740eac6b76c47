"""The paper's optimiser: Muon on every 2-D weight matrix and Nesterov-Adam on the rest, exactly as the authors'
released code steps them (`ReleasedMuonAdam`), and the EMA of the weights; the recipe's settings and the
learning-rate schedule are elflow.schedule, which a model's loader reads without this module. `ELFOptimizer` also keeps the two earlier updates, built on torch.optim.Muon
and torch.optim.Adam, so that runs trained with them resume exactly (UPDATE_RULES). How the Newton-Schulz
polynomial is evaluated fast on a CPU is elflow.newton_schulz."""

from __future__ import annotations

import math
import os

import torch

from elflow.newton_schulz import NS_COEFFICIENTS, default_ns_dtype, newton_schulz, ns_precision, resolve_ns_method
from elflow.schedule import EMA_DECAY, OPTIMIZERS, UPDATE_RULES
from elflow.util.errors import ELFError

# the matrices whose step "torch-head-transposed" rescales
DECODE_HEAD_MATRICES = ("decode_head.proj.weight", "decode_head.unembed.weight")
MUON_MOMENTUM = 0.95
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
NS_EPS = 1e-8  # the released normalisation: G / (|G|_F + NS_EPS)



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


# ----------------------------------------------------------------------------------------------------------
# the optimiser state a resume loads, checked before it is used

# the settings of a group that the update reads from the group itself: a stored state that changes one of them
# steps with another rule than the run's
GROUP_SETTINGS = ("muon", "in_out", "momentum", "betas", "eps", "weight_decay", "ns_steps", "nesterov",
                  "ns_coefficients", "adjust_lr_fn", "lr_scale", "amsgrad", "maximize", "decoupled_weight_decay")
MOMENT_WORDS = {"m": "momentum", "v": "second moment", "momentum_buffer": "momentum", "exp_avg": "first moment",
                "exp_avg_sq": "second moment", "max_exp_avg_sq": "largest second moment"}


class _Misfit(Exception):
    """What does not fit, said once by `check_optimizer_state` with the file it came from."""


def _moments_of(opt, group: dict) -> tuple[tuple[str, ...], bool]:
    """(the tensors each parameter's state holds, whether it holds a step count) under `opt` for `group`."""
    if isinstance(opt, ReleasedMuonAdam):
        return (("m",) if group["muon"] else ("m", "v")), True
    if isinstance(opt, torch.optim.Muon):
        return ("momentum_buffer",), False
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ()), True


def _same(a, b) -> bool:
    """Two group settings alike: equal numbers, strings or flags (a flag only equals a flag), element by element
    for sequences; NaN equals nothing."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _check_group(saved, own: dict, ours: dict, released: bool, what: str) -> None:
    """A stored group against the run's: a dict with the same parameter count and every setting of
    GROUP_SETTINGS the run's group has (all of them present under the released update)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
        raise _Misfit(f"{what} is not a parameter group")
    if len(saved["params"]) != len(own["params"]):
        raise _Misfit(f"{what} holds {len(saved['params'])} parameters, this run's has {len(own['params'])} "
                      "(another network, --update-rule or --optimizer)")
    if saved["params"] != own["params"]:
        raise _Misfit(f"{what} numbers its parameters {saved['params'][:4]}..., this run's {own['params'][:4]}...")
    for key in GROUP_SETTINGS:
        if key not in ours:
            continue
        if key not in saved:
            if released:
                raise _Misfit(f"{what} has no setting {key!r}")
            continue
        if not _same(saved[key], ours[key]):
            raise _Misfit(f"{what} has {key} {saved[key]!r}, this run's update has {ours[key]!r} (another "
                          "--update-rule, --optimizer or --weight-decay, or an edited file)")


def _step_count(value, name: str, limit: int | None) -> float:
    """A stored step count as a number: a whole number from 0 to `limit` (the checkpoint's step)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.device.type == "meta":
            raise _Misfit(f"parameter {name}: its step count is a tensor of shape {tuple(value.shape)}, not a number")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Misfit(f"parameter {name}: its step count is {type(value).__name__}, not a number")
    top = "" if limit is None else f" to {limit:,} (the checkpoint's step)"
    if not math.isfinite(value) or value != int(value) or value < 0 or (limit is not None and value > limit):
        raise _Misfit(f"parameter {name}: its step count is {value!r}, not a whole number from 0{top}")
    return value


def _check_param(state, p: torch.Tensor, name: str, moments: tuple, has_step: bool, limit) -> float | None:
    """One parameter's stored state: every moment of the update present, of the parameter's shape,
    floating-point and finite; its step count (`_step_count`), returned."""
    if not isinstance(state, dict):
        raise _Misfit(f"parameter {name}: its state is {type(state).__name__}, not a record of moments")
    for key in moments:
        t = state.get(key)
        word = f"{MOMENT_WORDS.get(key, key)} {key!r}"
        if not isinstance(t, torch.Tensor):
            raise _Misfit(f"parameter {name}: its state holds no {word}" if t is None else
                          f"parameter {name}: its {word} is {type(t).__name__}, not a tensor")
        if tuple(t.shape) != tuple(p.shape):
            raise _Misfit(f"parameter {name}: its {word} has shape {tuple(t.shape)}, the parameter's is "
                          f"{tuple(p.shape)}")
        if not t.is_floating_point() or t.device.type == "meta":
            raise _Misfit(f"parameter {name}: its {word} holds {t.dtype} values on {t.device.type}, not "
                          "floating-point numbers")
        if not bool(torch.isfinite(t).all()):
            raise _Misfit(f"parameter {name}: its {word} holds NaN or infinite values (a training that "
                          "diverged, or a damaged file)")
    if not has_step:
        return None
    if "step" not in state:
        raise _Misfit(f"parameter {name}: its state holds no step count")
    return _step_count(state["step"], name, limit)


def _check_part(opt, saved, names: dict, what: str, limit) -> None:
    """One optimiser's stored state (torch's state_dict layout) against `opt`; `what` names it ("" where the
    update has one)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        raise _Misfit(f"{what or 'it'} is not an optimiser state (a record of 'state' and 'param_groups')")
    released = isinstance(opt, ReleasedMuonAdam)
    own, ours = opt.state_dict()["param_groups"], opt.param_groups
    if len(saved["param_groups"]) != len(own):
        raise _Misfit(f"{what or 'it'} holds {len(saved['param_groups'])} parameter groups, this run's update has "
                      f"{len(own)} (another network, --update-rule or --optimizer)")
    steps, bare = {}, []
    for g, (group, mine, live) in enumerate(zip(saved["param_groups"], own, ours)):
        _check_group(group, mine, live, released, f"{what}group {g + 1}")
        moments, has_step = _moments_of(opt, live)
        for index, p in zip(mine["params"], live["params"]):
            name = names.get(id(p), f"number {index}")
            if index not in saved["state"]:
                bare.append(name)
                continue
            steps[name] = _check_param(saved["state"][index], p, name, moments, has_step, limit)
    if released and steps and bare:  # the released update steps every parameter at every step
        raise _Misfit(f"parameter {bare[0]}: its state is missing, while {len(steps)} others have one")
    counts = [s for s in steps.values() if s is not None]
    if released and counts:  # one count, the checkpoint's step: every parameter steps at every step
        expected = limit if limit is not None else max(set(counts), key=counts.count)
        odd = next((n for n, s in steps.items() if s != expected), None)
        if odd is not None:
            other = "the checkpoint's step" if limit is not None else "the other parameters' count"
            raise _Misfit(f"parameter {odd}: its step count is {steps[odd]:g}, {other} is {expected:g} (the "
                          "released update steps every parameter at every step)")


def check_optimizer_state(optimizer: ELFOptimizer, states, named, where, step: int | None = None) -> None:
    """The optimiser state a resume is to load (`ELFOptimizer.state_dict`'s list), checked against the run's
    `optimizer` (built for its network and update rule) before anything of it is used: its parts and their
    groups, each group's parameter count and settings (the 'muon' flag among them), and per parameter (named by
    `named`, the (name, parameter) pairs the optimiser was built from) the moments its update reads, present,
    of the parameter's shape, floating-point and finite, and its step count, a whole number from 0 to `step`
    (the checkpoint's; under the released update every parameter's is `step`). One ELFError naming `where`
    (the state's file) and the first parameter or group that does not fit, and what to do."""
    names = {id(p): n for n, p in named}
    parts = optimizer.optimizers
    step = step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
    try:
        if not isinstance(states, list) or len(states) != len(parts):
            n = len(states) if isinstance(states, list) else f"a {type(states).__name__}, not a list of"
            raise _Misfit(f"it holds {n} optimiser states, this run's update ({optimizer.kind}, --update-rule "
                          f"{optimizer.update_rule}) has {len(parts)}")
        for k, (opt, saved) in enumerate(zip(parts, states)):
            _check_part(opt, saved, names, f"its optimiser {k + 1} of {len(parts)}, " if len(parts) > 1 else "", step)
    except _Misfit as e:
        ckpt = os.path.dirname(str(where)) or "."
        raise ELFError(f"{where}: {e}; the run cannot resume from it. If run.json's optimiser settings were edited "
                       "(optimizer, update_rule, adam_heads), restore run.json; else resume from an earlier checkpoint "
                       f"(move this one aside), or start a new run from its weights with --init-from {ckpt}") from None

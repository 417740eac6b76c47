"""The method around the network, in the paper's notation: the recipe, the schedules, the training objective
and the samplers. The one home of the recipe's constants, which training, sampling, the report and the toy
read from here.

    path      z_t = t x + (1 - t) eps,  eps ~ N(0, noise_scale^2),  t = 0 noise, t = 1 data
    velocity  v = (x - z_t) / max(1 - t, t_eps);  the network predicts x, v_pred = (x_pred - z_t) / max(1 - t, t_eps)
    denoise   || v_pred - target ||^2,  target = v + (1 - 1/omega)(v_cond - v_uncond) on self-conditioned rows
    decode    cross-entropy of net(p x + (1 - p) s n, t = 1, decode mode) against the tokens, p per token
    sample    z0 = noise_scale N(0, 1); a loop over a time grid with a swappable step (ode, sde, vc), the last
              step plain Euler; the decode pass reads the final state out as tokens

The trained pass is reused, detached, for the listing's v_cond pass (exact with dropout 0); docs/method.md has
the costs and the derivations.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from elflow.util.budget import MAX_SAMPLING_STEPS  # a sampler of more steps is refused
from elflow.util.errors import ELFError, Record

# the released recipe (OpenWebText, and the conditional tasks where said)
NOISE_SCALE = 2.0  # eps ~ N(0, NOISE_SCALE^2) on the path; z0 of the sampler
T_EPS = 0.05  # the velocity's clip: v = (x - z) / max(1 - t, T_EPS)
T_MEAN, T_STD = -1.5, 0.8  # training times and the sampling grid: t = sigmoid(N(T_MEAN, T_STD^2))
P_MEAN, P_STD = 0.8, 0.8  # the decode corruption level per token: p = sigmoid(N(P_MEAN, P_STD^2))
OMEGA_LOW, OMEGA_HIGH = 0.5, 5.0  # guidance scales: log(1 + omega) uniform over this range
DECODE_NOISE_SCALE = 5.0  # the decode branch's noise n ~ N(0, s^2): 5 for text,
CONDITIONAL_DECODE_NOISE_SCALE = 1.0  # 1 for a conditional model (translation, summarisation)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# the range of each constant of the recipe: (check, what it must be); the one statement of these ranges, which
# the recipe, its command-line flags and a stored record are all checked against
MAX_SCALE = 100.0  # gamma, omega and guidance: far beyond any useful value (trained omega 0.5-5), and below
# where the guided extrapolation overflows low precision arithmetic
MAX_LOGIT = 10.0  # the logit-normal time's mean and spread: at 10 every drawn time is within 5e-5 of 0 or 1
MAX_NOISE_SCALE = 1_000.0  # the paths' noise scales (2 and 1 as released): beyond, the data is lost in the noise

RECIPE_RANGES = {
    "noise_scale": (lambda v: _finite(v) and 0 < v <= MAX_NOISE_SCALE, f"in (0, {MAX_NOISE_SCALE:g}]"),
    "t_eps": (lambda v: _finite(v) and 0 < v < 1, "in (0, 1)"),
    "decode_prob": (lambda v: _finite(v) and 0 <= v <= 1, "in [0, 1]"),
    "self_cond_prob": (lambda v: _finite(v) and 0 <= v <= 1, "in [0, 1]"),
    "decode_noise_scale": (lambda v: _finite(v) and 0 < v <= MAX_NOISE_SCALE, f"in (0, {MAX_NOISE_SCALE:g}]"),
    "decode_clean_prob": (lambda v: _finite(v) and 0 <= v < 1, "in [0, 1)"),  # 1: no decode row ever corrupted
    "omega_low": (lambda v: _finite(v) and 0 <= v <= MAX_SCALE, f"from 0 to {MAX_SCALE:g}"),
    "omega_high": (lambda v: _finite(v) and 0 <= v <= MAX_SCALE, f"from 0 to {MAX_SCALE:g}"),
    "source_drop_prob": (lambda v: _finite(v) and 0 <= v < 1, "in [0, 1)"),  # 1: no source ever seen
    "t_mean": (lambda v: _finite(v) and abs(v) <= MAX_LOGIT, f"from -{MAX_LOGIT:g} to {MAX_LOGIT:g}"),
    "t_std": (lambda v: _finite(v) and 0 < v <= MAX_LOGIT, f"in (0, {MAX_LOGIT:g}]"),
}


@dataclass(frozen=True)
class Recipe(Record):
    """The training recipe's constants (released OpenWebText values by default); `from_dict` refuses a key that
    is none of them."""

    noise_scale: float = NOISE_SCALE
    t_eps: float = T_EPS
    decode_prob: float = 0.2
    self_cond_prob: float = 0.5
    decode_noise_scale: float = DECODE_NOISE_SCALE
    decode_clean_prob: float = 0.0  # share of decode-row tokens left clean (p = 1); 0 in the released recipe
    omega_low: float = OMEGA_LOW
    omega_high: float = OMEGA_HIGH
    source_drop_prob: float = 0.1  # conditional data only
    t_mean: float = T_MEAN
    t_std: float = T_STD

    def __post_init__(self):
        bad = [f"{k} {v!r} (must be {RECIPE_RANGES[k][1]})" for k, v in self.to_dict().items()
               if not RECIPE_RANGES[k][0](v)]
        if not bad and not self.omega_low <= self.omega_high:
            bad.append(f"omega range [{self.omega_low}, {self.omega_high}] (needs 0 <= omega_low <= omega_high)")
        if bad:
            raise ValueError(f"the recipe's constants are out of range: {'; '.join(bad)}")

    @property
    def self_conditioned(self) -> bool:
        """Whether the network is given its own previous guess (and trained for guidance by it)."""
        return self.self_cond_prob > 0


def recipe_for(overrides: dict, conditional: bool = False) -> Recipe:
    """The recipe of a model: the released constants, decode noise 1.0 for a conditional model (the one
    statement of that rule), and the run's own overrides on top."""
    base = {"decode_noise_scale": CONDITIONAL_DECODE_NOISE_SCALE} if conditional else {}
    return Recipe.from_dict({**base, **(overrides or {})})


# ----------------------------------------------------------------------------------------------------------
# schedules: pure functions of a generator


def _device(generator):
    return generator.device if generator is not None else None


def draw_time(n: int, generator: torch.Generator | None = None, mean: float = T_MEAN, std: float = T_STD):
    """(n,) training times t = sigmoid(N(mean, std^2))."""
    u = torch.randn(n, generator=generator, device=_device(generator))
    return torch.sigmoid(mean + std * u)


def draw_decode_level(shape, generator: torch.Generator | None = None, mean: float = P_MEAN, std: float = P_STD):
    """Decode corruption levels p = sigmoid(N(0.8, 0.8^2)) of any shape (one per token in training)."""
    u = torch.randn(tuple(shape), generator=generator, device=_device(generator))
    return torch.sigmoid(mean + std * u)


def draw_guidance(n: int, generator: torch.Generator | None = None, low: float = OMEGA_LOW, high: float = OMEGA_HIGH):
    """(n,) guidance scales omega, log-uniform in 1 + omega over [low, high]."""
    if not (-1 < low <= high):
        raise ValueError(f"draw_guidance: need -1 < low <= high, got low={low}, high={high}")
    u = torch.rand(n, generator=generator, device=_device(generator))
    return torch.exp(math.log1p(low) + u * (math.log1p(high) - math.log1p(low))) - 1.0


# the sampler settings of a model when no flag is given, by the kind of model; a progressively distilled
# model's depend on its steps: its few-step settings up to FEW_STEPS, its longer ones beyond, DISTILLED_STEPS
# when none are given (the released few-step model's)
FEW_STEPS = DISTILLED_STEPS = 8
SAMPLING_DEFAULTS = {  # the text sampling defaults (TEXT_SAMPLING) are the samplers' own keyword defaults
    "text": {"sampler": "sde", "steps": 32, "gamma": 1.5, "omega": 3.0, "guidance": 1.0},
    "conditional": {"sampler": "ode", "steps": 64, "gamma": 0.0, "omega": 1.0, "guidance": 2.0},
    "distilled": {"sampler": "sde", "gamma": 1.5, "omega": 2.5},  # a progressively distilled student, <= 8 steps
    "distilled-long": {"sampler": "sde", "gamma": 2.0, "omega": 2.0},  # the same beyond 8 steps
    "flow-map": {"sampler": "map", "grid": "uniform", "gamma": 0.0},  # a flow-map student's jumps
}
FLOW_MAP_STEPS = 4  # a flow-map student's default step count (it samples at any up to MAX_MAP_STEPS)
MAX_MAP_STEPS = 64  # a flow map jumps: more steps than its teacher's sampler takes (64) gain nothing
TEXT_SAMPLING = SAMPLING_DEFAULTS["text"]


def distilled_defaults(steps: int) -> dict:
    """The settings of a progressively distilled model sampled at `steps` steps."""
    return {**SAMPLING_DEFAULTS["distilled" if steps <= FEW_STEPS else "distilled-long"], "steps": int(steps)}


SAMPLERS = ("ode", "sde", "vc", "map")  # "map": the jumps of a flow-map student (elflow.methods.lmd)
GRIDS = ("logit_normal", "uniform")  # the kinds of time grid (`time_grid`)
DEFAULT_GRID = GRIDS[0]  # the released sampler's


def _count(v, low: int, high: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high)


def _non_negative(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _scale(v) -> bool:
    return _non_negative(v) and v <= MAX_SCALE


# what a sampler accepts, setting by setting: (check, what the value must be); the one statement of these ranges,
# which the samplers, the sampling settings and the command line's flags all check
SAMPLING_RANGES = {
    "steps": (lambda v: _count(v, 1, MAX_SAMPLING_STEPS),
              f"an integer from 1 to {MAX_SAMPLING_STEPS:,} (the released recipe samples with at most 64 steps)"),
    "gamma": (_scale, f"a number from 0 to {MAX_SCALE:g}"),
    "omega": (_scale, f"a number from 0 to {MAX_SCALE:g}"),
    "guidance": (_scale, f"a number from 0 to {MAX_SCALE:g}"),
    "batch_size": (lambda v: _count(v, 1), "an integer >= 1"),
}


def time_grid(steps: int, kind: str = DEFAULT_GRID, generator: torch.Generator | None = None,
              device=None, mean: float = T_MEAN, std: float = T_STD) -> torch.Tensor:
    """steps + 1 increasing times from exactly 0 to exactly 1.

    "logit_normal": 0, the sorted sigmoid of steps - 1 draws of N(mean, std^2), 1: the released sampler, which
    draws its grid from the model's own training times (the recipe's t_mean, t_std; -1.5, 0.8 as released).
    "uniform": 0, 1/steps, ..., 1.
    """
    if not SAMPLING_RANGES["steps"][0](steps):
        raise ValueError(f"time_grid: steps must be {SAMPLING_RANGES['steps'][1]}, got {steps!r}")
    device = device if device is not None else _device(generator)
    if kind == "uniform":
        grid = torch.arange(steps + 1, dtype=torch.float32, device=device) / steps
    elif kind == "logit_normal":
        interior = draw_time(steps - 1, generator, mean, std).to(device).sort().values
        zero, one = torch.zeros(1, device=device), torch.ones(1, device=device)
        grid = torch.cat([zero, interior, one])
    else:
        raise ValueError(f"time_grid: kind must be one of {', '.join(GRIDS)}, got {kind!r}")
    grid[0], grid[-1] = 0.0, 1.0
    return grid


# ----------------------------------------------------------------------------------------------------------
# training

TIME_BINS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)  # edges of the time bins the denoising loss is logged in


@dataclass
class Draw:
    """All randomness of one training batch, on the data's device. The discrete choices are drawn on the CPU
    and the rows they select are found there (`row_index`), so that selecting rows needs no device-to-host
    sync; they reach the device by asynchronous copies (`to_device`)."""

    t: torch.Tensor  # (B,) flow time (1 on decode rows)
    omega: torch.Tensor  # (B,) guidance scale
    eps: torch.Tensor  # (B, L, C) standard normal; scaled by the branch's noise scale
    p: torch.Tensor  # (B, L, 1) decode corruption level (used on decode rows)
    decode: torch.Tensor  # (B,) bool
    self_cond: torch.Tensor  # (B,) bool, never on decode rows
    drop_source: torch.Tensor  # (B,) bool, conditional data only
    decode_rows: torch.Tensor  # the indices of the decode rows (`row_index`)
    self_cond_rows: torch.Tensor  # the indices of the self-conditioned rows


def decode_levels(shape, recipe: Recipe, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """The decode branch's corruption levels p (one per token), a share recipe.decode_clean_prob of them set to
    1 (clean). The clean draw comes after the levels, so that at share 0 the random stream is the released one."""
    p = draw_decode_level(shape, generator)  # on the generator's device
    if recipe.decode_clean_prob > 0:
        p = p.masked_fill(torch.rand(p.shape, generator=generator, device=p.device) < recipe.decode_clean_prob, 1.0)
    return p.to(device)


def draw_training_noise(shape, recipe: Recipe, generator: torch.Generator | None = None,
                        cpu_generator: torch.Generator | None = None, device=None,
                        conditional: bool = False) -> Draw:
    """Draw the randomness of a batch of shape (B, L, C). `generator` lives on `device` (or is None)."""
    B, L, C = shape
    r = torch.rand(3, B, generator=cpu_generator)
    decode = r[0] < recipe.decode_prob
    self_cond = (r[1] < recipe.self_cond_prob) & ~decode
    drop_source = (r[2] < recipe.source_drop_prob) & torch.tensor(conditional)
    t = draw_time(B, generator, recipe.t_mean, recipe.t_std).to(device)
    omega = draw_guidance(B, generator, recipe.omega_low, recipe.omega_high).to(device)
    eps = torch.randn(B, L, C, generator=generator, device=device)
    p = decode_levels((B, L, 1), recipe, generator, device)
    rows = {"decode_rows": row_index(decode, device), "self_cond_rows": row_index(self_cond, device)}
    decode, self_cond, drop_source = (to_device(m, device) for m in (decode, self_cond, drop_source))
    t = torch.where(decode, torch.ones_like(t), t)
    return Draw(t=t, omega=omega, eps=eps, p=p, decode=decode, self_cond=self_cond, drop_source=drop_source, **rows)


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor on `device` without a host sync: on a GPU through pinned memory, copied asynchronously
    (a copy from pageable memory waits for the GPU's queue)."""
    if device is None:
        return x
    if torch.device(device).type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def row_index(mask: torch.Tensor, device) -> torch.Tensor:
    """The indices of the True rows of a CPU mask, on `device`: found on the CPU (no device sync), copied
    asynchronously (`to_device`), and marked as data-dependent in size, so that torch.compile traces one
    graph for every row count instead of one per count."""
    idx = to_device(mask.nonzero().flatten(), device)
    torch._dynamo.decorators.mark_unbacked(idx, 0)
    return idx


def elf_loss(net, x: torch.Tensor, tokens: torch.Tensor, draw: Draw, recipe: Recipe = Recipe(),
             valid: torch.Tensor | None = None, known: torch.Tensor | None = None, trained=None):
    """The ELF objective of one batch whose rows are in either branch, one token mean over both branches
    (`token_mean_loss`). Returns (loss, rows).

    x (B, L, C) clean embeddings, tokens (B, L) their ids, valid (B, L) bool positions scored (None: all),
    known (B, L) bool positions of a clean source (conditional data): pinned to x on denoise rows, never
    scored, zeroed on rows whose source is dropped. `trained` is the pass whose gradients train, with
    net.mixed's signature (net.mixed unless given; the no-grad self-conditioning pass is net itself). rows
    holds per-row tensors (no host sync): "denoise" and "decode" losses (each row's own token mean; 0 on rows
    of the other branch), "correct" and "scored" decode tokens.
    """
    B, L, C = x.shape
    dev = x.device
    trained = trained if trained is not None else net.mixed
    is_dec = draw.decode.to(dev)
    t = draw.t[:, None, None]
    clip = (1 - t).clamp_min(recipe.t_eps)  # (B, 1, 1)
    known = torch.zeros(B, L, dtype=torch.bool, device=dev) if known is None else known.to(dev, torch.bool)
    x = x.masked_fill((known & draw.drop_source.to(dev)[:, None])[..., None], 0.0)  # a dropped source is zeros
    pin = (known & ~is_dec[:, None])[..., None]  # (B, L, 1): the source stays clean on denoise rows

    # noise: the flow path on denoise rows, per-token corruption of every position on decode rows
    z = torch.where(is_dec[:, None, None], draw.p * x + (1 - draw.p) * recipe.decode_noise_scale * draw.eps,
                    t * x + (1 - t) * recipe.noise_scale * draw.eps)
    z = torch.where(pin, x, z)

    # self-conditioning slot: the clean source, and on self-conditioned rows the guess of a no-grad pass
    # (run on every batch, on no rows too: the row count is data, never a branch of the traced graph)
    slot = torch.where(pin, x, torch.zeros_like(x))
    sc = draw.self_cond_rows
    with torch.no_grad():
        guess = net(z[sc], draw.t[sc], draw.omega[sc], slot[sc])
    slot = slot.index_copy(0, sc, torch.where(pin[sc], x[sc], guess.to(x.dtype)))

    # the trained pass, every row with its own mode gate; logits only on decode rows
    dec = draw.decode_rows
    x_pred, logits = trained(z, draw.t, draw.omega, slot, is_dec.float(), dec)  # (B, L, C), (Bd, L, V)

    # target = v + (1 - 1/omega)(v_cond - v_uncond) on self-conditioned rows: v_cond from this pass (detached),
    # v_uncond from the slot's pass; other rows keep v
    v = (x - z) / clip
    v_pred = (x_pred - z) / clip
    v_cond = (x_pred.detach() - z) / clip
    v_uncond = (slot - z) / clip
    k = torch.where(draw.self_cond.to(dev), 1 - 1 / draw.omega, torch.zeros_like(draw.omega))[:, None, None]
    err = (v_pred - (v + k * (v_cond - v_uncond))).pow(2).mean(-1)  # (B, L)
    return token_mean_loss(err, logits, tokens, is_dec, dec, scored_positions(known, valid))


def scored_positions(known: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """(B, L) float: the positions a row's loss covers, every valid one but the known (source) ones."""
    return (~known).float() if valid is None else (valid.to(known.device, torch.bool) & ~known).float()


def token_mean_loss(err: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, is_dec: torch.Tensor,
                    dec: torch.Tensor, w: torch.Tensor):
    """The one loss of a batch whose rows are in either branch: a token mean over both branches together,

        loss = (sum over denoise rows' scored positions of err + sum over decode rows' of the cross-entropy)
               / (scored positions of the batch),

    so that a row weighs as many tokens as it scores (rows of packed text all score L: then it equals the
    mean of the rows' means). err (B, L) per-token denoising error, logits (Bd, L, V) of the decode rows
    `dec` (indices; is_dec (B,) bool), tokens (B, L), w (B, L) the scored positions (0 / 1). Returns
    (loss, rows): per-row tensors (no host sync) for the metrics, "denoise" and "decode" (the sum over the
    row's scored positions; 0 on rows of the other branch), "scored" (the row's scored positions), "correct"
    decode tokens."""
    per_row = w.sum(-1)  # (B,)
    denoise = torch.where(is_dec, torch.zeros_like(per_row), (err * w).sum(-1))  # (B,) sums
    ce = token_nll(logits, tokens[dec])  # (Bd, L)
    decode = torch.zeros_like(per_row).index_copy(0, dec, (ce * w[dec]).sum(-1))
    correct = torch.zeros_like(per_row).index_copy(0, dec,
                                                   ((logits.argmax(-1) == tokens[dec]).float() * w[dec]).sum(-1))
    loss = (denoise.sum() + decode.sum()) / per_row.sum().clamp_min(1)
    rows = {"denoise": denoise.detach(), "decode": decode.detach(), "scored": per_row, "correct": correct}
    return loss, rows


def token_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (B, L) of logits (B, L, V) in fp32: F.cross_entropy's numbers (log-softmax over
    the classes, then the target's entry), written so that a batch of data-dependent size compiles without a
    guard on its being empty."""
    return -F.log_softmax(logits.float().transpose(1, 2), 1).gather(1, tokens[:, None]).squeeze(1)


def time_bin(t: torch.Tensor) -> torch.Tensor:
    """The index of each time's bin in TIME_BINS, (B,) long."""
    return torch.bucketize(t, torch.tensor(TIME_BINS[1:-1], device=t.device, dtype=t.dtype))


def time_bin_labels() -> list[str]:
    return [f"t{TIME_BINS[i]:.1f}-{TIME_BINS[i + 1]:.1f}" for i in range(len(TIME_BINS) - 1)]


# ----------------------------------------------------------------------------------------------------------
# sampling: one loop over a time grid with a swappable step
#
# A step maps (denoise, z, t, t_next, x_prev) -> (z_next, x); denoise(z, t, x_prev) -> (x, v) is the network
# with everything else bound (omega, guidance, known positions). The velocity is v = (x - z) / max(1 - t, t_eps).
def euler_step(z, t, t_next, x_pred, t_eps: float = T_EPS):
    """Move z a fraction (t_next - t)/(1 - t) of the way to the guess x_pred (v clipped at 1 - t >= t_eps)."""
    return z + (t_next - t) * (x_pred - z) / (1 - t).clamp_min(t_eps)


def ode_step(denoise, z, t, t_next, x_prev):
    """Euler: z' = z + (t' - t) v(z, t)."""
    x, v = denoise(z, t, x_prev)
    return z + (t_next - t) * v, x


def map_step(denoise, z, t, t_next, x_prev):
    """A flow map's jump: the guess x_hat for the target t' gives z' = z + (t' - t) v, v = (x_hat - z) /
    max(1 - t, t_eps) (elflow.flowmap.map_from_x); at t' = 1 it lands on x_hat, as the last Euler step does."""
    x, v = denoise(z, t, x_prev, t_next)
    return z + (t_next - t) * v, x


def sde_step(denoise, z, t, t_next, x_prev, *, gamma, noise, generator, noise_scale, pin, consistent=False):
    """Back off to t_b = alpha t, alpha = clip(1 - gamma (t' - t), 0, 1), re-noise z_b = alpha z + std e, then
    Euler from t_b to t'. The released step has std = (1 - alpha) noise_scale; the variance-consistent one
    (consistent=True) has std = noise_scale sqrt((1 - t_b)^2 - alpha^2 (1 - t)^2), so that z_b carries exactly
    the path's noise level at t_b. `pin` puts known positions back after the re-noising."""
    alpha = (1 - gamma * (t_next - t)).clamp(0, 1)
    t_b = alpha * t
    if consistent:
        std = noise_scale * ((1 - t_b) ** 2 - (alpha * (1 - t)) ** 2).clamp_min(0).sqrt()
    else:
        std = (1 - alpha) * noise_scale
    noise.normal_(generator=generator)  # one N(0, 1) draw of z's shape per step, into a buffer made once
    z_b = pin(alpha * z + std * noise)
    x, v = denoise(z_b, t_b, x_prev)
    return z_b + (t_next - t_b) * v, x


def check_sampling_args(steps: int, gamma: float, omega: float, guidance: float = 1.0, sampler: str = "sde",
                        recipe: Recipe = Recipe()) -> None:
    """ValueError for settings no sampler can use (SAMPLING_RANGES); a warning for an omega outside the range
    the model trained on."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    if sampler == "map" and isinstance(steps, int) and not 1 <= steps <= MAX_MAP_STEPS:
        raise ValueError(f"a flow map samples with 1 to {MAX_MAP_STEPS} steps (its jumps), got {steps!r}")
    for name, value in (("steps", steps), ("gamma", gamma), ("guidance", guidance), ("omega", omega)):
        ok, what = SAMPLING_RANGES[name]
        if not ok(value):
            raise ValueError(f"{name} must be {what}, got {value!r}")
    if not recipe.omega_low <= omega <= recipe.omega_high:
        warnings.warn(f"omega {omega} lies outside the range the model was trained on "
                      f"[{recipe.omega_low}, {recipe.omega_high}]; results may be poor", stacklevel=2)


def _net_device(net):
    """The device of a network's parameters; None for a plain function."""
    params = net.parameters() if isinstance(net, torch.nn.Module) else iter(())
    p = next(params, None)
    return p.device if p is not None else None


def _check_tensor(x, name: str, ndim: int, device=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ELFError(f"integrate: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type == "meta":
        raise ELFError(f"integrate: {name} is on the meta device, which holds no values; make it on cpu or cuda")
    if device is not None and x.device != device:
        raise ELFError(f"integrate: {name} is on {x.device}, the network on {device}; move it there")
    if x.ndim != ndim or x.numel() == 0:
        raise ELFError(f"integrate: {name} must be a non-empty {ndim}-D tensor, got shape {tuple(x.shape)}")
    return x


def check_integrate_args(net, z0, grid, sampler, gamma, omega, guidance, known, known_mask) -> None:
    """`integrate`'s arguments, checked once before its loop (one host read each of z0, the grid and the known
    values, none per step): ELFError naming the first that is wrong. z0 a floating-point (B, L, C) tensor of
    finite values on the network's device (C its width and L within its length where it has them); the grid a
    1-D tensor of at least two finite times in [0, 1], never falling; a sampler of SAMPLERS; gamma and guidance
    within SAMPLING_RANGES, omega too or a (B,) tensor; known (B, L, C) finite values with known_mask (B, L),
    both or neither."""
    device = _net_device(net)
    _check_tensor(z0, "z0", 3, device)
    if not z0.is_floating_point():
        raise ELFError(f"integrate: z0 must hold floating-point values, got {z0.dtype}")
    config = getattr(net, "config", None)
    dim, length = getattr(config, "dim", None), getattr(config, "max_length", None)
    if isinstance(dim, int) and z0.shape[-1] != dim:
        raise ELFError(f"integrate: z0 has {z0.shape[-1]} channels per position, the network's space has {dim}: "
                       f"z0 must have shape (B, L, {dim})")
    if isinstance(length, int) and z0.shape[1] > length:
        raise ELFError(f"integrate: z0 has {z0.shape[1]} positions, more than the {length} the network covers")
    if sampler not in SAMPLERS:
        raise ELFError(f"integrate: unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    for name, value in (("gamma", gamma), ("guidance", guidance)) + ((("omega", omega),)
                                                                     if not isinstance(omega, torch.Tensor) else ()):
        ok, what = SAMPLING_RANGES[name]
        if not ok(value):
            raise ELFError(f"integrate: {name} must be {what}, got {value!r}")
    if isinstance(omega, torch.Tensor):
        _check_tensor(omega, "omega", 1, z0.device)
        if omega.shape[0] != z0.shape[0] or not bool(torch.isfinite(omega).all()):
            raise ELFError(f"integrate: an omega tensor must hold {z0.shape[0]} finite values (one per row of z0), "
                           f"got shape {tuple(omega.shape)}")
    _check_tensor(grid, "grid", 1)
    times = grid.detach().to("cpu", torch.float64)
    if times.numel() < 2 or not bool(torch.isfinite(times).all()) or times.min() < 0 or times.max() > 1 \
            or bool((times.diff() < 0).any()):
        raise ELFError(f"integrate: the time grid must hold at least two finite times in [0, 1], rising from the "
                       f"noise (0) to the data (1) as time_grid makes them, got {times.tolist()[:6]}")
    if (known is None) != (known_mask is None):
        raise ELFError("integrate: known and known_mask go together: pass both, or neither")
    if known is not None:
        _check_tensor(known, "known", 3)
        _check_tensor(known_mask, "known_mask", 2)
        if tuple(known.shape) != tuple(z0.shape) or tuple(known_mask.shape) != tuple(z0.shape[:2]):
            raise ELFError(f"integrate: known must have z0's shape {tuple(z0.shape)} and known_mask "
                           f"{tuple(z0.shape[:2])}, got {tuple(known.shape)} and {tuple(known_mask.shape)}")
        if not known.is_floating_point() or not bool(torch.isfinite(known).all()):
            raise ELFError("integrate: known must hold finite floating-point values")
    if not bool(torch.isfinite(z0).all()):
        raise ELFError("integrate: z0 holds NaN or infinite values; start from finite noise (noise_scale * randn)")


def integrate(net, z0: torch.Tensor, grid: torch.Tensor, *, sampler: str = TEXT_SAMPLING["sampler"],
              gamma: float = TEXT_SAMPLING["gamma"], omega=TEXT_SAMPLING["omega"], guidance: float = 1.0,
              known: torch.Tensor | None = None, known_mask: torch.Tensor | None = None,
              generator: torch.Generator | None = None, recipe: Recipe = Recipe(), callback: Callable | None = None):
    """Integrate z0 (B, L, C) over the time grid (grid[0] = 0 ... grid[-1] = 1): returns (z_final, x_last).

    net(z, t, omega, x_prev) -> x is called once per step (twice when guidance != 1 with known positions).
    Every interval but the last uses `sampler` ("ode", "sde" or "vc"); the last is a plain Euler step, which
    lands on the guess. "map" is a flow-map student's: every interval one jump, net(..., target=t') (its last
    lands on the guess too). The previous guess fills the self-conditioning slot (zeros at the first step).

    known (B, L, C) clean embeddings and known_mask (B, L) bool mark positions held fixed (a conditional
    model's source, a prompt, a suffix): z and the guess are the clean values there and v = 0, and the first
    slot holds them. With guidance g != 1 a second pass sees z and the slot with the known positions zeroed
    (the source dropped) and v = v_u + g (v_c - v_u), x = x_u + g (x_c - x_u). Without known positions
    guidance has nothing to act on and costs no pass. `callback(i, t, z, x)` sees each step's guess.
    Every argument is checked once first (`check_integrate_args`); no host sync inside the loop; the noise
    buffer is allocated once.
    """
    check_integrate_args(net, z0, grid, sampler, gamma, omega, guidance, known, known_mask)
    n = grid.numel() - 1
    B = z0.shape[0]
    grid = grid.to(z0.device, torch.float32)
    w = omega if isinstance(omega, torch.Tensor) else torch.full((B,), float(omega), device=z0.device)
    if known is None:
        keep = None
        def pin(a):  # noqa: E301
            return a
        x_prev = None
    else:
        keep = known_mask.to(z0.device, torch.bool)[..., None]  # (B, L, 1)
        known = known.to(z0.device, z0.dtype)
        def pin(a):  # noqa: E301
            return torch.where(keep, known, a)
        x_prev = torch.where(keep, known, torch.zeros_like(z0))
    guided = keep is not None and guidance != 1.0
    t_eps = recipe.t_eps

    def denoise(z, t, slot, target=None):
        tt = t.expand(B)
        clip = (1 - t).clamp_min(t_eps)
        at = {} if target is None else {"target": target.expand(B)}  # a flow map's jump to `target`
        x = net(z, tt, w, slot, **at)
        if keep is None:
            return x, (x - z) / clip
        v = torch.where(keep, 0.0, (x - z) / clip)
        if guided:  # the unconditional pass: the known positions dropped, its outputs zero there
            z_u, s_u = z.masked_fill(keep, 0.0), slot.masked_fill(keep, 0.0)
            x_u = net(z_u, tt, w, s_u, **at).masked_fill(keep, 0.0)
            v_u = ((x_u - z_u) / clip).masked_fill(keep, 0.0)
            v = v_u + guidance * (v - v_u)
            x = x_u + guidance * (x - x_u)
        return pin(x), v

    if sampler in ("ode", "map"):
        step = {"ode": ode_step, "map": map_step}[sampler]
    else:
        step = functools.partial(sde_step, gamma=gamma, noise=torch.empty_like(z0), generator=generator,
                                 noise_scale=recipe.noise_scale, pin=pin, consistent=sampler == "vc")
    z = pin(z0)
    for i in range(n):
        last = ode_step if sampler != "map" else map_step  # the last interval lands on the guess
        z, x_prev = (step if i < n - 1 else last)(denoise, z, grid[i], grid[i + 1], x_prev)
        if callback is not None:
            callback(i, grid[i], z, x_prev)
    return z, x_prev


def decode_tokens(net, z: torch.Tensor, omega) -> torch.Tensor:
    """The single decode pass (t = 1, zero self-conditioning slot, mode tokens on): (B, L, C) -> ids (B, L)."""
    w = omega if isinstance(omega, torch.Tensor) else torch.full((z.shape[0],), float(omega), device=z.device)
    return net.decode(z, w).argmax(-1)


@torch.no_grad()
def generate_tokens(net, batch: int, length: int, steps: int = TEXT_SAMPLING["steps"],
                    sampler: str = TEXT_SAMPLING["sampler"], gamma: float = TEXT_SAMPLING["gamma"],
                    omega: float = TEXT_SAMPLING["omega"], grid: str = DEFAULT_GRID, guidance: float = 1.0,
                    known=None, known_mask=None, generator: torch.Generator | None = None, recipe: Recipe = Recipe(),
                    device=None, callback: Callable | None = None):
    """Draw z0 = noise_scale N(0, 1) and a fresh time grid, sample, decode: (ids (B, L), z_final (B, L, C))."""
    check_sampling_args(steps, gamma, omega, guidance, sampler, recipe)
    device = device or next(net.parameters()).device
    z0 = recipe.noise_scale * torch.randn(batch, length, net.config.dim, generator=generator, device=device)
    times = time_grid(steps, grid, generator=generator, device=device, mean=recipe.t_mean, std=recipe.t_std)
    w = torch.full((batch,), float(omega), device=device)
    z, _ = integrate(net, z0, times, sampler=sampler, gamma=gamma, omega=w, guidance=guidance, known=known,
                  known_mask=known_mask, generator=generator, recipe=recipe,
                  callback=callback)
    return decode_tokens(net, z, w), z

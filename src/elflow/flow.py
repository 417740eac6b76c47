"""The method around the network, in the paper's notation: the recipe, the schedules, the training objective
and the samplers. The one home of the recipe's constants, which training, sampling, the report and the toy
read from here.

    path      z_t = t x + (1 - t) eps,  eps ~ N(0, noise_scale^2),  t = 0 noise, t = 1 data
    velocity  v = (x - z_t) / max(1 - t, t_eps);  the network predicts x, v_pred = (x_pred - z_t) / max(1 - t, t_eps)
    denoise   || v_pred - target ||^2,  target = v + (1 - 1/omega)(v_cond - v_uncond) on self-conditioned rows
    decode    cross-entropy of net(p x + (1 - p) s n, t = 1, decode mode) against the tokens, p per token
    step      z_t' = z_t + (t' - t) v: a fraction (t' - t) / (1 - t) of the way to the guess (`euler_step`)
    sample    z0 = noise_scale N(0, 1); a loop over a time grid with a swappable step (ode, sde, vc, or a flow
              map's jumps), the last step plain Euler; the decode pass reads the final state out as tokens

The training draw (`draw_training_noise`) and the objective's skeleton (`flow_objective`: noise path,
self-conditioning slot, the objective's own terms, one token mean) serve ELF's objective (`elf_loss`) and its
distillation students' (elflow.methods.pd, elflow.methods.lmd) alike. The trained pass is reused, detached, for
the listing's v_cond pass (exact with dropout 0); docs/method.md has the costs and the derivations.
"""

from __future__ import annotations

import functools
import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from elflow.util.budget import MAX_SAMPLING_STEPS  # a sampler of more steps is refused
from elflow.util.devices import AUTOCAST_DTYPES
from elflow.util.errors import ELFError, Record, check_seed

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
        grid = logit_normal_grid(steps, None, generator, device, mean, std)
    else:
        raise ValueError(f"time_grid: kind must be one of {', '.join(GRIDS)}, got {kind!r}")
    grid[0], grid[-1] = 0.0, 1.0
    return grid


def logit_normal_grid(steps: int, rows: int | None = None, generator: torch.Generator | None = None, device=None,
                      mean: float = T_MEAN, std: float = T_STD) -> torch.Tensor:
    """The logit-normal grid: 0, the sorted times sigmoid(N(mean, std^2)) of steps - 1 draws (`draw_time`), 1.
    (steps + 1,) times, or with `rows` one grid per row, (rows, steps + 1), drawn in one call (row after row).
    The sampler's grid (`time_grid`) and a progressive student's sub-steps (elflow.methods.pd) are this grid."""
    shape = (steps - 1,) if rows is None else (rows, steps - 1)
    interior = draw_time(math.prod(shape), generator, mean, std).reshape(shape).to(device).sort(dim=-1).values
    ends = shape[:-1] + (1,)
    return torch.cat([torch.zeros(ends, device=device), interior, torch.ones(ends, device=device)], dim=-1)


def per_row(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-row values v (B,) as (B, 1, ..., 1), broadcastable against `like` (B, ...); floating values in the wider
    of the two dtypes (times never rounded to a low-precision z's). One value for every row (0-d) stays as it
    is."""
    if v.ndim == 0:
        return v
    v = v.reshape(-1, *([1] * (like.ndim - 1)))
    return v.to(torch.promote_types(v.dtype, like.dtype)) if v.is_floating_point() else v


# ----------------------------------------------------------------------------------------------------------
# training

TIME_BINS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)  # edges of the time bins the denoising loss is logged in


@dataclass
class Draw:
    """All randomness of one training batch of any flow objective (`draw_training_noise`), on the data's device:
    ELF's own, and a distillation student's, which adds the time its step ends at and, for a progressive
    student, its teacher's sub-step times. The discrete choices are drawn on the CPU and the rows they select
    are found there (`row_index`), so that selecting rows needs no device-to-host sync; they reach the device
    by asynchronous copies (`to_device`)."""

    t: torch.Tensor  # (B,) flow time (1 on decode rows); a student's step starts here
    omega: torch.Tensor  # (B,) guidance scale
    eps: torch.Tensor  # (B, L, C) standard normal; scaled by the branch's noise scale
    p: torch.Tensor  # (B, L, 1) decode corruption level (used on decode rows)
    decode: torch.Tensor  # (B,) bool
    self_cond: torch.Tensor  # (B,) bool, never on decode rows
    drop_source: torch.Tensor  # (B,) bool, conditional data only (a student keeps every source)
    decode_rows: torch.Tensor  # the indices of the decode rows (`row_index`)
    self_cond_rows: torch.Tensor  # the indices of the self-conditioned rows
    t_next: torch.Tensor | None = None  # (B,) a student's: the time its step ends at (1 on decode rows)
    sub_times: torch.Tensor | None = None  # (B, K + 1) a progressive student's: its teacher's sub-step times
    target_rows: torch.Tensor | None = None  # a student's: the indices of the rows its teacher gives a target


def decode_levels(shape, recipe: Recipe, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """The decode branch's corruption levels p (one per token), a share recipe.decode_clean_prob of them set to
    1 (clean). The clean draw comes after the levels, so that at share 0 the random stream is the released one."""
    p = draw_decode_level(shape, generator)  # on the generator's device
    if recipe.decode_clean_prob > 0:
        p = p.masked_fill(torch.rand(p.shape, generator=generator, device=p.device) < recipe.decode_clean_prob, 1.0)
    return p.to(device)


def draw_training_noise(shape, recipe: Recipe, generator: torch.Generator | None = None,
                        cpu_generator: torch.Generator | None = None, device=None, conditional: bool = False,
                        times: Callable | None = None, sub_times: Callable | None = None) -> Draw:
    """Draw the randomness of a batch of shape (B, L, C), every objective's in one order: on `cpu_generator` each
    row's coins (decode row, self-conditioned row and, in ELF's own objective, a dropped source, used on
    conditional data only), then on `generator` (which lives on `device`, or is None) the rows' times, the
    guidance scales, the noise, the decode levels and a progressive student's sub-step times.

    ELF's times are its training times, t = sigmoid(N(t_mean, t_std^2)). A student passes its own:
    times(B, generator, device) -> (t, t_next), where its step starts and ends, and, for a progressive student,
    sub_times(t, t_next, generator) -> (B, K + 1) its teacher's sub-step times. A student's draw keeps every
    source and lists the rows whose target its teacher gives (`target_rows`: every row but the decode rows)."""
    B, L, C = shape
    student = times is not None
    r = torch.rand(2 if student else 3, B, generator=cpu_generator)
    decode = r[0] < recipe.decode_prob
    self_cond = (r[1] < recipe.self_cond_prob) & ~decode
    if student:
        t, t_next = times(B, generator, device)
    else:
        t, t_next = draw_time(B, generator, recipe.t_mean, recipe.t_std).to(device), None
    omega = draw_guidance(B, generator, recipe.omega_low, recipe.omega_high).to(device)
    eps = torch.randn(B, L, C, generator=generator, device=device)
    p = decode_levels((B, L, 1), recipe, generator, device)
    extra = {"sub_times": sub_times(t, t_next, generator)} if sub_times is not None else {}
    rows = {"decode_rows": row_index(decode, device), "self_cond_rows": row_index(self_cond, device)}
    if student:
        rows["target_rows"] = row_index(~decode, device)
        drop_source = torch.zeros(B, dtype=torch.bool, device=device)
        decode, self_cond = to_device(decode, device), to_device(self_cond, device)
        t_next = torch.where(decode, torch.ones_like(t_next), t_next)
    else:
        drop_source = (r[2] < recipe.source_drop_prob) & torch.tensor(conditional)
        decode, self_cond, drop_source = (to_device(m, device) for m in (decode, self_cond, drop_source))
    t = torch.where(decode, torch.ones_like(t), t)
    return Draw(t=t, omega=omega, eps=eps, p=p, decode=decode, self_cond=self_cond, drop_source=drop_source,
                t_next=t_next, **extra, **rows)


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


def noise_path(x: torch.Tensor, draw: Draw, recipe: Recipe, pin: torch.Tensor) -> torch.Tensor:
    """The noised input z (B, L, C) of clean embeddings x: the flow path z_t = t x + (1 - t) noise_scale eps on
    flow rows, the decode branch's per-token corruption p x + (1 - p) decode_noise_scale eps of every position on
    decode rows, and x itself where `pin` (B, L, 1) holds."""
    t = draw.t[:, None, None]
    z = torch.where(draw.decode.to(x.device)[:, None, None],
                    draw.p * x + (1 - draw.p) * recipe.decode_noise_scale * draw.eps,
                    t * x + (1 - t) * recipe.noise_scale * draw.eps)
    return torch.where(pin, x, z)


def self_conditioning_slot(guesser, x: torch.Tensor, z: torch.Tensor, draw: Draw, pin: torch.Tensor) -> torch.Tensor:
    """The self-conditioning slot (B, L, C): x where `pin` (B, L, 1) holds (a clean source), zeros elsewhere, and
    on the self-conditioned rows the guess of a no-grad pass guesser(z, t, omega, slot) from that slot, with x
    put back where `pin` holds. The pass runs on every batch, on no rows too: the row count is data, never a
    branch of a traced graph."""
    slot = torch.where(pin, x, torch.zeros_like(x))
    sc = draw.self_cond_rows
    with torch.no_grad():
        guess = guesser(z[sc], draw.t[sc], draw.omega[sc], slot[sc])
    return slot.index_copy(0, sc, torch.where(pin[sc], x[sc], guess.to(x.dtype)))


def flow_objective(x: torch.Tensor, tokens: torch.Tensor, draw: Draw, recipe: Recipe, valid: torch.Tensor | None,
                   known: torch.Tensor | None, guesser, terms: Callable, student: bool = False):
    """The skeleton of every flow objective on one batch whose rows are in either branch (ELF's own,
    `elf_loss`, and a distillation student's, elflow.methods.pd and elflow.methods.lmd). Returns (loss, rows).

        clean   x (B, L, C), with a dropped source's positions zeros; known (B, L) the positions held clean
        noise   z, the flow path on flow rows and the decode corruption on decode rows (`noise_path`)
        slot    x at the known positions of flow rows; on self-conditioned rows `guesser`'s guess
                (`self_conditioning_slot`): the network itself in ELF, the teacher of a student
        terms   terms(z, slot, x, known) -> (err (B, L), logits (Bd, L, V)): the objective's per-token error on
                flow rows and its logits of the decode rows (`draw.decode_rows`)
        loss    one token mean over both branches of the scored positions (`token_mean_loss`)

    valid (B, L) bool positions scored (None: all), known (B, L) bool positions of a clean source (conditional
    data): never scored. ELF corrupts the known positions of its decode rows with the rest, and its slot carries
    the gradient of x; a `student` keeps them clean on decode rows too, and its slot (its teacher's) none."""
    B, L = x.shape[:2]
    dev = x.device
    is_dec = draw.decode.to(dev)
    known = torch.zeros(B, L, dtype=torch.bool, device=dev) if known is None else known.to(dev, torch.bool)
    x = x.masked_fill((known & draw.drop_source.to(dev)[:, None])[..., None], 0.0)  # a dropped source is zeros
    flow_known = (known & ~is_dec[:, None])[..., None]  # (B, L, 1): the source stays clean on flow rows
    z = noise_path(x, draw, recipe, known[..., None] if student else flow_known)
    with torch.no_grad() if student else nullcontext():
        slot = self_conditioning_slot(guesser, x, z, draw, flow_known)
    err, logits = terms(z, slot, x, known)
    return token_mean_loss(err, logits, tokens, is_dec, draw.decode_rows, scored_positions(known, valid))


def elf_loss(net, x: torch.Tensor, tokens: torch.Tensor, draw: Draw, recipe: Recipe = Recipe(),
             valid: torch.Tensor | None = None, known: torch.Tensor | None = None, trained=None):
    """The ELF objective of one batch (`flow_objective`, with the network's own guess in the self-conditioning
    slot): on flow rows the squared error of the velocity, v_pred = (x_pred - z) / max(1 - t, t_eps), against
    the guided target

        target = v + (1 - 1/omega)(v_cond - v_uncond)   on self-conditioned rows (v elsewhere),

    v_cond from the trained pass (detached), v_uncond from the slot's pass; on decode rows the cross-entropy of
    the readout. `trained` is the pass whose gradients train, with net.mixed's signature (net.mixed unless
    given; the no-grad self-conditioning pass is net itself), every row with its own mode gate and logits only
    on decode rows. Returns (loss, rows) (`token_mean_loss`): per-row tensors (no host sync), "denoise" and
    "decode" losses, "correct" and "scored" decode tokens.
    """
    trained = trained if trained is not None else net.mixed
    clip = (1 - draw.t[:, None, None]).clamp_min(recipe.t_eps)  # (B, 1, 1)

    def guided_velocity_error(z, slot, x, known):
        is_dec = draw.decode.to(x.device)
        x_pred, logits = trained(z, draw.t, draw.omega, slot, is_dec.float(), draw.decode_rows)
        v = (x - z) / clip
        v_pred = (x_pred - z) / clip
        v_cond = (x_pred.detach() - z) / clip
        v_uncond = (slot - z) / clip
        k = torch.where(draw.self_cond.to(x.device), 1 - 1 / draw.omega, torch.zeros_like(draw.omega))[:, None, None]
        return (v_pred - (v + k * (v_cond - v_uncond))).pow(2).mean(-1), logits  # (B, L), (Bd, L, V)

    return flow_objective(x, tokens, draw, recipe, valid, known, net, guided_velocity_error)


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
def euler_step(z, t, t_next, x=None, t_eps: float = T_EPS, *, v=None):
    """The jump from time t to t_next, z' = z + (t' - t) v, with v the velocity of the guess x,
    v = (x - z) / max(1 - t, t_eps): z moves a fraction (t' - t) / max(1 - t, t_eps) of the way to x, and at
    t' = 1 lands on it. Every move of z from one time to a later one is this step: the samplers' (`ode_step`,
    `sde_step`, `map_step`), a progressive teacher's sub-steps and a flow map's X(z, s, t)
    (elflow.flowmap.flow_map).

    Given the guess x the step is computed as z + (t' - t)(x - z) / max(1 - t, t_eps); given the velocity v
    itself (the samplers', guided and zero at known positions) as z + (t' - t) v. t and t_next are one time
    (0-d) or one per row (B,)."""
    t, t_next = per_row(t, z), per_row(t_next, z)
    if v is None:
        return z + (t_next - t) * (x - z) / (1 - t).clamp_min(t_eps)
    return z + (t_next - t) * v


def ode_step(denoise, z, t, t_next, x_prev):
    """Euler: z' = z + (t' - t) v(z, t)."""
    x, v = denoise(z, t, x_prev)
    return euler_step(z, t, t_next, v=v), x


def map_step(denoise, z, t, t_next, x_prev):
    """A flow map's jump X(z, t, t'): the Euler step with the guess x_hat the map gives for the target t'
    (elflow.flowmap); at t' = 1 it lands on x_hat, as the last Euler step does."""
    x, v = denoise(z, t, x_prev, t_next)
    return euler_step(z, t, t_next, v=v), x


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
    return euler_step(z_b, t_b, t_next, v=v), x


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


# a model's generation defaults (its record's "sampling"), and the settings one call samples with
@dataclass(frozen=True)
class GenerationDefaults(Record):
    """A model's generation defaults, as its record stores them: the step count, the step kind and its back-off
    gamma, the self-conditioning guidance omega, the source guidance (conditional models) and the time grid's
    kind. The path's constants (noise scale, t_eps) and the logit-normal grid's distribution are the model's
    own, its recipe's (elflow.flow.Recipe); the seed, the batch size and the precision are the caller's
    (`SamplingSettings`)."""

    steps: int = SAMPLING_DEFAULTS["text"]["steps"]
    sampler: str = SAMPLING_DEFAULTS["text"]["sampler"]
    gamma: float = SAMPLING_DEFAULTS["text"]["gamma"]
    omega: float = SAMPLING_DEFAULTS["text"]["omega"]
    guidance: float = SAMPLING_DEFAULTS["text"]["guidance"]
    grid: str = DEFAULT_GRID

    def check(self, recipe: Recipe | None = None):
        """These settings if every one is usable (ELFError naming the first that is not); a warning for an
        omega outside the range `recipe` trained on."""
        try:
            check_sampling_args(self.steps, self.gamma, self.omega, self.guidance, self.sampler,
                                recipe or Recipe())
        except ValueError as e:
            raise ELFError(str(e)) from None
        if self.grid not in GRIDS:
            raise ELFError(f"grid must be one of {', '.join(GRIDS)}, got {self.grid!r}")
        return self


@dataclass(frozen=True)
class SamplingSettings(GenerationDefaults):
    """How one call samples: a model's generation defaults (or others given), the seed, the batch size and the
    autocast precision."""

    seed: int = 0
    batch_size: int = 8
    dtype: str = "fp32"

    def check(self, recipe: Recipe | None = None) -> "SamplingSettings":
        super().check(recipe)
        ok, what = SAMPLING_RANGES["batch_size"]
        if not ok(self.batch_size):
            raise ELFError(f"the batch size must be {what}, got {self.batch_size!r}")
        check_seed(self.seed)
        if self.dtype not in AUTOCAST_DTYPES:
            raise ELFError(f"dtype must be one of {', '.join(AUTOCAST_DTYPES)}, got {self.dtype!r}")
        return self

    def tag(self) -> str:
        """A file-name tag of the settings that tell sample sets apart."""
        return (f"{self.sampler}_steps{self.steps}_omega{self.omega:g}"
                + (f"_gamma{self.gamma:g}" if self.sampler != "ode" else ""))

    def describe(self) -> str:
        return f"{self.sampler}, {self.steps} steps, omega {self.omega:g}"


def _net_device(net):
    """The device of a network's parameters; None for a plain function."""
    params = net.parameters() if isinstance(net, torch.nn.Module) else iter(())
    p = next(params, None)
    return p.device if p is not None else None


def _check_tensor(x, name: str, ndim: int, device=None, who: str = "integrate") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ELFError(f"{who}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type == "meta":
        raise ELFError(f"{who}: {name} is on the meta device, which holds no values; make it on cpu or cuda")
    if device is not None and x.device != device:
        raise ELFError(f"{who}: {name} is on {x.device}, the network on {device}; move it there")
    if x.ndim != ndim or x.numel() == 0:
        raise ELFError(f"{who}: {name} must be a non-empty {ndim}-D tensor, got shape {tuple(x.shape)}")
    return x


def check_network_dtype(net, who: str) -> None:
    """A network's floating-point weights are float32: elflow samples fp32 weights (bf16 runs through autocast,
    settings.dtype / --dtype bf16); a network converted with .half(), .bfloat16() or .double() is one ELFError."""
    p = next((p for p in net.parameters() if p.is_floating_point()), None) if isinstance(net, torch.nn.Module) \
        else None
    if p is not None and p.dtype != torch.float32:
        raise ELFError(f"{who}: the network's weights are {str(p.dtype).removeprefix('torch.')}; elflow samples "
                       "float32 weights (for bf16, sample with dtype bf16, which autocasts): convert it with "
                       "net.float()")


def check_omega(omega, rows: int, device, who: str) -> None:
    """The self-conditioning guidance scale a sampler or the readout takes: a number within
    SAMPLING_RANGES["omega"], or a (rows,) tensor on `device` whose every value is; ELFError naming `who`."""
    ok, what = SAMPLING_RANGES["omega"]
    if not isinstance(omega, torch.Tensor):
        if not ok(omega):
            raise ELFError(f"{who}: omega must be {what}, got {omega!r}")
        return
    _check_tensor(omega, "omega", 1, device, who)
    values = omega.detach().to("cpu", torch.float64)
    if omega.shape[0] != rows or not bool(torch.isfinite(values).all()) or not ok(float(values.min())) or \
            not ok(float(values.max())):
        raise ELFError(f"{who}: an omega tensor must hold {rows} values (one per row), each {what}, got shape "
                       f"{tuple(omega.shape)} and values from {float(values.min()):g} to {float(values.max()):g}")


def check_integrate_args(net, z0, grid, sampler, gamma, omega, guidance, known, known_mask, generator=None,
                         recipe=None, callback=None) -> None:
    """`integrate`'s arguments, checked once before its loop (one host read each of z0, the grid and the known
    values, none per step): ELFError naming the first that is wrong. z0 a floating-point (B, L, C) tensor of
    finite values on the network's device (C its width and L within its length where it has them); the grid a
    1-D tensor of at least two finite times in [0, 1], never falling; a sampler of SAMPLERS; gamma and guidance
    within SAMPLING_RANGES, omega too or a (B,) tensor; known (B, L, C) finite values with known_mask (B, L),
    both or neither; net and callback callables, generator a torch.Generator, recipe a Recipe."""
    if not callable(net):
        raise ELFError(f"integrate: net must be a network (a callable net(z, t, omega, x_prev)), got "
                       f"{type(net).__name__}")
    check_network_dtype(net, "integrate")
    for name, value, ok, what in (("generator", generator, isinstance(generator, torch.Generator), "a torch.Generator"),
                                  ("recipe", recipe, isinstance(recipe, Recipe), "a Recipe (elflow.flow.Recipe)"),
                                  ("callback", callback, callable(callback), "a callable")):
        if value is not None and not ok:
            raise ELFError(f"integrate: {name} must be None or {what}, got {type(value).__name__}")
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
    for name, value in (("gamma", gamma), ("guidance", guidance)):
        ok, what = SAMPLING_RANGES[name]
        if not ok(value):
            raise ELFError(f"integrate: {name} must be {what}, got {value!r}")
    check_omega(omega, z0.shape[0], z0.device, "integrate")
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
        if known_mask.dtype != torch.bool and not bool(((known_mask == 0) | (known_mask == 1)).all()):
            raise ELFError("integrate: known_mask must be a bool tensor (True where a position is held fixed), or "
                           "hold only 0 and 1; a position is held or not, never in part")
    if not bool(torch.isfinite(z0).all()):
        raise ELFError("integrate: z0 holds NaN or infinite values; start from finite noise (noise_scale * randn)")


def integrate(net, z0: torch.Tensor, grid: torch.Tensor, *, sampler: str = TEXT_SAMPLING["sampler"],
              gamma: float = TEXT_SAMPLING["gamma"], omega=TEXT_SAMPLING["omega"], guidance: float = 1.0,
              known: torch.Tensor | None = None, known_mask: torch.Tensor | None = None,
              generator: torch.Generator | None = None, recipe: Recipe = Recipe(), callback: Callable | None = None):
    """Integrate z0 (B, L, C) over the time grid (grid[0] = 0 ... grid[-1] = 1): returns (z_final, x_last).

    net(z, t, omega, x_prev) -> x is called once per step (twice when guidance != 1 with known positions).
    Every interval but the last uses `sampler` ("ode", "sde" or "vc"); the last is a plain Euler step, which
    lands on the guess. "map" is a flow map's (a flow-map student's, the 2-D toy's): every interval one jump,
    net(z, t, omega, x_prev, target=t') (its last lands on the guess too). Each step moves z by `euler_step`.
    The previous guess fills the self-conditioning slot (zeros at the first step).

    known (B, L, C) clean embeddings and known_mask (B, L) bool mark positions held fixed (a conditional
    model's source, a prompt, a suffix): z and the guess are the clean values there and v = 0, and the first
    slot holds them. With guidance g != 1 a second pass sees z and the slot with the known positions zeroed
    (the source dropped) and v = v_u + g (v_c - v_u), x = x_u + g (x_c - x_u). Without known positions
    guidance has nothing to act on and costs no pass. `callback(i, t, z, x)` sees each step's guess.
    Every argument is checked once first (`check_integrate_args`); no host sync inside the loop; the noise
    buffer is allocated once.
    """
    check_integrate_args(net, z0, grid, sampler, gamma, omega, guidance, known, known_mask, generator, recipe,
                         callback)
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

    last = map_step if sampler == "map" else ode_step  # the last interval lands on the guess
    if sampler in ("sde", "vc"):
        step = functools.partial(sde_step, gamma=gamma, noise=torch.empty_like(z0), generator=generator,
                                 noise_scale=recipe.noise_scale, pin=pin, consistent=sampler == "vc")
    else:
        step = last
    z = pin(z0)
    for i in range(n):
        z, x_prev = (step if i < n - 1 else last)(denoise, z, grid[i], grid[i + 1], x_prev)
        if callback is not None:
            callback(i, grid[i], z, x_prev)
    return z, x_prev


def decode_tokens(net, z: torch.Tensor, omega) -> torch.Tensor:
    """The single decode pass (t = 1, zero self-conditioning slot, mode tokens on): (B, L, C) -> ids (B, L).
    omega: a number or a (B,) tensor within SAMPLING_RANGES (ELFError otherwise)."""
    _check_tensor(z, "z", 3, who="decode_tokens")
    check_omega(omega, z.shape[0], z.device, "decode_tokens")
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

"""The method around the network, in the paper's notation: the recipe, the schedules, the training objective
and the one step from a time to a later one (the sampler that loops over it is elflow.sampler). The one home of
the recipe's constants, which training, sampling, the report and the toy read from here.

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

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from elflow.util.budget import MAX_SAMPLING_STEPS  # a sampler of more steps is refused
from elflow.util.errors import Record, finite, short_repr

# the released recipe (OpenWebText, and the conditional tasks where said)
NOISE_SCALE = 2.0  # eps ~ N(0, NOISE_SCALE^2) on the path; z0 of the sampler
T_EPS = 0.05  # the velocity's clip: v = (x - z) / max(1 - t, T_EPS)
T_MEAN, T_STD = -1.5, 0.8  # training times and the sampling grid: t = sigmoid(N(T_MEAN, T_STD^2))
P_MEAN, P_STD = 0.8, 0.8  # the decode corruption level per token: p = sigmoid(N(P_MEAN, P_STD^2))
OMEGA_LOW, OMEGA_HIGH = 0.5, 5.0  # guidance scales: log(1 + omega) uniform over this range
DECODE_NOISE_SCALE = 5.0  # the decode branch's noise n ~ N(0, s^2): 5 for text,
CONDITIONAL_DECODE_NOISE_SCALE = 1.0  # 1 for a conditional model (translation, summarisation)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and finite(v)


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
        bad = [f"{k} {short_repr(v)} (must be {RECIPE_RANGES[k][1]})" for k, v in self.to_dict().items()
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
    return isinstance(v, (int, float)) and not isinstance(v, bool) and finite(v) and v >= 0


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

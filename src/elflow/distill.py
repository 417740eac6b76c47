"""Progressive distillation: a student that takes one step of size s = 1/N where its frozen teacher takes K.

Per training row (decode rows, with probability 0.2, keep the ordinary decode cross-entropy):

    t_s = u max(1 - s, 1e-6), u ~ logit-normal(-1.5, 0.8),   t_t = t_s + s
    z_t_s = t_s x0 + (1 - t_s) 2 eps                          (known positions hold x0)
    slot  = the teacher's guess at (z_t_s, t_s) on half the rows, zeros on the rest (known positions x0)
    z_K   = K teacher Euler steps from t_s to t_t, each guess fed back as the next slot
    x~    = z_t_s + (1 - t_s) / (t_t - t_s) (z_K - z_t_s)    (the x whose single Euler step lands on z_K)
    loss  = || student(z_t_s, t_s, omega, slot) - x~ ||^2 / C, a masked token mean per row

`elflow distill TEACHER --student-steps 16,8,4,2,1 --teacher-steps 64` runs the rounds: round 1's student
copies the teacher's EMA weights, round k+1 starts from round k's student EMA (fresh optimiser and EMA). The
teacher stays the original one in every round. Each round is an ordinary elflow run folder (OUT/round-<N>)
trained by `elflow.train.train` with this module's objective; its stored recipe carries the few-step
sampling defaults that `elflow sample` picks up.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from elflow.flow import TIME_BINS, Recipe, _index, euler_step
from elflow.schedules import T_MEAN, T_STD, sample_decode_level, sample_guidance, sample_time
from elflow.utils import ELFError, atomic_write_json

__all__ = ["teacher_init", "pd_target", "sample_sub_step_times", "DistillDraw", "draw_distill_noise",
           "distill_loss", "DistillObjective", "sampling_defaults", "check_schedule", "distill", "add_arguments",
           "run"]

SUB_STEP_MIN_SPAN = 1e-3  # below this interval the extrapolation to t = 1 is ill-conditioned: use the guess
STEP_SIZE_FLOOR = 1e-6  # t_s = u max(1 - s, floor): a one-step student still sees a (tiny) spread of t_s


# ----------------------------------------------------------------------------------------------------------
# the teacher's side


def _rows(v: torch.Tensor) -> torch.Tensor:
    return v.reshape(-1, 1, 1)


def teacher_init(teacher, z_t_s, t_s, omega, x0, known_mask) -> torch.Tensor:
    """The teacher's guess of x at (z_t_s, t_s, omega) from a slot holding x0 at the known positions and zeros
    elsewhere: (B, L, C). The guess is returned as the network gives it; whoever uses it as a
    self-conditioning slot puts x0 back at the known positions."""
    known = known_mask[..., None]
    slot = torch.where(known, x0, torch.zeros_like(x0))
    return teacher(z_t_s, t_s, omega, slot)


def pd_target(teacher, z_t_s, t_s, t_t, omega, sc_half, x0, known_mask, steps: int, sub_step_times=None,
              t_eps: float = 0.05) -> torch.Tensor:
    """The distillation target x~ (B, L, C): `steps` teacher Euler steps from t_s to t_t, read back as the x
    prediction whose single Euler step from (z_t_s, t_s) lands on the same point.

    sc_half (B, L, C) is the first self-conditioning slot (shared with the student); each later slot is the
    previous guess with x0 at the known positions, where z stays x0 as well. sub_step_times (B, steps + 1)
    runs from t_s to t_t (uniform steps if None). One step returns the teacher's guess itself, as does an
    interval shorter than 1e-3.
    """
    if steps < 1:
        raise ValueError(f"pd_target: steps must be >= 1, got {steps}")
    B = z_t_s.shape[0]
    if sub_step_times is None:
        frac = torch.arange(steps + 1, device=z_t_s.device, dtype=t_s.dtype) / steps
        sub_step_times = t_s[:, None] + (t_t - t_s)[:, None] * frac[None]
    if sub_step_times.shape != (B, steps + 1):
        raise ValueError(f"pd_target: sub_step_times must have shape ({B}, {steps + 1}), "
                         f"got {tuple(sub_step_times.shape)}")
    known = known_mask[..., None]
    z, slot, guess = z_t_s, sc_half, None
    for k in range(steps):
        tau, tau_next = sub_step_times[:, k], sub_step_times[:, k + 1]
        guess = teacher(z, tau, omega, slot)
        if steps == 1:
            return guess
        slot = torch.where(known, x0, guess)
        z = euler_step(z, _rows(tau), _rows(tau_next), slot, t_eps)
        z = torch.where(known, x0, z)
    span = _rows(t_t - t_s)
    scale = (1 - _rows(t_s)) / span.clamp_min(SUB_STEP_MIN_SPAN)
    return torch.where(span < SUB_STEP_MIN_SPAN, guess, z_t_s + scale * (z - z_t_s))


def sample_sub_step_times(t_s, t_t, steps: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, steps + 1) times t_s = tau_0 < ... < tau_steps = t_t: the interior ones are sorted logit-normal
    (-1.5, 0.8) draws u mapped to tau = t_s + (t_t - t_s) u."""
    B = t_s.shape[0]
    u = sample_time(B * (steps - 1), generator, T_MEAN, T_STD).reshape(B, steps - 1).to(t_s.device)
    u = u.sort(dim=1).values
    zero, one = torch.zeros(B, 1, device=t_s.device), torch.ones(B, 1, device=t_s.device)
    frac = torch.cat([zero, u, one], dim=1)
    times = t_s[:, None] + (t_t - t_s)[:, None] * frac
    times[:, 0], times[:, -1] = t_s, t_t  # exact end points
    return times


# ----------------------------------------------------------------------------------------------------------
# the student's loss


@dataclass
class DistillDraw:
    """All randomness of one distillation batch (discrete choices on the CPU, as in flow.Draw)."""

    t: torch.Tensor  # (B,) student time t_s (1 on decode rows)
    t_next: torch.Tensor  # (B,) t_t = t_s + s (1 on decode rows)
    omega: torch.Tensor  # (B,)
    eps: torch.Tensor  # (B, L, C) standard normal
    p: torch.Tensor  # (B, L, 1) decode corruption level
    sub_times: torch.Tensor  # (B, K + 1) the teacher's sub-step times
    decode: torch.Tensor  # (B,) bool, CPU
    self_cond: torch.Tensor  # (B,) bool, CPU, never on decode rows
    drop_source: torch.Tensor  # (B,) bool, CPU: always False (the source stays in distillation)


def draw_distill_noise(shape, recipe: Recipe, step_size: float, teacher_steps: int,
                       generator: torch.Generator | None = None, cpu_generator: torch.Generator | None = None,
                       device=None) -> DistillDraw:
    """The randomness of a (B, L, C) batch for a student step of `step_size` and `teacher_steps` sub-steps."""
    B, L, C = shape
    r = torch.rand(2, B, generator=cpu_generator)
    decode = r[0] < recipe.decode_prob
    self_cond = (r[1] < recipe.self_cond_prob) & ~decode
    u = sample_time(B, generator).to(device)
    omega = sample_guidance(B, generator, recipe.omega_low, recipe.omega_high).to(device)
    eps = torch.randn(B, L, C, generator=generator, device=device)
    p = sample_decode_level((B, L, 1), generator).to(device)
    t_s = u * max(1.0 - step_size, STEP_SIZE_FLOOR)
    t_t = t_s + step_size
    sub = sample_sub_step_times(t_s, t_t, teacher_steps, generator)
    dec = decode.to(device)
    t_s = torch.where(dec, torch.ones_like(t_s), t_s)
    t_t = torch.where(dec, torch.ones_like(t_t), t_t)
    return DistillDraw(t=t_s, t_next=t_t, omega=omega, eps=eps, p=p, sub_times=sub, decode=decode,
                       self_cond=self_cond, drop_source=torch.zeros(B, dtype=torch.bool))


def distill_loss(student, teacher, x, tokens, draw: DistillDraw, recipe: Recipe = Recipe(), mask=None,
                 source_len: int = 0, teacher_steps: int = 1):
    """The distillation objective of one batch; returns (loss, metrics) with the keys of flow.elf_loss.

    x (B, L, C) clean embeddings, tokens (B, L), mask (B, L) positions that count (padding excluded),
    source_len: the first positions are known (a clean source) and are neither noised nor scored.
    """
    B, L, C = x.shape
    dev = x.device
    known = (torch.arange(L, device=dev) < source_len)[None, :].expand(B, L)
    kn = known[..., None]
    is_dec = draw.decode.to(dev)
    t = _rows(draw.t)
    z_distill = t * x + (1 - t) * recipe.noise_scale * draw.eps
    z_decode = draw.p * x + (1 - draw.p) * recipe.decode_noise_scale * draw.eps
    z = torch.where(kn, x, torch.where(_rows(is_dec), z_decode, z_distill))

    # the shared self-conditioning slot: x0 at known positions; the teacher's first guess on half the
    # distillation rows; zeros elsewhere (decode rows get an all-zero slot)
    slot = torch.where(kn, x, torch.zeros_like(x))
    sc = _index(draw.self_cond, dev)
    with torch.no_grad():
        if len(sc):
            guess = teacher_init(teacher, z[sc], draw.t[sc], draw.omega[sc], x[sc], known[sc])
            slot = slot.index_copy(0, sc, torch.where(kn[sc], x[sc], guess.to(slot.dtype)))
        slot = torch.where(_rows(is_dec), torch.zeros_like(slot), slot)

        rows = _index(~draw.decode, dev)
        target = torch.zeros_like(x)
        if len(rows):
            tgt = pd_target(teacher, z[rows], draw.t[rows], draw.t_next[rows], draw.omega[rows], slot[rows],
                            x[rows], known[rows], teacher_steps, draw.sub_times[rows], recipe.t_eps)
            target = target.index_copy(0, rows, tgt.to(target.dtype))

    dec = _index(draw.decode, dev)
    x_pred, logits = student(z, draw.t, draw.omega, slot, decode_gate=draw.decode.to(dev, torch.float32),
                             logits_rows=dec)
    err = (x_pred.float() - target).pow(2).mean(-1)  # (B, L)

    valid = torch.ones(B, L, dtype=torch.bool, device=dev) if mask is None else mask.to(dev, torch.bool)
    w = (valid & ~known).float()
    n_valid = w.sum(-1).clamp_min(1)
    distill_row = torch.where(is_dec, torch.zeros(B, device=dev), (err * w).sum(-1) / n_valid)
    ce = F.cross_entropy(logits.float().transpose(1, 2), tokens[dec], reduction="none")  # (Bd, L)
    decode_row = (ce * w[dec]).sum(-1) / n_valid[dec]
    correct = ((logits.argmax(-1) == tokens[dec]).float() * w[dec]).sum()
    loss = (distill_row.sum() + decode_row.sum()) / B

    edges = torch.tensor(TIME_BINS[1:-1], device=dev)
    bins = torch.bucketize(draw.t.detach(), edges)
    den = (~is_dec).float()
    nb = len(TIME_BINS) - 1
    metrics = {
        "loss": loss.detach(),
        "denoise_sum": distill_row.detach().sum(), "denoise_n": den.sum(),
        "decode_sum": decode_row.detach().sum(), "decode_n": is_dec.float().sum(),
        "decode_correct": correct.detach(), "decode_tokens": w[dec].sum(),
        "bin_sum": torch.zeros(nb, device=dev).index_add(0, bins, distill_row.detach() * den),
        "bin_n": torch.zeros(nb, device=dev).index_add(0, bins, den),
    }
    return loss, metrics


class DistillObjective:
    """The distillation objective in the shape elflow.train.train_step takes: draw(...) and loss(...)."""

    def __init__(self, teacher, student_steps: int, teacher_steps: int):
        self.teacher = teacher
        self.step_size = 1.0 / student_steps
        self.sub_steps = teacher_steps // student_steps

    def draw(self, shape, recipe, generator=None, cpu_generator=None, device=None, conditional=False):
        return draw_distill_noise(shape, recipe, self.step_size, self.sub_steps, generator, cpu_generator, device)

    def loss(self, model, x, tokens, draw, recipe, mask=None, source_len=0):
        return distill_loss(model, self.teacher, x, tokens, draw, recipe, mask, source_len, self.sub_steps)

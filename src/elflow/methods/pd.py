"""Progressive distillation: a student that takes one step of size s where its frozen teacher takes K
sub-steps, regressed on the x whose single Euler step lands where the teacher's K steps land (`PDMethod`, ELF
trained with this objective; elflow.distill runs its rounds).

Per training row (flow.draw_training_noise with the student's times; decode rows, with the recipe's share, keep
the ordinary decode cross-entropy):

    times   t_s = u max(1 - s, 1e-6), u logit-normal; t_t = t_s + s; the teacher's sub-step times in between
    z_t_s   t_s x0 + (1 - t_s) noise_scale eps      (known positions, a conditional model's source, hold x0)
    slot    the teacher's guess at (z_t_s, t_s) on the self-conditioned share of rows, zeros on the others
    target  x~ = z_t_s + (1 - t_s) / (t_t - t_s) (z_K - z_t_s), z_K where the teacher's K Euler sub-steps land
    loss    || x_student - x~ ||^2 / C; one token mean with the decode rows' cross-entropy (flow.flow_objective)
"""

from __future__ import annotations

import torch

from elflow.flow import (
    T_EPS,
    T_MEAN,
    T_STD,
    Draw,
    Recipe,
    draw_time,
    draw_training_noise,
    euler_step,
    flow_objective,
    logit_normal_grid,
    per_row,
)
from elflow.methods.elf import ELFMethod
from elflow.util.budget import check_sampling_steps
from elflow.util.errors import ELFError

SUB_STEP_MIN_SPAN = 1e-3  # below this interval the extrapolation to t = 1 is ill-conditioned: use the guess


STEP_SIZE_FLOOR = 1e-6  # t_s = u max(1 - s, floor): a one-step student still sees a (tiny) spread of t_s


# ----------------------------------------------------------------------------------------------------------
# the teacher's side
def teacher_init(teacher, z_t_s, t_s, omega, x0, known_mask) -> torch.Tensor:
    """The teacher's guess of x at (z_t_s, t_s, omega) from a slot holding x0 at the known positions and zeros
    elsewhere: (B, L, C), the guess the student's self-conditioning slot holds on its self-conditioned rows
    (flow.self_conditioning_slot, which puts x0 back at the known positions)."""
    known = known_mask[..., None]
    slot = torch.where(known, x0, torch.zeros_like(x0))
    return teacher(z_t_s, t_s, omega, slot)


def pd_target(teacher, z_t_s, t_s, t_t, omega, sc_half, x0, known_mask, steps: int, sub_step_times=None,
              t_eps: float = T_EPS) -> torch.Tensor:
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
        z = euler_step(z, tau, tau_next, slot, t_eps)
        z = torch.where(known, x0, z)
    span = per_row(t_t - t_s, z_t_s)
    scale = (1 - per_row(t_s, z_t_s)) / span.clamp_min(SUB_STEP_MIN_SPAN)
    return torch.where(span < SUB_STEP_MIN_SPAN, guess, z_t_s + scale * (z - z_t_s))


def draw_sub_step_times(t_s, t_t, steps: int, generator: torch.Generator | None = None, mean: float = T_MEAN,
                          std: float = T_STD) -> torch.Tensor:
    """(B, steps + 1) times t_s = tau_0 < ... < tau_steps = t_t: a logit-normal grid per row (flow.logit_normal_grid;
    mean, std the teacher's training times, -1.5, 0.8 as released) mapped to tau = t_s + (t_t - t_s) u."""
    frac = logit_normal_grid(steps, t_s.shape[0], generator, t_s.device, mean, std)
    times = t_s[:, None] + (t_t - t_s)[:, None] * frac
    times[:, 0], times[:, -1] = t_s, t_t  # exact end points
    return times


# ----------------------------------------------------------------------------------------------------------
# the student's loss
def draw_distill_noise(shape, recipe: Recipe, step_size: float, teacher_steps: int,
                       generator: torch.Generator | None = None, cpu_generator: torch.Generator | None = None,
                       device=None) -> Draw:
    """The randomness of a (B, L, C) batch for a student step of `step_size` and `teacher_steps` sub-steps
    (flow.draw_training_noise with the student's times: t_s = u max(1 - s, 1e-6), u logit-normal, t_t = t_s + s,
    and the teacher's sub-step times)."""
    def times(n, generator, device):
        t_s = draw_time(n, generator, recipe.t_mean, recipe.t_std).to(device) * max(1.0 - step_size, STEP_SIZE_FLOOR)
        return t_s, t_s + step_size

    def sub_times(t_s, t_t, generator):
        return draw_sub_step_times(t_s, t_t, teacher_steps, generator, recipe.t_mean, recipe.t_std)

    return draw_training_noise(shape, recipe, generator, cpu_generator, device, times=times, sub_times=sub_times)


def distill_loss(student, teacher, x, tokens, draw: Draw, recipe: Recipe = Recipe(), valid=None,
                 known=None, trained=None, teacher_steps: int = 1):
    """The distillation objective of one batch (flow.flow_objective, the teacher's guess in the shared
    self-conditioning slot): on flow rows the squared error of the student's x against the teacher's target
    x~ (`pd_target`, no gradient); returns (loss, rows) as flow.elf_loss does.

    x (B, L, C) clean embeddings, tokens (B, L), valid (B, L) positions that count (None: all), known (B, L)
    bool positions of a clean source, neither noised nor scored. `trained` is the student's mixed pass.
    """
    trained = trained if trained is not None else student.mixed

    def target_error(z, slot, x, known):
        # (the teacher's passes run on no rows too: a row count is data, never a branch of a traced graph)
        rows = draw.target_rows
        with torch.no_grad():
            tgt = pd_target(teacher, z[rows], draw.t[rows], draw.t_next[rows], draw.omega[rows], slot[rows],
                            x[rows], known[rows], teacher_steps, draw.sub_times[rows], recipe.t_eps)
            target = torch.zeros_like(x).index_copy(0, rows, tgt.to(x.dtype))
        is_dec = draw.decode.to(x.device)
        x_pred, logits = trained(z, draw.t, draw.omega, slot, is_dec.float(), draw.decode_rows)
        return (x_pred.float() - target).pow(2).mean(-1), logits  # (B, L), (Bd, L, V)

    return flow_objective(x, tokens, draw, recipe, valid, known, teacher, target_error, student=True)


class PDMethod(ELFMethod):
    """ELF trained as a progressive-distillation student of a frozen `teacher`: each row a decode row (the
    ordinary decode cross-entropy) or a distillation row whose target is the teacher's `teacher_steps //
    student_steps` sub-steps over one student step (`distill_loss`). The student is an ELF network: its runs
    are ELF runs whose record says how it was distilled."""

    def __init__(self, teacher, student_steps: int, teacher_steps: int):
        self.teacher = teacher
        self.step_size = 1.0 / student_steps
        self.sub_steps = teacher_steps // student_steps

    def draw(self, batch, space, recipe, generator, cpu_generator):
        B, L = batch["tokens"].shape
        return draw_distill_noise((B, L, space.dim), recipe, self.step_size, self.sub_steps, generator,
                                  cpu_generator, batch["tokens"].device)

    def objective(self, net, x, batch, draw, recipe):
        return distill_loss(net, self.teacher, x, batch["tokens"], draw, recipe, valid=batch.get("mask"),
                            known=batch.get("known"), teacher_steps=self.sub_steps)


# ----------------------------------------------------------------------------------------------------------
# the rounds
def check_schedule(student_steps, teacher_steps: int) -> list[int]:
    """The student step counts as a list; ELFError unless they fall strictly and each divides the teacher's."""
    steps = list(student_steps)
    check_sampling_steps(teacher_steps, "--teacher-steps")
    if not steps or any(not isinstance(n, int) or n < 1 for n in steps):
        raise ELFError(f"--student-steps must be integers >= 1, got {steps}")
    if any(b >= a for a, b in zip(steps, steps[1:])):
        raise ELFError(f"--student-steps must decrease strictly from round to round, got {steps}")
    bad = [n for n in steps if teacher_steps % n]
    if bad:
        raise ELFError(f"--student-steps {bad} do not divide --teacher-steps {teacher_steps}: every student step "
                       "must span a whole number of teacher steps")
    return steps

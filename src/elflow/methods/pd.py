"""Progressive distillation: a student that takes one step of size s where its frozen teacher takes K
sub-steps, regressed on the x whose single Euler step lands where the teacher's K steps land (`PDMethod`, ELF
trained with this objective; elflow.distill runs its rounds)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elflow.flow import (
    T_EPS,
    T_MEAN,
    T_STD,
    Recipe,
    decode_levels,
    draw_guidance,
    draw_time,
    euler_step,
    row_index,
    scored_positions,
    to_device,
    token_mean_loss,
)
from elflow.methods.elf import ELFMethod, step_sums
from elflow.util.budget import check_sampling_steps
from elflow.util.errors import ELFError

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
        z = euler_step(z, _rows(tau), _rows(tau_next), slot, t_eps)
        z = torch.where(known, x0, z)
    span = _rows(t_t - t_s)
    scale = (1 - _rows(t_s)) / span.clamp_min(SUB_STEP_MIN_SPAN)
    return torch.where(span < SUB_STEP_MIN_SPAN, guess, z_t_s + scale * (z - z_t_s))


def draw_sub_step_times(t_s, t_t, steps: int, generator: torch.Generator | None = None, mean: float = T_MEAN,
                          std: float = T_STD) -> torch.Tensor:
    """(B, steps + 1) times t_s = tau_0 < ... < tau_steps = t_t: the interior ones are sorted logit-normal
    (mean, std; the teacher's training times, -1.5, 0.8 as released) draws u mapped to tau = t_s + (t_t - t_s) u."""
    B = t_s.shape[0]
    u = draw_time(B * (steps - 1), generator, mean, std).reshape(B, steps - 1).to(t_s.device)
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
    """All randomness of one distillation batch, on the data's device (discrete choices drawn on the CPU and
    their rows found there, as in flow.Draw)."""

    t: torch.Tensor  # (B,) student time t_s (1 on decode rows)
    t_next: torch.Tensor  # (B,) t_t = t_s + s (1 on decode rows)
    omega: torch.Tensor  # (B,)
    eps: torch.Tensor  # (B, L, C) standard normal
    p: torch.Tensor  # (B, L, 1) decode corruption level
    sub_times: torch.Tensor  # (B, K + 1) the teacher's sub-step times
    decode: torch.Tensor  # (B,) bool
    self_cond: torch.Tensor  # (B,) bool, never on decode rows
    drop_source: torch.Tensor  # (B,) bool: always False (the source stays in distillation)
    decode_rows: torch.Tensor  # row indices (flow.row_index): decode rows,
    self_cond_rows: torch.Tensor  # self-conditioned rows,
    distill_rows: torch.Tensor  # and the other rows, whose target the teacher gives


def draw_distill_noise(shape, recipe: Recipe, step_size: float, teacher_steps: int,
                       generator: torch.Generator | None = None, cpu_generator: torch.Generator | None = None,
                       device=None) -> DistillDraw:
    """The randomness of a (B, L, C) batch for a student step of `step_size` and `teacher_steps` sub-steps."""
    B, L, C = shape
    r = torch.rand(2, B, generator=cpu_generator)
    decode = r[0] < recipe.decode_prob
    self_cond = (r[1] < recipe.self_cond_prob) & ~decode
    u = draw_time(B, generator, recipe.t_mean, recipe.t_std).to(device)
    omega = draw_guidance(B, generator, recipe.omega_low, recipe.omega_high).to(device)
    eps = torch.randn(B, L, C, generator=generator, device=device)
    p = decode_levels((B, L, 1), recipe, generator, device)
    t_s = u * max(1.0 - step_size, STEP_SIZE_FLOOR)
    t_t = t_s + step_size
    sub = draw_sub_step_times(t_s, t_t, teacher_steps, generator, recipe.t_mean, recipe.t_std)
    rows = {"decode_rows": row_index(decode, device), "self_cond_rows": row_index(self_cond, device),
            "distill_rows": row_index(~decode, device)}
    decode, self_cond = to_device(decode, device), to_device(self_cond, device)
    t_s = torch.where(decode, torch.ones_like(t_s), t_s)
    t_t = torch.where(decode, torch.ones_like(t_t), t_t)
    return DistillDraw(t=t_s, t_next=t_t, omega=omega, eps=eps, p=p, sub_times=sub, decode=decode,
                       self_cond=self_cond, drop_source=torch.zeros(B, dtype=torch.bool, device=device), **rows)


def distill_loss(student, teacher, x, tokens, draw: DistillDraw, recipe: Recipe = Recipe(), valid=None,
                 known=None, trained=None, teacher_steps: int = 1):
    """The distillation objective of one batch; returns (loss, rows) as flow.elf_loss does.

    x (B, L, C) clean embeddings, tokens (B, L), valid (B, L) positions that count (None: all), known (B, L)
    bool positions of a clean source, neither noised nor scored. `trained` is the student's mixed pass.
    """
    B, L, C = x.shape
    dev = x.device
    trained = trained if trained is not None else student.mixed
    known = torch.zeros(B, L, dtype=torch.bool, device=dev) if known is None else known.to(dev, torch.bool)
    kn = known[..., None]
    is_dec = draw.decode.to(dev)
    t = _rows(draw.t)
    z_distill = t * x + (1 - t) * recipe.noise_scale * draw.eps
    z_decode = draw.p * x + (1 - draw.p) * recipe.decode_noise_scale * draw.eps
    z = torch.where(kn, x, torch.where(_rows(is_dec), z_decode, z_distill))

    # the shared self-conditioning slot: x0 at known positions; the teacher's first guess on half the
    # distillation rows; zeros elsewhere (decode rows get an all-zero slot)
    slot = torch.where(kn, x, torch.zeros_like(x))
    # (the teacher's passes run on no rows too: a row count is data, never a branch of a traced graph)
    sc = draw.self_cond_rows
    with torch.no_grad():
        guess = teacher_init(teacher, z[sc], draw.t[sc], draw.omega[sc], x[sc], known[sc])
        slot = slot.index_copy(0, sc, torch.where(kn[sc], x[sc], guess.to(slot.dtype)))
        slot = torch.where(_rows(is_dec), torch.zeros_like(slot), slot)

        rows = draw.distill_rows
        tgt = pd_target(teacher, z[rows], draw.t[rows], draw.t_next[rows], draw.omega[rows], slot[rows],
                        x[rows], known[rows], teacher_steps, draw.sub_times[rows], recipe.t_eps)
        target = torch.zeros_like(x).index_copy(0, rows, tgt.to(x.dtype))

    dec = draw.decode_rows
    x_pred, logits = trained(z, draw.t, draw.omega, slot, is_dec.float(), dec)
    err = (x_pred.float() - target).pow(2).mean(-1)  # (B, L)
    return token_mean_loss(err, logits, tokens, is_dec, dec, scored_positions(known, valid))


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

    def loss(self, net, space, batch, draw, recipe):
        x = self.encode(space, batch, draw)
        loss, rows = distill_loss(net, self.teacher, x, batch["tokens"], draw, recipe, valid=batch.get("mask"),
                                  known=batch.get("known"), teacher_steps=self.sub_steps)
        return loss, step_sums(loss, rows, draw)


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

"""Flow-map distillation of an ELF teacher: one student that jumps from any time s to any later time t, so that
it samples at every step count (Lagrangian map distillation, elflow.flowmap; `MapMethod`, ELF trained with this
objective; elflow.distill runs it). The student is the teacher's network with the target time as one more
input (elflow.model.ELFConfig.target_time), initialised from the teacher's weights with the new input at zero,
so that it starts as its teacher.

Per training row (decode rows, with the recipe's share, keep the ordinary decode cross-entropy):

    (s, t)  a time pair, s <= t (flowmap.draw_time_pairs)
    z_s     s x0 + (1 - s) noise_scale eps          (known positions, a conditional model's source, hold x0)
    slot    the teacher's guess at (z_s, s) on the self-conditioned share of rows, zeros on the others
    loss    || ((1 - t) dX/dt - sg[x_T(X, t) - X]) / max(1 - t, t_eps) ||^2 / C, X = X(z_s, s, t) the
            student's jump, dX/dt its exact time derivative (forward-mode autodiff), x_T the frozen teacher's
            x-prediction with the same slot and omega; one token mean with the decode rows' cross-entropy
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elflow.flow import Recipe, decode_levels, draw_guidance, row_index, scored_positions, to_device, token_mean_loss
from elflow.flowmap import DIAGONAL_SHARE, draw_time_pairs, lmd_residual
from elflow.methods.elf import ELFMethod, step_sums


@dataclass
class MapDraw:
    """All randomness of one flow-map batch, on the data's device (discrete choices drawn on the CPU, as in
    flow.Draw). `t` is the start time s (1 on decode rows; the log's time bins read it), `t_next` the target."""

    t: torch.Tensor  # (B,) s
    t_next: torch.Tensor  # (B,) t >= s
    omega: torch.Tensor  # (B,)
    eps: torch.Tensor  # (B, L, C) standard normal
    p: torch.Tensor  # (B, L, 1) decode corruption level
    decode: torch.Tensor  # (B,) bool
    self_cond: torch.Tensor  # (B,) bool, never on decode rows
    drop_source: torch.Tensor  # (B,) bool: always False (the source stays in distillation)
    decode_rows: torch.Tensor
    self_cond_rows: torch.Tensor
    map_rows: torch.Tensor  # the rows whose loss is the map's


def draw_map_noise(shape, recipe: Recipe, generator: torch.Generator | None = None,
                   cpu_generator: torch.Generator | None = None, device=None,
                   diagonal: float = DIAGONAL_SHARE) -> MapDraw:
    """The randomness of a (B, L, C) batch of the flow-map objective."""
    B, L, C = shape
    r = torch.rand(2, B, generator=cpu_generator)
    decode = r[0] < recipe.decode_prob
    self_cond = (r[1] < recipe.self_cond_prob) & ~decode
    s, t = draw_time_pairs(B, generator, diagonal, device)
    omega = draw_guidance(B, generator, recipe.omega_low, recipe.omega_high).to(device)
    eps = torch.randn(B, L, C, generator=generator, device=device)
    p = decode_levels((B, L, 1), recipe, generator, device)
    rows = {"decode_rows": row_index(decode, device), "self_cond_rows": row_index(self_cond, device),
            "map_rows": row_index(~decode, device)}
    decode, self_cond = to_device(decode, device), to_device(self_cond, device)
    s = torch.where(decode, torch.ones_like(s), s)
    t = torch.where(decode, torch.ones_like(t), t)
    return MapDraw(t=s, t_next=t, omega=omega, eps=eps, p=p, decode=decode, self_cond=self_cond,
                   drop_source=torch.zeros(B, dtype=torch.bool, device=device), **rows)


def map_loss(student, teacher, x, tokens, draw: MapDraw, recipe: Recipe = Recipe(), valid=None, known=None):
    """The flow-map objective of one batch; returns (loss, rows) as flow.elf_loss does. x (B, L, C) clean
    embeddings, tokens (B, L), valid (B, L) the positions that count (None: all), known (B, L) bool positions
    of a clean source, neither noised nor scored."""
    B, L, C = x.shape
    dev = x.device
    known = torch.zeros(B, L, dtype=torch.bool, device=dev) if known is None else known.to(dev, torch.bool)
    kn = known[..., None]
    is_dec = draw.decode.to(dev)
    s = draw.t[:, None, None]
    z_map = s * x + (1 - s) * recipe.noise_scale * draw.eps
    z_dec = draw.p * x + (1 - draw.p) * recipe.decode_noise_scale * draw.eps
    z = torch.where(kn, x, torch.where(is_dec[:, None, None], z_dec, z_map))

    # the shared self-conditioning slot: x0 at known positions, the teacher's guess at (z_s, s) on the
    # self-conditioned rows (a row count is data, never a branch of a traced graph)
    slot = torch.where(kn, x, torch.zeros_like(x))
    sc = draw.self_cond_rows
    with torch.no_grad():
        guess = teacher(z[sc], draw.t[sc], draw.omega[sc], slot[sc])
        slot = slot.index_copy(0, sc, torch.where(kn[sc], x[sc], guess.to(slot.dtype)))

    rows = draw.map_rows
    xr, knr, omr, slr = x[rows], kn[rows], draw.omega[rows], slot[rows]

    def student_map(z_, s_, t_):  # known positions stay x0: the map never moves them
        return torch.where(knr, xr, student(z_, s_, omr, slr, target=t_))

    def teacher_x(z_, t_):
        return torch.where(knr, xr, teacher(z_, t_, omr, slr))

    r = lmd_residual(student_map, teacher_x, z[rows], draw.t[rows], draw.t_next[rows], recipe.t_eps)
    err = torch.zeros(B, L, device=dev, dtype=r.dtype).index_copy(0, rows, r.pow(2).mean(-1))

    dec = draw.decode_rows
    ones = torch.ones(dec.shape[0], device=dev)
    _, logits = student.mixed(z[dec], ones, draw.omega[dec], torch.zeros_like(z[dec]), ones,
                              torch.arange(dec.shape[0], device=dev))
    return token_mean_loss(err, logits, tokens, is_dec, dec, scored_positions(known, valid))


class MapMethod(ELFMethod):
    """ELF trained as a flow-map student of a frozen `teacher` (module docstring). The student is an ELF network
    with a target time: its runs are ELF runs whose record says how it was distilled."""

    tangents = True  # the map's time derivative (flowmap.lmd_residual)

    def __init__(self, teacher):
        self.teacher = teacher

    def draw(self, batch, space, recipe, generator, cpu_generator):
        B, L = batch["tokens"].shape
        return draw_map_noise((B, L, space.dim), recipe, generator, cpu_generator, batch["tokens"].device)

    def loss(self, net, space, batch, draw, recipe):
        x = self.encode(space, batch, draw)
        loss, rows = map_loss(net, self.teacher, x, batch["tokens"], draw, recipe, valid=batch.get("mask"),
                              known=batch.get("known"))
        return loss, step_sums(loss, rows, draw)

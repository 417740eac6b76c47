"""Flow-map distillation of an ELF teacher: one student that jumps from any time s to any later time t, so that
it samples at every step count (Lagrangian map distillation, elflow.flowmap; `MapMethod`, ELF trained with this
objective; elflow.distill runs it). The student is the teacher's network with the target time as one more
input (elflow.model.ELFConfig.target_time), initialised from the teacher's weights with the new input at zero,
so that it starts as its teacher.

Per training row (decode rows, with the recipe's share, keep the ordinary decode cross-entropy):

    (s, t)  a time pair, s <= t (flowmap.draw_time_pairs; flow.draw_training_noise draws the rest)
    z_s     s x0 + (1 - s) noise_scale eps          (known positions, a conditional model's source, hold x0)
    slot    the teacher's guess at (z_s, s) on the self-conditioned share of rows, zeros on the others
    loss    || ((1 - t) dX/dt - sg[x_T(X, t) - X]) / max(1 - t, t_eps) ||^2 / C, X = X(z_s, s, t) the
            student's jump, dX/dt its exact time derivative (forward-mode autodiff), x_T the frozen teacher's
            x-prediction with the same slot and omega; one token mean with the decode rows' cross-entropy
            (flow.flow_objective)
"""

from __future__ import annotations

import torch

from elflow.flow import Draw, Recipe, draw_training_noise, flow_objective
from elflow.flowmap import DIAGONAL_SHARE, draw_time_pairs, lmd_residual
from elflow.methods.elf import ELFMethod


def draw_map_noise(shape, recipe: Recipe, generator: torch.Generator | None = None,
                   cpu_generator: torch.Generator | None = None, device=None,
                   diagonal: float = DIAGONAL_SHARE) -> Draw:
    """The randomness of a (B, L, C) batch of the flow-map objective (flow.draw_training_noise with the student's
    times: `t` the start s, 1 on decode rows, which the log's time bins read; `t_next` the target t >= s)."""
    def times(n, generator, device):
        return draw_time_pairs(n, generator, diagonal, device)

    return draw_training_noise(shape, recipe, generator, cpu_generator, device, times=times)


def map_loss(student, teacher, x, tokens, draw: Draw, recipe: Recipe = Recipe(), valid=None, known=None):
    """The flow-map objective of one batch (flow.flow_objective, the teacher's guess in the shared
    self-conditioning slot): on flow rows the squared LMD residual of the student's jump (flowmap.lmd_residual),
    on decode rows the student's decode cross-entropy; returns (loss, rows) as flow.elf_loss does. x (B, L, C)
    clean embeddings, tokens (B, L), valid (B, L) the positions that count (None: all), known (B, L) bool
    positions of a clean source, neither noised nor scored."""

    def residual_error(z, slot, x, known):
        B, L = x.shape[:2]
        dev = x.device
        rows = draw.target_rows
        xr, knr, omr, slr = x[rows], known[rows][..., None], draw.omega[rows], slot[rows]

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
        return err, logits

    return flow_objective(x, tokens, draw, recipe, valid, known, teacher, residual_error, student=True)


class MapMethod(ELFMethod):
    """ELF trained as a flow-map student of a frozen `teacher` (module docstring). The student is an ELF network
    with a target time: its runs are ELF runs whose record says how it was distilled."""

    tangents = True  # the map's time derivative (flowmap.lmd_residual)

    def __init__(self, teacher):
        self.teacher = teacher

    def draw(self, batch, space, recipe, generator, cpu_generator):
        B, L = batch["tokens"].shape
        return draw_map_noise((B, L, space.dim), recipe, generator, cpu_generator, batch["tokens"].device)

    def objective(self, net, x, batch, draw, recipe):
        return map_loss(net, self.teacher, x, batch["tokens"], draw, recipe, valid=batch.get("mask"),
                        known=batch.get("known"))

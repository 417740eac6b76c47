"""The released conditional training step, re-written from its published semantics (official-facts.md,
"Training" and "Conditional generation"; forward_semantics.md, sections 1 and 7) in the paper's notation, one branch at a time. It shares no code with elflow's loss or optimiser: it
calls the network's trunk and heads, and reads the batch's random draws from a `Draw`.

The released step, per example (decode rows: `d.decode`):

    x0       the clean embeddings; on a dropped row (`d.drop_source`) zeros at the source positions
    denoise  z = t x0 + (1 - t) 2 eps on the target, z = x0 on the source; slot = x0 on the source, zeros
             elsewhere; a self-conditioned row's slot holds, on the target, the no-grad guess of net([z, slot])
             (its source put back to x0); target = v + (1 - 1/omega)(v_cond - v_uncond) on self-conditioned
             rows, v_uncond from the first guess, v_cond from net([z, that guess]) (both no-grad)
    decode   z = p x0 + (1 - p) s n at EVERY position (the source corrupted too), slot zeros, t = 1, mode gate 1
    pass     one forward of every row with its own (z, slot, t, omega, gate); the x head on every row, the
             decode head on every row (its cross-entropy kept on decode rows only)
    loss     (sum of the v-MSE over the denoise rows' scored positions + sum of the cross-entropy over the
             decode rows' scored positions) / (scored positions of the batch); scored = not source (and valid)

Their optimiser (`released_first_step`): Muon on every 2-D parameter as they store it (bias-corrected Nesterov
momentum 0.95, five Newton-Schulz steps in fp32 from G / (|G| + 1e-8), the step scaled by sqrt(max(1,
fan_out / fan_in))), Nesterov-Adam on the rest. They store the decode head's two matrices as (in, out) kernels
(`proj_kernel` (H, C), `unembed_kernel` (C, V)), the transposes of elflow's nn.Linear weights
(`AUTHORS_TRANSPOSED`; their optimiser state holds them so, tests/reference/checkpoint_7), and read those
kernels' fans accordingly; every other matrix is stored as elflow stores it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def released_encoder_mask(known: torch.Tensor, valid: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """The released collator's encoder attention (B, L, L) bool, [i, j] = query i sees key j: the source sees
    the source, every other position every valid key; on a dropped row (drop (B,) bool) the target, before
    encoding, loses its view of the source."""
    cond_i, cond_j = known[:, :, None], known[:, None, :]
    allowed = (cond_i & cond_j) | (~cond_i & valid[:, None, :])
    return allowed & ~(drop[:, None, None] & ~cond_i & cond_j)


# elflow's parameter names whose matrices the released network stores transposed, as (in, out) kernels
AUTHORS_TRANSPOSED = ("decode_head.proj.weight", "decode_head.unembed.weight")


def released_pass(net, z, slot, t, omega, gate):
    """The released model's one call on every row: (x_pred (B, L, C), logits (B, L, V)); the decode head on
    every row, as their forward computes it whenever a per-row gate is given."""
    h = net.trunk(z, t, omega, slot, gate)  # (B, L, H)
    return net.denoise_head(h, z, t, omega), net.logits_head(h)


def denoise_inputs(net, x0, known, d, noise_scale: float):
    """Per row: (z, slot, first guess, second guess) of the denoise branch (computed for every row; the loss
    keeps the denoise rows). x0 (B, L, C) with dropped sources zeroed, known (B, L, 1) bool."""
    t = d.t[:, None, None]
    z = torch.where(known, x0, t * x0 + (1 - t) * noise_scale * d.eps)
    slot0 = torch.where(known, x0, torch.zeros_like(x0))
    with torch.no_grad():
        first = net(z, d.t, d.omega, slot0)  # the no-grad first guess, the slot's own pass
        guess = torch.where(known, x0, first)
        second = net(z, d.t, d.omega, guess)  # net([z, guess]): v_cond's pass
    sc = d.self_cond[:, None, None]
    slot = torch.where(sc, guess, slot0)
    return z, slot, first, second


def decode_inputs(x0, d, decode_noise_scale: float):
    """Per row: z of the decode branch, every position corrupted per token."""
    return d.p * x0 + (1 - d.p) * decode_noise_scale * d.eps


def authors_cond_loss(net, x, tokens, known, d, recipe, valid=None, record=None):
    """The released conditional step's loss on one batch. x (B, L, C) clean embeddings, tokens (B, L), known
    (B, L) bool source positions, d the batch's draws, valid (B, L) bool (None: all). `record` (a dict, if
    given) receives the terms: the trained pass's inputs, x_pred, logits, per-token v-MSE and CE, scored mask."""
    B, L, C = x.shape
    src = known[..., None]  # (B, L, 1)
    x0 = torch.where(d.drop_source[:, None, None] & src, torch.zeros_like(x), x)

    # the denoise branch
    z_den, slot_den, first, second = denoise_inputs(net, x0, src, d, recipe.noise_scale)
    clip = (1 - d.t[:, None, None]).clamp_min(recipe.t_eps)  # (B, 1, 1)
    v = (x0 - z_den) / clip
    v_uncond, v_cond = (first - z_den) / clip, (second - z_den) / clip
    k = torch.where(d.self_cond, 1 - 1 / d.omega, torch.zeros_like(d.omega))[:, None, None]
    target = v + k * (v_cond - v_uncond)

    # the decode branch
    z_dec = decode_inputs(x0, d, recipe.decode_noise_scale)

    # one pass, each row with its branch's inputs
    row_dec = d.decode[:, None, None]
    gate = d.decode.float()
    z = torch.where(row_dec, z_dec, z_den)
    slot = torch.where(row_dec, torch.zeros_like(slot_den), slot_den)
    t = torch.where(d.decode, torch.ones_like(d.t), d.t)
    x_pred, logits = released_pass(net, z, slot, t, d.omega, gate)

    mse = ((x_pred - z_den) / clip - target).pow(2).mean(-1)  # (B, L)
    ce = F.cross_entropy(logits.float().reshape(B * L, -1), tokens.reshape(-1), reduction="none").view(B, L)
    scored = (~known).float() if valid is None else ((~known) & valid.bool()).float()
    den_w, dec_w = scored * (~d.decode).float()[:, None], scored * d.decode.float()[:, None]
    loss = ((mse * den_w).sum() + (ce * dec_w).sum()) / scored.sum().clamp_min(1)
    if record is not None:
        record.update(z=z, slot=slot, t=t, omega=d.omega, gate=gate, x_pred=x_pred, logits=logits, mse=mse,
                      ce=ce, scored=scored, target=target)
    return loss


# ---------------------------------------------------------------------------------------------------------
# the optimiser's step


def newton_schulz5(g: torch.Tensor, steps: int = 5, eps: float = 1e-8) -> torch.Tensor:
    """The quintic Newton-Schulz iteration (3.4445, -4.7750, 2.0315) on g (m, n), in fp32, from g / (|g| + eps)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def clip_by_global_norm(grads: dict, max_norm: float = 1.0) -> dict:
    """The gradients scaled by min(1, max_norm / (their global norm + 1e-6))."""
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    return {n: g * min(1.0, max_norm / (norm + 1e-6)) for n, g in grads.items()}


class ReleasedOptimizer:
    """The released optimiser re-written from its formulas, on elflow's parameters by name: Muon on every
    matrix, computed on the matrix as the authors store it (the decode head's kernels (in, out)), bias-corrected
    Nesterov momentum b = 0.95, five fp32 Newton-Schulz steps from G / (|G| + 1e-8), the step scaled by
    sqrt(max(1, fan_out / fan_in)) of the true fans; Nesterov-Adam (0.9, 0.999, eps 1e-8) on the rest; a
    parameter without a gradient stepped with a zero one. `step(params, lr)` moves {name: parameter} in place
    by their .grad."""

    def __init__(self, momentum: float = 0.95, betas=(0.9, 0.999), eps: float = 1e-8):
        self.b, (self.b1, self.b2), self.eps = momentum, betas, eps
        self.t, self.m, self.v = 0, {}, {}

    @torch.no_grad()
    def step(self, params: dict, lr: float) -> None:
        self.t += 1
        t = self.t
        for name, p in params.items():
            g = p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
            if p.ndim == 2:
                kernel = name in AUTHORS_TRANSPOSED
                g = g.T if kernel else g  # as stored
                m = self.m[name] = self.m.get(name, torch.zeros_like(g)) * self.b + (1 - self.b) * g
                u = self.b * m / (1 - self.b ** (t + 1)) + (1 - self.b) * g / (1 - self.b ** t)
                fan_in, fan_out = g.shape if kernel else g.shape[::-1]
                step = lr * math.sqrt(max(1.0, fan_out / fan_in)) * newton_schulz5(u)
                p -= step.T if kernel else step
            else:
                m = self.m[name] = self.m.get(name, torch.zeros_like(g)) * self.b1 + (1 - self.b1) * g
                v = self.v[name] = self.v.get(name, torch.zeros_like(g)) * self.b2 + (1 - self.b2) * g * g
                m_hat = self.b1 * m / (1 - self.b1 ** (t + 1)) + (1 - self.b1) * g / (1 - self.b1 ** t)
                p -= lr * m_hat / ((v / (1 - self.b2 ** t)).sqrt() + self.eps)


def released_first_step(name: str, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """The released optimiser's first step (`ReleasedOptimizer`, t = 1) for elflow's parameter `name` with
    gradient `grad`: the change of the weights, in elflow's layout."""
    p = torch.zeros_like(grad, dtype=torch.float32, requires_grad=True)
    p.grad = grad.float()
    ReleasedOptimizer().step({name: p}, lr)
    return -p.detach()

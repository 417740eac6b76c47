"""The method around the network, in the paper's notation: the training objective and the samplers.

Path:      z_t = t x + (1 - t) eps,  eps ~ N(0, noise_scale^2),  t = 0 noise, t = 1 data
Velocity:  v = (x - z_t) / max(1 - t, t_eps);  the network predicts x, so v_pred = (x_pred - z_t) / max(1 - t, t_eps)
Denoise:   || v_pred - target ||^2,  target = v + (1 - 1/omega)(v_cond - v_uncond) on self-conditioned rows
Decode:    cross-entropy of net(p x + (1 - p) 5 n, t=1, decode) against the tokens, p per token

One training row costs, by branch:
  denoise, no self-conditioning:  1 forward + backward   (the reference listing: 2 forwards + backward)
  denoise, self-conditioned:      2 forwards + backward  (the reference listing: 3 forwards + backward)
  decode:                         1 forward + backward
The listing's third pass, net([z, x0]) under stop-gradient, equals the trained pass's own output, so the
trained pass is reused, detached (exact when dropout is 0, as in every released config).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F

from elflow.schedules import sample_decode_level, sample_guidance, sample_time, time_grid

__all__ = [
    "Recipe", "Draw", "draw_training_noise", "elf_loss", "TIME_BINS",
    "euler_step", "ode_step", "sde_step", "vc_step", "STEPS", "sample_loop", "generate_tokens", "decode_tokens",
]


@dataclass(frozen=True)
class Recipe:
    """The training recipe's constants (released OpenWebText values by default)."""

    noise_scale: float = 2.0
    t_eps: float = 0.05
    decode_prob: float = 0.2
    self_cond_prob: float = 0.5
    decode_noise_scale: float = 5.0  # 1.0 for translation and summarisation
    omega_low: float = 0.5
    omega_high: float = 5.0
    source_drop_prob: float = 0.1  # conditional data only

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


TIME_BINS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)  # edges of the time bins the denoising loss is logged in


@dataclass
class Draw:
    """All randomness of one training batch. The discrete choices live on the CPU so that selecting rows
    needs no device-to-host sync; the continuous draws live on the data's device."""

    t: torch.Tensor  # (B,) flow time (1 on decode rows)
    omega: torch.Tensor  # (B,) guidance scale
    eps: torch.Tensor  # (B, L, C) standard normal; scaled by the branch's noise scale
    p: torch.Tensor  # (B, L, 1) decode corruption level (used on decode rows)
    decode: torch.Tensor  # (B,) bool, CPU
    self_cond: torch.Tensor  # (B,) bool, CPU, never on decode rows
    drop_source: torch.Tensor  # (B,) bool, CPU, conditional data only


def draw_training_noise(shape, recipe: Recipe, generator: torch.Generator | None = None,
                        cpu_generator: torch.Generator | None = None, device=None,
                        conditional: bool = False) -> Draw:
    """Draw the randomness of a batch of shape (B, L, C). `generator` lives on `device` (or is None)."""
    B, L, C = shape
    r = torch.rand(3, B, generator=cpu_generator)
    decode = r[0] < recipe.decode_prob
    self_cond = (r[1] < recipe.self_cond_prob) & ~decode
    drop_source = (r[2] < recipe.source_drop_prob) & torch.tensor(conditional)
    t = sample_time(B, generator).to(device)
    omega = sample_guidance(B, generator, recipe.omega_low, recipe.omega_high).to(device)
    eps = torch.randn(B, L, C, generator=generator, device=device)
    p = sample_decode_level((B, L, 1), generator).to(device)
    t = torch.where(decode.to(device), torch.ones_like(t), t)
    return Draw(t=t, omega=omega, eps=eps, p=p, decode=decode, self_cond=self_cond, drop_source=drop_source)


def _index(mask: torch.Tensor, device) -> torch.Tensor:
    return mask.nonzero().flatten().to(device, non_blocking=True)  # mask is on the CPU: no device sync


def elf_loss(net, x: torch.Tensor, tokens: torch.Tensor, draw: Draw, recipe: Recipe = Recipe(),
             mask: torch.Tensor | None = None, source_len: int = 0):
    """The ELF objective of one batch, both branches mixed per row.

    x (B, L, C) clean embeddings, tokens (B, L) their ids, mask (B, L) positions that count in the loss
    (padding excluded), source_len: the first positions hold a clean source (conditional data) that is
    never noised and never scored. Returns (loss, metrics) with metrics as tensors (no host sync):
    sums and counts, so that they add up across steps and ranks.
    """
    B, L, C = x.shape
    dev = x.device
    dec_rows = draw.decode.to(dev)[:, None, None]
    t = draw.t[:, None, None]
    clip = (1 - t).clamp_min(recipe.t_eps)  # (B, 1, 1)

    if source_len:
        keep = (~draw.drop_source).to(dev, x.dtype)[:, None, None]
        source = torch.arange(L, device=dev)[None, :, None] < source_len  # (1, L, 1)
        x = torch.where(source, x * keep, x)  # a dropped source is zeroed
    z_denoise = t * x + (1 - t) * recipe.noise_scale * draw.eps
    z_decode = draw.p * x + (1 - draw.p) * recipe.decode_noise_scale * draw.eps
    z = torch.where(dec_rows, z_decode, z_denoise)  # (B, L, C)
    if source_len:
        z = torch.where(source, x, z)  # the source stays clean

    # the self-conditioning input: x0 = net([z, 0]) without gradient, on the self-conditioned rows only
    x_prev = torch.zeros_like(z)
    sc = _index(draw.self_cond, dev)
    if len(sc):
        with torch.no_grad():
            x0 = net(z[sc], draw.t[sc], draw.omega[sc])
        x_prev = x_prev.index_copy(0, sc, x0.to(x_prev.dtype))

    # the trained pass: one forward for every row, each with its own mode gate
    # (through forward, so that a DistributedDataParallel wrapper sees it); logits only on decode rows,
    # since the vocabulary projection is the costly part, and empty when there is none (DDP's graph stays whole)
    dec = _index(draw.decode, dev)
    x_pred, logits = net(z, draw.t, draw.omega, x_prev, decode_gate=draw.decode.to(dev, torch.float32),
                         logits_rows=dec)  # (B, L, C), (Bd, L, V)

    # target = v + (1 - 1/omega)(v_cond - v_uncond), with v_cond from this very pass (detached) and
    # v_uncond from the x0 pass; rows without self-conditioning keep the plain target v.
    v = (x - z) / clip
    v_pred = (x_pred - z) / clip
    v_cond = (x_pred.detach() - z) / clip
    v_uncond = (x_prev - z) / clip
    k = torch.where(draw.self_cond.to(dev), 1 - 1 / draw.omega, torch.zeros_like(draw.omega))[:, None, None]
    target = v + k * (v_cond - v_uncond)
    err = (v_pred - target).pow(2).mean(-1)  # (B, L)

    valid = torch.ones(B, L, dtype=torch.bool, device=dev) if mask is None else mask.to(dev, torch.bool)
    if source_len:
        valid = valid & ~source[..., 0]
    w = valid.float()
    n_valid = w.sum(-1).clamp_min(1)
    denoise_row = (err * w).sum(-1) / n_valid  # (B,)

    # decode branch
    ce = F.cross_entropy(logits.transpose(1, 2), tokens[dec], reduction="none")  # (Bd, L)
    decode_row = (ce * w[dec]).sum(-1) / n_valid[dec]
    correct = ((logits.argmax(-1) == tokens[dec]).float() * w[dec]).sum()

    is_dec = draw.decode.to(dev)
    denoise_row = torch.where(is_dec, torch.zeros_like(denoise_row), denoise_row)
    loss = (denoise_row.sum() + decode_row.sum()) / B  # expected weights 0.8 / 0.2, as one branch per device

    # per-bin denoising loss, as sums and counts
    edges = torch.tensor(TIME_BINS[1:-1], device=dev)
    bins = torch.bucketize(draw.t.detach(), edges)
    den = (~is_dec).float()
    nb = len(TIME_BINS) - 1
    metrics = {
        "loss": loss.detach(),
        "denoise_sum": denoise_row.detach().sum(), "denoise_n": den.sum(),
        "decode_sum": decode_row.detach().sum(), "decode_n": is_dec.float().sum(),
        "decode_correct": correct.detach(), "decode_tokens": w[dec].sum(),
        "bin_sum": torch.zeros(nb, device=dev).index_add(0, bins, denoise_row.detach() * den),
        "bin_n": torch.zeros(nb, device=dev).index_add(0, bins, den),
    }
    return loss, metrics


# ----------------------------------------------------------------------------------------------------------
# samplers: a loop over a time grid with a swappable step
#
# A denoiser is any callable (z, t, x_prev) -> x_pred with z (B, L, C), t (B,), x_prev (B, L, C) or None.


def euler_step(z, t, t_next, x_pred, t_eps: float = 0.05):
    """Move z a fraction (t_next - t)/(1 - t) of the way to the guess x_pred (v clipped at 1 - t >= t_eps)."""
    return z + (t_next - t) * (x_pred - z) / (1 - t).clamp_min(t_eps)


def ode_step(denoise, z, t, t_next, x_prev, noise, gamma, noise_scale, t_eps, generator):
    x_pred = denoise(z, t.expand(z.shape[0]), x_prev)
    return euler_step(z, t, t_next, x_pred, t_eps), x_pred


def _backed_off_step(denoise, z, t, t_next, x_prev, noise, gamma, noise_scale, t_eps, generator, consistent):
    alpha = (1 - gamma * (t_next - t)).clamp(0, 1)
    t_b = alpha * t
    if consistent:  # fresh noise so that z_b carries exactly the path's noise level at t_b
        std = noise_scale * ((1 - t_b) ** 2 - (alpha * (1 - t)) ** 2).clamp_min(0).sqrt()
    else:  # the released code's version
        std = (1 - alpha) * noise_scale
    noise.normal_(generator=generator)
    z_b = alpha * z + std * noise
    x_pred = denoise(z_b, t_b.expand(z.shape[0]), x_prev)
    return euler_step(z_b, t_b, t_next, x_pred, t_eps), x_pred


def sde_step(*args):
    """The released SDE-style step: back off to t_b = alpha t, z_b = alpha z + (1 - alpha) 2 e, then Euler."""
    return _backed_off_step(*args, consistent=False)


def vc_step(*args):
    """Variance-consistent re-noising: like sde_step, with noise std 2 sqrt((1 - t_b)^2 - alpha^2 (1 - t)^2)."""
    return _backed_off_step(*args, consistent=True)


STEPS: dict[str, Callable] = {"ode": ode_step, "sde": sde_step, "vc": vc_step}


def sample_loop(denoise, z: torch.Tensor, grid: torch.Tensor, step: str = "sde", gamma: float = 1.5,
                noise_scale: float = 2.0, t_eps: float = 0.05, generator: torch.Generator | None = None,
                callback: Callable | None = None):
    """Integrate from z at grid[0] to grid[-1] = 1. Returns (z_final, x_pred_last).

    Every interval but the last uses `step`; the last is a plain Euler step (it lands on the guess).
    The previous guess is fed back as the self-conditioning input. `callback(i, t, z, x_pred)` sees each
    step's guess. Grid and noise buffers are allocated once; no host sync inside the loop.
    """
    if step not in STEPS:
        raise ValueError(f"unknown sampler step {step!r}; choose one of {', '.join(STEPS)}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    grid = grid.to(z.device, torch.float32)
    n = grid.numel() - 1
    if n < 1:
        raise ValueError("the time grid needs at least two points (steps >= 1)")
    step_fn = STEPS[step]
    noise = torch.empty_like(z) if step != "ode" else None
    x_prev = None
    for i in range(n - 1):
        z, x_prev = step_fn(denoise, z, grid[i], grid[i + 1], x_prev, noise, gamma, noise_scale, t_eps, generator)
        if callback is not None:
            callback(i, grid[i], z, x_prev)
    x_prev = denoise(z, grid[n - 1].expand(z.shape[0]), x_prev)
    z = euler_step(z, grid[n - 1], grid[n], x_prev, t_eps)
    if callback is not None:
        callback(n - 1, grid[n - 1], z, x_prev)
    return z, x_prev


def decode_tokens(net, z: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """The single decode pass at t = 1 with a zero self-conditioning input: (B, L, C) -> token ids (B, L)."""
    return net(z, torch.ones(z.shape[0], device=z.device), omega, decode=True).argmax(-1)


def check_sampling_args(steps: int, gamma: float, omega: float, recipe: Recipe = Recipe()) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not math.isfinite(gamma) or gamma < 0:
        raise ValueError(f"gamma must be a finite number >= 0, got {gamma}")
    if not math.isfinite(omega):
        raise ValueError(f"omega must be finite, got {omega}")
    if not recipe.omega_low <= omega <= recipe.omega_high:
        warnings.warn(f"omega {omega} lies outside the range the model was trained on "
                      f"[{recipe.omega_low}, {recipe.omega_high}]; results may be poor", stacklevel=3)


@torch.no_grad()
def generate_tokens(net, batch: int, length: int, steps: int = 32, sampler: str = "sde", gamma: float = 1.5,
                    omega: float = 3.0, grid: str = "logit_normal", generator: torch.Generator | None = None,
                    recipe: Recipe = Recipe(), device=None, callback: Callable | None = None):
    """Sample `batch` passages of `length` positions: returns (tokens (B, L), z_final (B, L, C))."""
    check_sampling_args(steps, gamma, omega, recipe)
    device = device or next(net.parameters()).device
    C = net.config.dim
    z = recipe.noise_scale * torch.randn(batch, length, C, generator=generator, device=device)
    times = time_grid(steps, grid, generator=generator, device=device)  # a fresh grid per batch
    w = torch.full((batch,), float(omega), device=device)

    def denoise(z_, t_, x_prev):
        return net(z_, t_, w, x_prev)

    z, _ = sample_loop(denoise, z, times, sampler, gamma, recipe.noise_scale, recipe.t_eps, generator, callback)
    return decode_tokens(net, z, w), z

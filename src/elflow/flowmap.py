"""Flow-map distillation: one student X(z_s, s, t) that jumps along the teacher's probability-flow ODE from any
time s to any later time t, so that one network samples at every step count (the flow map matching of Boffi,
Albergo & Vanden-Eijnden, in its Lagrangian map distillation form). Written for any map network and any
teacher, in elflow's conventions (x-prediction, t = 0 noise, t = 1 data):

    map        X(z, s, t) = z + (t - s) u,   u = (x_hat(z, s, t) - z) / max(1 - s, t_eps)
               (the identity at t = s; at t = 1 it lands on x_hat; as t -> s, dX/dt -> the velocity of x_hat(z, s, s))
    teacher    v_T(z, t) = (x_T(z, t) - z) / (1 - t),  x_T the frozen teacher's x-prediction
    LMD        r = dX/dt (z_s, s, t) - sg[v_T(X(z_s, s, t), t)],  dX/dt exact, by forward-mode autodiff in t
    sample     z_{k+1} = X(z_k, t_k, t_{k+1}) over any grid 0 = t_0 < ... < t_K = 1 (elflow.sampler.integrate, its
               "map" step)

The map is the Euler step of the network's x for the target time (elflow.flow.euler_step), the one jump from a
time to a later one that the samplers and a progressive teacher take too.

The residual is computed in x-space and divided by the clipped 1 - t, r = ((1 - t) dX/dt - sg[x_T(X, t) - X])
/ max(1 - t, t_eps), the weighting of ELF's own loss: for t <= 1 - t_eps it is the velocity residual above,
exactly; past it the target stays the unclipped ODE (a clipped velocity would slow the map down over the last
t_eps and leave it short of the data) and the weight fades to 0 at t = 1, where the residual says nothing.
At t = s the residual is the diagonal term u(z, s, s) - v_T(z, s): the network's x at t = s must be the
teacher's. Networks are callables net(z, s, t) -> x_hat and teacher(z, t) -> x_T, with z of any shape (B, ...)
and s, t of shape (B,); bind any further inputs (omega, a self-conditioning slot) before passing them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from elflow.flow import T_EPS, euler_step, per_row

MapNet = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (z, s, t) -> x_hat
Teacher = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (z, t) -> x

# share of training pairs with t = s (the diagonal term). 0 by default: a student that starts as its teacher
# (zero weights on the target time) meets the diagonal term from its first step, the LMD pairs with t close to
# s keep it met, and diagonal rows only take rows from the jumps (on the toy, shares of 0.1, 0.25 and 0.5 gave
# 1-step samples 2%, 19% and 77% further from the data; docs/method.md)
DIAGONAL_SHARE = 0.0


def flow_map(net: MapNet, z: torch.Tensor, s: torch.Tensor, t: torch.Tensor, t_eps: float = T_EPS) -> torch.Tensor:
    """X(z, s, t) = z + (t - s)(x_hat - z) / max(1 - s, t_eps) of the map network net(z, s, t) -> x_hat: the Euler
    step of size t - s towards x_hat (elflow.flow.euler_step). z (B, ...), s, t (B,)."""
    return euler_step(z, s, t, net(z, s, t), t_eps)


def map_and_time_derivative(net: MapNet, z: torch.Tensor, s: torch.Tensor, t: torch.Tensor,
                            t_eps: float = T_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(X(z, s, t), dX/dt): the time derivative exact, by forward-mode autodiff (torch.func.jvp) in t alone,
    z and s held fixed. Both outputs carry the network's gradients (reverse over forward)."""
    def in_t(t_):
        return flow_map(net, z, s, t_, t_eps)

    # attention in its composite form: the fused kernels have no forward-mode derivative
    with warnings.catch_warnings(), sdpa_kernel([SDPBackend.MATH]):
        # torch's first forward-mode pass loads decompositions with a deprecated call
        warnings.filterwarnings("ignore", message=".*torch.jit.script.* is deprecated", category=DeprecationWarning)
        return torch.func.jvp(in_t, (t,), (torch.ones_like(t),))


def lmd_residual(net: MapNet, teacher: Teacher, z: torch.Tensor, s: torch.Tensor, t: torch.Tensor,
                 t_eps: float = T_EPS) -> torch.Tensor:
    """The Lagrangian map distillation residual, shape of z:

        r = ((1 - t) dX/dt - sg[x_T(X, t) - X]) / max(1 - t, t_eps),  X = X(z, s, t),

    equal to dX/dt - sg[v_T(X, t)] for t <= 1 - t_eps. The gradient flows through dX/dt alone; the teacher's
    pass runs without autograd at the detached X. z (B, ...) lies at time s; s <= t (B,), pairs with t = s
    give the diagonal term."""
    X, dX = map_and_time_derivative(net, z, s, t, t_eps)
    X = X.detach()
    t_ = per_row(t, z)
    with torch.no_grad():
        gap = teacher(X, t).to(X.dtype) - X  # (1 - t) v_T(X, t), unclipped
    return ((1 - t_) * dX - gap) / (1 - t_).clamp_min(t_eps)


def lmd_loss(net: MapNet, teacher: Teacher, z: torch.Tensor, s: torch.Tensor, t: torch.Tensor,
             t_eps: float = T_EPS, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over rows (weighted by weight (B,) if given) of the squared LMD residual, averaged over every
    other dimension: one scalar. Diagonal pairs (t = s) in the batch are the diagonal term."""
    err = lmd_residual(net, teacher, z, s, t, t_eps).pow(2).flatten(1).mean(1)  # (B,)
    if weight is None:
        return err.mean()
    return (weight * err).sum() / weight.sum().clamp_min(1e-12)


def draw_time_pairs(n: int, generator: torch.Generator | None = None, diagonal: float = DIAGONAL_SHARE,
                      device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, t), each (n,), 0 <= s <= t <= 1, for training the map:

    the sorted pair of two independent U(0, 1) draws, s = min, t = max: density 2 on s < t, so every jump
    length d = t - s has density 2 (1 - d) (short jumps, which the long ones are built on, are seen most often)
    and every start s has density 2 (1 - s) (the jumps from noise, which the fewest-step grids take, most
    often); a share `diagonal` of the rows (each row by a coin) instead has t = s, s ~ U(0, 1) (the diagonal
    term)."""
    if not 0 <= diagonal <= 1:
        raise ValueError(f"draw_time_pairs: diagonal must lie in [0, 1], got {diagonal}")
    dev = generator.device if generator is not None else None
    u = torch.rand(3, n, generator=generator, device=dev)
    s, t = torch.minimum(u[0], u[1]), torch.maximum(u[0], u[1])
    on_diag = u[2] < diagonal
    t = torch.where(on_diag, u[0], t)
    s = torch.where(on_diag, u[0], s)
    return s.to(device), t.to(device)

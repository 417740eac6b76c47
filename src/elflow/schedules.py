"""Schedules as pure functions: training times, decode corruption levels, guidance scales, sampling grids.

Also `elflow schedules` (Figure 2): prints their statistics and plots them.

    t      = sigmoid(u),  u ~ N(-1.5, 0.8^2)            flow time, 0 = noise, 1 = data (median 0.18)
    p      = sigmoid(u),  u ~ N(0.8, 0.8^2)             decode corruption level per token (median 0.69)
    omega  : log(1 + omega) ~ U[log 1.5, log 6]         guidance scale in [0.5, 5] (median 2)
    grid   = [0, sorted(N - 1 draws of t), 1]           sampling times ("logit_normal"), or uniform
"""

from __future__ import annotations

import math

import torch

__all__ = ["sample_time", "sample_decode_level", "sample_guidance", "time_grid", "T_MEAN", "T_STD"]

T_MEAN, T_STD = -1.5, 0.8  # logit-normal time schedule (training and the sampling grid)
P_MEAN, P_STD = 0.8, 0.8  # logit-normal decode corruption level


def _device(generator):
    return generator.device if generator is not None else None


def sample_time(n: int, generator: torch.Generator | None = None, mean: float = T_MEAN, std: float = T_STD):
    """(n,) training times t = sigmoid(N(mean, std^2))."""
    u = torch.randn(n, generator=generator, device=_device(generator))
    return torch.sigmoid(mean + std * u)


def sample_decode_level(shape, generator: torch.Generator | None = None, mean: float = P_MEAN, std: float = P_STD):
    """Decode corruption levels p = sigmoid(N(0.8, 0.8^2)) of any shape (one per token in training)."""
    u = torch.randn(tuple(shape), generator=generator, device=_device(generator))
    return torch.sigmoid(mean + std * u)


def sample_guidance(n: int, generator: torch.Generator | None = None, low: float = 0.5, high: float = 5.0):
    """(n,) guidance scales omega, log-uniform in 1 + omega over [low, high]."""
    if not (-1 < low <= high):
        raise ValueError(f"sample_guidance: need -1 < low <= high, got low={low}, high={high}")
    u = torch.rand(n, generator=generator, device=_device(generator))
    return torch.exp(math.log1p(low) + u * (math.log1p(high) - math.log1p(low))) - 1.0


def time_grid(steps: int, kind: str = "logit_normal", generator: torch.Generator | None = None,
              device=None) -> torch.Tensor:
    """steps + 1 increasing times from exactly 0 to exactly 1.

    "logit_normal": 0, the sorted sigmoid of steps - 1 draws of N(-1.5, 0.8^2), 1 (the released sampler).
    "uniform": 0, 1/steps, ..., 1.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"time_grid: steps must be an integer >= 1, got {steps!r}")
    device = device if device is not None else _device(generator)
    if kind == "uniform":
        grid = torch.arange(steps + 1, dtype=torch.float32, device=device) / steps
    elif kind == "logit_normal":
        interior = sample_time(steps - 1, generator=generator).to(device).sort().values
        zero, one = torch.zeros(1, device=device), torch.ones(1, device=device)
        grid = torch.cat([zero, interior, one])
    else:
        raise ValueError(f"time_grid: kind must be 'logit_normal' or 'uniform', got {kind!r}")
    grid[0], grid[-1] = 0.0, 1.0
    return grid


# ----------------------------------------------------------------------------------------------------------
# `elflow schedules`: Figure 2


def schedule_statistics(n: int = 200_000, grids: int = 2000, steps: int = 32, seed: int = 0) -> dict:
    """Monte-Carlo statistics of the schedules, to compare with the values the method's description gives."""
    g = torch.Generator().manual_seed(seed)
    t = sample_time(n, g)
    p = sample_decode_level((n,), g)
    w = sample_guidance(n, g)
    top = torch.stack([time_grid(steps, generator=g)[-2] for _ in range(grids)])
    return {
        "t_median": t.median().item(),
        "t_below_2_3": (t < 2 / 3).float().mean().item(),
        "t_above_half": (t > 0.5).float().mean().item(),
        "p_median": p.median().item(),
        "p_below_half": (p < 0.5).float().mean().item(),
        "omega_median": w.median().item(),
        "omega_below_1": (w < 1).float().mean().item(),
        f"grid{steps}_top_mean": top.mean().item(),
        f"grid{steps}_top_p2.5": top.quantile(0.025).item(),
        f"grid{steps}_top_p97.5": top.quantile(0.975).item(),
    }


EXPECTED = {  # what the method's description says of these schedules
    "t_median": 0.18, "t_below_2_3": 0.997, "t_above_half": 0.03, "p_median": 0.69, "p_below_half": 0.16,
    "omega_median": 2.0, "omega_below_1": 0.21, "grid32_top_mean": 0.53,
}


def plot_schedules(path, n: int = 100_000, seed: int = 0, steps=(8, 32), overwrite: bool = True) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = torch.Generator().manual_seed(seed)
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    draws = [("training time t", sample_time(n, g), 0.18), ("decode level p", sample_decode_level((n,), g), 0.69),
             ("guidance omega", sample_guidance(n, g), 2.0)]
    for ax, (name, x, med) in zip(axes, draws):
        ax.hist(x.numpy(), bins=120, density=True, color="tab:blue", alpha=0.75)
        ax.axvline(x.median().item(), color="k", ls="--", lw=1, label=f"median {x.median().item():.2f}")
        ax.set_title(name)
        ax.legend()
    ax = axes[3]
    for row, k in enumerate(steps):
        for j in range(6):
            grid = time_grid(k, generator=g).numpy()
            y = row * 7 + j
            ax.plot(grid, [y] * len(grid), "|", ms=8, color=f"C{row}")
        ax.text(1.02, row * 7 + 2.5, f"N={k}", va="center")
    ax.plot(time_grid(32, "uniform").numpy(), [-2] * 33, "|", ms=8, color="gray")
    ax.text(1.02, -2, "uniform", va="center")
    ax.set_yticks([])
    ax.set_xlim(0, 1.15)
    ax.set_title("sampling grids (logit-normal)")
    fig.tight_layout()
    from elflow.utils import atomic_write

    with atomic_write(path, overwrite=overwrite) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("--out", default="schedules.png", help="where to write the PNG")
    p.add_argument("--samples", type=int, default=200_000, help="Monte-Carlo draws per distribution")
    p.add_argument("--seed", type=int, default=0, help="seed of the Monte-Carlo draws")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")


def run(args) -> int:
    from elflow.utils import ELFError, check_output

    if args.samples < 2:
        raise ELFError(f"--samples must be at least 2 (medians and shares need draws), got {args.samples}")
    check_output(args.out, args.overwrite)
    stats = schedule_statistics(n=args.samples, seed=args.seed)
    print(f"{'statistic':<22}{'measured':>10}{'expected':>11}")
    for k, v in stats.items():
        ref = EXPECTED.get(k)
        print(f"{k:<22}{v:>10.3f}{'' if ref is None else f'{ref:>11.3f}'}")
    plot_schedules(args.out, seed=args.seed, overwrite=args.overwrite)
    print(f"wrote {args.out}")
    return 0

"""Figure 2: the training distributions (times, decode levels, guidance scales) and the sampling grids, their
statistics against their closed forms and one figure."""

from __future__ import annotations

import torch

from elflow.flow import draw_decode_level, draw_guidance, draw_time, time_grid
from elflow.util.budget import FIGURE_BYTES, MAX_DRAWS, Estimate, check_count, check_fits, held, tensor
from elflow.util.files import atomic_write


# ----------------------------------------------------------------------------------------------------------
# `elflow schedules`: Figure 2
def check_schedules(n: int, grids: int = 2000, steps: int = 32) -> Estimate:
    """Refuse, before any draw, a number of draws past any real use or whose memory exceeds this machine's:
    the three kept draws of `n` values, the three that a draw and a statistic make on the way (measured: five
    live), the grids, and the figure."""
    n = check_count(n, "--samples", MAX_DRAWS, "200,000 draws give the statistics to three decimals", low=2)
    return check_fits(Estimate("the schedules' statistics", f"--samples {n}", {
        "draws": held(tensor(n), 6 * tensor(n)), "grids": tensor(grids, steps + 1) * 2, "figure": FIGURE_BYTES},
        "choose a smaller --samples"))


def schedule_statistics(n: int = 200_000, grids: int = 2000, steps: int = 32, seed: int = 0) -> dict:
    """Monte-Carlo statistics of the schedules, to compare with the values the method's description gives."""
    g = torch.Generator().manual_seed(seed)
    t = draw_time(n, g)
    p = draw_decode_level((n,), g)
    w = draw_guidance(n, g)
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


def schedules_figure(n: int = 100_000, seed: int = 0, steps=(8, 32)):
    """Figure 2 as a matplotlib figure: histograms of the training time t, the decode level p and the guidance
    omega, and draws of the sampling grids (logit-normal at each of `steps`, and the uniform one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = torch.Generator().manual_seed(seed)
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    draws = [("training time t", "t", draw_time(n, g)), ("decode level p", "p", draw_decode_level((n,), g)),
             ("guidance omega", "omega", draw_guidance(n, g))]
    for ax, (name, symbol, x) in zip(axes, draws):
        ax.hist(x.numpy(), bins=120, density=True, color="tab:blue", alpha=0.75)
        ax.axvline(x.median().item(), color="k", ls="--", lw=1, label=f"median {x.median().item():.2f}")
        ax.set_title(name)
        ax.set_xlabel(symbol)
        ax.set_ylabel("density")
        ax.legend()
    ax = axes[3]
    rows, names = [], []
    ax.plot(time_grid(32, "uniform").numpy(), [0] * 33, "|", ms=8, color="gray")
    rows.append(0)
    names.append("uniform, N=32")
    for row, k in enumerate(steps, 1):
        base = 2 + (row - 1) * 7  # six draws of the grid, one line each
        for j in range(6):
            grid = time_grid(k, generator=g).numpy()
            ax.plot(grid, [base + j] * len(grid), "|", ms=8, color=f"C{row - 1}")
        rows.append(base + 2.5)
        names.append(f"N={k} (6 draws)")
    ax.set_yticks(rows, names)  # the grids named on the axis, beside (not on) their points
    ax.tick_params(axis="y", length=0)
    ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel("sampling time t")
    ax.set_ylabel("grid")
    ax.set_title("sampling grids")
    fig.tight_layout()
    return fig


def plot_schedules(path, n: int = 100_000, seed: int = 0, steps=(8, 32), overwrite: bool = True) -> None:
    import matplotlib.pyplot as plt

    fig = schedules_figure(n, seed, steps)
    with atomic_write(path, overwrite=overwrite) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)

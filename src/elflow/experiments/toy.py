"""Figure 1: a 2-D Gaussian mixture with its exact denoiser, sampled by each sampler at several step counts; a
small trained teacher, its progressive distillation, and the network of its flow-map student (the comparison
itself is experiments.toy_distill's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from elflow.flow import NOISE_SCALE, T_EPS, Recipe, time_grid
from elflow.methods.pd import pd_target
from elflow.sampler import integrate
from elflow.util.files import atomic_write


@dataclass
class GaussianMixture:
    means: torch.Tensor  # (K, 2)
    std: float  # per-cluster standard deviation s
    noise_scale: float = NOISE_SCALE  # sigma, as in ELF

    def draw(self, n: int, generator=None) -> torch.Tensor:
        k = torch.randint(len(self.means), (n,), generator=generator)
        return self.means[k] + self.std * torch.randn(n, 2, generator=generator)

    @property
    def mean(self) -> torch.Tensor:
        return self.means.mean(0)

    def posterior_mean(self, z: torch.Tensor, t: torch.Tensor, x_prev=None) -> torch.Tensor:
        """Exact E[x | z_t]; z (B, 2) or (B, 1, 2) as the sampler passes it, t (B,). x_prev is ignored."""
        shape = z.shape
        z = z.reshape(-1, 2).double()
        t = t.reshape(-1, 1).double()
        mu = self.means.double()  # (K, 2)
        s2, sig2 = self.std ** 2, self.noise_scale ** 2
        v = t ** 2 * s2 + (1 - t) ** 2 * sig2  # (B, 1)
        diff = z[:, None, :] - t[:, :, None] * mu[None]  # (B, K, 2)
        logw = -0.5 * diff.pow(2).sum(-1) / v  # (B, K), equal mixture weights
        w = torch.softmax(logw, dim=-1)
        cond = mu[None] + (t[:, :, None] * s2 / v[:, :, None]) * diff  # (B, K, 2)
        return (w[..., None] * cond).sum(1).reshape(shape).to(torch.float32)

    def inside(self, x: torch.Tensor, radius: float | None = None) -> torch.Tensor:
        """(n,) bool: within `radius` (default 3 s) of some cluster centre."""
        radius = 3 * self.std if radius is None else radius
        return torch.cdist(x.reshape(-1, 2).double(), self.means.double()).min(-1).values <= radius


def ring_mixture(k: int = 8, radius: float = 1.9, std: float = 0.1) -> GaussianMixture:
    """K clusters on a ring: neighbours 2 R sin(pi / K) apart (1.45 for the defaults)."""
    a = torch.arange(k, dtype=torch.float32) * 2 * math.pi / k
    return GaussianMixture(torch.stack([radius * a.cos(), radius * a.sin()], -1), std)


def grid_mixture(k: int = 4, spacing: float = 1.5, std: float = 0.1) -> GaussianMixture:
    """A k x k grid of clusters centred on the origin (k even: no cluster sits on the data mean)."""
    c = (torch.arange(k, dtype=torch.float32) - (k - 1) / 2) * spacing
    gx, gy = torch.meshgrid(c, c, indexing="ij")
    return GaussianMixture(torch.stack([gx.flatten(), gy.flatten()], -1), std)


def run_toy(mixture: GaussianMixture, steps_list=(1, 2, 4, 8, 16), num: int = 44, seed: int = 0,
            sampler: str = "ode", gamma: float = 0.0, grid: str = "uniform", denoiser=None, map_net=None):
    """Sample with each step count from the same starting noise. Returns {N: dict(final, path, guesses, inside)}.
    `denoiser(z, t, omega, x_prev) -> x` defaults to the mixture's exact posterior mean; a flow map's network
    `map_net(z, s, t) -> x_hat` instead jumps from grid time to grid time (`sample_map`; the sampler and gamma
    do not apply to it)."""
    denoiser = denoiser or (lambda z_, t_, w_, x_prev: mixture.posterior_mean(z_, t_))
    g = torch.Generator().manual_seed(seed)
    z0 = mixture.noise_scale * torch.randn(num, 1, 2, generator=g)
    out = {}
    for n in steps_list:
        times = time_grid(n, grid, generator=torch.Generator().manual_seed(seed + 1))
        path, guesses = [z0[:, 0].clone()], []

        def record(i, t, z, x_pred, path=path, guesses=guesses):
            path.append(z[:, 0].clone())
            guesses.append(x_pred[:, 0].clone())

        if map_net is not None:
            z, _ = sample_map(map_net, z0.clone(), times, callback=record)
        else:
            z, _ = integrate(denoiser, z0.clone(), times,
                             sampler=sampler, gamma=gamma, recipe=Recipe(noise_scale=mixture.noise_scale),
                             generator=torch.Generator().manual_seed(seed + 2), callback=record)
        out[n] = {"final": z[:, 0], "path": torch.stack(path), "guesses": torch.stack(guesses),
                  "inside": int(mixture.inside(z[:, 0]).sum())}
    return out


@torch.no_grad()
def sample_map(map_net, z0: torch.Tensor, grid: torch.Tensor, callback=None):
    """(z_final, the last x_hat) of the flow map `map_net(z, s, t) -> x_hat` from z0 (B, 1, 2) over the time grid:
    sampler.integrate's "map" step, one jump z_{k+1} = X(z_k, t_k, t_{k+1}) per interval (the slot and omega unused)."""
    return integrate(lambda z, t, omega, x_prev, target: map_net(z, t, target), z0, grid, sampler="map",
                     callback=callback)


# ----------------------------------------------------------------------------------------------------------
# a trained teacher and its progressively distilled students
class ToyNet(torch.nn.Module):
    """An x-predictor for 2-D points: (z (B, 1, 2), t (B,)) -> x (B, 1, 2), an MLP on z and Fourier features
    of t. Called as the samplers and `distill.pd_target` call a network: net(z, t, omega, x_prev), the last
    two ignored. With `target_time` it is a flow map's network: the features of a target time t_target (B,)
    join the input (net(z, s, t_target=t); t_target None means t_target = t, the plain denoiser)."""

    def __init__(self, width: int = 256, depth: int = 3, freqs: int = 8, target_time: bool = False):
        super().__init__()
        self.width, self.depth, self.freqs, self.target_time = width, depth, freqs, target_time
        self.register_buffer("k", torch.arange(1, freqs + 1, dtype=torch.float32) * math.pi, persistent=False)
        layers, size = [], 2 + (1 + 2 * freqs) * (2 if target_time else 1)
        for _ in range(depth):
            layers += [torch.nn.Linear(size, width), torch.nn.SiLU()]
            size = width
        self.mlp = torch.nn.Sequential(*layers, torch.nn.Linear(size, 2))

    def _time_features(self, t, like):
        t = t.reshape(-1, 1).to(like.dtype)
        return [t, torch.sin(t * self.k), torch.cos(t * self.k)]

    def forward(self, z, t, omega=None, x_prev=None, t_target=None):
        feats = [z.reshape(-1, 2), *self._time_features(t, z)]
        if self.target_time:
            feats += self._time_features(t if t_target is None else t_target, z)
        return self.mlp(torch.cat(feats, dim=-1)).reshape(z.shape)


def flow_map_student(teacher: ToyNet) -> ToyNet:
    """A ToyNet with the target-time input that starts equal to `teacher` at every target time: the teacher's
    weights, zeros on the new input's columns. As a map (flowmap.flow_map) it starts as the teacher's Euler
    step from s to t."""
    student = ToyNet(teacher.width, teacher.depth, teacher.freqs, target_time=True)
    state = {k: v.clone() for k, v in teacher.state_dict().items()}
    first = state["mlp.0.weight"]
    state["mlp.0.weight"] = torch.cat([first, torch.zeros(first.shape[0], 1 + 2 * teacher.freqs)], dim=1)
    student.load_state_dict(state)
    return student


def _fit(net, loss_fn, steps: int, lr: float, seed: int) -> list[float]:
    """Adam with a cosine decay; returns the loss every 10% of the way."""
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(seed)
    trace = []
    for i in range(steps):
        loss = loss_fn(g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (i + 1) % max(steps // 10, 1) == 0:
            trace.append(loss.item())
    return trace


def train_toy_teacher(mixture: GaussianMixture, steps: int = 3000, batch: int = 1024, lr: float = 2e-3,
                      seed: int = 0, t_eps: float = T_EPS) -> ToyNet:
    """An x-predictor trained by flow matching on the mixture (uniform t, the v-space loss of ELF)."""
    torch.manual_seed(seed)
    net = ToyNet()

    def loss_fn(g):
        x = mixture.draw(batch, g)[:, None]
        t = torch.rand(batch, generator=g)
        tt = t[:, None, None]
        z = tt * x + (1 - tt) * mixture.noise_scale * torch.randn(x.shape, generator=g)
        return (((net(z, t) - x) / (1 - tt).clamp_min(t_eps)) ** 2).mean()

    _fit(net, loss_fn, steps, lr, seed)
    return net.eval().requires_grad_(False)


def distill_toy(teacher: ToyNet, mixture: GaussianMixture, student_steps=(4, 2, 1), teacher_steps: int = 16,
                steps: int = 1500, batch: int = 1024, lr: float = 1e-3, seed: int = 0) -> dict[int, ToyNet]:
    """Progressive distillation of the toy teacher, as `elflow distill` runs it: round 1's student copies the
    teacher, each later round starts from the previous student; the frozen teacher's `teacher_steps`-step
    Euler path over [t_s, t_s + 1/N] gives the x-space target (`distill.pd_target`)."""
    import copy

    students, current = {}, teacher
    for n in student_steps:
        s = 1.0 / n
        student = copy.deepcopy(current).train().requires_grad_(True)

        def loss_fn(g, student=student, s=s, n=n):
            x = mixture.draw(batch, g)[:, None]
            t_s = torch.rand(batch, generator=g) * (1 - s)
            tt = t_s[:, None, None]
            z = tt * x + (1 - tt) * mixture.noise_scale * torch.randn(x.shape, generator=g)
            with torch.no_grad():
                target = pd_target(teacher, z, t_s, t_s + s, torch.ones(batch), torch.zeros_like(z), x,
                                   torch.zeros(batch, 1, dtype=torch.bool), teacher_steps // n)
            return ((student(z, t_s) - target) ** 2).mean()

        _fit(student, loss_fn, steps, lr, seed + n)
        current = students[n] = student.eval().requires_grad_(False)
    return students


def toy_figure(mixture: GaussianMixture, results, title: str | None = None):
    """One panel per step count (or model): the data, each sample's path z_t, the guesses along it and where
    it ends; a legend in a row of its own below the panels names each kind of mark. `results` is one row of
    panels ({name or N: run_toy's result}) or a list of such rows, drawn one above the other. A result with
    an "energy" entry shows its energy distance to the mixture in the panel's title. Returns the figure."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    rows_of = [results] if isinstance(results, dict) else list(results)
    cols = max(len(r) for r in rows_of)
    width = 3.3 * cols
    ncol = max(1, min(5, int(width / 2.6)))  # as many of the five names to a row as fit
    key_rows = -(-5 // ncol)
    energy = any("energy" in r for row in rows_of for r in row.values())
    fig = plt.figure(figsize=(width, (3.6 + 0.3 * energy) * len(rows_of) + 0.3 + 0.28 * key_rows
                              + 0.25 * bool(title)), layout="constrained")
    grid = fig.add_gridspec(len(rows_of) + 1, cols, height_ratios=(*[3.6 + 0.3 * energy] * len(rows_of),
                                                                     0.28 * key_rows))
    axes = []
    data = mixture.draw(600, torch.Generator().manual_seed(123))
    for i, row in enumerate(rows_of):
        for j, (n, r) in enumerate(row.items()):
            ax = fig.add_subplot(grid[i, j], **({"sharex": axes[0], "sharey": axes[0]} if axes else {}))
            axes.append(ax)
            ax.scatter(data[:, 0], data[:, 1], s=2, c="lightgray", label="data (the mixture)")
            ax.add_collection(LineCollection(r["path"].transpose(0, 1).numpy(), lw=0.5, colors="tab:blue",
                                             alpha=0.4, label="path of z from noise"))
            g = r["guesses"].reshape(-1, 2)
            ax.scatter(g[:, 0], g[:, 1], s=6, c="tab:orange", alpha=0.5, label="guesses of x at each step")
            ax.scatter(r["final"][:, 0], r["final"][:, 1], s=10, c="tab:red", label="samples (where z ends)")
            ax.plot(*mixture.mean.tolist(), "k+", ms=12, mew=2, label="data mean")
            name = n if isinstance(n, str) else f"N = {n} step" + "s" * (n != 1)
            text = f"{name}: {r['inside']}/{len(r['final'])} inside"
            ax.set_title(text + (f"\nenergy distance {r['energy']:.4f}" if "energy" in r else ""), fontsize=11)
            ax.set_aspect("equal")
            ax.set_xlim(-3.2, 3.2)
            ax.set_ylim(-3.2, 3.2)
            ax.set_xticks(range(-3, 4))
            ax.set_yticks(range(-3, 4))
            ax.tick_params(labelsize=10, labelleft=j == 0)
            ax.set_xlabel("$x_1$", fontsize=11)
            if j == 0:
                ax.set_ylabel("$x_2$", fontsize=11)
    key = fig.add_subplot(grid[-1, :])
    key.axis("off")
    handles, labels = axes[-1].get_legend_handles_labels()
    legend = key.legend(handles, labels, loc="center", ncol=ncol, fontsize=10, frameon=False)
    for h, label in zip(legend.legend_handles, labels):  # full-size, full-strength marks, however faint in panels
        h.set_alpha(1)
        if label.startswith("path"):
            h.set_linewidth(2)
        elif hasattr(h, "set_sizes"):
            h.set_sizes([30])
    if title:
        fig.suptitle(textwrap.fill(title, max(30, int(width * 11))), fontsize=12)
    return fig


def plot_toy(mixture: GaussianMixture, results, path, title: str | None = None,
             overwrite: bool = True) -> None:
    """`toy_figure` written to a PNG (atomically; an existing file only with `overwrite`)."""
    import matplotlib.pyplot as plt

    fig = toy_figure(mixture, results, title)
    with atomic_write(path, overwrite=overwrite) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)

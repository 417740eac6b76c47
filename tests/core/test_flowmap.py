"""The flow-map objective against exact flow maps: a Gaussian's in closed form (any shape), the 2-D mixture's
by a fine RK4 integration of its exact velocity. The time derivative against finite differences and the closed
form, the LMD residual of the exact map (zero) and of perturbed maps (their predicted values), the identity at
t = s, the sampler's exact transport, the time-pair draw."""

import math

import pytest
import torch

from elflow.experiments.toy import ring_mixture
from elflow.flow import T_EPS, euler_step, per_row
from elflow.flowmap import draw_time_pairs, flow_map, lmd_loss, lmd_residual, map_and_time_derivative
from elflow.sampler import integrate
from elflow.util.errors import ELFError


def teacher_velocity(teacher, z, t, t_eps: float = T_EPS):
    """v_T(z, t) = (x_T(z, t) - z) / max(1 - t, t_eps): the teacher's velocity as its sampler reads it, written
    out here as the target lmd_residual must match."""
    return (teacher(z, t) - z) / (1 - per_row(t, z)).clamp_min(t_eps)


def diagonal_residual(net, teacher, z, s, t_eps: float = T_EPS):
    """u(z, s, s) - v_T(z, s) = (x_hat(z, s, s) - x_T(z, s)) / max(1 - s, t_eps) in one plain forward pass: a
    second form of lmd_residual at t = s, which takes it through the jvp."""
    with torch.no_grad():
        x_t = teacher(z, s)
    return (net(z, s, s) - x_t.to(z.dtype)) / (1 - per_row(s, z)).clamp_min(t_eps)


SIGMA = 2.0  # the path's noise scale


class Gaussian:
    """x ~ N(m, sd^2) per dimension on the path z_t = t x + (1 - t) eps, eps ~ N(0, SIGMA^2): z_t ~ N(t m, a_t^2),
    a_t^2 = t^2 sd^2 + (1 - t)^2 SIGMA^2. The probability-flow ODE is linear in z, so its map is the monotone
    affine map between the marginals, X(z, s, t) = t m + (a_t / a_s)(z - s m)."""

    def __init__(self, m: float = 0.7, sd: float = 0.5):
        self.m, self.sd = m, sd

    def a(self, t):
        return (t ** 2 * self.sd ** 2 + (1 - t) ** 2 * SIGMA ** 2).sqrt()

    def da(self, t):  # d a_t / dt
        return (t * self.sd ** 2 - (1 - t) * SIGMA ** 2) / self.a(t)

    @staticmethod
    def rows(v, z):
        return v.reshape(-1, *([1] * (z.ndim - 1)))

    def exact_map(self, z, s, t):
        s_, t_ = self.rows(s, z), self.rows(t, z)
        return t_ * self.m + self.a(t_) / self.a(s_) * (z - s_ * self.m)

    def exact_dmap(self, z, s, t):  # d/dt of exact_map
        s_, t_ = self.rows(s, z), self.rows(t, z)
        return self.m + self.da(t_) / self.a(s_) * (z - s_ * self.m)

    def teacher(self, z, t):  # E[x | z_t]
        t_ = self.rows(t, z)
        return self.m + t_ * self.sd ** 2 / self.a(t_) ** 2 * (z - t_ * self.m)

    def net(self, z, s, t):
        """The x output whose map (flowmap.flow_map, 1 - s >= t_eps) is the exact one: x = z + (1 - s)(m +
        D (z - s m) / a_s) with D = (a_t - a_s) / (t - s) written without the division (finite at t = s)."""
        s_, t_ = self.rows(s, z), self.rows(t, z)
        d = (self.sd ** 2 * (t_ + s_) - SIGMA ** 2 * (2 - t_ - s_)) / (self.a(t_) + self.a(s_))
        return z + (1 - s_) * (self.m + d * (z - s_ * self.m) / self.a(s_))


def _draw(shape, seed=0, s_max=0.9):
    g = torch.Generator().manual_seed(seed)
    z = SIGMA * torch.randn(shape, generator=g, dtype=torch.float64)
    s = torch.rand(shape[0], generator=g, dtype=torch.float64) * s_max
    t = s + (1 - s) * torch.rand(shape[0], generator=g, dtype=torch.float64)
    return z, s, t


SHAPES = [(64, 2), (8, 5, 3)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_network_form_of_the_gaussian_map_is_its_closed_form(shape):
    gauss = Gaussian()
    z, s, t = _draw(shape)
    assert torch.allclose(flow_map(gauss.net, z, s, t), gauss.exact_map(z, s, t), atol=1e-12)
    # the closed form is a flow: it moves the marginal N(s m, a_s^2) to N(t m, a_t^2), mean and spread
    g = torch.Generator().manual_seed(1)
    x = gauss.m + gauss.sd * torch.randn(200_000, generator=g, dtype=torch.float64)
    s0, t0 = torch.full((200_000,), 0.3, dtype=torch.float64), torch.full((200_000,), 0.8, dtype=torch.float64)
    z_s = 0.3 * x + 0.7 * SIGMA * torch.randn(200_000, generator=g, dtype=torch.float64)
    moved = flow_map(gauss.net, z_s[:, None], s0, t0)[:, 0]
    assert moved.mean().item() == pytest.approx(0.8 * gauss.m, abs=0.01)
    assert moved.std().item() == pytest.approx(gauss.a(torch.tensor(0.8)).item(), rel=0.01)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_jvp_time_derivative_equals_finite_differences_and_the_closed_form(shape):
    gauss = Gaussian()
    z, s, t = _draw(shape)
    X, dX = map_and_time_derivative(gauss.net, z, s, t)
    h = 1e-5
    central = (flow_map(gauss.net, z, s, t + h) - flow_map(gauss.net, z, s, t - h)) / (2 * h)
    assert torch.allclose(X, gauss.exact_map(z, s, t), atol=1e-12)
    assert torch.allclose(dX, central, atol=1e-8)
    assert torch.allclose(dX, gauss.exact_dmap(z, s, t), atol=1e-12)
    assert dX.abs().max() > 0.1  # not trivially zero


@pytest.mark.parametrize("shape", SHAPES)
def test_the_lmd_residual_of_the_exact_map_is_zero_and_a_perturbed_maps_is_what_it_predicts(shape):
    gauss = Gaussian()
    z, s, t = _draw(shape, s_max=0.9)
    t = torch.cat([t[:-2], torch.tensor([0.97, 1.0], dtype=torch.float64)])  # also past 1 - t_eps, and t = 1
    r = lmd_residual(gauss.net, gauss.teacher, z, s, t)
    assert r.shape == z.shape and r.abs().max() < 1e-10

    # x + c (t - s): X moves by delta = (t - s)^2 c / (1 - s), dX/dt by 2 (t - s) c / (1 - s); the teacher is
    # linear, x_T(X + delta) - (X + delta) = x_T(X) - X + (k_t - 1) delta with k_t = t sd^2 / a_t^2, so
    # r = (2 (t - s) c / (1 - s) (1 - t) - (k_t - 1) delta) / max(1 - t, t_eps)
    c = 0.3
    s_, t_ = Gaussian.rows(s, z), Gaussian.rows(t, z)
    perturbed = lmd_residual(lambda z_, a, b: gauss.net(z_, a, b) + c * Gaussian.rows(b - a, z_), gauss.teacher,
                             z, s, t)
    delta = (t_ - s_) ** 2 * c / (1 - s_)
    k = t_ * gauss.sd ** 2 / gauss.a(t_) ** 2
    expected = (2 * (t_ - s_) * c / (1 - s_) * (1 - t_) - (k - 1) * delta) / (1 - t_).clamp_min(0.05)
    assert torch.allclose(perturbed, expected.expand_as(z), atol=1e-10)
    assert perturbed.abs().max() > 0.1

    # below 1 - t_eps it is the velocity residual dX/dt - v_T(X, t) exactly
    below = t < 0.95
    X, dX = map_and_time_derivative(gauss.net, z, s, t)
    dX = dX + 2 * (t_ - s_) * c / (1 - s_)
    v = teacher_velocity(gauss.teacher, X + delta, t)
    assert torch.allclose(perturbed[below], (dX - v)[below], atol=1e-10)


def test_lmd_loss_is_the_mean_square_residual_and_zero_for_the_exact_map():
    gauss = Gaussian()
    z, s, t = _draw((32, 4, 2))
    assert lmd_loss(gauss.net, gauss.teacher, z, s, t).item() < 1e-20

    def net(z_, a, b):
        return gauss.net(z_, a, b) + 0.2 * Gaussian.rows(b - a, z_) * z_

    r = lmd_residual(net, gauss.teacher, z, s, t)
    assert lmd_loss(net, gauss.teacher, z, s, t).item() == pytest.approx(r.pow(2).mean().item(), rel=1e-12)
    w = torch.zeros(32, dtype=torch.float64)
    w[3] = 2.0
    assert lmd_loss(net, gauss.teacher, z, s, t, weight=w).item() == pytest.approx(r[3].pow(2).mean().item(),
                                                                                   rel=1e-12)


def test_the_map_is_the_identity_at_t_equals_s_and_its_slope_there_is_the_networks_velocity():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).double()

    def net(z, s, t):  # any network: z (B, L, 3)
        B, L, _ = z.shape
        return mlp(torch.cat([z, s[:, None, None].expand(B, L, 1), t[:, None, None].expand(B, L, 1)], -1))

    z, s, _ = _draw((6, 4, 3))
    assert torch.equal(flow_map(net, z, s, s), z)
    X, dX = map_and_time_derivative(net, z, s, s)
    assert torch.equal(X, z)
    assert torch.allclose(dX, (net(z, s, s) - z) / Gaussian.rows(1 - s, z), atol=1e-12)

    # the diagonal term is the LMD residual at t = s, and zero for the exact map
    teacher = Gaussian().teacher
    assert torch.allclose(diagonal_residual(net, teacher, z, s), lmd_residual(net, teacher, z, s, s), atol=1e-12)
    gauss = Gaussian()
    assert diagonal_residual(gauss.net, gauss.teacher, z, s).abs().max() < 1e-12
    assert diagonal_residual(net, teacher, z, s).abs().max() > 0.1


def test_the_residuals_gradient_flows_through_the_time_derivative_only():
    """d/dtheta of the LMD loss equals that of ||dX/dt - const||^2 with the teacher's target held fixed."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()

    def net(z, s, t):
        return mlp(torch.cat([z, s[:, None], t[:, None]], -1))

    teacher = Gaussian().teacher
    z, s, t = _draw((16, 2), s_max=0.5)
    t = torch.minimum(t, torch.full_like(t, 0.9))
    lmd_loss(net, teacher, z, s, t).backward()
    got = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    X, dX = map_and_time_derivative(net, z, s, t)
    target = teacher_velocity(teacher, X.detach(), t).detach()
    (dX - target).pow(2).mean().backward()
    assert all(torch.allclose(a, p.grad, atol=1e-12) for a, p in zip(got, mlp.parameters()))
    assert max(a.abs().max() for a in got) > 1e-3


def _posterior_mean64(mix):
    """The mixture's posterior mean E[x | z_t] in float64 throughout (the toy's returns float32)."""
    means = mix.means.double()

    def pm(z, t):
        t2 = t.reshape(-1, 1)
        v = t2 ** 2 * mix.std ** 2 + (1 - t2) ** 2 * mix.noise_scale ** 2
        diff = z[:, None, :] - t2[:, :, None] * means[None]
        w = torch.softmax(-0.5 * diff.pow(2).sum(-1) / v, dim=-1)
        return (w[..., None] * (means[None] + (t2[:, :, None] * mix.std ** 2 / v[:, :, None]) * diff)).sum(1)

    return pm


def _mixture_map(pm, steps=64):
    """The mixture's exact map by RK4 on its exact velocity (float64), given as a network's x output: the
    straight line from z through X(z, s, t) reaches it at t = 1 (t > s only)."""

    def velocity(z, t):
        return (pm(z, t) - z) / (1 - t)[:, None]

    def rk4(z, s, t):
        h = ((t - s) / steps)[:, None]
        for i in range(steps):
            tau = s + i * h[:, 0]
            k1 = velocity(z, tau)
            k2 = velocity(z + h / 2 * k1, tau + h[:, 0] / 2)
            k3 = velocity(z + h / 2 * k2, tau + h[:, 0] / 2)
            k4 = velocity(z + h * k3, tau + h[:, 0])
            z = z + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return z

    def net(z, s, t):
        return z + ((1 - s) / (t - s))[:, None] * (rk4(z, s, t) - z)

    return net, velocity


def test_on_the_mixture_the_rk4_maps_jvp_is_its_finite_difference_and_its_residual_vanishes():
    mix = ring_mixture(k=4, radius=1.0, std=0.4)  # wide clusters: the velocity stays smooth up to t = 0.9
    pm = _posterior_mean64(mix)
    assert torch.allclose(pm(torch.ones(3, 2, dtype=torch.float64), torch.full((3,), 0.5, dtype=torch.float64)),
                          mix.posterior_mean(torch.ones(3, 2), torch.full((3,), 0.5)).double(), atol=1e-6)
    net, velocity = _mixture_map(pm)
    g = torch.Generator().manual_seed(0)
    z = SIGMA * torch.randn(32, 2, generator=g, dtype=torch.float64)
    s = 0.4 * torch.rand(32, generator=g, dtype=torch.float64)
    t = s + 0.15 + (0.9 - s - 0.15) * torch.rand(32, generator=g, dtype=torch.float64)
    X, dX = map_and_time_derivative(net, z, s, t)
    h = 1e-5
    central = (flow_map(net, z, s, t + h) - flow_map(net, z, s, t - h)) / (2 * h)
    assert torch.allclose(dX, central, atol=1e-6)
    # against the exact velocity at the map's end point the residual is RK4's error, far below a wrong map's
    r = lmd_residual(net, pm, z, s, t)
    assert r.abs().max() < 1e-5
    assert torch.allclose(dX, velocity(X, t), atol=1e-5)
    wrong = lmd_residual(lambda z_, a, b: net(z_, a, b) + 0.1, pm, z, s, t)
    assert wrong.abs().max() > 0.05
    # the exact denoiser's Euler step (a map whose x ignores t) is no flow map: its residual is far from zero
    euler = lmd_residual(lambda z_, a, b: pm(z_, a), pm, z, s, t)
    assert euler.abs().max() > 0.1


@pytest.mark.parametrize("steps", [1, 2, 4, 7])
def test_sampling_with_the_exact_map_is_exact_at_every_step_count(steps):
    """The exact map composes (X(X(z, 0, a), a, 1) = X(z, 0, 1)), so any grid ends at m + (sd / SIGMA) z0: the
    monotone transport of N(0, SIGMA^2) onto N(m, sd^2)."""
    gauss = Gaussian()
    g = torch.Generator().manual_seed(steps)
    z0 = SIGMA * torch.randn(16, 3, 2, generator=g, dtype=torch.float64)
    inner = torch.rand(steps - 1, generator=g, dtype=torch.float64).sort().values
    grid = torch.cat([torch.zeros(1, dtype=torch.float64), inner, torch.ones(1, dtype=torch.float64)])
    seen = []
    z, x = integrate(lambda z_, t_, w_, slot, target: gauss.net(z_, t_, target), z0, grid.float(), sampler="map",
                     callback=lambda k, t, z_, x_: seen.append(k))
    assert torch.allclose(z, gauss.m + gauss.sd / SIGMA * z0, atol=1e-5)
    assert torch.allclose(x, z) and seen == list(range(steps))


def test_sampling_a_flow_map_refuses_a_grid_of_one_time():
    with pytest.raises(ELFError, match="at least two finite times"):
        integrate(lambda z_, t_, w_, slot, target: Gaussian().net(z_, t_, target), torch.zeros(2, 1, 2),
                  torch.zeros(1), sampler="map")


def test_the_time_pairs_follow_their_documented_distribution():
    n = 200_000
    s, t = draw_time_pairs(n, torch.Generator().manual_seed(0), diagonal=0.25)
    assert s.shape == t.shape == (n,) and (s >= 0).all() and (t <= 1).all() and (s <= t).all()
    diag = s == t
    assert diag.float().mean().item() == pytest.approx(0.25, abs=4 * math.sqrt(0.25 * 0.75 / n))
    gap = (t - s)[~diag]
    # sorted pair of two uniforms: the gap has density 2 (1 - d), mean 1/3, P(gap > 1/2) = 1/4; s has mean 1/3
    assert gap.mean().item() == pytest.approx(1 / 3, abs=0.003)
    assert (gap > 0.5).float().mean().item() == pytest.approx(0.25, abs=0.004)
    assert s[~diag].mean().item() == pytest.approx(1 / 3, abs=0.003)
    assert s[diag].mean().item() == pytest.approx(0.5, abs=0.005)
    s, t = draw_time_pairs(1000, torch.Generator().manual_seed(0), diagonal=0.0)
    assert (s < t).all()
    with pytest.raises(ValueError, match="diagonal must lie in"):
        draw_time_pairs(4, diagonal=1.5)


def test_the_maps_jump_clips_the_divisor_and_lands_on_x_at_t_1():
    z, x = torch.tensor([[1.0, -1.0]]), torch.tensor([[3.0, 0.5]])
    assert torch.allclose(euler_step(z, torch.tensor([0.2]), torch.tensor([1.0]), x), x)
    # 1 - s = 0.02 < t_eps = 0.05: the step moves (t - s) / 0.05 of the way
    out = euler_step(z, torch.tensor([0.98]), torch.tensor([0.99]), x)
    assert torch.allclose(out, z + 0.2 * (x - z), atol=1e-6)

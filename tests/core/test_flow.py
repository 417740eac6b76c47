"""The training objective and the samplers against independent expectations."""

import math

import pytest
import torch
import torch.nn.functional as F

from elflow.flow import Recipe, draw_training_noise, elf_loss, euler_step, time_grid
from elflow.methods.elf import step_sums as step_metrics
from elflow.model import ELF, get_config
from elflow.sampler import generate_tokens, integrate


def tiny_net(seed=0):
    torch.manual_seed(seed)
    net = ELF(get_config("tiny"))
    torch.nn.init.normal_(net.x_head.weight, std=0.3)  # a non-trivial x head (it starts at zero)
    return net


def listing_loss(net, x, tokens, d, r: Recipe):
    """The reference listing, row by row in spirit: x0 pass for every denoise row, a separate stop-gradient
    [z, x0] pass for the guided target, then the trained pass; decode rows through a decode-mode call."""
    B = x.shape[0]
    total = 0.0
    for i in range(B):
        xi, ei, ti, wi = x[i:i + 1], d.eps[i:i + 1], d.t[i:i + 1], d.omega[i:i + 1]
        if d.decode[i]:
            zt = d.p[i:i + 1] * xi + (1 - d.p[i:i + 1]) * r.decode_noise_scale * ei
            logits = net.decode(zt, wi)
            total = total + F.cross_entropy(logits[0], tokens[i])
            continue
        t = ti[:, None, None]
        z = t * xi + (1 - t) * r.noise_scale * ei
        clip = (1 - t).clamp_min(r.t_eps)
        v = (xi - z) / clip
        with torch.no_grad():
            x0 = net(z, ti, wi, x_prev=torch.zeros_like(z))
        if d.self_cond[i]:
            with torch.no_grad():
                xs = net(z, ti, wi, x_prev=x0)
            v_c, v_u = (xs - z) / clip, (x0 - z) / clip
            target = v + (1 - 1 / wi[:, None, None]) * (v_c - v_u)
            x_pred = net(z, ti, wi, x_prev=x0)
        else:
            target = v
            x_pred = net(z, ti, wi, x_prev=torch.zeros_like(z))
        total = total + (((x_pred - z) / clip - target) ** 2).mean()
    return total / B


def test_pass_reuse_equals_the_three_pass_listing_in_loss_and_gradient():
    r = Recipe()
    net = tiny_net()
    B, L = 16, 12
    x = torch.randn(B, L, 32)
    tokens = torch.randint(0, 100, (B, L))
    d = draw_training_noise((B, L, 32), r, generator=torch.Generator().manual_seed(3),
                            cpu_generator=torch.Generator().manual_seed(4))
    assert d.decode.any() and d.self_cond.any() and (~d.self_cond & ~d.decode).any()  # all three kinds of row

    loss, rows = elf_loss(net, x, tokens, d, r)
    metrics = step_metrics(loss, rows, d)
    grads = torch.autograd.grad(loss, list(net.parameters()), allow_unused=True)
    ref = listing_loss(net, x, tokens, d, r)
    ref_grads = torch.autograd.grad(ref, list(net.parameters()), allow_unused=True)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for (name, _), g, h in zip(net.named_parameters(), grads, ref_grads):
        if h is None:
            assert g is None or g.abs().max() == 0, name
        else:
            assert torch.allclose(g, h, rtol=1e-4, atol=1e-6), name
    n_dec = int(d.decode.sum())
    assert metrics["decode_rows"].item() == n_dec and metrics["denoise_rows"].item() == B - n_dec
    assert metrics["bin_n"].sum().item() == B - n_dec


def test_clean_decode_tokens_change_only_the_decode_levels_they_pick():
    """decode_clean_prob q sets about a share q of the levels to exactly 1 (the sigmoid draw never gives 1);
    every other draw of the batch, and every level not picked, equals the released recipe's draw."""
    shape = (64, 32, 8)
    gens = lambda: dict(generator=torch.Generator().manual_seed(7), cpu_generator=torch.Generator().manual_seed(8))
    base = draw_training_noise(shape, Recipe(), **gens())
    d = draw_training_noise(shape, Recipe(decode_clean_prob=0.25), **gens())
    assert not (base.p == 1).any()
    clean = d.p == 1
    n = clean.numel()
    assert abs(clean.float().mean().item() - 0.25) < 4 * math.sqrt(0.25 * 0.75 / n)  # 4 binomial sigmas
    assert torch.equal(d.p[~clean], base.p[~clean])
    for name in ("t", "omega", "eps", "decode", "self_cond", "drop_source"):
        assert torch.equal(getattr(d, name), getattr(base, name)), name
    # a clean decode row is read from x itself: the loss equals the listing's with p = 1 there
    r = Recipe(decode_clean_prob=0.5)
    net = tiny_net(2)
    x = torch.randn(16, 12, 32)
    tokens = torch.randint(0, 100, (16, 12))
    d = draw_training_noise((16, 12, 32), r, generator=torch.Generator().manual_seed(3),
                            cpu_generator=torch.Generator().manual_seed(4))
    assert (d.p[d.decode] == 1).any()
    loss, _ = elf_loss(net, x, tokens, d, r)
    assert loss.item() == pytest.approx(listing_loss(net, x, tokens, d, r).item(), rel=1e-5)


def test_guidance_target_vanishes_at_omega_one_and_without_self_conditioning():
    """At omega = 1 the correction (1 - 1/omega) is zero, so the loss equals the plain-target loss."""
    r = Recipe(decode_prob=0.0, self_cond_prob=1.0)
    net = tiny_net(1)
    x = torch.randn(4, 8, 32)
    d = draw_training_noise((4, 8, 32), r, generator=torch.Generator().manual_seed(0),
                            cpu_generator=torch.Generator().manual_seed(0))
    d.omega = torch.ones(4)
    loss, _ = elf_loss(net, x, torch.zeros(4, 8, dtype=torch.long), d, r)
    t = d.t[:, None, None]
    z = t * x + (1 - t) * 2 * d.eps
    with torch.no_grad():
        x0 = net(z, d.t, d.omega)
        x_pred = net(z, d.t, d.omega, x_prev=x0)
    plain = ((x_pred - x) ** 2 / ((1 - t).clamp_min(0.05) ** 2)).mean()
    assert loss.item() == pytest.approx(plain.item(), rel=1e-5)


class PointwiseNet(torch.nn.Module):
    """A stand-in x-predictor with no attention, so each position's loss can be computed by hand."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.config = get_config("tiny")

    def forward(self, z, t, omega, x_prev=None):
        return self.lin(z)

    def mixed(self, z, t, omega, x_prev, gate, logits_rows):
        return self.lin(z), torch.zeros(len(logits_rows), z.shape[1], 100)


def test_mask_and_source_positions_are_not_scored():
    r = Recipe(decode_prob=0.0, self_cond_prob=0.0)
    torch.manual_seed(0)
    net = PointwiseNet()
    x = torch.randn(2, 10, 32)
    d = draw_training_noise((2, 10, 32), r, generator=torch.Generator().manual_seed(5),
                            cpu_generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 7:] = False
    tokens = torch.zeros(2, 10, dtype=torch.long)
    t = d.t[:, None, None]
    z = t * x + (1 - t) * 2 * d.eps
    with torch.no_grad():
        err = ((net(z, d.t, d.omega) - x) ** 2 / (1 - t).clamp_min(0.05) ** 2).mean(-1)  # (B, L)
    loss, _ = elf_loss(net, x, tokens, d, r, valid=mask)
    expected = (err[0, :7].sum() + err[1].sum()) / 17  # one token mean: row 0 weighs its 7 scored positions
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)

    # a source prefix: clean (z = x there), never scored; the targets keep their own noise
    known = torch.zeros(2, 10, dtype=torch.bool)
    known[:, :4] = True
    loss_src, _ = elf_loss(net, x, tokens, d, r, known=known)
    assert loss_src.item() == pytest.approx(err[:, 4:].mean().item(), rel=1e-5)
    # variable-length sources, as pair_layout makes them: whatever the source holds, the loss is the same
    known[1, 4:7] = True
    x2 = torch.where(known[..., None], torch.randn_like(x) * 5, x)
    a, _ = elf_loss(net, x, tokens, d, r, known=known)
    b, _ = elf_loss(net, x2, tokens, d, r, known=known)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert a.item() == pytest.approx(((err[0, 4:].sum() + err[1, 7:].sum()) / 9).item(), rel=1e-5)


class ContextReader(PointwiseNet):
    """A stand-in that sees its whole row through one term, x_pred = lin(z_j) + ctx(mean_j z_j) (so a
    dropped source changes every guess), with a pointwise decode head: logits = head(z_j)."""

    def __init__(self):
        super().__init__()
        self.ctx = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 100)

    def guess(self, z):
        return self.lin(z) + self.ctx(z.mean(-2, keepdim=True))

    def forward(self, z, t, omega, x_prev=None):
        return self.guess(z)

    def mixed(self, z, t, omega, x_prev, gate, logits_rows):
        return self.guess(z), self.head(z[logits_rows])


def test_the_loss_is_one_token_mean_over_both_branches_computed_by_hand():
    """Two denoise rows (sources of 2 and 4 tokens, the second dropped) and one decode row (source of 3):
    loss = (sum of the denoise rows' per-token v-MSE + sum of the decode row's per-token CE) over their
    non-source positions / the number of those positions (6 + 4 + 5), position by position."""
    from elflow.flow import Draw, row_index

    torch.manual_seed(0)
    net, r = ContextReader(), Recipe()
    L, C = 8, 32
    x, eps = torch.randn(3, L, C), torch.randn(3, L, C)
    tokens = torch.randint(0, 100, (3, L))
    src = [2, 4, 3]
    known = torch.arange(L)[None, :] < torch.tensor(src)[:, None]
    decode, self_cond = torch.tensor([False, False, True]), torch.zeros(3, dtype=torch.bool)
    d = Draw(t=torch.tensor([0.3, 0.7, 1.0]), omega=torch.tensor([1.0, 2.0, 1.0]), eps=eps,
             p=torch.rand(3, L, 1), decode=decode, self_cond=self_cond, drop_source=torch.tensor([False, True, False]),
             decode_rows=row_index(decode, None), self_cond_rows=row_index(self_cond, None))
    loss, rows = elf_loss(net, x, tokens, d, r, known=known)

    total, count, per_row = 0.0, 0, []
    with torch.no_grad():
        for i in range(3):
            t = d.t[i].item()
            clean = [torch.zeros(C) if j < src[i] and d.drop_source[i] else x[i, j] for j in range(L)]
            if d.decode[i]:  # every position corrupted per token, the source too
                z = [d.p[i, j] * x[i, j] + (1 - d.p[i, j]) * r.decode_noise_scale * eps[i, j] for j in range(L)]
            else:  # the source clean (zeros when dropped), the target on the flow path
                z = [clean[j] if j < src[i] else t * x[i, j] + (1 - t) * r.noise_scale * eps[i, j]
                     for j in range(L)]
            context = net.ctx(torch.stack(z).mean(0))
            row = []
            for j in range(src[i], L):
                if d.decode[i]:
                    row.append(F.cross_entropy(net.head(z[j])[None], tokens[i, j:j + 1]).item())
                else:
                    clip = max(1 - t, r.t_eps)
                    v_pred, v = (net.lin(z[j]) + context - z[j]) / clip, (clean[j] - z[j]) / clip
                    row.append(((v_pred - v) ** 2).mean().item())
            total, count = total + sum(row), count + len(row)
            per_row.append(sum(row) / len(row))
    assert count == 6 + 4 + 5
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    assert abs(loss.item() - sum(per_row) / 3) > 1e-3 * loss.item()  # not the mean of the rows' means
    # the metrics' parts: each row's sum over its scored positions, in its own branch, and the positions
    assert rows["scored"].tolist() == [6.0, 4.0, 5.0]
    assert (rows["denoise"][:2] / rows["scored"][:2]).tolist() == pytest.approx(per_row[:2], rel=1e-5)
    assert rows["decode"][2].item() / 5 == pytest.approx(per_row[2], rel=1e-5)
    assert rows["denoise"][2].item() == 0 and rows["decode"][:2].tolist() == [0.0, 0.0]


def test_packed_rows_give_the_mean_of_the_rows_means_bit_for_bit():
    """Rows that all score L = 32 positions: the token mean equals the mean of the rows' token means exactly
    (a power-of-two count rescales without rounding), so packed text trains as before, bit for bit."""
    net = tiny_net()
    r = Recipe()
    x = torch.randn(8, 32, 32)
    d = draw_training_noise((8, 32, 32), r, generator=torch.Generator().manual_seed(1),
                            cpu_generator=torch.Generator().manual_seed(2))
    loss, rows = elf_loss(net, x, torch.randint(0, 100, (8, 32)), d, r)
    means = (rows["denoise"] + rows["decode"]) / rows["scored"]  # each row's own token mean
    assert loss.item() == (means.sum() / 8).item()


def test_euler_step_moves_the_right_fraction_and_lands_on_the_guess():
    z, x_hat = torch.randn(5, 3), torch.randn(5, 3)
    t, t2 = torch.tensor(0.25), torch.tensor(0.5)
    assert torch.allclose(euler_step(z, t, t2, x_hat), z + (x_hat - z) / 3)
    assert torch.allclose(euler_step(z, torch.tensor(0.75), torch.tensor(1.0), x_hat), x_hat)
    # a whole run: the last Euler step returns the last guess, with any grid and any step kind
    for step in ("ode", "sde", "vc"):
        out, last = integrate(lambda z_, t_, w_, xp: 0.5 * z_ + 1.0, torch.randn(2, 4, 3), time_grid(6, "uniform"),
                           sampler=step, gamma=1.5, generator=torch.Generator().manual_seed(0))
        assert torch.allclose(out, last)


def _backed_off_std(step):
    """Run one step from t = 0.10 to 0.12 on states with noise level 2 (1 - t) = 1.8, record z_b's std."""
    seen = {}

    def denoise(z, t, w, xp):
        seen["z"], seen["t"] = z, t
        return torch.zeros_like(z)

    z = 1.8 * torch.randn(400_000, 1, 1, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([0.10, 0.12, 1.0])
    integrate(denoise, z, grid, sampler=step, gamma=1.5, generator=torch.Generator().manual_seed(1),
           callback=lambda i, t, z_, x: seen.setdefault("first", (seen["z"].std().item(), seen["t"][0].item())))
    return seen["first"]


def test_sde_numbers_of_the_explainer():
    std, t_b = _backed_off_std("sde")
    assert t_b == pytest.approx(0.097, abs=1e-6)  # alpha = 0.97
    assert std == pytest.approx(math.sqrt((0.97 * 1.8) ** 2 + (0.03 * 2) ** 2), rel=5e-3)
    assert std == pytest.approx(1.747, abs=0.01)
    std_vc, _ = _backed_off_std("vc")
    assert std_vc == pytest.approx(2 * (1 - 0.097), abs=0.01)  # 1.806: the path's level at t_b


def test_sampling_is_reproducible_and_checks_its_arguments():
    net = tiny_net()
    a, _ = generate_tokens(net, 2, 8, steps=4, generator=torch.Generator().manual_seed(7))
    b, _ = generate_tokens(net, 2, 8, steps=4, generator=torch.Generator().manual_seed(7))
    c, _ = generate_tokens(net, 2, 8, steps=4, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and a.shape == (2, 8)
    assert not torch.equal(generate_tokens(net, 2, 8, steps=4, generator=torch.Generator().manual_seed(8))[1],
                           generate_tokens(net, 2, 8, steps=4, generator=torch.Generator().manual_seed(7))[1])
    with pytest.raises(ValueError, match="steps must be an integer from 1 to 10,000"):
        generate_tokens(net, 1, 4, steps=0)
    with pytest.raises(ValueError, match="gamma must be"):
        generate_tokens(net, 1, 4, gamma=-1.0)
    with pytest.warns(UserWarning, match="outside the range the model was trained on"):
        generate_tokens(net, 1, 4, steps=2, omega=9.0)
    with pytest.raises(ValueError, match="unknown sampler"):
        generate_tokens(net, 1, 4, steps=2, sampler="heun")


@pytest.mark.parametrize("sampler", ["sde", "vc", "ode"])
def test_sampling_loop_has_no_host_sync_no_buffer_per_step_and_one_decode_pass(monkeypatch, sampler):
    """No tensor -> Python conversion (a host sync on a GPU) and no random or grid buffer allocated per step
    (the arguments' check before the loop reads a few values once, as many at 3 steps as at 9); one network pass
    per step and a single decode pass at the end."""
    import elflow.sampler as loop_module

    net = tiny_net().eval()
    passes = []
    forward = net.forward
    decode = net.decode
    monkeypatch.setattr(net, "forward", lambda *a, **k: passes.append(False) or forward(*a, **k))
    monkeypatch.setattr(net, "decode", lambda *a, **k: passes.append(True) or decode(*a, **k))
    state = {"in_loop": False, "buffers": 0, "syncs": 0}

    def no_sync(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, **k):
            state["syncs"] += state["in_loop"]
            return original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        no_sync(name)
    for name in ("randn", "randn_like", "rand", "rand_like", "empty", "empty_like", "linspace", "normal"):
        original = getattr(torch, name)

        def counted(*a, _original=original, **k):
            state["buffers"] += state["in_loop"]
            return _original(*a, **k)
        monkeypatch.setattr(torch, name, counted)
    loop = loop_module.integrate

    def watched(*a, **k):
        state["in_loop"] = True
        try:
            return loop(*a, **k)
        finally:
            state["in_loop"] = False
    monkeypatch.setattr(loop_module, "integrate", watched)
    buffers, syncs = {}, {}
    for steps in (3, 9):
        passes.clear()
        state["buffers"] = state["syncs"] = 0
        generate_tokens(net, 2, 8, steps=steps, sampler=sampler, generator=torch.Generator().manual_seed(0))
        assert passes == [False] * steps + [True]  # one pass per step, then the decode pass once
        buffers[steps], syncs[steps] = state["buffers"], state["syncs"]
    assert buffers[3] == buffers[9] <= (0 if sampler == "ode" else 1)  # the noise buffer, once
    assert syncs[3] == syncs[9] <= 8  # the arguments' check, once: none per step

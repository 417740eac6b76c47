"""Figure 2 statistics against the explainer (Monte-Carlo), grid properties, and the Figure 1 toy."""

import math

import pytest
import torch

from elflow.experiments.schedules import schedule_statistics
from elflow.experiments.toy import grid_mixture, ring_mixture, run_toy
from elflow.flow import sample_decode_level, sample_guidance, sample_time, time_grid


@pytest.fixture(scope="module")
def stats():
    return schedule_statistics(n=200_000, grids=2000, steps=32, seed=0)


# expected value, tolerance (several Monte-Carlo standard errors, plus the rounding of the published value)
@pytest.mark.parametrize("key,value,tol", [
    ("t_median", 0.18, 0.006), ("t_below_2_3", 0.997, 0.001), ("t_above_half", 0.03, 0.003),
    ("p_median", 0.69, 0.006), ("p_below_half", 0.16, 0.006), ("omega_median", 2.0, 0.02),
    ("omega_below_1", 0.21, 0.006), ("grid32_top_mean", 0.53, 0.01),
])
def test_schedule_statistics_match_the_explainer(stats, key, value, tol):
    assert stats[key] == pytest.approx(value, abs=tol)


def test_grid_top_range(stats):
    assert 0.33 < stats["grid32_top_p2.5"] < 0.42 and 0.68 < stats["grid32_top_p97.5"] < 0.8


@pytest.mark.parametrize("mean,std", [(-1.5, 0.8), (0.7, 1.3)])
def test_exact_closed_forms(mean, std):
    """The medians against their closed forms: sigmoid(N(m, s^2)) has median sigmoid(m) (the training times,
    the decode levels p); 1 + omega log-uniform on [1.5, 6] has median sqrt(1.5 * 6) = 3, so omega's is 2.
    Tolerances are four Monte-Carlo standard errors of a median of 200,000 draws."""
    g = torch.Generator().manual_seed(1)
    n = 200_000
    sig = torch.sigmoid(torch.tensor(mean)).item()
    density = 0.3989 / (std * sig * (1 - sig))  # of sigmoid(N(m, s^2)) at its median
    tol = 4 / (2 * density * n ** 0.5)
    assert sample_time(n, g, mean, std).median().item() == pytest.approx(sig, abs=tol)
    assert sample_decode_level((n,), g, mean, std).median().item() == pytest.approx(sig, abs=tol)
    omega = sample_guidance(n, g)
    assert omega.median().item() == pytest.approx(2.0, abs=4 / (2 * n ** 0.5 / (3 * math.log(4.0))))
    assert omega.min() >= 0.5 and omega.max() <= 5.0
    assert sample_time(7, g).shape == (7,) and sample_decode_level((2, 3, 1), g).shape == (2, 3, 1)


@pytest.mark.parametrize("kind", ["logit_normal", "uniform"])
@pytest.mark.parametrize("steps", [1, 2, 32])
def test_time_grid(kind, steps):
    g = time_grid(steps, kind, generator=torch.Generator().manual_seed(0))
    assert g.shape == (steps + 1,) and g[0].item() == 0.0 and g[-1].item() == 1.0
    assert (g[1:] > g[:-1]).all()


def test_time_grid_bad_input():
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        time_grid(0)
    with pytest.raises(ValueError, match="kind must be"):
        time_grid(4, "cosine")


def test_toy_one_step_lands_every_sample_on_the_data_mean():
    mix = ring_mixture()
    res = run_toy(mix, steps_list=(1,), num=50)
    assert torch.allclose(res[1]["final"], mix.mean.expand(50, 2), atol=1e-5)
    assert res[1]["inside"] == 0


@pytest.mark.parametrize("mix", [ring_mixture(), grid_mixture()])
def test_toy_more_steps_never_fewer_inside_and_almost_all_at_16(mix):
    res = run_toy(mix, steps_list=(1, 2, 4, 8, 16), num=400, seed=3)
    counts = [res[n]["inside"] for n in (1, 2, 4, 8, 16)]
    assert counts == sorted(counts), counts
    assert counts[-1] >= 0.95 * 400


def test_posterior_mean_is_exact_against_monte_carlo():
    """E[x | z_t] from the closed form against importance-weighted samples of the mixture."""
    mix = ring_mixture(k=4, radius=1.0, std=0.3)
    g = torch.Generator().manual_seed(0)
    xs = mix.sample(400_000, g).double()
    z, t = torch.tensor([[0.3, -0.2]]), torch.tensor([0.4])
    var = (1 - 0.4) ** 2 * 4.0
    w = torch.exp(-((z.double() - 0.4 * xs) ** 2).sum(-1) / (2 * var))
    mc = (w[:, None] * xs).sum(0) / w.sum()
    assert torch.allclose(mix.posterior_mean(z, t)[0].double(), mc, atol=5e-3)


@pytest.mark.slow
def test_toy_distillation_students_reach_clusters_in_one_step_where_the_teacher_cannot():
    """A small trained teacher at N = 1 lands on the data mean (nothing inside a cluster); its distilled
    one-step student lands inside clusters, as the teacher's own 16-step path does."""
    from elflow.experiments.toy import distill_toy, ring_mixture, run_toy, train_toy_teacher

    mix = ring_mixture()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small MLP: threads only add synchronisation
    try:
        teacher = train_toy_teacher(mix, steps=600, batch=512, seed=0)
        students = distill_toy(teacher, mix, student_steps=(4, 2, 1), steps=300, batch=512, seed=0)
    finally:
        torch.set_num_threads(threads)
    n = 100
    at_one = run_toy(mix, (1,), n, seed=1, denoiser=teacher)[1]
    assert at_one["inside"] == 0
    assert at_one["final"].norm(dim=-1).max() < 1.0  # near the mean (the origin), the ring has radius 1.9
    one_step = run_toy(mix, (1,), n, seed=1, denoiser=students[1])[1]
    sixteen = run_toy(mix, (16,), n, seed=1, denoiser=teacher)[16]
    assert one_step["inside"] >= 20 and one_step["inside"] >= sixteen["inside"] // 3


def test_toy_figure_labels_its_axes_and_keeps_its_legend_clear_of_the_panels():
    import matplotlib.pyplot as plt

    from elflow.experiments.toy import toy_figure

    mix = ring_mixture()
    for steps in ((1,), (1, 4), (1, 2, 4, 8, 16)):
        fig = toy_figure(mix, run_toy(mix, steps_list=steps, num=20), "title")
        fig.canvas.draw()
        *axes, key = fig.axes
        assert [a.get_xlabel() for a in axes] == ["$x_1$"] * len(steps) and axes[0].get_ylabel() == "$x_2$"
        assert all(len(a.get_xticklabels()) >= 5 and a.get_xticklabels()[0].get_fontsize() >= 9 for a in axes)
        assert all(a.get_legend() is None for a in axes)  # no legend over a panel's points
        legend = key.get_legend()
        names = [t.get_text() for t in legend.get_texts()]
        assert names == ["data (the mixture)", "path of z from noise", "guesses of x at each step",
                         "samples (where z ends)", "data mean"]
        box = legend.get_window_extent()
        for a in axes:  # below every panel and its tick labels
            assert box.y1 <= a.get_tightbbox().y0 + 1
        assert box.x0 >= 0 and box.x1 <= fig.bbox.x1 and box.y0 >= 0  # inside the figure
        plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
# the size check of `elflow schedules`
@pytest.mark.parametrize("value,needle", [
    ("0", "--samples must be at least 2"), ("-5", "--samples must be at least 2"),
    (str(10**12), "--samples must be an integer from 2 to 1,000,000,000"),
    (str(10**11), "--samples must be an integer from 2 to 1,000,000,000"),
    ("500000000", "the schedules' statistics at --samples 500000000 needs about"),  # over 1 GiB
])
def test_schedules_refuses_a_bad_number_of_draws_in_one_line_writing_nothing(tmp_path, capsys, monkeypatch, value,
                                                                             needle):
    from helpers import assert_one_error

    from elflow.cli import main
    from elflow.util import budget

    monkeypatch.setattr(budget, "available_memory", lambda device=None: (2**30, "available on this machine"))
    out = tmp_path / "s.png"
    code = main(["schedules", "--samples", value, "--out", str(out)])
    assert_one_error(code, capsys.readouterr().err, "schedules", needle)
    assert not out.exists()


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_schedules_refuses_draws_that_are_no_integer(tmp_path, capsys, value):
    from helpers import assert_not_an_integer

    from elflow.cli import main

    with pytest.raises(SystemExit) as e:
        main(["schedules", "--samples", value, "--out", str(tmp_path / "s.png")])
    assert_not_an_integer(e.value.code, capsys.readouterr().err, "schedules", "--samples")
    assert not (tmp_path / "s.png").exists()

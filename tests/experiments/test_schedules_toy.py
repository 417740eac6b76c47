"""Figure 2 statistics against the explainer (Monte-Carlo), grid properties, the Figure 1 toy and its
distillation comparison (energy distances, the flow-map student, `elflow toy --json` and its limits)."""

import json
import math

import pytest
import torch
from helpers import cli

from elflow.experiments.schedules import schedule_statistics
from elflow.experiments.toy import ToyNet, flow_map_student, grid_mixture, ring_mixture, run_toy
from elflow.experiments.toy_distill import energy_distance, map_of
from elflow.flow import draw_decode_level, draw_guidance, draw_time, time_grid


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
    assert draw_time(n, g, mean, std).median().item() == pytest.approx(sig, abs=tol)
    assert draw_decode_level((n,), g, mean, std).median().item() == pytest.approx(sig, abs=tol)
    omega = draw_guidance(n, g)
    assert omega.median().item() == pytest.approx(2.0, abs=4 / (2 * n ** 0.5 / (3 * math.log(4.0))))
    assert omega.min() >= 0.5 and omega.max() <= 5.0
    assert draw_time(7, g).shape == (7,) and draw_decode_level((2, 3, 1), g).shape == (2, 3, 1)


@pytest.mark.parametrize("kind", ["logit_normal", "uniform"])
@pytest.mark.parametrize("steps", [1, 2, 32])
def test_time_grid(kind, steps):
    g = time_grid(steps, kind, generator=torch.Generator().manual_seed(0))
    assert g.shape == (steps + 1,) and g[0].item() == 0.0 and g[-1].item() == 1.0
    assert (g[1:] > g[:-1]).all()


def test_time_grid_bad_input():
    with pytest.raises(ValueError, match="steps must be an integer from 1 to 10,000"):
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
    xs = mix.draw(400_000, g).double()
    z, t = torch.tensor([[0.3, -0.2]]), torch.tensor([0.4])
    var = (1 - 0.4) ** 2 * 4.0
    w = torch.exp(-((z.double() - 0.4 * xs) ** 2).sum(-1) / (2 * var))
    mc = (w[:, None] * xs).sum(0) / w.sum()
    assert torch.allclose(mix.posterior_mean(z, t)[0].double(), mc, atol=5e-3)


@pytest.fixture(scope="module")
def toy_teacher():
    """The slow tests' teacher: 600 steps of batch 512 on the 8-cluster ring, on one thread (a small MLP)."""
    from elflow.experiments.toy import train_toy_teacher
    from elflow.experiments.toy_distill import single_thread

    with single_thread():
        return train_toy_teacher(ring_mixture(), steps=600, batch=512, seed=0)


@pytest.mark.slow
def test_toy_distillation_students_reach_clusters_in_one_step_where_the_teacher_cannot(toy_teacher):
    """A small trained teacher at N = 1 lands on the data mean (nothing inside a cluster); its distilled
    one-step student lands inside clusters, as the teacher's own 16-step path does."""
    from elflow.experiments.toy import distill_toy
    from elflow.experiments.toy_distill import single_thread

    mix, teacher = ring_mixture(), toy_teacher
    with single_thread():
        students = distill_toy(teacher, mix, student_steps=(4, 2, 1), steps=300, batch=512, seed=0)
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
    one = run_toy(mix, steps_list=(1, 4), num=20)
    rows_of_panels = [one, {"a, 1 step": one[1], "b, 4 steps": {**one[4], "energy": 0.0123}, "c": one[4]}]
    for steps, results in [*((s, run_toy(mix, steps_list=s, num=20)) for s in ((1,), (1, 4), (1, 2, 4, 8, 16))),
                           ((1, 4, 1, 4, 4), rows_of_panels)]:
        fig = toy_figure(mix, results, "title")
        fig.canvas.draw()
        *axes, key = fig.axes
        assert [a.get_xlabel() for a in axes] == ["$x_1$"] * len(steps) and axes[0].get_ylabel() == "$x_2$"
        if isinstance(results, list):  # rows of panels: the first of each row labels its y axis
            assert [a.get_ylabel() for a in axes] == ["$x_2$", "", "$x_2$", "", ""]
            assert axes[2].get_position().y1 < axes[0].get_position().y0  # the second row below the first
            assert axes[3].get_title() == "b, 4 steps: 9/20 inside\nenergy distance 0.0123"
        assert all(len(a.get_xticklabels()) >= 5 and a.get_xticklabels()[0].get_fontsize() >= 9 for a in axes)
        assert all(a.get_legend() is None for a in axes)  # no legend over a panel's points
        legend = key.get_legend()
        names = [t.get_text() for t in legend.get_texts()]
        assert all(h.get_alpha() == 1 for h in legend.legend_handles)
        assert names == ["data (the mixture)", "path of z from noise", "guesses of x at each step",
                         "samples (where z ends)", "data mean"]
        box = legend.get_window_extent()
        for a in axes:  # below every panel and its tick labels
            assert box.y1 <= a.get_tightbbox().y0 + 1
        assert box.x0 >= 0 and box.x1 <= fig.bbox.x1 and box.y0 >= 0  # inside the figure
        plt.close(fig)


def test_energy_distance_against_its_definition_and_a_closed_form():
    a, b = torch.zeros(5, 2), torch.zeros(7, 2)
    b[:, 0] = 3.0
    assert energy_distance(a, b) == pytest.approx(6.0)  # two point masses d apart: 2 d
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 2, generator=g), torch.randn(200, 2, generator=g) + 0.5

    def mean_dist(p, q):  # every pair, directly
        return (p.double()[:, None] - q.double()[None]).pow(2).sum(-1).sqrt().mean().item()

    direct = 2 * mean_dist(x, y) - mean_dist(x, x) - mean_dist(y, y)
    assert energy_distance(x, y, block=7) == pytest.approx(direct, rel=1e-10)
    assert energy_distance(x, y) == pytest.approx(direct, rel=1e-10)
    assert energy_distance(y, x) == pytest.approx(direct, rel=1e-10) and abs(energy_distance(x, x)) < 1e-12
    # N(0, 1) against N(mu, 1) in 1-D: 2 E|N(mu, 2)| - 2 E|N(0, 2)|, E|N(m, s^2)| = s sqrt(2/pi) e^(-m^2/2s^2)
    # + m (1 - 2 Phi(-m/s)); sampling adds about 1/n
    mu, s2, n = 1.0, math.sqrt(2), 3000
    fold = s2 * math.sqrt(2 / math.pi) * math.exp(-mu ** 2 / 4) + mu * math.erf(mu / 2)
    exact = 2 * fold - 2 * s2 * math.sqrt(2 / math.pi)
    p, q = torch.randn(n, 1, generator=g), torch.randn(n, 1, generator=g) + mu
    assert energy_distance(p, q) == pytest.approx(exact, abs=0.03)


def test_the_flow_map_student_starts_as_its_teacher_and_samples_as_its_euler_ode():
    torch.manual_seed(0)
    teacher = ToyNet(width=32, depth=2)
    student = flow_map_student(teacher)
    g = torch.Generator().manual_seed(1)
    z, s, t = torch.randn(50, 1, 2, generator=g), torch.rand(50, generator=g), torch.rand(50, generator=g)
    assert torch.allclose(student(z, s, t_target=t), teacher(z, s), atol=1e-6)
    assert torch.allclose(student(z, s), teacher(z, s), atol=1e-6)  # no target time: the diagonal
    mix = ring_mixture()
    as_map = run_toy(mix, (1, 4), 30, map_net=map_of(student))
    as_ode = run_toy(mix, (1, 4), 30, denoiser=teacher)
    for n in (1, 4):
        assert torch.allclose(as_map[n]["final"], as_ode[n]["final"], atol=1e-5)
        assert as_map[n]["path"].shape == as_ode[n]["path"].shape == (n + 1, 30, 2)
    with torch.no_grad():  # the target time reaches the output once its weights are not zero
        student.mlp[0].weight[:, -1] = 1.0
    assert not torch.allclose(student(z, s, t_target=t), teacher(z, s), atol=1e-3)


def test_toy_json_prints_one_object_of_energy_distances(tmp_path, capsys):
    """The exact denoiser at N = 1 lands every sample on the data mean (the origin): its energy distance to the
    ring is 2 R - E|Y - Y'|, about 3.8 - 2.41 (the mean chord of 8 clusters on radius 1.9 and their spread)."""
    code, out, err = cli(capsys, ["toy", "--json", "--steps", "1", "16", "--num", "20", "--out", tmp_path / "t.png"])
    assert code == 0, err
    got = json.loads(out)  # the whole of stdout is one object
    assert [(r["name"], r["steps"]) for r in got["rows"]] == [("exact", 1), ("exact", 16)]
    assert all(set(r) == {"name", "steps", "energy_distance"} for r in got["rows"])
    chord = sum(2 * 1.9 * math.sin(math.pi * k / 8) for k in range(8)) / 8
    assert got["rows"][0]["energy_distance"] == pytest.approx(2 * 1.9 - chord - 0.02, abs=0.03)
    assert 0 < got["floor"] < 0.005 and got["rows"][1]["energy_distance"] < 0.01
    assert got["samples"] == 4000 and (tmp_path / "t.png").stat().st_size > 0


def ed_of(got: dict, name: str, steps: int) -> float:
    return next(r["energy_distance"] for r in got["rows"] if (r["name"], r["steps"]) == (name, steps))


def test_toy_distill_json_has_every_models_rows_and_the_figure_their_panels(tmp_path, capsys, monkeypatch):
    """The layout of `elflow toy --distill --json` with a few training steps (the learning itself is the slow
    test's): rows for the exact denoiser and the teacher at 1, 2, 4, 16, 64 steps and the extra --steps, the PD
    students at their own counts, the flow map at every count; one object on stdout, the figure written."""
    from elflow.experiments import toy_distill

    monkeypatch.setitem(toy_distill.DISTILL_SIZES, "teacher_steps", 3)
    monkeypatch.setitem(toy_distill.DISTILL_SIZES, "student_steps", 6)
    monkeypatch.setitem(toy_distill.DISTILL_SIZES, "batch", 16)
    monkeypatch.setitem(toy_distill.DISTILL_SIZES, "teacher_batch", 16)
    monkeypatch.setattr(toy_distill, "ENERGY_SAMPLES", 300)
    code, out, err = cli(capsys, ["toy", "--distill", "--json", "--steps", "1", "8", "--num", "10",
                                   "--out", tmp_path / "t.png"])
    assert code == 0, err
    got = json.loads(out)
    keys = [(r["name"], r["steps"]) for r in got["rows"]]
    assert keys == [*(("exact", n) for n in (1, 2, 4, 8, 16, 64)), *(("teacher", n) for n in (1, 2, 4, 16, 64)),
                    ("pd", 1), ("pd", 2), ("pd", 4), *(("flow-map", n) for n in (1, 2, 4, 16, 64))]
    assert all(r["energy_distance"] >= 0 for r in got["rows"])
    assert got["sizes"]["student_steps"] == 6 and got["sizes"]["pd_steps_per_round"] == 2
    assert got["samples"] == got["sizes"]["energy_samples"] == 300
    # the text output's table of the same rows: a line per model, blank where a model has no such step count
    from elflow.cli.toy import print_table

    print_table(got["rows"], got["floor"], got)
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("model"))
    assert lines[head].split() == ["model", "N=1", "N=2", "N=4", "N=8", "N=16", "N=64"]
    cells = {line[:22].strip(): line[22:] for line in lines[head + 1:head + 5]}
    assert list(cells) == ["exact denoiser", "trained teacher", "PD student (N steps)", "flow-map student"]
    assert len(cells["exact denoiser"].split()) == 6 and len(cells["PD student (N steps)"].split()) == 3
    assert float(cells["flow-map student"].split()[0]) == pytest.approx(ed_of(got, "flow-map", 1), abs=1e-4)
    assert (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.parametrize("args,needles", [
    (["--steps", "20000"], ["--steps 20,000", "limit of 10,000"]),
    (["--num", "2000000"], ["--num 2,000,000", "limit of 1,000,000"]),
    (["--clusters", "65"], ["--clusters 65", "limit of 64 on the ring"]),
    (["--layout", "grid", "--clusters", "17"], ["limit of 16 per side of the grid"]),
    (["--steps", *map(str, range(1, 14))], ["13 --steps values", "limit of 12"]),
    (["--num", "100000", "--steps", "300"], ["30,000,000", "points kept"]),
    (["--layout", "grid", "--clusters", "16", "--num", "10000", "--steps", "500"], ["1,280,000,000"]),
    (["--num", "0"], [">= 1"]),
])
def test_toy_refuses_sizes_that_cannot_fit_before_any_work(tmp_path, capsys, args, needles):
    from helpers import assert_one_error

    code, out, err = cli(capsys, ["toy", *args, "--out", tmp_path / "t.png"])
    assert_one_error(code, err, "toy", *needles)
    assert out == "" and not (tmp_path / "t.png").exists()


@pytest.mark.slow
def test_the_flow_map_student_beats_the_teacher_and_the_progressive_student_at_one_step(toy_teacher):
    """At equal student training (300 steps of batch 512 at one learning rate: PD's three rounds 100 each), the
    flow-map student's one-step samples are closer to the mixture than the teacher's one Euler step and than
    the one-step PD student's; one student serves every step count (2 and 4 steps beat the teacher's too), and
    at one step it is within a small margin of the teacher's own 64-step ODE, the most a student can copy."""
    from elflow.experiments.toy import distill_toy
    from elflow.experiments.toy_distill import distill_flow_map_toy, energy_rows, single_thread

    mix, teacher = ring_mixture(), toy_teacher
    with single_thread():
        pd = distill_toy(teacher, mix, student_steps=(4, 2, 1), steps=100, batch=512, lr=3e-3, seed=0)
        fmap = distill_flow_map_toy(teacher, mix, steps=300, batch=512, lr=3e-3, seed=0)
    rows = energy_rows(mix, [("teacher", (1, 2, 4, 64), lambda z, t: teacher(z, t), None),
                             ("pd", (1,), lambda z, t: pd[1](z, t), None),
                             ("flow-map", (1, 2, 4), None, map_of(fmap))], n=4000, seed=0)
    ed = {(r["name"], r["steps"]): r["energy_distance"] for r in rows}
    assert ed[("flow-map", 1)] < ed[("pd", 1)], ed
    assert ed[("flow-map", 1)] < ed[("teacher", 1)] / 10, ed
    assert all(ed[("flow-map", n)] < ed[("teacher", n)] for n in (2, 4)), ed
    assert ed[("flow-map", 1)] < 1.5 * ed[("teacher", 64)], ed


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

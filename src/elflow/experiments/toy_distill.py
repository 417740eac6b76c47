"""The toy's distillation comparison: a small teacher trained on the 2-D mixture, its progressively distilled
students (4, 2, 1 steps) and one flow-map student (every step count) for the same number of student training
steps, each scored by the energy distance of its samples to the mixture."""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager

import torch

from elflow.experiments.toy import (
    GaussianMixture,
    ToyNet,
    _fit,
    distill_toy,
    flow_map_student,
    run_toy,
    sample_map,
    train_toy_teacher,
)
from elflow.flow import T_EPS, Recipe, time_grid
from elflow.flowmap import DIAGONAL_SHARE, draw_time_pairs, lmd_loss
from elflow.sampler import integrate

ENERGY_SAMPLES = 4000  # samples of each model (and of the mixture) in an energy distance
TABLE_STEPS = (1, 2, 4, 16, 64)  # step counts of the exact denoiser, the teacher and the flow map
PD_STEPS = (4, 2, 1)  # the progressive students, in the order they are distilled
TEACHER_PATH_STEPS = 16  # Euler steps of the teacher's path that a progressive student's target follows


# the sizes of `elflow toy --distill` (about three CPU-minutes together): the teacher's training, then the
# students' (PD's three rounds share student_steps equally; the flow map has them all), and both students'
# learning rate (each does better at 3e-3 than at 1e-3 on this budget; docs/method.md)
DISTILL_SIZES = {"teacher_steps": 2000, "teacher_batch": 1024, "student_steps": 1800, "batch": 512, "lr": 3e-3}


@contextmanager
def single_thread():
    """torch on one thread inside: for a small MLP on 2-D points more threads only add synchronisation (on two
    cores the table's work took 2.2 times the CPU time of one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _single_threaded(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with single_thread():
            return fn(*args, **kwargs)
    return run


def mean_distance(a: torch.Tensor, b: torch.Tensor, block: int = 2048) -> float:
    """The mean Euclidean distance over every pair of a point of a (n, d) and one of b (m, d), in float64, block x
    block distances at a time so that memory stays bounded whatever n and m."""
    a, b = a.reshape(len(a), -1).double(), b.reshape(len(b), -1).double()
    total = 0.0
    for i in range(0, len(a), block):
        for j in range(0, len(b), block):
            d = torch.cdist(a[i:i + block], b[j:j + block], compute_mode="donot_use_mm_for_euclid_dist")
            total += d.sum().item()
    return total / (len(a) * len(b))


def energy_distance(a: torch.Tensor, b: torch.Tensor, block: int = 2048, b_self: float | None = None) -> float:
    """2 E|X - Y| - E|X - X'| - E|Y - Y'| between the empirical distributions of the points a (n, d) and b (m, d):
    every pair counted (the statistic of the two sets themselves, >= 0, 0 only for equal sets), in bounded
    memory (`mean_distance`). b_self, if given, is mean_distance(b, b) computed once for many a."""
    b_self = mean_distance(b, b, block) if b_self is None else b_self
    return 2 * mean_distance(a, b, block) - mean_distance(a, a, block) - b_self


def distill_flow_map_toy(teacher: ToyNet, mixture: GaussianMixture, steps: int = 1800, batch: int = 512,
                         lr: float = 3e-3, seed: int = 0, diagonal: float = DIAGONAL_SHARE,
                         t_eps: float = T_EPS) -> ToyNet:
    """A flow-map student of the toy teacher by Lagrangian map distillation (flowmap.lmd_loss): it starts as
    the teacher (flow_map_student), z_s lies on the data's path at s, and (s, t) pairs come from
    flowmap.draw_time_pairs with a share `diagonal` of t = s. Adam with a cosine decay, as the other toy
    students. Returns the student, called as net(z, s, t_target=t)."""
    student = flow_map_student(teacher).train()

    def net(z, s, t):
        return student(z, s, t_target=t)

    def loss_fn(g):
        x = mixture.draw(batch, g)[:, None]
        s, t = draw_time_pairs(batch, g, diagonal)
        ss = s[:, None, None]
        z = ss * x + (1 - ss) * mixture.noise_scale * torch.randn(x.shape, generator=g)
        return lmd_loss(net, teacher, z, s, t, t_eps)

    _fit(student, loss_fn, steps, lr, seed + 100)
    return student.eval().requires_grad_(False)


def map_of(student: ToyNet):
    """A flow-map ToyNet as flowmap's networks are called: (z, s, t) -> x_hat."""
    return lambda z, s, t: student(z, s, t_target=t)


@torch.no_grad()
def final_points(mixture: GaussianMixture, steps: int, n: int, seed: int, denoiser=None, map_net=None):
    """(n, 2) samples after `steps` uniform steps from n starting noises of `seed`: Euler ODE steps of the
    x-predictor `denoiser(z, t)` (the exact posterior mean if None), or jumps of the map `map_net(z, s, t)`."""
    z0 = mixture.noise_scale * torch.randn(n, 1, 2, generator=torch.Generator().manual_seed(seed))
    grid = time_grid(steps, "uniform")
    if map_net is not None:
        return sample_map(map_net, z0, grid)[0][:, 0]
    den = denoiser or mixture.posterior_mean
    z, _ = integrate(lambda z_, t_, w_, x_prev: den(z_, t_), z0, grid, sampler="ode",
                     recipe=Recipe(noise_scale=mixture.noise_scale))
    return z[:, 0]


@_single_threaded
def energy_rows(mixture: GaussianMixture, models: list[tuple], n: int | None = None, seed: int = 0) -> list[dict]:
    """Rows {"name", "steps", "energy_distance"}: each model at each of its step counts, `n` samples from the
    same starting noises against `n` draws of the mixture. models: (name, step counts, denoiser, map_net), a
    denoiser(z, t) -> x for the Euler ODE (None: the exact posterior mean) or a map network. n defaults to
    ENERGY_SAMPLES."""
    n = ENERGY_SAMPLES if n is None else n
    truth = mixture.draw(n, torch.Generator().manual_seed(seed + 7919))
    truth_self = mean_distance(truth, truth)
    rows = []
    for name, counts, den, map_net in models:
        for k in counts:
            pts = final_points(mixture, k, n, seed + 104729, den, map_net)
            rows.append({"name": name, "steps": k, "energy_distance": energy_distance(pts, truth, b_self=truth_self)})
    return rows


def energy_floor(mixture: GaussianMixture, n: int | None = None, seed: int = 0) -> float:
    """The energy distance between two independent draws of n (ENERGY_SAMPLES) points of the mixture: what
    sampling noise alone gives (the rows' truth draw against a second one)."""
    n = ENERGY_SAMPLES if n is None else n
    truth = mixture.draw(n, torch.Generator().manual_seed(seed + 7919))
    return energy_distance(mixture.draw(n, torch.Generator().manual_seed(seed + 15485863)), truth)


@_single_threaded
def distillation_table(mixture: GaussianMixture, num: int = 44, seed: int = 0, energy_samples: int | None = None,
                       **sizes) -> dict:
    """Train the teacher, its progressive students and the flow-map student (equal student training steps,
    batch and learning rate: PD's rounds share student_steps equally), then score them. `sizes` are any of
    DISTILL_SIZES' keys, which give the others.

    Returns {"rows": [{"name", "steps", "energy_distance"}], "floor": energy_floor, "figure": rows of panels
    for toy_figure (each run_toy's result at `num` samples, with its "energy"), "sizes", "cpu_seconds"}.
    Names: "exact" (the exact denoiser's Euler ODE), "teacher" (the trained teacher's), "pd" (the progressive
    student of that step count), "flow-map" (the one flow-map student)."""
    unknown = sorted(set(sizes) - set(DISTILL_SIZES))
    if unknown:
        raise ValueError(f"distillation_table: unknown sizes {unknown}; known: {sorted(DISTILL_SIZES)}")
    sizes = {**DISTILL_SIZES, **sizes}
    energy_samples = ENERGY_SAMPLES if energy_samples is None else energy_samples
    per_round = max(1, sizes["student_steps"] // len(PD_STEPS))
    sizes["student_steps"] = per_round * len(PD_STEPS)
    clock = time.process_time()
    teacher = train_toy_teacher(mixture, sizes["teacher_steps"], batch=sizes["teacher_batch"], seed=seed)
    students = distill_toy(teacher, mixture, PD_STEPS, TEACHER_PATH_STEPS, steps=per_round, batch=sizes["batch"],
                           lr=sizes["lr"], seed=seed)
    fmap = distill_flow_map_toy(teacher, mixture, steps=sizes["student_steps"], batch=sizes["batch"], lr=sizes["lr"],
                                seed=seed)
    trained = time.process_time() - clock

    def den(net):
        return lambda z, t: net(z, t)

    models = [("exact", TABLE_STEPS, None, None), ("teacher", TABLE_STEPS, den(teacher), None),
              *(("pd", (n,), den(students[n]), None) for n in sorted(PD_STEPS)),
              ("flow-map", TABLE_STEPS, None, map_of(fmap))]
    rows = energy_rows(mixture, models, energy_samples, seed)
    energy = {(r["name"], r["steps"]): r["energy_distance"] for r in rows}
    shown = (1, 2, 4)
    figure = []
    for name, label, kw in (("teacher", "teacher", {"denoiser": teacher}), ("pd", "PD student", None),
                            ("flow-map", "flow map", {"map_net": map_of(fmap)})):
        panels = {}
        for n in shown:
            args = kw if kw is not None else {"denoiser": students[n]}
            res = run_toy(mixture, (n,), num, seed, **args)[n]
            panels[f"{label}, {n} step" + "s" * (n != 1)] = {**res, "energy": energy[(name, n)]}
        figure.append(panels)
    return {"rows": rows, "floor": energy_floor(mixture, energy_samples, seed), "figure": figure,
            "sizes": {**sizes, "pd_rounds": list(PD_STEPS), "pd_steps_per_round": per_round,
                      "energy_samples": energy_samples},
            "cpu_seconds": {"training": trained, "total": time.process_time() - clock}}

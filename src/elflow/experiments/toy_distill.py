"""The toy's distillation comparison: a small teacher trained on the 2-D mixture, its progressively distilled
students (4, 2, 1 steps) and one flow-map student (every step count) for the same number of student training
steps, each scored by the energy distance of its samples to the mixture."""

from __future__ import annotations

import time

import torch

from elflow.experiments.toy import (
    GaussianMixture,
    ToyNet,
    _fit,
    distill_toy,
    flow_map_student,
    run_toy,
    train_toy_teacher,
)
from elflow.flow import T_EPS, sample, time_grid
from elflow.flowmap import DIAGONAL_SHARE, lmd_loss, sample_flow_map, sample_time_pairs

ENERGY_SAMPLES = 4000  # samples of each model (and of the mixture) in an energy distance
TABLE_STEPS = (1, 2, 4, 16, 64)  # step counts of the exact denoiser, the teacher and the flow map
PD_STEPS = (4, 2, 1)  # the progressive students, in the order they are distilled
TEACHER_PATH_STEPS = 16  # Euler steps of the teacher's path that a progressive student's target follows


# the sizes of `elflow toy --distill` (about three CPU-minutes together, single-threaded)
DISTILL_SIZES = {"teacher_steps": 2000, "student_steps": 1800, "batch": 512}


def energy_distance(a: torch.Tensor, b: torch.Tensor, block: int = 2048) -> float:
    """2 E|X - Y| - E|X - X'| - E|Y - Y'| between the empirical distributions of the points a (n, d) and b (m, d):
    every pair counted (the statistic of the two sets themselves, >= 0, 0 only for equal sets), in float64,
    block x block distances at a time so that memory stays bounded whatever n and m."""
    a, b = a.reshape(len(a), -1).double(), b.reshape(len(b), -1).double()

    def mean_distance(p, q):
        total = 0.0
        for i in range(0, len(p), block):
            for j in range(0, len(q), block):
                total += torch.cdist(p[i:i + block], q[j:j + block],
                                     compute_mode="donot_use_mm_for_euclid_dist").sum().item()
        return total / (len(p) * len(q))

    return 2 * mean_distance(a, b) - mean_distance(a, a) - mean_distance(b, b)


def distill_flow_map_toy(teacher: ToyNet, mixture: GaussianMixture, steps: int = 1800, batch: int = 512,
                         lr: float = 1e-3, seed: int = 0, diagonal: float = DIAGONAL_SHARE,
                         t_eps: float = T_EPS) -> ToyNet:
    """A flow-map student of the toy teacher by Lagrangian map distillation (flowmap.lmd_loss): it starts as
    the teacher (flow_map_student), z_s lies on the data's path at s, and (s, t) pairs come from
    flowmap.sample_time_pairs with a share `diagonal` of t = s. Adam with a cosine decay, as the other toy
    students. Returns the student, called as net(z, s, t_target=t)."""
    student = flow_map_student(teacher).train()

    def net(z, s, t):
        return student(z, s, t_target=t)

    def loss_fn(g):
        x = mixture.sample(batch, g)[:, None]
        s, t = sample_time_pairs(batch, g, diagonal)
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
        return sample_flow_map(map_net, z0, grid)[0][:, 0]
    den = denoiser or mixture.posterior_mean
    z, _ = sample(lambda z_, t_, w_, x_prev: den(z_, t_), z0, grid, sampler="ode", noise_scale=mixture.noise_scale)
    return z[:, 0]


def energy_rows(mixture: GaussianMixture, models: list[tuple], n: int = ENERGY_SAMPLES, seed: int = 0) -> list[dict]:
    """Rows {"name", "steps", "energy_distance"}: each model at each of its step counts, `n` samples from the
    same starting noises against `n` draws of the mixture. models: (name, step counts, denoiser, map_net), a
    denoiser(z, t) -> x for the Euler ODE (None: the exact posterior mean) or a map network."""
    truth = mixture.sample(n, torch.Generator().manual_seed(seed + 7919))
    rows = []
    for name, counts, den, map_net in models:
        for k in counts:
            pts = final_points(mixture, k, n, seed + 104729, den, map_net)
            rows.append({"name": name, "steps": k, "energy_distance": energy_distance(pts, truth)})
    return rows


def energy_floor(mixture: GaussianMixture, n: int = ENERGY_SAMPLES, seed: int = 0) -> float:
    """The energy distance between two independent draws of n points of the mixture: what sampling noise alone
    gives (the rows' truth draw against a second one)."""
    truth = mixture.sample(n, torch.Generator().manual_seed(seed + 7919))
    return energy_distance(mixture.sample(n, torch.Generator().manual_seed(seed + 15485863)), truth)


def distillation_table(mixture: GaussianMixture, num: int = 44, seed: int = 0, teacher_train_steps: int | None = None,
                       student_train_steps: int | None = None, batch: int | None = None,
                       energy_samples: int = ENERGY_SAMPLES) -> dict:
    """Train the teacher, its progressive students and the flow-map student (equal student training steps and
    batch: PD's rounds share `student_train_steps` equally), then score them. Sizes default to DISTILL_SIZES.

    Returns {"rows": [{"name", "steps", "energy_distance"}], "floor": energy_floor, "figure": rows of panels
    for toy_figure (each run_toy's result at `num` samples, with its "energy"), "sizes", "cpu_seconds"}.
    Names: "exact" (the exact denoiser's Euler ODE), "teacher" (the trained teacher's), "pd" (the progressive
    student of that step count), "flow-map" (the one flow-map student)."""
    sizes = {**DISTILL_SIZES, **{k: v for k, v in (("teacher_steps", teacher_train_steps),
                                                   ("student_steps", student_train_steps), ("batch", batch))
                                 if v is not None}}
    per_round = sizes["student_steps"] // len(PD_STEPS)
    sizes["student_steps"] = per_round * len(PD_STEPS)
    clock = time.process_time()
    teacher = train_toy_teacher(mixture, sizes["teacher_steps"], batch=2 * sizes["batch"], seed=seed)
    students = distill_toy(teacher, mixture, PD_STEPS, TEACHER_PATH_STEPS, steps=per_round, batch=sizes["batch"],
                           seed=seed)
    fmap = distill_flow_map_toy(teacher, mixture, steps=sizes["student_steps"], batch=sizes["batch"], seed=seed)
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
            "sizes": {**sizes, "teacher_batch": 2 * sizes["batch"], "pd_rounds": list(PD_STEPS),
                      "pd_steps_per_round": per_round, "energy_samples": energy_samples},
            "cpu_seconds": {"training": trained, "total": time.process_time() - clock}}

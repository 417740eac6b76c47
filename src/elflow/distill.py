"""Progressive distillation: a student that takes one step of size s = 1/N where its frozen teacher takes K.

Per training row (decode rows, with probability 0.2, keep the ordinary decode cross-entropy):

    t_s = u max(1 - s, 1e-6), u ~ logit-normal(-1.5, 0.8),   t_t = t_s + s
    z_t_s = t_s x0 + (1 - t_s) 2 eps                          (known positions hold x0)
    slot  = the teacher's guess at (z_t_s, t_s) on half the rows, zeros on the rest (known positions x0)
    z_K   = K teacher Euler steps from t_s to t_t, each guess fed back as the next slot
    x~    = z_t_s + (1 - t_s) / (t_t - t_s) (z_K - z_t_s)    (the x whose single Euler step lands on z_K)
    loss  = || student(z_t_s, t_s, omega, slot) - x~ ||^2 / C, one token mean over the batch's scored
            positions of both branches (flow.token_mean_loss)

`elflow distill TEACHER --student-steps 16,8,4,2,1 --teacher-steps 64` runs the rounds: round 1's student
copies the teacher's EMA weights, round k+1 starts from round k's student EMA (fresh optimiser and EMA). The
teacher stays the original one in every round. Each round is an ordinary elflow run folder (OUT/round-<N>)
trained by `elflow.train.train` with this module's objective; its record (TrainConfig.distillation) gives
the model the few-step sampling defaults (generate.SAMPLING_DEFAULTS) that `elflow sample` picks up.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from elflow.flow import Recipe, decode_levels, euler_step, row_index, scored_positions, to_device, token_mean_loss
from elflow.generate import distilled_defaults
from elflow.schedules import T_MEAN, T_STD, sample_guidance, sample_time
from elflow.checkpoint import REPLACED
from elflow.utils import ELFError, FolderHold, FolderLock, atomic_write_json, check_output, read_json

__all__ = ["teacher_init", "pd_target", "sample_sub_step_times", "DistillDraw", "draw_distill_noise",
           "distill_loss", "DistillObjective", "check_schedule", "load_teacher", "distill",
           "add_arguments", "run"]

SUB_STEP_MIN_SPAN = 1e-3  # below this interval the extrapolation to t = 1 is ill-conditioned: use the guess
STEP_SIZE_FLOOR = 1e-6  # t_s = u max(1 - s, floor): a one-step student still sees a (tiny) spread of t_s


# ----------------------------------------------------------------------------------------------------------
# the teacher's side


def _rows(v: torch.Tensor) -> torch.Tensor:
    return v.reshape(-1, 1, 1)


def teacher_init(teacher, z_t_s, t_s, omega, x0, known_mask) -> torch.Tensor:
    """The teacher's guess of x at (z_t_s, t_s, omega) from a slot holding x0 at the known positions and zeros
    elsewhere: (B, L, C). The guess is returned as the network gives it; whoever uses it as a
    self-conditioning slot puts x0 back at the known positions."""
    known = known_mask[..., None]
    slot = torch.where(known, x0, torch.zeros_like(x0))
    return teacher(z_t_s, t_s, omega, slot)


def pd_target(teacher, z_t_s, t_s, t_t, omega, sc_half, x0, known_mask, steps: int, sub_step_times=None,
              t_eps: float = 0.05) -> torch.Tensor:
    """The distillation target x~ (B, L, C): `steps` teacher Euler steps from t_s to t_t, read back as the x
    prediction whose single Euler step from (z_t_s, t_s) lands on the same point.

    sc_half (B, L, C) is the first self-conditioning slot (shared with the student); each later slot is the
    previous guess with x0 at the known positions, where z stays x0 as well. sub_step_times (B, steps + 1)
    runs from t_s to t_t (uniform steps if None). One step returns the teacher's guess itself, as does an
    interval shorter than 1e-3.
    """
    if steps < 1:
        raise ValueError(f"pd_target: steps must be >= 1, got {steps}")
    B = z_t_s.shape[0]
    if sub_step_times is None:
        frac = torch.arange(steps + 1, device=z_t_s.device, dtype=t_s.dtype) / steps
        sub_step_times = t_s[:, None] + (t_t - t_s)[:, None] * frac[None]
    if sub_step_times.shape != (B, steps + 1):
        raise ValueError(f"pd_target: sub_step_times must have shape ({B}, {steps + 1}), "
                         f"got {tuple(sub_step_times.shape)}")
    known = known_mask[..., None]
    z, slot, guess = z_t_s, sc_half, None
    for k in range(steps):
        tau, tau_next = sub_step_times[:, k], sub_step_times[:, k + 1]
        guess = teacher(z, tau, omega, slot)
        if steps == 1:
            return guess
        slot = torch.where(known, x0, guess)
        z = euler_step(z, _rows(tau), _rows(tau_next), slot, t_eps)
        z = torch.where(known, x0, z)
    span = _rows(t_t - t_s)
    scale = (1 - _rows(t_s)) / span.clamp_min(SUB_STEP_MIN_SPAN)
    return torch.where(span < SUB_STEP_MIN_SPAN, guess, z_t_s + scale * (z - z_t_s))


def sample_sub_step_times(t_s, t_t, steps: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, steps + 1) times t_s = tau_0 < ... < tau_steps = t_t: the interior ones are sorted logit-normal
    (-1.5, 0.8) draws u mapped to tau = t_s + (t_t - t_s) u."""
    B = t_s.shape[0]
    u = sample_time(B * (steps - 1), generator, T_MEAN, T_STD).reshape(B, steps - 1).to(t_s.device)
    u = u.sort(dim=1).values
    zero, one = torch.zeros(B, 1, device=t_s.device), torch.ones(B, 1, device=t_s.device)
    frac = torch.cat([zero, u, one], dim=1)
    times = t_s[:, None] + (t_t - t_s)[:, None] * frac
    times[:, 0], times[:, -1] = t_s, t_t  # exact end points
    return times


# ----------------------------------------------------------------------------------------------------------
# the student's loss


@dataclass
class DistillDraw:
    """All randomness of one distillation batch, on the data's device (discrete choices drawn on the CPU and
    their rows found there, as in flow.Draw)."""

    t: torch.Tensor  # (B,) student time t_s (1 on decode rows)
    t_next: torch.Tensor  # (B,) t_t = t_s + s (1 on decode rows)
    omega: torch.Tensor  # (B,)
    eps: torch.Tensor  # (B, L, C) standard normal
    p: torch.Tensor  # (B, L, 1) decode corruption level
    sub_times: torch.Tensor  # (B, K + 1) the teacher's sub-step times
    decode: torch.Tensor  # (B,) bool
    self_cond: torch.Tensor  # (B,) bool, never on decode rows
    drop_source: torch.Tensor  # (B,) bool: always False (the source stays in distillation)
    decode_rows: torch.Tensor  # row indices (flow.row_index): decode rows,
    self_cond_rows: torch.Tensor  # self-conditioned rows,
    distill_rows: torch.Tensor  # and the other rows, whose target the teacher gives


def draw_distill_noise(shape, recipe: Recipe, step_size: float, teacher_steps: int,
                       generator: torch.Generator | None = None, cpu_generator: torch.Generator | None = None,
                       device=None) -> DistillDraw:
    """The randomness of a (B, L, C) batch for a student step of `step_size` and `teacher_steps` sub-steps."""
    B, L, C = shape
    r = torch.rand(2, B, generator=cpu_generator)
    decode = r[0] < recipe.decode_prob
    self_cond = (r[1] < recipe.self_cond_prob) & ~decode
    u = sample_time(B, generator).to(device)
    omega = sample_guidance(B, generator, recipe.omega_low, recipe.omega_high).to(device)
    eps = torch.randn(B, L, C, generator=generator, device=device)
    p = decode_levels((B, L, 1), recipe, generator, device)
    t_s = u * max(1.0 - step_size, STEP_SIZE_FLOOR)
    t_t = t_s + step_size
    sub = sample_sub_step_times(t_s, t_t, teacher_steps, generator)
    rows = {"decode_rows": row_index(decode, device), "self_cond_rows": row_index(self_cond, device),
            "distill_rows": row_index(~decode, device)}
    decode, self_cond = to_device(decode, device), to_device(self_cond, device)
    t_s = torch.where(decode, torch.ones_like(t_s), t_s)
    t_t = torch.where(decode, torch.ones_like(t_t), t_t)
    return DistillDraw(t=t_s, t_next=t_t, omega=omega, eps=eps, p=p, sub_times=sub, decode=decode,
                       self_cond=self_cond, drop_source=torch.zeros(B, dtype=torch.bool, device=device), **rows)


def distill_loss(student, teacher, x, tokens, draw: DistillDraw, recipe: Recipe = Recipe(), valid=None,
                 known=None, trained=None, teacher_steps: int = 1):
    """The distillation objective of one batch; returns (loss, rows) as flow.elf_loss does.

    x (B, L, C) clean embeddings, tokens (B, L), valid (B, L) positions that count (None: all), known (B, L)
    bool positions of a clean source, neither noised nor scored. `trained` is the student's mixed pass.
    """
    B, L, C = x.shape
    dev = x.device
    trained = trained if trained is not None else student.mixed
    known = torch.zeros(B, L, dtype=torch.bool, device=dev) if known is None else known.to(dev, torch.bool)
    kn = known[..., None]
    is_dec = draw.decode.to(dev)
    t = _rows(draw.t)
    z_distill = t * x + (1 - t) * recipe.noise_scale * draw.eps
    z_decode = draw.p * x + (1 - draw.p) * recipe.decode_noise_scale * draw.eps
    z = torch.where(kn, x, torch.where(_rows(is_dec), z_decode, z_distill))

    # the shared self-conditioning slot: x0 at known positions; the teacher's first guess on half the
    # distillation rows; zeros elsewhere (decode rows get an all-zero slot)
    slot = torch.where(kn, x, torch.zeros_like(x))
    # (the teacher's passes run on no rows too: a row count is data, never a branch of a traced graph)
    sc = draw.self_cond_rows
    with torch.no_grad():
        guess = teacher_init(teacher, z[sc], draw.t[sc], draw.omega[sc], x[sc], known[sc])
        slot = slot.index_copy(0, sc, torch.where(kn[sc], x[sc], guess.to(slot.dtype)))
        slot = torch.where(_rows(is_dec), torch.zeros_like(slot), slot)

        rows = draw.distill_rows
        tgt = pd_target(teacher, z[rows], draw.t[rows], draw.t_next[rows], draw.omega[rows], slot[rows],
                        x[rows], known[rows], teacher_steps, draw.sub_times[rows], recipe.t_eps)
        target = torch.zeros_like(x).index_copy(0, rows, tgt.to(x.dtype))

    dec = draw.decode_rows
    x_pred, logits = trained(z, draw.t, draw.omega, slot, is_dec.float(), dec)
    err = (x_pred.float() - target).pow(2).mean(-1)  # (B, L)
    return token_mean_loss(err, logits, tokens, is_dec, dec, scored_positions(known, valid))


class DistillObjective:
    """The distillation objective as an elflow.methods.elf.Objective: draw(...) and loss(...), for
    `elflow.train.train(..., objective=...)`."""

    def __init__(self, teacher, student_steps: int, teacher_steps: int):
        self.teacher = teacher
        self.step_size = 1.0 / student_steps
        self.sub_steps = teacher_steps // student_steps

    def draw(self, shape, recipe, generator=None, cpu_generator=None, device=None, conditional=False):
        return draw_distill_noise(shape, recipe, self.step_size, self.sub_steps, generator, cpu_generator, device)

    def loss(self, net, x, tokens, draw, recipe, valid=None, known=None, trained=None):
        return distill_loss(net, self.teacher, x, tokens, draw, recipe, valid, known, trained, self.sub_steps)


# ----------------------------------------------------------------------------------------------------------
# the rounds


def check_schedule(student_steps, teacher_steps: int) -> list[int]:
    """The student step counts as a list; ELFError unless they fall strictly and each divides the teacher's."""
    steps = list(student_steps)
    if not isinstance(teacher_steps, int) or teacher_steps < 1:
        raise ELFError(f"--teacher-steps must be an integer >= 1, got {teacher_steps!r}")
    if not steps or any(not isinstance(n, int) or n < 1 for n in steps):
        raise ELFError(f"--student-steps must be integers >= 1, got {steps}")
    if any(b >= a for a, b in zip(steps, steps[1:])):
        raise ELFError(f"--student-steps must decrease strictly from round to round, got {steps}")
    bad = [n for n in steps if teacher_steps % n]
    if bad:
        raise ELFError(f"--student-steps {bad} do not divide --teacher-steps {teacher_steps}: every student step "
                       "must span a whole number of teacher steps")
    return steps


def _teacher_device():
    import os

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load_teacher(path, length: int | None = None, device=None):
    """(frozen network, info): the EMA weights of a run or checkpoint (its trained weights, with a warning,
    where it stored no EMA), in eval mode and without gradients."""
    from elflow.checkpoint import build_from_state_dict, load_init_weights

    cfg, sd, info = load_init_weights(path)
    if length and length > cfg.max_length:
        cfg = cfg.replace(max_length=length)
    net = build_from_state_dict(sd, config=cfg, options=info.get("short_run")).to(device or "cpu").eval()
    net.requires_grad_(False)
    return net, info


MANIFEST = "distill.json"
# settings a resumed distillation must share with the stored one
SAME_ON_RESUME = ("preset", "model", "short_run", "data", "space", "latent_std", "length", "layout", "batch", "steps", "epochs",
                  "seed", "lr", "ema_decay", "warmup_frac")


def _base_config(teacher_info: dict, overrides: dict):
    """The rounds' TrainConfig: the teacher's stored data and network settings, then the overrides."""
    from dataclasses import fields

    from elflow.model import PRESETS
    from elflow.train import TrainConfig

    from elflow.checkpoint import stored_training

    stored = (stored_training(teacher_info["checkpoint"]) or {}).get("train", {})
    known = {f.name for f in fields(TrainConfig)}
    keep = ("preset", "data", "text_field", "on_bad", "space", "latent_std", "length", "layout", "batch",
            "micro_batch", "adam_heads", "ns_method", "grad_clip", "dtype", "compile", "model",
            "task", "source_length", "source_field", "target_field", "space_dim", "space_seed", "val_fraction")
    base = {k: stored[k] for k in keep if k in stored and k in known}
    if stored:  # the teacher's table draw (stream 1 where it stored none)
        base["space_stream"] = TrainConfig.from_dict(stored).space_stream
    scale = teacher_info.get("space", {}).get("latent_std")
    if isinstance(scale, (int, float)) and base.get("space") is not None:
        base["latent_std"] = repr(float(scale))  # the teacher's resolved scale: no re-estimate, the same space
    base.update({k: v for k, v in overrides.items() if v is not None})
    if "data" not in base or "space" not in base:
        raise ELFError(f"{teacher_info['checkpoint']} stores no training data settings (a converted checkpoint?); "
                       "pass --data and --space")
    if base.get("preset") not in PRESETS:
        base["preset"] = "elf-b"  # every shape field is set from the teacher below
    shape = {k: v for k, v in teacher_info["config"].items() if k not in ("dim", "vocab_size", "max_length")}
    if overrides.get("predict") not in (None, shape.get("predict", "x")):
        raise ELFError(f"--predict {overrides['predict']}: the students start from the teacher's weights, whose head "
                       f"predicts {shape.get('predict', 'x')}; distil with --predict {shape.get('predict', 'x')}")
    for key in ("predict", "conditioning", "decoder", "bottleneck"):  # the network's variants are run settings
        if key in shape:
            base[key] = shape.pop(key)
    base["model"] = shape
    base["short_run"] = dict(teacher_info.get("short_run") or {})  # the students are networks of the teacher's kind
    base["length"] = base.get("length") or teacher_info["config"]["max_length"]
    base["recipe"] = TrainConfig.from_dict(stored).recipe  # the teacher's recipe constants
    base["sample_every"] = 0
    return TrainConfig(**base)


def distill(teacher, out, student_steps=(16, 8, 4, 2, 1), teacher_steps: int = 64, steps_per_round: int | None = None,
            epochs: float | None = None, warmup_frac: float = 0.1, ema_decay: float = 0.9999, lr: float | None = None,
            resume: bool = False, overwrite: bool = False, cache_dir=None, quiet: bool = False,
            stop_after: int | None = None, **overrides) -> dict:
    """Run the distillation rounds into `out`/round-<N>; returns {N: the round's run folder}.

    One round per student step count; a round lasts `steps_per_round` optimiser steps or `epochs` passes
    (one pass by default), warms up over `warmup_frac` of it. `overrides` are TrainConfig fields (data,
    space, batch, seed, dtype, log_every, ckpt_every, keep, ...). `stop_after` ends this invocation after
    that many optimiser steps in all; `resume` continues exactly where a stopped or killed one ended.
    """
    from elflow.train import train

    steps = check_schedule(student_steps, teacher_steps)
    if steps_per_round is not None and epochs is not None:
        raise ELFError("pass either --steps-per-round or --epochs, not both")
    if steps_per_round is not None and steps_per_round < 1:
        raise ELFError(f"--steps-per-round must be >= 1, got {steps_per_round}")
    if epochs is not None and not epochs > 0:
        raise ELFError(f"--epochs must be > 0, got {epochs}")
    if not 0 <= warmup_frac <= 1:
        raise ELFError(f"--warmup-frac must lie in [0, 1], got {warmup_frac}")
    if steps_per_round is None and epochs is None:
        epochs = 1.0
    out = check_output(out, folder=True)
    _check_out(out, [teacher])

    device = _teacher_device()
    teacher_net, info = load_teacher(teacher, device=device)
    info = {**info, "config": teacher_net.config.to_dict()}
    cfg = _base_config(info, overrides)
    cfg.steps = steps_per_round or cfg.steps
    cfg.epochs = None if steps_per_round else epochs
    cfg.warmup_frac = warmup_frac
    cfg.ema_decay = ema_decay
    if lr is not None:
        cfg.lr = lr
    if cfg.length > teacher_net.config.max_length:
        teacher_net = load_teacher(teacher, cfg.length, device)[0]

    manifest = {"format": "elflow-distill-1", "teacher": info["checkpoint"], "teacher_space_id": info.get("space_id"),
                "teacher_ema": info.get("ema", True), "student_steps": steps, "teacher_steps": teacher_steps,
                "train": {k: cfg.to_dict()[k] for k in SAME_ON_RESUME}}
    # under torchrun: one group for all rounds; rank 0 alone reads and writes OUT
    group = _process_group(cfg.dist_timeout)
    main = group is None or dist.get_rank() == 0
    hold = FolderHold(out, "elflow distill") if main else None
    status = [None]
    if main:
        try:
            hold.open()  # held for the whole distillation: a second command on OUT is refused
            fresh = _prepare_out(out, manifest, resume, overwrite)
            if fresh:
                atomic_write_json(out / MANIFEST, manifest)
            status = [fresh]
        except ELFError as e:
            hold.close(False)
            status = [e]
    if group is not None:
        dist.broadcast_object_list(status, src=0)
    if isinstance(status[0], ELFError):
        if group is not None:
            dist.destroy_process_group()
        raise status[0]
    fresh = status[0]

    rounds, left, ok = {}, stop_after, False
    try:
        for i, n in enumerate(steps):
            rdir = out / f"round-{n}"
            init = info["checkpoint"] if i == 0 else str(rounds[steps[i - 1]])
            rcfg = _round_config(cfg, n, teacher_steps, init, out)
            again = [(rdir / "run.json").exists()]
            if group is not None:  # every rank takes rank 0's view of the folder, before anyone writes it
                dist.broadcast_object_list(again, src=0)
            if not quiet and (group is None or dist.get_rank() == 0):
                print(f"round {i + 1}/{len(steps)}: the {n}-step student, in {rdir}", file=sys.stderr)
            summary = train(rcfg, rdir, resume=again[0], cache_dir=cache_dir, quiet=quiet,
                            stop_after=left, objective=DistillObjective(teacher_net, n, teacher_steps))
            rounds[n] = rdir
            if left is not None:
                left -= summary["end_step"] - summary["start_step"]
                if left <= 0:
                    break
            if not quiet:
                print(f"round {i + 1}/{len(steps)}: {n}-step student in {rdir}", file=sys.stderr)
        ok = True
    finally:
        if main:
            _settle(out, fresh, ok, steps)
            hold.close(ok or _started(out))
        if group is not None:
            dist.destroy_process_group()
    return rounds


def _process_group(timeout_minutes: float):
    """Under torchrun (WORLD_SIZE > 1) the process group every round trains in (its collectives wait
    `timeout_minutes`), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from elflow.utils import setup_distributed

    setup_distributed(timeout_minutes=timeout_minutes)
    return dist.group.WORLD


def _round_config(cfg, n: int, teacher_steps: int, init: str, out: Path):
    from dataclasses import replace

    s = distilled_defaults(n)
    name = f"{cfg.wandb_run or out.resolve().name}/round-{n}" if cfg.wandb else cfg.wandb_run
    return replace(cfg, init_from=init, distillation={"student_steps": n, "teacher_steps": teacher_steps},
                   sample_steps=s["steps"], sample_sampler=s["sampler"], sample_omega=s["omega"], wandb_run=name)


ROUND_DIR = re.compile(r"round-\d+")


def _own_names(folder: Path) -> set[str]:
    """The files of a distillation in `folder`: its record, its rounds, its report (never other files)."""
    if not folder.is_dir():
        return set()
    return {p.name for p in folder.iterdir() if p.name in (MANIFEST, "report.json") or ROUND_DIR.fullmatch(p.name)}


def _started(out: Path) -> bool:
    """Whether the distillation in `out` got as far as a checkpoint (from then on it resumes)."""
    from elflow.checkpoint import list_checkpoints

    return any(list_checkpoints(out / name) for name in _own_names(out) if ROUND_DIR.fullmatch(name))


def _settle(out: Path, fresh: bool, ok: bool, steps) -> None:
    """After the rounds: a replaced distillation goes once the new one has a checkpoint and comes back if it
    failed before; a refused or failed fresh start leaves no record behind."""
    from elflow.checkpoint import recover_replaced

    names = _own_names(out) | _own_names(out / REPLACED)
    outcome = recover_replaced(out, lambda d: ok or _started(d), names)
    if outcome is None and fresh and not ok and not _started(out) and (
            not any((out / f"round-{n}" / "run.json").exists() for n in steps)):
        (out / MANIFEST).unlink(missing_ok=True)


def _check_out(out: Path, teacher) -> None:
    """--out may not be the teacher's folder, nor a folder above it: a distillation never writes over its
    teacher."""
    out = out.expanduser().resolve()
    for t in teacher:
        t = Path(t).expanduser().resolve()
        if out == t or out in t.parents:
            raise ELFError(f"--out {out} holds the teacher ({t}); the distillation must go into a folder of its "
                           "own: choose another --out")


def _prepare_out(out: Path, manifest: dict, resume: bool, overwrite: bool) -> bool:
    """Check `out` (held by this command) against a stored distillation; True when this is a fresh start. An
    interrupted replacement is settled first; --overwrite sets the distillation's own files aside
    (OUT/.replaced-run) until the new one has a checkpoint, and leaves every other file as it is."""
    from elflow.checkpoint import recover_replaced, set_aside

    names = _own_names(out) | _own_names(out / REPLACED)
    if recover_replaced(out, _started, names) == "restored":
        print(f"restored the distillation in {out} that an interrupted --overwrite was replacing", file=sys.stderr)
    stored_path = out / MANIFEST
    if stored_path.exists():
        if overwrite:
            set_aside(out, sorted(_own_names(out)))
            return True
        if not resume:
            raise ELFError(f"{out} already holds a distillation; pass --resume to continue it or --overwrite "
                           "to replace it (the old one is kept until the new one's first checkpoint)")
        stored = read_json(stored_path)
        from elflow.train import TrainConfig

        diff = [k for k in ("teacher", "student_steps", "teacher_steps") if stored.get(k) != manifest[k]]
        try:
            train = TrainConfig.from_dict(stored.get("train", {})).to_dict()  # options read where they are stored
        except (TypeError, ValueError, AttributeError) as e:
            raise ELFError(f"{stored_path}: corrupted ({type(e).__name__}: {e})") from None
        diff += [f"train.{k}" for k in SAME_ON_RESUME if train[k] != manifest["train"][k]]
        if diff:
            raise ELFError(f"{out} holds another distillation (differs in {', '.join(diff)}); resume it with its "
                           "own settings, or choose another --out")
        return False
    if resume:
        raise ELFError(f"{out} holds no distillation to resume; check --out, or start without --resume")
    mine = _own_names(out)
    if any(p.name != FolderLock.NAME for p in out.iterdir()):
        if not overwrite:
            raise ELFError(f"{out} exists and is not an elflow distillation folder; choose another --out or pass "
                           "--overwrite (its files are left as they are)")
        if mine:
            set_aside(out, sorted(mine))
    return True


# ----------------------------------------------------------------------------------------------------------
# CLI


def _int_list(text: str) -> list[int]:
    try:
        return [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise ELFError(f"--student-steps must be a comma-separated list of integers such as 16,8,4,2,1, "
                       f"got {text!r}") from None


def add_arguments(p) -> None:
    p.add_argument("teacher", metavar="TEACHER", help="an elflow run or checkpoint folder (its EMA weights teach)")
    p.add_argument("--student-steps", default="16,8,4,2,1", help="the students' step counts, one round each")
    p.add_argument("--teacher-steps", type=int, default=64, help="teacher steps over [0, 1] (sub-steps per "
                   "student step: this / student steps)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps-per-round", type=int, default=None, help="optimiser steps per round")
    length.add_argument("--epochs", type=float, default=None, help="passes over the data per round (default 1)")
    p.add_argument("--out", default="runs/distill", help="folder of the rounds (OUT/round-<N>)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the teacher's)")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward (accumulation)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3 * batch / 256)")
    p.add_argument("--ema-decay", type=float, default=0.9999, help="EMA decay of each round's student")
    p.add_argument("--warmup-frac", type=float, default=0.1, help="warm-up as a fraction of each round")
    p.add_argument("--data", default=None, help="training text (default: the teacher's)")
    p.add_argument("--space", default=None, help="embedding space (default: the teacher's)")
    p.add_argument("--latent-std", default=None, help="latent std of the space (default: the teacher's)")
    p.add_argument("--length", type=int, default=None, help="sequence length (default: the teacher's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the students' noise and data order")
    p.add_argument("--predict", choices=("x", "v", "eps"), default=None,
                   help="the students' prediction target; it must be the teacher's (default: the teacher's)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default=None, help="autocast (default: the teacher's)")
    p.add_argument("--log-every", type=int, default=10, help="steps per metrics line")
    p.add_argument("--ckpt-every", type=int, default=500, help="steps per checkpoint (and one at each round's end)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept per round")
    p.add_argument("--resume", action="store_true", help="continue the distillation in --out")
    p.add_argument("--overwrite", action="store_true", help="replace the distillation in --out")
    p.add_argument("--cache-dir", default=None, help="tokenization cache")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    from elflow.tracking import add_arguments as add_tracking

    add_tracking(p, "one W&B run per round, named NAME/round-N")


def run(args) -> int:
    if args.wandb:
        from elflow.tracking import require

        require()
    for name in ("batch", "micro_batch", "log_every", "ckpt_every"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ELFError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.lr is not None and not args.lr > 0:
        raise ELFError(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.ema_decay < 1:
        raise ELFError(f"--ema-decay must lie in [0, 1), got {args.ema_decay}")
    overrides = {k: getattr(args, k) for k in ("batch", "micro_batch", "data", "space", "latent_std", "length",
                                               "dtype", "predict")}
    overrides.update(seed=args.seed, log_every=args.log_every, ckpt_every=args.ckpt_every, keep=args.keep,
                     wandb=args.wandb, wandb_run=args.wandb_run)
    rounds = distill(args.teacher, args.out, _int_list(args.student_steps), args.teacher_steps,
                     steps_per_round=args.steps_per_round, epochs=args.epochs, warmup_frac=args.warmup_frac,
                     ema_decay=args.ema_decay, lr=args.lr, resume=args.resume, overwrite=args.overwrite,
                     cache_dir=args.cache_dir, quiet=args.quiet, **overrides)
    for n, rdir in rounds.items():
        print(f"{n}-step student: {rdir} (elflow sample {rdir})")
    return 0

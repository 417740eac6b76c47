"""Progressive distillation's rounds: each round a training run whose objective is the teacher's
(elflow.methods.pd), started from the previous round's student; the rounds of one distillation share a
folder (OUT/<N>-step, by the student's steps) with a manifest (distill.json) that --resume and --overwrite read."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from elflow.config import NetworkOverrides, TrainConfig, check_setting, kept_from
from elflow.data.datasets import check_not_relative
from elflow.flow import FLOW_MAP_STEPS, MAX_MAP_STEPS
from elflow.lifecycle.claim import (
    absolute_paths,
    check_not_inside,
    check_only_own,
    local_path,
    micro_batch_for,
    stored_config,
    stored_files,
)
from elflow.lifecycle.outputs import check_out
from elflow.methods.lmd import MapMethod
from elflow.methods.pd import PDMethod, check_schedule
from elflow.model import PRESETS
from elflow.runs.checkpoint import list_checkpoints, recover_replaced, set_aside
from elflow.runs.folder import DISTILL_MANIFEST, REPLACED, REPORT_FILE, RUN_FILE, STATE_FILE, run_folders_holding
from elflow.runs.load import Origin, build_loaded, load_init_weights
from elflow.runs.log import training_records
from elflow.runs.record import Distillation, RunRecord
from elflow.runs.stored import training_settings
from elflow.schedule import EMA_DECAY
from elflow.space import latent_std_of, parse_space, space_name
from elflow.train import train
from elflow.util.budget import check_fits, elf_params, elf_training, precision, weights
from elflow.util.distributed import setup_distributed, world_size
from elflow.util.errors import ELFError
from elflow.util.files import FolderHold, atomic_write_json, check_output, read_json, resolved


def _teacher_device():
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class Teacher(NamedTuple):
    """A distillation's teacher, read once (`read_teacher`): its record, its EMA weights (its trained weights,
    with a warning, where it stored no EMA), where they came from, its training settings with those its record
    holds ({} for a model stored without them; the token store its checkpoint was trained on is its origin's).
    The teacher's network and the first student's starting weights are made from these weights;
    nothing of the teacher is read again, so that a run still training, whose checkpoint `--keep` prunes
    meanwhile, is distilled from the checkpoint that was read."""

    record: RunRecord
    weights: dict
    origin: Origin
    settings: dict

    def network(self, length: int, device) -> torch.nn.Module:
        """The frozen network of the teacher's weights (its positions widened to `length` where that is longer),
        in eval mode."""
        net = build_loaded(self.record, self.weights, self.origin.path, length).to(device).eval()
        return net.requires_grad_(False)

    @property
    def start(self) -> tuple:
        """(record, weights, origin): what a student started from the teacher loads (elflow.train.start_from)."""
        return self.record, self.weights, self.origin


def read_teacher(path) -> Teacher:
    """The teacher at `path` (a run, checkpoint or model folder), each of its files read once."""
    record, sd, origin = load_init_weights(path, need="distill")
    stored = training_settings(origin.path) if origin.format in ("checkpoint", "model-folder") else {}
    if stored:  # with those its record holds
        stored = TrainConfig.of_run(record, stored, origin.path).to_dict()
    return Teacher(record, sd, origin, stored)


# settings a resumed distillation must share with the stored one (the students' network is the teacher's, which
# the manifest names, and each round's run checks its own record on resume)
SAME_ON_RESUME = ("preset", "short_run", "data", "space", "length", "layout", "batch", "steps", "epochs", "seed", "lr",
                  "ema_decay", "warmup_frac")


def _same_on_resume(cfg: TrainConfig) -> dict:
    """What a distillation's manifest holds of its rounds' settings (SAME_ON_RESUME), the space by its --space
    value (each round's run checks the rest of its space on resume)."""
    d = cfg.to_dict()
    return {k: space_name(d[k]) if k == "space" and d[k] else d[k] for k in SAME_ON_RESUME}


# the teacher's training config a distillation keeps (its data and how it is read, its network and run)
KEPT = ("preset", "data", "text_field", "on_bad", "length", "layout", "batch", "micro_batch", "adam_heads", "ns_method",
        "grad_clip", "dtype", "compile", "network", "task", "val_fraction", "recipe")


def _base_config(teacher: Teacher, overrides: dict) -> TrainConfig:
    """The rounds' TrainConfig: the teacher's stored data and network settings, then the overrides."""
    overrides = dict(overrides)
    record, origin = teacher.record, teacher.origin
    base = {k: teacher.settings[k] for k in KEPT if k in teacher.settings}
    base.setdefault("recipe", record.recipe.to_dict())  # (a teacher stored without its settings: its record's)
    base.setdefault("task", record.task.to_dict() if record.task else None)
    # the teacher's space as built (its scale resolved: no re-estimate), its encoder or kind replaced by --space
    given, scale = overrides.pop("space", None), overrides.pop("latent_std", None)
    base["space"] = {**replace(record.space, id=None).to_dict(), **(parse_space(given) if given else {}),
                     **({"latent_std": latent_std_of(scale)} if scale is not None else {})}
    predict = overrides.get("predict")  # (the students' network is the teacher's: checked below)
    base.update({k: v for k, v in overrides.items() if v is not None and k != "predict"})
    if "data" not in base:
        raise ELFError(f"{origin.path} stores no training data settings (a converted or released model); pass "
                       "--data")
    if overrides.get("data") is None and origin.format == "checkpoint":  # the teacher's data, as recorded
        check_not_relative(base["data"], origin.data_store, Path(origin.path) / STATE_FILE)
    if base.get("preset") not in PRESETS:
        base["preset"] = "elf-b"  # every shape field is set from the teacher below
    shape = record.network
    if predict not in (None, shape.predict):
        raise ELFError(f"--predict {predict}: the students start from the teacher's weights, whose head predicts "
                       f"{shape.predict}; distil with --predict {shape.predict}")
    base["network"] = NetworkOverrides.of(shape).to_dict()  # the teacher's shape
    base["short_run"] = record.options.to_dict() if record.options.active else {}  # students of the teacher's kind
    base["length"] = base.get("length") or record.length
    base["sample_every"] = 0
    return absolute_paths(TrainConfig(**base))


def distill(teacher, out, student_steps=(16, 8, 4, 2, 1), teacher_steps: int = 64, steps_per_round: int | None = None,
            epochs: float | None = None, warmup_frac: float = 0.1, ema_decay: float = EMA_DECAY,
            lr: float | None = None,
            resume: bool = False, overwrite: bool = False, cache_dir=None, quiet: bool = False,
            stop_after: int | None = None, **overrides) -> dict:
    """Run the distillation rounds into `out`/<N>-step (`round_dir`); returns {N: the round's run folder}.

    One round per student step count; a round lasts `steps_per_round` optimiser steps or `epochs` passes
    (one pass by default), warms up over `warmup_frac` of it. `overrides` are TrainConfig fields (data,
    space, batch, seed, dtype, log_every, ckpt_every, keep, ...). `stop_after` ends this invocation after
    that many optimiser steps in all; `resume` continues exactly where a stopped or killed one ended.
    """
    steps = check_schedule(student_steps, teacher_steps)
    if steps_per_round is not None and epochs is not None:
        raise ELFError("pass either --steps-per-round or --epochs, not both")
    if steps_per_round is not None and steps_per_round < 1:
        raise ELFError(f"--steps-per-round must be >= 1, got {steps_per_round}")
    if epochs is not None and not epochs > 0:
        raise ELFError(f"--epochs must be > 0, got {epochs}")
    check_setting("warmup_frac", warmup_frac)
    if steps_per_round is None and epochs is None:
        epochs = 1.0
    out = check_out(out, folder=True)
    _check_out(out, [teacher])

    device = _teacher_device()
    read = read_teacher(teacher)
    record, origin = read.record, read.origin
    if record.network.target_time:
        raise ELFError(f"{teacher} is a flow-map student; progressive distillation starts from a model that "
                       "samples step by step (an undistilled model, or a progressive student)")
    cfg = _base_config(read, overrides)
    cfg.steps = steps_per_round or cfg.steps
    cfg.epochs = None if steps_per_round else epochs
    cfg.warmup_frac = warmup_frac
    cfg.ema_decay = ema_decay
    if lr is not None:
        cfg.lr = lr
    _check_memory(read, cfg, device, tangents=False)
    teacher_net = read.network(cfg.length, device)

    manifest = {"format": "elflow-distill-1", "teacher": local_path(origin.path), "teacher_space_id": record.space.id,
                "teacher_ema": origin.ema, "student_steps": steps, "teacher_steps": teacher_steps,
                "train": _same_on_resume(cfg)}
    # under torchrun: one group for all rounds; rank 0 alone reads and writes OUT
    group = _process_group(cfg.dist_timeout)
    main = group is None or dist.get_rank() == 0
    hold, fresh = _claim(out, manifest, resume, overwrite, group, main)
    rounds, left, ok = {}, stop_after, False
    try:
        for i, n in enumerate(steps):
            rdir = round_dir(out, n)
            seen = [rdir.name, (rdir / RUN_FILE).exists()]
            if group is not None:  # every rank takes rank 0's view of the folder, before anyone writes it
                dist.broadcast_object_list(seen, src=0)
            rdir, again = out / seen[0], seen[1]
            init = origin.path if i == 0 else str(rounds[steps[i - 1]])
            rcfg = _round_config(cfg, n, teacher_steps, init, out, rdir.name)
            if again:  # a round that has begun continues with its own update and schedule (an earlier run's)
                rcfg = kept_from(stored_config(rdir), rcfg)
            said = f"round {i + 1} of {len(steps)}, the {n}-step student ({rdir})"
            if main and not quiet:
                print(f"{said}: training", file=sys.stderr)
            summary = train(rcfg, rdir, resume=again, cache_dir=cache_dir, quiet=quiet, stop_after=left,
                            method=PDMethod(teacher_net, n, teacher_steps), init=read.start if i == 0 else None)
            read = read._replace(weights={})  # the teacher's network holds what it needs of them
            rounds[n] = rdir
            if left is not None:
                left -= summary["end_step"] - summary["start_step"]
                if left <= 0:
                    break
            if main and not quiet:
                print(f"{said}: done, {round_result(rdir)}", file=sys.stderr)
            if main and i + 1 < len(steps):
                warn_still_at_start(rcfg.ema_decay, summary["end_step"])
        ok = True
    finally:
        if main:
            _settle(out, fresh, ok, steps)
            hold.close(ok or _started(out))
        if group is not None:
            dist.destroy_process_group()
    return rounds


def _claim(out: Path, manifest: dict, resume: bool, overwrite: bool, group, main: bool):
    """(the hold on OUT, whether the distillation starts afresh): rank 0 takes OUT for the whole distillation
    (a second command on it is refused) and writes the manifest of a fresh one; every rank learns the outcome,
    and an ELFError of rank 0's is raised on every rank."""
    hold = FolderHold(out, "elflow distill") if main else None
    status = [None]
    if main:
        try:
            hold.open()
            fresh = _prepare_out(out, manifest, resume, overwrite)
            if fresh:
                atomic_write_json(out / DISTILL_MANIFEST, manifest)
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
    return hold, status[0]


def distill_flow_map(teacher, out, steps: int = 1000, sample_steps: int = FLOW_MAP_STEPS, warmup_frac: float = 0.1,
                     ema_decay: float = EMA_DECAY, lr: float | None = None, resume: bool = False,
                     overwrite: bool = False, cache_dir=None, quiet: bool = False, stop_after: int | None = None,
                     **overrides) -> Path:
    """Distil `teacher` into one flow-map student (elflow.methods.lmd) trained for `steps` optimiser steps in
    the run folder `out`, which samples at any step count (`sample_steps` by default). The student is the
    teacher's network with a target time, started from the teacher's EMA weights; `overrides` are TrainConfig
    fields as for `distill`. `resume` continues a stopped one exactly; `stop_after` ends this invocation after
    that many steps."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ELFError(f"--steps must be an integer >= 1 (the student's optimiser steps), got {steps!r}")
    if isinstance(sample_steps, bool) or not isinstance(sample_steps, int) or not 1 <= sample_steps <= MAX_MAP_STEPS:
        raise ELFError(f"the student's default sampling steps must be an integer from 1 to {MAX_MAP_STEPS}, got "
                       f"{sample_steps!r}")
    check_setting("warmup_frac", warmup_frac)
    out = check_output(out, False, "--out", folder=True)  # the student's own run folder, which --resume reopens,
    outer = run_folders_holding(resolved(out).parent)     # but never inside another run's folder
    if outer:
        raise ELFError(f"--out {out} lies inside {outer[0]}, the folder of another run; the student goes into a "
                       "folder of its own, outside any run: choose another --out")
    _check_out(out, [teacher])
    device = _teacher_device()
    read = read_teacher(teacher)
    record, origin = read.record, read.origin
    if record.distillation is not None:
        raise ELFError(f"{teacher} is a distilled student ({record.distillation.objective}); a flow-map student is "
                       "distilled from an undistilled ELF model")
    if record.network.decoder == "separate":
        raise ELFError(f"{teacher} reads out with a separate decoder; a flow-map student is distilled from a model "
                       "whose one network denoises and decodes")
    cfg = _base_config(read, overrides)
    cfg = replace(cfg, steps=steps, epochs=None, warmup_frac=warmup_frac,
                  ema_decay=ema_decay, init_from=origin.path,
                  distillation=Distillation("flow-map", sample_steps, None))
    if lr is not None:
        cfg = replace(cfg, lr=lr)
    _check_memory(read, cfg, device, tangents=True)
    teacher_net = read.network(cfg.length, device)
    if resume and (out / RUN_FILE).exists():
        cfg = kept_from(stored_config(out), cfg)
    train(cfg, out, resume=resume, overwrite=overwrite, cache_dir=cache_dir, quiet=quiet, stop_after=stop_after,
          method=MapMethod(teacher_net), command="elflow distill --objective flow-map", init=read.start)
    return out


def _check_memory(teacher: Teacher, cfg: TrainConfig, device, tangents: bool) -> None:
    """Before any network is built: the teacher's network and its no-grad passes, and a student's training step
    (elflow.util.budget.elf_training; `tangents` for a flow-map student), at the students' micro-batch and
    length (`cfg`), refused in one line when they do not fit `device` (the space's encoder is counted once it is
    built, in elflow.train.set_up)."""
    shape = teacher.record.network.widened(cfg.length)
    micro = micro_batch_for(cfg, world_size())
    recipe = cfg.flow_recipe()
    flags = f"--batch {cfg.batch}" + (f" --micro-batch {micro}" if micro != cfg.batch else "")
    check_fits(elf_training(shape, rows=micro, length=cfg.length, decode_share=recipe.decode_prob,
                            self_cond_share=recipe.self_cond_prob, checkpointing=bool(cfg.grad_checkpoint),
                            tangents=tangents, teacher=shape, teacher_weights=weights(elf_params(shape)),
                            **precision(device, cfg.dtype), what=f"distilling {teacher.origin.path}",
                            flags=f"{flags} --length {cfg.length}"), device)


def _process_group(timeout_minutes: float):
    """Under torchrun (WORLD_SIZE > 1) the process group every round trains in (its collectives wait
    `timeout_minutes`), else None."""
    if world_size() <= 1:
        return None

    setup_distributed(timeout_minutes=timeout_minutes)
    return dist.group.WORLD


def round_dir(out: Path, n: int) -> Path:
    """The run folder of the round whose student takes `n` steps: OUT/<n>-step (OUT/round-<n> where a
    distillation made before that name holds it)."""
    legacy = out / f"round-{n}"
    return legacy if (legacy / RUN_FILE).exists() and not (out / f"{n}-step").exists() else out / f"{n}-step"


def round_result(rdir: Path) -> str:
    """'step S, final loss L (denoising D, decoding C)': the last training record of a round's own folder."""
    recs = training_records(rdir)
    if not recs:
        return "no training record"
    last = recs[-1]
    parts = [f"{name} {last[k]:.4g}" for k, name in (("loss_denoise", "denoising"), ("loss_decode", "decoding"))
             if isinstance(last.get(k), (int, float))]
    return f"step {last['step']}, final loss {last['loss']:.4g}" + (f" ({', '.join(parts)})" if parts else "")


def warn_still_at_start(ema_decay: float, steps: int) -> None:
    """A warning when a round's EMA weights, which the next round starts from, are still mostly the weights
    the round started from (decay ** steps of them)."""
    kept = ema_decay ** steps
    if kept > 0.5:
        print(f"warning: after {steps} steps with --ema-decay {ema_decay:g}, the round's EMA weights are still "
              f"{kept:.0%} the weights it started from; the next round starts from them and sees the same "
              "batches, so it reports nearly the same losses. Longer rounds, or a lower --ema-decay (such as "
              "0.99), let each round start from its predecessor's student", file=sys.stderr)


def _round_config(cfg, n: int, teacher_steps: int, init: str, out: Path, folder: str):
    """A round's settings: its student starts from `init` and samples as its kind does (its record's sampling
    defaults follow its step count)."""
    name = f"{cfg.wandb_run or out.resolve().name}/{folder}" if cfg.wandb else cfg.wandb_run
    return replace(cfg, init_from=init, distillation=Distillation("pd", n, teacher_steps),
                   wandb_run=name)


ROUND_DIR = re.compile(r"\d+-step|round-\d+")


def _own_names(folder: Path) -> set[str]:
    """The files of a distillation in `folder`: its record, its rounds, its report (never other files)."""
    if not folder.is_dir():
        return set()
    return {p.name for p in folder.iterdir()
            if p.name in (DISTILL_MANIFEST, REPORT_FILE) or ROUND_DIR.fullmatch(p.name)}


def _started(out: Path) -> bool:
    """Whether the distillation in `out` got as far as a checkpoint (from then on it resumes)."""
    return any(list_checkpoints(out / name) for name in _own_names(out) if ROUND_DIR.fullmatch(name))


def _settle(out: Path, fresh: bool, ok: bool, steps) -> None:
    """After the rounds: a replaced distillation goes once the new one has a checkpoint and comes back if it
    failed before; a refused or failed fresh start leaves no record behind."""
    names = _own_names(out) | _own_names(out / REPLACED)
    outcome = recover_replaced(out, lambda d: ok or _started(d), names)
    if outcome is None and fresh and not ok and not _started(out) and (
            not any((round_dir(out, n) / RUN_FILE).exists() for n in steps)):
        (out / DISTILL_MANIFEST).unlink(missing_ok=True)


def _check_out(out: Path, teacher) -> None:
    """--out may not be the teacher's folder or its run folder, nor a folder above or inside them: a
    distillation never writes over or among its teacher's files."""
    out_path = resolved(out)
    for t in teacher:
        for held in (resolved(t), *run_folders_holding(t)):
            if out_path == held or out_path in held.parents:
                raise ELFError(f"--out {out_path} holds the teacher ({held}); the distillation must go into a "
                               "folder of its own: choose another --out")
        check_not_inside(out, t, "the teacher")


def _prepare_out(out: Path, manifest: dict, resume: bool, overwrite: bool) -> bool:
    """Check `out` (held by this command) against a stored distillation; True when this is a fresh start. An
    interrupted replacement is settled first; --overwrite sets the distillation's own files aside
    (OUT/.replaced-run) until the new one has a checkpoint, and leaves every other file as it is."""
    names = _own_names(out) | _own_names(out / REPLACED)
    if recover_replaced(out, _started, names) == "restored":
        print(f"restored the distillation in {out} that an interrupted --overwrite was replacing", file=sys.stderr)
    stored_path = out / DISTILL_MANIFEST
    if stored_path.exists():
        if overwrite:
            check_only_own(out, _own_names(out), "the distillation", "--overwrite replaces only what it wrote")
            _check_rounds(out, _own_names(out))
            set_aside(out, sorted(_own_names(out)))
            return True
        if not resume:
            raise ELFError(f"{out} already holds a distillation; pass --resume to continue it or --overwrite "
                           "to replace it (the old one is kept until the new one's first checkpoint)")
        stored = read_json(stored_path)

        stored = {**stored, "teacher": local_path(stored.get("teacher"))}  # (a path recorded relative: from here)
        diff = [k for k in ("teacher", "student_steps", "teacher_steps") if stored.get(k) != manifest[k]]
        try:  # options read where they are stored, paths from here
            train = _same_on_resume(absolute_paths(TrainConfig.from_dict(stored.get("train", {}))))
        except (TypeError, ValueError, AttributeError) as e:
            raise ELFError(f"{stored_path}: corrupted ({type(e).__name__}: {e})") from None
        diff += [f"train.{k}" for k in SAME_ON_RESUME if train[k] != manifest["train"][k]]
        if diff:
            raise ELFError(f"{out} holds another distillation (differs in {', '.join(diff)}); resume it with its "
                           "own settings, or choose another --out")
        return False
    if resume:
        raise ELFError(f"{out} holds no distillation to resume; check --out, or start without --resume")
    mine = _own_names(out) if overwrite else set()  # rounds whose record is gone: --overwrite replaces them
    check_only_own(out, mine, "a distillation", "a distillation goes into an empty folder or a folder of its own")
    _check_rounds(out, mine)
    if mine:
        set_aside(out, sorted(mine))
    return True


def _check_rounds(out: Path, names) -> None:
    """Each round folder among `names` holds only what its run wrote (its run.json's list): a file of another's
    inside a round (notes, samples, an evaluation's eval/ folder) is refused in one line, never set aside with
    the round and dropped."""
    for name in sorted(names):
        if ROUND_DIR.fullmatch(name):
            check_only_own(out / name, stored_files(out / name), "the round's run",
                           "--overwrite replaces only what the distillation wrote")



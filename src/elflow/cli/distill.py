"""`elflow distill`: its flags and its run (the work is the library's)."""

from __future__ import annotations

from elflow.cli.common import add_arguments as add_tracking
from elflow.cli.common import check_counts
from elflow.config import check_setting
from elflow.distill import distill, distill_flow_map
from elflow.flow import FLOW_MAP_STEPS
from elflow.runs.tracking import require_wandb
from elflow.schedule import EMA_DECAY, MUON_BLR
from elflow.util.budget import LENGTH_BOUND, TRAINING_STEPS_BOUND
from elflow.util.devices import RUN_DTYPES
from elflow.util.distributed import torchrun_env
from elflow.util.errors import ELFError

PD_TEACHER_STEPS = 64  # the released distillation's teacher steps


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
    p.add_argument("--objective", choices=("pd", "flow-map"), default="pd",
                   help="pd: progressive distillation, one student per step count, in rounds (OUT/<N>-step); "
                        "flow-map: one student that samples at any step count, trained in one phase into OUT "
                        "(default pd)")
    p.add_argument("--student-steps", default=None,
                   help="pd: the students' step counts, one round each (default 16,8,4,2,1); flow-map: the "
                        f"student's default sampling steps (default {FLOW_MAP_STEPS}; it samples at any)")
    p.add_argument("--steps", type=int, default=None,
                   help="flow-map: the student's optimiser steps (default 1000); pd rounds take --steps-per-round")
    p.add_argument("--teacher-steps", type=int, default=None, help=f"pd: teacher steps over [0, 1] (sub-steps per "
                   f"student step: this / student steps; default {PD_TEACHER_STEPS}); a flow-map student learns from "
                   "the teacher's velocity at each time, not from its steps")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps-per-round", type=int, default=None, help="optimiser steps per round")
    length.add_argument("--epochs", type=float, default=None, help="passes over the data per round (default 1)")
    p.add_argument("--out", default="runs/distill",
                   help="folder of the rounds, one run folder per student: OUT/<N>-step")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the teacher's)")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward (accumulation)")
    p.add_argument("--lr", type=float, default=None, help=f"learning rate (default {MUON_BLR:g} x batch / 256)")
    p.add_argument("--ema-decay", type=float, default=EMA_DECAY, help=f"EMA decay of each round's student "
                                                                     f"(default {EMA_DECAY})")
    p.add_argument("--warmup-frac", type=float, default=0.1, help="warm-up as a fraction of each round")
    p.add_argument("--data", default=None, help="training text (default: the teacher's)")
    p.add_argument("--space", default=None, help="embedding space (default: the teacher's)")
    p.add_argument("--latent-std", default=None, help="latent std of the space (default: the teacher's)")
    p.add_argument("--length", type=int, default=None, help="sequence length (default: the teacher's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the students' noise and data order")
    p.add_argument("--predict", choices=("x", "v", "eps"), default=None,
                   help="the students' prediction target; it must be the teacher's (default: the teacher's)")
    p.add_argument("--dtype", choices=RUN_DTYPES, default=None, help="autocast (default: the teacher's)")
    p.add_argument("--log-every", type=int, default=10, help="steps per metrics line")
    p.add_argument("--ckpt-every", type=int, default=500, help="steps per checkpoint (and one at each round's end)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept per round")
    p.add_argument("--resume", action="store_true", help="continue the distillation in --out")
    p.add_argument("--overwrite", action="store_true", help="replace the distillation in --out")
    p.add_argument("--cache-dir", default=None, help="tokenization cache")
    p.add_argument("--quiet", action="store_true", help="no progress bars")

    add_tracking(p, "one W&B run per round, named NAME/<N>-step")


def run(args) -> int:
    torchrun_env()  # torchrun's variables, checked before the batch is split by WORLD_SIZE
    if args.wandb:
        require_wandb()
    for name in ("batch", "micro_batch", "log_every", "ckpt_every"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ELFError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    check_counts(args, length=LENGTH_BOUND, steps=TRAINING_STEPS_BOUND, steps_per_round=TRAINING_STEPS_BOUND)
    if args.keep is not None and args.keep < 0:
        raise ELFError(f"--keep must be >= 0 (0 keeps every checkpoint), got {args.keep}")
    for name in ("lr", "ema_decay", "warmup_frac"):  # the ranges of the training settings they set
        check_setting(name, getattr(args, name))
    overrides = {k: getattr(args, k) for k in ("batch", "micro_batch", "data", "space", "latent_std", "length",
                                               "dtype", "predict")}
    overrides.update(seed=args.seed, log_every=args.log_every, ckpt_every=args.ckpt_every, keep=args.keep,
                     wandb=args.wandb, wandb_run=args.wandb_run)
    if args.objective == "flow-map":
        if args.steps_per_round is not None or args.epochs is not None:
            raise ELFError("--steps-per-round and --epochs set the rounds of --objective pd; a flow-map student trains "
                           "for --steps")
        if args.teacher_steps is not None:
            raise ELFError(f"--teacher-steps {args.teacher_steps} sets the teacher's sub-steps of --objective pd; a "
                           "flow-map student learns from the teacher's velocity at each time and takes no teacher "
                           "steps: drop --teacher-steps")
        steps = _int_list(args.student_steps) if args.student_steps else [FLOW_MAP_STEPS]
        if len(steps) != 1:
            raise ELFError(f"--student-steps of a flow-map student is one step count (its default), got "
                           f"{args.student_steps}")
        out = distill_flow_map(args.teacher, args.out, 1000 if args.steps is None else args.steps, steps[0],
                               warmup_frac=args.warmup_frac, ema_decay=args.ema_decay, lr=args.lr,
                               resume=args.resume, overwrite=args.overwrite, cache_dir=args.cache_dir,
                               quiet=args.quiet, **overrides)
        print(f"flow-map student: {out} (elflow sample {out} --steps K, for any K)")
        return 0
    if args.steps is not None:
        raise ELFError("--steps is the optimiser steps of a flow-map student (--objective flow-map); the rounds of "
                       "--objective pd take --steps-per-round")
    teacher_steps = PD_TEACHER_STEPS if args.teacher_steps is None else args.teacher_steps
    rounds = distill(args.teacher, args.out, _int_list(args.student_steps or "16,8,4,2,1"), teacher_steps,
                     steps_per_round=args.steps_per_round, epochs=args.epochs, warmup_frac=args.warmup_frac,
                     ema_decay=args.ema_decay, lr=args.lr, resume=args.resume, overwrite=args.overwrite,
                     cache_dir=args.cache_dir, quiet=args.quiet, **overrides)
    for n, rdir in rounds.items():
        print(f"{n}-step student: {rdir} (elflow sample {rdir})")
    return 0

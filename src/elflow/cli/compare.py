"""`elflow compare`: its flags and its run (the work is the library's)."""

from __future__ import annotations

from pathlib import Path

from elflow.cli.common import check_counts, check_scales
from elflow.config import RUN_DEFAULTS, TrainConfig
from elflow.experiments.compare import DEFAULT_MINUTES, GRID_DEFAULTS, JUDGE_DEFAULTS, compare
from elflow.flow import SAMPLING_RANGES
from elflow.methods.baseline import KNOB_RANGES, MATCHES
from elflow.model import PRESETS
from elflow.schedule import MUON_BLR
from elflow.util.budget import MAX_SAMPLING_STEPS, MAX_TRAINING_STEPS, SAMPLES_BOUND, TRAINING_STEPS_BOUND
from elflow.util.errors import ELFError


# ----------------------------------------------------------------------------------------------------------
# command line
def add_arguments(p) -> None:
    b = p.add_argument_group("what is trained (the same for the three methods)")
    b.add_argument("--data", default="builtin", help="training text: 'builtin' (Shakespeare), a .txt file or "
                   "folder, a .jsonl file or a hub dataset")
    b.add_argument("--preset", default="demo", choices=tuple(PRESETS), help="ELF's size; the baselines match its "
                   "parameter count")
    quick = RUN_DEFAULTS["quickstart"][0]
    b.add_argument("--space", default=None, help=f"embedding space (default: the quickstart's {quick['space']} for "
                                                 "the demo preset, else the preset's)")
    b.add_argument("--length", type=int, default=64, help="sequence length")
    b.add_argument("--batch", type=int, default=32, help="rows per optimiser step")
    b.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default: the quickstart's {quick['lr']:g} for the demo preset, else "
                        f"{MUON_BLR:g} x batch / 256)")
    b.add_argument("--match", choices=MATCHES, default="total",
                   help="match ELF's parameter count in all, or without token tables and decode head")
    b.add_argument("--seed", type=int, default=0, help="seed of training and sampling")
    g = b.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, default=None, help="budget: this many optimiser steps each (same tokens)")
    g.add_argument("--minutes", type=float, default=None,
                   help=f"budget: this many minutes of training each (default {DEFAULT_MINUTES:g})")
    s = p.add_argument_group("sampling and judging")
    s.add_argument("--num", type=int, default=GRID_DEFAULTS["num"], help="samples per setting")
    s.add_argument("--elf-steps", type=int, nargs="+", default=list(GRID_DEFAULTS["elf_steps"]),
                   help="ELF sampling steps")
    s.add_argument("--omega", type=float, nargs="+", default=list(GRID_DEFAULTS["omegas"]),
                   help="ELF guidance scales")
    s.add_argument("--temperature", type=float, nargs="+", default=list(GRID_DEFAULTS["ar_temperatures"]),
                   help="AR temperatures")
    s.add_argument("--mdlm-steps", type=int, nargs="+", default=list(GRID_DEFAULTS["mdlm_steps"]),
                   help="MDLM sampling steps")
    s.add_argument("--judge", default=None, help="a judge folder or hub id (default: a small judge trained once on "
                   "the training split and cached)")
    s.add_argument("--judge-steps", type=int, default=JUDGE_DEFAULTS["steps"], help="training steps of that judge")
    o = p.add_argument_group("where")
    o.add_argument("--out", default="runs/compare", help="output folder")
    o.add_argument("--overwrite", action="store_true", help="replace a comparison in --out")
    o.add_argument("--cache-dir", default=None, help="tokenization and judge cache ($ELFLOW_CACHE)")
    o.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    o.add_argument("--quiet", action="store_true", help="no progress bars (training, sampling, judging) and no "
                                                        "samples printed during training")


def run(args) -> int:
    for name in ("num", "length", "batch", "judge_steps"):
        if getattr(args, name) < 1:
            raise ELFError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_counts(args, steps=TRAINING_STEPS_BOUND, num=SAMPLES_BOUND,
                 judge_steps=(MAX_TRAINING_STEPS, "the judge trains for 200 steps by default"),
                 elf_steps=(MAX_SAMPLING_STEPS, "the released recipe samples with at most 64 steps"),
                 mdlm_steps=(MAX_SAMPLING_STEPS, "MDLM samples with 64 steps by default"))
    check_scales(args, omega=SAMPLING_RANGES["omega"], temperature=KNOB_RANGES["temperature"])
    given = dict(preset=args.preset, data=args.data, length=args.length, batch=args.batch, seed=args.seed,
                 match=args.match, **({"space": args.space} if args.space else {}),
                 **({"lr": args.lr} if args.lr is not None else {}))
    if args.preset != "demo":  # the quickstart's settings fit the demo network
        given.update(adam_heads=True, ema_decay=0.98, warmup=50, keep=2)
        cfg = TrainConfig(**given)
    else:
        cfg = TrainConfig.named("quickstart", **given)
    cfg.resolved().validate()
    compare(cfg, args.out, steps=args.steps, minutes=args.minutes, num=args.num, judge=args.judge,
            elf_steps=args.elf_steps, omegas=args.omega, ar_temperatures=args.temperature, mdlm_steps=args.mdlm_steps,
            seed=args.seed, cache_dir=args.cache_dir, device=args.device, overwrite=args.overwrite,
            judge_settings={"steps": args.judge_steps}, quiet=args.quiet)
    print(f"results: {Path(args.out) / 'compare.json'}; plot: {Path(args.out) / 'compare.png'}")
    return 0

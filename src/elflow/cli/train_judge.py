"""`elflow train-judge`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import json
import math

from elflow.data.corpus import check_documents
from elflow.eval.judge import NOT_GPT2_NOTE, JudgeConfig, check_judge_training, train_judge
from elflow.lifecycle.outputs import check_out
from elflow.util.devices import check_device
from elflow.util.errors import ELFError
from elflow.util.files import FolderHold


# ----------------------------------------------------------------------------------------------------------
# command line
def add_arguments(p) -> None:
    d = JudgeConfig()
    p.add_argument("--out", default="runs/judge", help="folder for the Hugging Face causal-LM judge")
    p.add_argument("--data", default="builtin",
                   help="training text: 'builtin' (Shakespeare), a .txt file, a folder or a .jsonl file")
    p.add_argument("--steps", type=int, default=200, help="optimiser steps")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden width")
    p.add_argument("--depth", type=int, default=d.depth, help="transformer blocks")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    p.add_argument("--context", type=int, default=d.context, help="context length (eval truncates to it)")
    p.add_argument("--val-every", type=int, default=10, help="hold out every N-th document for the check")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and data order")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--cache-dir", default=None, help="where the GPT-2 ranks are cached ($ELFLOW_CACHE)")
    p.add_argument("--overwrite", action="store_true", help="write into an --out folder that is not empty")


def run(args) -> int:
    for name in ("steps", "batch_size", "hidden", "depth", "heads"):
        if getattr(args, name) < 1:
            raise ELFError(f"--{name.replace('_', '-')} must be at least 1")
    if args.val_every < 2:
        raise ELFError(f"--val-every must be at least 2 (every N-th document is held out), got {args.val_every}")
    if args.context < 2:
        raise ELFError(f"--context must be at least 2 (a judge scores each token given the ones before it), "
                       f"got {args.context}")
    if not (math.isfinite(args.lr) and args.lr > 0) or args.warmup < 0:
        raise ELFError(f"--lr must be a finite number > 0 and --warmup >= 0, got {args.lr} and {args.warmup}")
    check_device(args.device)
    check_documents(args.data)  # a bad --data is refused before the tokenizer is built
    cfg = JudgeConfig(hidden=args.hidden, depth=args.depth, heads=args.heads, context=args.context)
    check_judge_training(cfg, args.batch_size, args.steps, args.device)
    out = check_out(args.out, folder=True)
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise ELFError(f"--out {out} is not empty; pass --overwrite to write the judge into it (its files of the "
                       "same names are replaced), or choose another --out")
    with FolderHold(out, "elflow train-judge"):
        info = train_judge(args.out, cfg, data=args.data, steps=args.steps, batch_size=args.batch_size,
                           lr=args.lr, warmup=args.warmup, seed=args.seed, val_every=args.val_every,
                           device=args.device, cache_dir=args.cache_dir)
    print(f"judge saved to {args.out} ({info['seconds']:.0f} s); held-out perplexity "
          f"{info['heldout_perplexity']:.2f} on {info['heldout_tokens']} tokens of {info['heldout_documents']} "
          f"held-out document(s)")
    print(f"use it with: elflow eval SAMPLES.jsonl --judge {args.out}")
    print(NOT_GPT2_NOTE)
    print(json.dumps(info))
    return 0

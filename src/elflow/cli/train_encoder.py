"""`elflow train-encoder`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import math

from elflow.experiments.encoder_train import check_encoder_training, train_encoder
from elflow.lifecycle.outputs import check_out
from elflow.util.devices import check_device
from elflow.util.errors import ELFError
from elflow.util.files import FolderHold


# ----------------------------------------------------------------------------------------------------------
# command line
def add_arguments(p) -> None:
    p.add_argument("--out", default="runs/encoder", help="folder for the encoder and its tokenizer "
                   "(default: runs/encoder); use it as --space t5:FOLDER")
    p.add_argument("--data", default="builtin", help="training text: 'builtin' (Shakespeare), a .txt file, a folder "
                   "or a .jsonl file (default: builtin)")
    p.add_argument("--vocab", type=int, default=2000, help="sentencepiece pieces (default: 2000)")
    p.add_argument("--on-bad", choices=("stop", "skip"), default="stop",
                   help="empty, binary or non-UTF-8 files and bad jsonl lines: stop with an error, or skip them with "
                        "a warning (default: stop)")
    p.add_argument("--length", type=int, default=64, help="tokens per training window (default: 64)")
    p.add_argument("--density", type=float, default=0.15, help="share of tokens corrupted (default: 0.15, T5's)")
    p.add_argument("--span", type=float, default=3.0, help="mean corrupted-span length (default: 3, T5's)")
    p.add_argument("--hidden", type=int, default=128, help="width d_model (default: 128)")
    p.add_argument("--depth", type=int, default=2, help="encoder blocks, and as many decoder blocks (default: 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    p.add_argument("--steps", type=int, default=300, help="optimiser steps (default: 300)")
    p.add_argument("--batch", type=int, default=32, help="windows per step (default: 32)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate, cosine decay (default: 2e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the corruption (default: 0)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--cache-dir", default=None, help="where the built-in corpus is cached (default: $ELFLOW_CACHE "
                   "or ~/.cache/elflow)")
    p.add_argument("--overwrite", action="store_true", help="write into an --out folder that is not empty")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    for name in ("vocab", "length", "hidden", "depth", "heads", "steps", "batch"):
        if getattr(args, name) < 1:
            raise ELFError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.hidden % args.heads:
        raise ELFError(f"--hidden {args.hidden} does not split into --heads {args.heads}")
    for ok, what in ((0 < args.density < 1, f"--density must lie in (0, 1), got {args.density}"),
                     (math.isfinite(args.span) and 1 <= args.span <= args.length,
                      f"--span must be a number from 1 to --length {args.length}, got {args.span}"),
                     (math.isfinite(args.lr) and args.lr > 0, f"--lr must be a finite number > 0, got {args.lr}"),
                     (args.length >= 4, f"--length must be at least 4 (a window needs a span and tokens around it), "
                                        f"got {args.length}")):
        if not ok:
            raise ELFError(what)
    check_device(args.device)
    check_encoder_training(vocab=args.vocab, length=args.length, density=args.density, span=args.span,
                           hidden=args.hidden, depth=args.depth, heads=args.heads, batch=args.batch, steps=args.steps,
                           device=args.device)
    out = check_out(args.out, folder=True)
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise ELFError(f"--out {out} is not empty; pass --overwrite to write the encoder into it, or choose another "
                       "--out")
    with FolderHold(out, "elflow train-encoder"):  # a second command writing the same folder is refused meanwhile
        info = train_encoder(out, args.data, vocab=args.vocab, length=args.length, density=args.density,
                             span=args.span, hidden=args.hidden, depth=args.depth, heads=args.heads, steps=args.steps,
                             batch=args.batch, lr=args.lr, seed=args.seed, device=args.device,
                             cache_dir=args.cache_dir, progress=not args.quiet, on_bad=args.on_bad)
    print(f"encoder saved to {out} ({info['seconds']:.0f} s): held-out span-corruption loss "
          f"{info['heldout_loss']:.3f} (at initialisation {info['heldout_loss_at_init']:.3f}, unigram "
          f"{info['heldout_unigram_entropy']:.3f}); use it with --space t5:{out}")
    return 0

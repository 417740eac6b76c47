"""`elflow bench`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import json

from elflow.cli.common import check_counts
from elflow.experiments.bench import MODES, bench
from elflow.model import PRESETS
from elflow.newton_schulz import NS_METHODS
from elflow.util.budget import MAX_THREADS, check_sampling_steps
from elflow.util.devices import AUTOCAST_DTYPES, RUN_DTYPES, check_device
from elflow.util.files import check_stdout_open, print_result


# ----------------------------------------------------------------------------------------------------------
# CLI
def add_arguments(p) -> None:
    p.add_argument("mode", choices=MODES, help="forward: one no-grad pass; train: full optimiser steps; "
                                                "sample: generation including the decode pass")
    p.add_argument("--preset", default="tiny", help=f"network size: {', '.join(PRESETS)}")
    p.add_argument("--depth", type=int, default=None, help="transformer blocks (default: the preset's)")
    p.add_argument("--hidden", type=int, default=None, help="hidden width (default: the preset's)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: the preset's)")
    p.add_argument("--vocab-size", type=int, default=None, help="decode-head vocabulary (default: the preset's)")
    p.add_argument("--length", type=int, default=None, help="sequence length L (default: the preset's)")
    p.add_argument("--batch", type=int, default=4, help="rows per pass (train: per micro-batch)")
    p.add_argument("--steps", type=int, default=32, help="sample: sampling steps (the decode pass is extra)")
    p.add_argument("--dtype", choices=AUTOCAST_DTYPES, default="fp32", help="autocast precision")
    p.add_argument("--compile", action="store_true", help="torch.compile the network")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--iters", type=int, default=3, help="timed iterations (steps, passes or generations)")
    p.add_argument("--accum", type=int, default=1, help="train: micro-batches per optimiser step")
    p.add_argument("--space", choices=["standin", "none"], default="standin",
                   help="train: a random encoder of the real shape (standin) or free embeddings (none)")
    p.add_argument("--grad-checkpoint", action="store_true", help="train: activation checkpointing per block")
    p.add_argument("--adam-heads", action="store_true", help="train: heads and embedders on Adam, not Muon")
    p.add_argument("--ns-dtype", choices=RUN_DTYPES, default="auto",
                   help="train: Newton-Schulz dtype (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--ns-method", choices=NS_METHODS, default="auto",
                   help="train: Newton-Schulz evaluation (auto: by-shape for fp32 on CPU, iterate otherwise)")
    p.add_argument("--peak-size", type=int, default=None, help="matmul size of the peak measurement")
    p.add_argument("--breakdown", action="store_true", help="train: time encoder/passes/backward/optimiser/EMA")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    if args.json:
        check_stdout_open("--json")
    check_sampling_steps(args.steps)
    check_counts(args, threads=(MAX_THREADS, "more threads than cores only slow it"))
    args.device = check_device(args.device)
    rec = bench(args.mode, args.preset, args.depth, args.hidden, args.heads, args.length, args.batch, args.steps,
                args.dtype, args.compile, args.device, args.warmup, args.iters, args.accum, args.space,
                args.grad_checkpoint, args.adam_heads, args.ns_dtype, args.ns_method, args.peak_size,
                args.breakdown, args.seed, args.threads, args.vocab_size)
    if args.json:
        print_result(json.dumps(rec))
        return 0
    print(f"{rec['mode']} {rec['preset']} B={rec['batch']} L={rec['length']} {rec['dtype']} on {rec['device_name']} "
          f"({rec['threads']} threads)")
    print(f"  {rec['seconds_per_iter']:.4g} s/iter, {rec['tokens_per_s']:.4g} tokens/s, "
          f"{rec['flops_per_s'] / 1e9:.4g} GFLOP/s model, peak {rec['peak_flops_per_s'] / 1e9:.4g} GFLOP/s "
          f"({rec['peak']['op']} {rec['peak']['size']}), utilisation {100 * rec['utilisation']:.1f}%")
    print(f"  peak memory {rec['peak_memory_bytes'] / 2 ** 20:.0f} MiB ({rec['memory_kind']})")
    if "breakdown_seconds" in rec:
        print("  " + ", ".join(f"{k} {v:.3g}s" for k, v in rec["breakdown_seconds"].items()))
    return 0

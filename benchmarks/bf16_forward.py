"""ELF-B inference forward, elflow against our re-implementation of the authors' network, fp32 and bf16 autocast.

Both networks hold the same weights (`authors_network.AuthorsELF.from_elflow`). Each round times every
contestant on every (dtype, pass) in one process, the contestants' order rotating from round to round, so
that load from other jobs falls on all of them alike; the figure is the ratio elflow speed / authors speed
(= authors time / elflow time), as the median over rounds with its range, and the ratio of the best times.

    pass     denoise: net(z, t, omega, x_prev) against theirs(cat[z, x_prev], t, omega)[0]
             decode:  net.decode(z, omega)      against theirs(cat[z, 0], 1, omega, decoder_step_active=True)
    dtype    fp32; bf16 = torch.autocast(cpu, bfloat16) around the call, as `elflow bench` and the sampler do
    accuracy each network's bf16 output against its own fp32 output (max and mean |difference|; for the
             logits also the share of positions whose argmax changes), over --accuracy-seeds random networks
             (default initialisation, the x head redrawn so that it is not zero) and inputs

`--baseline-src FILE` adds a contestant: elflow's network from another copy of model.py (e.g. an earlier
commit's, `git show REV:src/elflow/model.py > /tmp/model_before.py`), with the same weights. `--literal` adds
the authors' network with autocast disabled for CUDA only (authors_network.py says why). `--clock thread`
with `--threads 1` counts this thread's CPU time, which time spent waiting for other jobs does not inflate.
Writes one JSON line to benchmarks/results/bf16_forward.jsonl (CPU model and flags, torch, threads, load).

    python benchmarks/bf16_forward.py                    # ELF-B, L 1,024, batch 1, 5 rounds (~5 min on 2 cores)
    python benchmarks/bf16_forward.py --threads 1 --clock thread --rounds 9
    python benchmarks/bf16_forward.py --quick            # tiny sizes, seconds (a smoke test)
    python benchmarks/bf16_forward.py --profile DIR      # also torch.profiler tables per (net, dtype, pass)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from authors_network import AuthorsELF  # noqa: E402

from elflow.model import ELF, get_config
from elflow.util.devices import cpu_flags

RESULTS = Path(__file__).resolve().parent / "results" / "bf16_forward.jsonl"
FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni", "avx512_vnni")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_model_module(path: str):
    spec = importlib.util.spec_from_file_location("elflow_model_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def build(preset: str, length: int, seed: int, baseline: str | None, literal: bool):
    """{name: (net, run(dtype, pass) -> output)} with one set of weights, and the config."""
    cfg = get_config(preset, max_length=length)
    torch.manual_seed(seed)
    net = ELF(cfg).eval()
    with torch.no_grad():  # a trained head is not zero: give the x head weights so its output carries errors
        torch.nn.init.normal_(net.x_head.weight, std=cfg.hidden ** -0.5)
    theirs = AuthorsELF.from_elflow(net).eval()
    g = torch.Generator().manual_seed(seed + 1)
    z = torch.randn(1, length, cfg.dim, generator=g)
    x_prev = torch.randn(1, length, cfg.dim, generator=g)
    t, w, one = torch.full((1,), 0.4), torch.full((1,), 3.0), torch.ones(1)
    zx, z0 = torch.cat([z, x_prev], -1), torch.cat([z, torch.zeros_like(z)], -1)

    def ours(m):
        return {"denoise": lambda: m(z, t, w, x_prev), "decode": lambda: m.decode(z, w)}

    calls = {"elflow": ours(net),
             "authors": {"denoise": lambda: theirs(zx, t, w)[0],
                         "decode": lambda: theirs(z0, one, w, decoder_step_active=True)[1]}}
    if literal:  # their autocast('cuda', enabled=False) taken literally: on a CPU, input path and heads in bf16
        lit = AuthorsELF.from_elflow(net, autocast_off="cuda").eval()
        calls["authors_literal"] = {"denoise": lambda: lit(zx, t, w)[0],
                                    "decode": lambda: lit(z0, one, w, decoder_step_active=True)[1]}
    if baseline:
        old = load_model_module(baseline).ELF(cfg).eval()
        old.load_state_dict(net.state_dict())
        calls["elflow_baseline"] = ours(old)
    return calls, cfg


def run_once(fn, dtype: str):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        return fn()


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def timed(fn, dtype: str, iters: int, clock) -> float:
    best = float("inf")
    for _ in range(iters):
        t0 = clock()
        run_once(fn, dtype)
        best = min(best, clock() - t0)
    return best


def accuracy(calls) -> dict:
    """Each contestant's bf16 output against its own fp32 output, per pass."""
    out = {}
    for name, passes in calls.items():
        for p, fn in passes.items():
            ref, low = run_once(fn, "fp32").double(), run_once(fn, "bf16").double()
            d = (low - ref).abs()
            rec = {"max_abs": d.max().item(), "mean_abs": d.mean().item(), "ref_mean_abs": ref.abs().mean().item()}
            if p == "decode":
                rec["argmax_changed"] = (low.argmax(-1) != ref.argmax(-1)).double().mean().item()
            out[f"{name}/{p}"] = rec
    return out


def accuracy_study(args, seeds: int) -> dict:
    """accuracy() over `seeds` networks and inputs (seed, seed + 1, ...): the mean of the mean errors, the largest
    max error, the mean share of changed argmaxes; and the largest fp32 gap between elflow and the authors."""
    runs, gap = [], {"denoise": 0.0, "decode": 0.0}
    for k in range(seeds):
        calls, _ = build(args.preset, args.length, args.seed + k, args.baseline_src, args.literal)
        runs.append(accuracy(calls))
        for p in gap:
            d = (run_once(calls["elflow"][p], "fp32") - run_once(calls["authors"][p], "fp32")).abs().max().item()
            gap[p] = max(gap[p], d)
    summary = {}
    for key in runs[0]:
        rows = [r[key] for r in runs]
        summary[key] = {"max_abs": max(r["max_abs"] for r in rows),
                        "mean_abs": statistics.fmean(r["mean_abs"] for r in rows),
                        "ref_mean_abs": statistics.fmean(r["ref_mean_abs"] for r in rows)}
        if "argmax_changed" in rows[0]:
            summary[key]["argmax_changed"] = statistics.fmean(r["argmax_changed"] for r in rows)
    return {"seeds": seeds, "bf16_vs_fp32": summary, "fp32_elflow_vs_authors_max_abs": gap}


def profile(calls, dtype: str, folder: Path, rows: int = 40) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    folder.mkdir(parents=True, exist_ok=True)
    for name, passes in calls.items():
        for p, fn in passes.items():
            run_once(fn, dtype)
            with prof(activities=[ProfilerActivity.CPU], record_shapes=True) as pr:
                run_once(fn, dtype)
            avg = pr.key_averages()
            text = (avg.table(sort_by="self_cpu_time_total", row_limit=rows) + "\n\n"
                    + pr.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows))
            (folder / f"{name}_{dtype}_{p}.txt").write_text(text)
            print(f"profile {name} {dtype} {p}: {folder / f'{name}_{dtype}_{p}.txt'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="elf-b")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=1, help="calls per contestant per round (its best counts)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--passes", default="denoise,decode")
    ap.add_argument("--baseline-src", default=None, help="another model.py, timed as a third contestant")
    ap.add_argument("--literal", action="store_true",
                    help="add the authors' network with autocast disabled for CUDA only, as their code calls it")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="thread: CPU time of this thread (with --threads 1 it excludes time lost to other jobs)")
    ap.add_argument("--compile", action="store_true", help="torch.compile every contestant's network")
    ap.add_argument("--profile", default=None, help="folder for torch.profiler tables (one call each)")
    ap.add_argument("--accuracy-seeds", type=int, default=3, help="networks and inputs the bf16 errors average over")
    ap.add_argument("--label", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny preset, L 32, 2 rounds")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.length, args.rounds = "tiny", 32, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes, passes = args.dtypes.split(","), args.passes.split(",")
    calls, cfg = build(args.preset, args.length, args.seed, args.baseline_src, args.literal)
    calls = {n: {p: fn for p, fn in ps.items() if p in passes} for n, ps in calls.items()}
    if args.compile:  # each pass's call compiled as a whole; the accuracy figures stay eager
        calls = {n: {p: torch.compile(fn) for p, fn in ps.items()} for n, ps in calls.items()}
    load0 = os.getloadavg()
    acc = accuracy_study(args, args.accuracy_seeds)
    if args.profile:
        for dtype in dtypes:
            profile(calls, dtype, Path(args.profile))
    names = list(calls)
    times = {(n, d, p): [] for n in names for d in dtypes for p in passes}
    for d in dtypes:  # warm-up
        for p in passes:
            for n in names:
                run_once(calls[n][p], d)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for d in dtypes:
            for p in passes:
                for n in order:
                    times[(n, d, p)].append(timed(calls[n][p], d, args.iters, CLOCKS[args.clock]))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{d} {p} " + "/".join(f"{times[(n, d, p)][-1]:.3f}" for n in names) for d in dtypes for p in passes),
            flush=True)
    load1 = os.getloadavg()
    results = {}
    refs = [a for a in ("authors", "authors_literal") if a in names]
    for d in dtypes:
        for p in passes:
            for a in refs:
                ref = times[(a, d, p)]
                for n in names:
                    if n in refs:
                        continue
                    ratios = [x / y for x, y in zip(ref, times[(n, d, p)])]
                    results[f"{n}{'' if a == 'authors' else '_vs_literal'}/{d}/{p}"] = {
                        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                        "ratio_max": max(ratios), "ratio_best": min(ref) / min(times[(n, d, p)]),
                        "s_median": statistics.median(times[(n, d, p)]), "authors_s_median": statistics.median(ref)}
    flags = cpu_flags()
    rec = {"bench": "bf16_forward", "label": args.label, "git": git_rev(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "cpu": cpu_model(), "flags": {f: f in flags for f in FLAGS}, "torch": torch.__version__,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
           "loadavg_start": load0, "loadavg_end": load1, "preset": args.preset, "length": args.length, "batch": 1,
           "rounds": args.rounds, "iters": args.iters, "clock": args.clock, "compile": args.compile,
           "baseline_src": args.baseline_src,
           "ratio": "elflow speed / authors speed = authors time / elflow time", "results": results,
           "times_s": {"/".join(k): v for k, v in times.items()}, "accuracy": acc}
    print(f"{rec['cpu']}  flags: {' '.join(f for f, on in rec['flags'].items() if on)}  threads {rec['threads']}  "
          f"load {load0[0]:.2f} -> {load1[0]:.2f}")
    for k, v in results.items():
        print(f"  {k:28s} ratio median {v['ratio_median']:.3f} [{v['ratio_min']:.3f}, {v['ratio_max']:.3f}]  "
              f"best {v['ratio_best']:.3f}  ({v['s_median']*1e3:.1f} ms vs {v['authors_s_median']*1e3:.1f} ms)")
    for k, v in acc["bf16_vs_fp32"].items():
        extra = f"  argmax changed {v['argmax_changed']:.4f}" if "argmax_changed" in v else ""
        print(f"  bf16 vs fp32 {k:24s} max {v['max_abs']:.3e} mean {v['mean_abs']:.3e} "
              f"(|fp32| mean {v['ref_mean_abs']:.3e}){extra}")
    print(f"  fp32 elflow vs authors max |diff|: {acc['fp32_elflow_vs_authors_max_abs']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

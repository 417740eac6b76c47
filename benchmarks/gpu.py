"""The prepared GPU check: one command, self-timed, within eight minutes on one H200, one JSON.

    python benchmarks/gpu.py                  # on a GPU machine; writes $OUT/gpu.json (or benchmarks/results/)
    python benchmarks/gpu.py --dry-run        # CPU smoke mode: the same code at tiny sizes, well under a minute

It measures, in order (a phase that would not fit in what is left of the budget is skipped, with a note):
  1. exactness: one training step of a tiny ELF on the GPU against the same step on the CPU (fp32, TF32 off,
     the same noise), loss, gradients and updated weights;
  2. ELF-B training (L = 1024, T5-small-shaped encoder in the step, Muon + Adam + EMA, bf16 autocast,
     torch.compile, TF32 on): the largest micro-batch of --batches that fits (probed uncompiled), then
     tokens/s, model FLOP utilisation (against the measured bf16 matmul peak and the card's nominal one),
     peak memory; and the host syncs of one step (torch.cuda.set_sync_debug_mode);
  3. 1,000 ELF-B samples of 1,024 tokens at 32 SDE steps (plus the decode pass): wall time, compiled, bf16;
  4. ELF-M and ELF-L training as in 2, if the budget allows.
Where no hub cache is present the encoder is a randomly initialised model of T5-small's shape, which costs the
same. Targets: 300k training tokens/s for ELF-B, 1,000 samples in 30 s.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from elflow.experiments.bench import NoSpace, bench, matmul_peak, pass_flops
from elflow.flow import Recipe, draw_training_noise, row_index
from elflow.methods import get_method
from elflow.methods.base import TrainedPass
from elflow.model import ELF, get_config
from elflow.optim import EMA, ELFOptimizer
from elflow.sampler import generate_tokens
from elflow.train import shard_generators, train_step
from elflow.util.devices import use_tf32

BUDGET_S = 450  # eight minutes, less head room for start-up and the JSON
NOMINAL_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 tensor-core FLOP/s, datasheets


def nominal_peak(name: str) -> float | None:
    return next((v for k, v in NOMINAL_BF16.items() if k in name), None)


def exactness(device) -> dict:
    """One step of a tiny ELF on `device` against the CPU: same weights, same batch, same draw (made on the
    CPU and copied), fp32 with TF32 off and fp32 Newton-Schulz."""
    torch.manual_seed(0)
    cfg = get_config("tiny", dim=16, vocab_size=64, max_length=16)
    nets = {"cpu": ELF(cfg)}
    nets["dev"] = copy.deepcopy(nets["cpu"]).to(device)
    space = NoSpace(16, 64, 16)
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    g, c = shard_generators(0, 0, 0, "cpu")
    draw = draw_training_noise((8, 16, 16), Recipe(), generator=g, cpu_generator=c)
    use_tf32(device, False)
    out = {}
    for where, dev in (("cpu", torch.device("cpu")), ("dev", device)):
        net = nets[where]
        sp = copy.deepcopy(space).to(dev)
        sp.table = space.table.to(dev)
        d = dataclasses.replace(draw, **{f.name: getattr(draw, f.name).to(dev) for f in dataclasses.fields(draw)
                                         if getattr(draw, f.name) is not None})  # (a flow map's target: none)
        d = dataclasses.replace(d, decode_rows=row_index(draw.decode, dev), self_cond_rows=row_index(draw.self_cond, dev))
        opt = ELFOptimizer(list(net.named_parameters()), lr=1e-2, ns_dtype=torch.float32)
        loss, _ = TrainedPass(get_method("elf"), net, sp, Recipe())({"tokens": tokens.to(dev)}, d)
        loss.backward()
        grads = {n: p.grad.detach().cpu().clone() for n, p in net.named_parameters() if p.grad is not None}
        opt.step()
        out[where] = (loss.item(), grads, {n: p.detach().cpu() for n, p in net.named_parameters()})
    use_tf32(device, True)
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    (l_c, g_c, w_c), (l_d, g_d, w_d) = out["cpu"], out["dev"]
    return {"compared": f"{device.type} against cpu", "loss_cpu": l_c, "loss_device": l_d, "loss_rel_diff": abs(l_c - l_d) / abs(l_c),
            "grad_max_rel_diff": max(rel(g_d[n], g_c[n]) for n in g_c),
            "weights_max_abs_diff_after_step": max(float((w_d[n] - w_c[n]).abs().max()) for n in w_c)}


def host_syncs(device, preset: str, length: int, batch: int, compile_: bool) -> dict:
    """Synchronising CUDA calls in one training step (not a logging step: the loop reads nothing then), as
    torch.cuda.set_sync_debug_mode reports them, after two warm-up steps."""
    from elflow.experiments.bench import StandInSpace

    torch.manual_seed(0)
    cfg = get_config(preset, max_length=length)
    net = ELF(cfg).to(device)
    space = StandInSpace(cfg.dim, cfg.vocab_size, length, device)
    model = TrainedPass(get_method("elf"), net, space, Recipe())
    model = torch.compile(model) if compile_ else model
    opt = ELFOptimizer(list(net.named_parameters()), lr=1e-4)
    ema = EMA(net, 0.9999)
    shards = [{"tokens": torch.randint(0, cfg.vocab_size, (batch, length)).pin_memory()}]
    for step in range(2):
        train_step(model, shards, opt, ema, step, 0, 0, "bf16", 1.0, 1, device)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(model, shards, opt, ema, 2, 0, 0, "bf16", 1.0, 1, device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0][:200] for w in caught if "synchroniz" in str(w.message)]
    return {"per_step": len(syncs), "calls": syncs[:20], "batch": batch, "compiled": compile_}


def fitting_batch(device, preset: str, length: int, batches: list[int]) -> int:
    """The largest micro-batch of `batches` whose uncompiled bf16 step fits in memory (a compiled step needs
    no more)."""
    for b in sorted(batches, reverse=True):
        try:
            bench("train", preset=preset, length=length, batch=b, dtype="bf16", device=device, warmup=0, iters=1,
                  peak_size=1024)
            return b
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
    return min(batches)


def train_record(preset, length, batch, accum, compile_, device, dry, peak, name) -> dict:
    t0 = time.perf_counter()
    tr = bench("train", preset=preset, length=length, batch=batch, accum=accum, dtype="fp32" if dry else "bf16",
               compile=compile_, device=device, warmup=1 if dry else 3, iters=1 if dry else 5, breakdown=not compile_,
               space="standin")
    tr["wall_s_including_compile"] = time.perf_counter() - t0
    nominal = nominal_peak(name)
    tr["mfu_measured_peak"] = tr["flops_per_s"] / peak["flops_per_s"]
    tr["mfu_nominal_peak"] = tr["flops_per_s"] / nominal if nominal else None
    return {k: v for k, v in tr.items() if k not in ("config", "flop_formula", "reference_recipe")}


def sample_record(preset, length, n_samples, batch, compile_, device, dry, peak) -> dict:
    torch.manual_seed(0)
    cfg = get_config(preset, max_length=length)
    net = ELF(cfg).to(device).eval()
    model = torch.compile(net) if compile_ else net
    g = torch.Generator(device=device).manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=not dry):
        t0 = time.perf_counter()
        generate_tokens(model, batch, length, steps=32, generator=g, device=device)  # warm-up and compile
        sync()
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        done = 0
        while done < n_samples:
            generate_tokens(model, min(batch, n_samples - done), length, steps=32, generator=g, device=device)
            done += min(batch, n_samples - done)
        sync()
        secs = time.perf_counter() - t0
    flops = n_samples * (32 * pass_flops(cfg, length, "x") + pass_flops(cfg, length, "logits"))
    return {"samples": n_samples, "length": length, "steps": 32, "sampler": "sde", "batch": batch, "seconds": secs,
            "warmup_and_compile_s": warm, "tokens_per_s": n_samples * length / secs, "flops_per_s": flops / secs,
            "mfu_measured_peak": flops / secs / peak["flops_per_s"], "target_s": 30}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (checks the script runs)")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 48, 32, 16],
                    help="micro-batches to try for training, largest first (default 64 48 32 16)")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimiser step (default 2)")
    ap.add_argument("--samples", type=int, default=1000, help="samples to time (default 1000)")
    ap.add_argument("--sample-batch", type=int, default=500, help="samples per batch (default 500)")
    ap.add_argument("--no-compile", action="store_true", help="time uncompiled steps")
    ap.add_argument("--out", default=None,
                    help="JSON output (default $OUT/gpu.json, else benchmarks/results/gpu.json or gpu_dry_run.json)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    compile_ = not args.no_compile and not dry
    L = 32 if dry else 1024
    name = "cpu (dry run)" if dry else torch.cuda.get_device_name()
    use_tf32(device, True)
    res: dict = {"device": name, "torch": torch.__version__, "dry_run": dry, "compile": compile_, "tf32": True,
                 "budget_s": BUDGET_S}
    left = lambda: BUDGET_S - (time.perf_counter() - t_start)  # noqa: E731

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    def phase(key, need_s, fn):
        if left() < need_s and not dry:
            res[key] = {"skipped": f"time budget ({left():.0f} s left, {need_s} s needed)"}
            log(f"{key}: skipped")
            return
        try:
            res[key] = fn()
        except Exception as e:  # noqa: BLE001  (one failed phase must not lose the others' figures)
            res[key] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        log(f"{key}: {json.dumps(res[key], default=str)[:300]}")

    peak = matmul_peak(device, torch.float32 if dry else torch.bfloat16)
    res["matmul_peak"] = {**peak, "nominal_bf16_flops_per_s": nominal_peak(name)}
    log(f"matmul peak {peak['flops_per_s'] / 1e12:.1f} TFLOP/s")
    if dry:  # the same phases at tiny sizes (the exactness check compares the CPU with itself); no syncs to count
        phase("exactness", 0, lambda: exactness(device))
        phase("train_tiny", 0, lambda: train_record("tiny", L, 2, 1, False, device, dry, peak, name))
        phase("sample_tiny", 0, lambda: sample_record("tiny", L, 4, 2, False, device, dry, peak))
    else:
        phase("exactness", 20, lambda: exactness(device))
        phase("train_elf_b", 0, lambda: train_record("elf-b", L, fitting_batch(device, "elf-b", L, args.batches),
                                                     args.accum, compile_, device, dry, peak, name))
        fitted = res["train_elf_b"].get("batch", min(args.batches))
        phase("host_syncs_elf_b", 60, lambda: host_syncs(device, "elf-b", L, fitted, compile_))
        phase("sample_elf_b", 90, lambda: sample_record("elf-b", L, args.samples, args.sample_batch, compile_,
                                                        device, dry, peak))
        for preset in ("elf-m", "elf-l"):
            torch.cuda.empty_cache()
            phase(f"train_{preset.replace('-', '_')}", 150,
                  lambda p=preset: train_record(p, L, fitting_batch(device, p, L, args.batches), args.accum,
                                                compile_, device, dry, peak, name))
    res["total_wall_s"] = time.perf_counter() - t_start
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu.json" if os.environ.get("OUT") else
                            "benchmarks/results/gpu.json" if not dry else "benchmarks/results/gpu_dry_run.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    log(f"done in {res['total_wall_s']:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

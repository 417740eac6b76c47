"""The prepared GPU check: one command, self-timed, under six minutes on one H200.

    python benchmarks/gpu.py                  # on a GPU machine; writes $OUT/gpu.json (or benchmarks/results/)
    python benchmarks/gpu.py --dry-run        # CPU-safe: the same code at tiny sizes, seconds

It measures, in order (each phase is skipped, with a note, if the time budget would run out):
  1. ELF-B training throughput: bf16 autocast, torch.compile, SDPA restricted to the flash kernel, L = 1024,
     a T5-small-shaped encoder in every step, Muon (bf16 Newton-Schulz) + Adam + EMA (`elflow bench train`).
  2. 1,000 samples of 1,024 tokens at 32 SDE steps (plus the decode pass), bf16, compiled, flash.
  3. GPT-2 Large judging 1,000 x 1,024 tokens (forward + per-token NLL), bf16, flash.
Where no hub cache is present, the encoder and the judge are randomly initialised models of the real shapes
(T5-small encoder, GPT-2 Large), which cost the same. Targets: >= 300k training tokens/s; <= 30 s for the
1,000 samples.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from elflow.bench import bench, matmul_peak, pass_flops
from elflow.flow import generate_tokens
from elflow.model import ELF, get_config

BUDGET_S = 330  # leave head room under six minutes


def gpt2_judge(dry: bool, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    if not dry:
        try:
            return GPT2LMHeadModel.from_pretrained("gpt2-large", local_files_only=True), "gpt2-large (hub cache)"
        except Exception:
            pass
    cfg = (GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64) if dry else
           GPT2Config(n_layer=36, n_embd=1280, n_head=20, vocab_size=50257, n_positions=1024))
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg), "random init, GPT-2 Large shape" if not dry else "random init, tiny"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (checks the script runs)")
    ap.add_argument("--train-batch", type=int, default=32, help="rows per micro-batch (ELF-B, L = 1024)")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimiser step")
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--sample-batch", type=int, default=500)
    ap.add_argument("--judge-batch", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=None, help="JSON output (default $OUT/gpu.json or benchmarks/results/gpu.json)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    if not dry and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run on a CPU", file=sys.stderr)
        return 2
    compile_ = not args.no_compile and not dry
    preset, L = ("tiny", 32) if dry else ("elf-b", 1024)
    dtype = "fp32" if dry else "bf16"
    kernel = [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION] if dry else [SDPBackend.FLASH_ATTENTION]
    n_samples, s_batch, j_batch = (4, 2, 2) if dry else (args.samples, args.sample_batch, args.judge_batch)
    res: dict = {"device": torch.cuda.get_device_name() if not dry else "cpu (dry run)", "torch": torch.__version__,
                 "dry_run": dry, "compile": compile_, "sdpa": "flash only" if not dry else "math/flash"}
    left = lambda: BUDGET_S - (time.perf_counter() - t_start)  # noqa: E731

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    res["matmul_peak"] = matmul_peak(device, torch.float32 if dry else torch.bfloat16)
    log(f"bf16 matmul peak {res['matmul_peak']['flops_per_s'] / 1e12:.1f} TFLOP/s")

    # 1. training throughput
    with sdpa_kernel(kernel):
        t0 = time.perf_counter()
        tr = bench("train", preset=preset, length=L, batch=2 if dry else args.train_batch,
                   accum=1 if dry else args.accum, dtype=dtype, compile=compile_, device=device,
                   warmup=1 if dry else 3, iters=1 if dry else 5, breakdown=True)
        tr["wall_s_including_compile"] = time.perf_counter() - t0
    res["train"] = tr
    log(f"train: {tr['tokens_per_s']:.0f} tokens/s, utilisation {100 * tr['utilisation']:.1f}%, "
        f"peak memory {tr['peak_memory_bytes'] / 2 ** 30:.1f} GiB, target 300k")

    # 2. 1,000 samples
    if left() > 60 or dry:
        torch.manual_seed(0)
        cfg = get_config(preset)
        net = ELF(cfg).to(device).eval()
        model = torch.compile(net) if compile_ else net
        g = torch.Generator(device=device).manual_seed(0)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not dry)
        with sdpa_kernel(kernel), autocast:
            t0 = time.perf_counter()
            generate_tokens(model, s_batch, L, steps=32, generator=g, device=device)  # warm-up / compile
            if device.type == "cuda":
                torch.cuda.synchronize()
            warm = time.perf_counter() - t0
            t0 = time.perf_counter()
            done = 0
            while done < n_samples:
                b = min(s_batch, n_samples - done)
                tokens, _ = generate_tokens(model, b, L, steps=32, generator=g, device=device)
                done += b
            if device.type == "cuda":
                torch.cuda.synchronize()
            secs = time.perf_counter() - t0
        flops = n_samples * (32 * pass_flops(cfg, L, "x") + pass_flops(cfg, L, "logits"))
        res["sample"] = {"samples": n_samples, "length": L, "steps": 32, "batch": s_batch, "seconds": secs,
                         "warmup_and_compile_s": warm, "tokens_per_s": n_samples * L / secs,
                         "flops_per_s": flops / secs, "utilisation": flops / secs / res["matmul_peak"]["flops_per_s"],
                         "target_s": 30}
        del net, model
        log(f"sample: {n_samples} x {L} tokens, 32 steps: {secs:.1f} s (target 30 s)")
    else:
        res["sample"] = {"skipped": f"time budget ({left():.0f} s left)"}

    # 3. GPT-2 Large judging
    if left() > 30 or dry:
        judge, kind = gpt2_judge(dry, device)
        judge = judge.to(device).eval()
        jl = 64 if dry else 1024
        V = judge.config.vocab_size
        ids = torch.randint(0, V, (j_batch, jl), device=device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not dry)

        @torch.no_grad()
        def score(x):
            logits = judge(x).logits[:, :-1].float()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1), reduction="sum")

        with sdpa_kernel(kernel), autocast:
            score(ids)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            done = 0
            while done < n_samples:
                score(ids[: min(j_batch, n_samples - done)])
                done += j_batch
            if device.type == "cuda":
                torch.cuda.synchronize()
            secs = time.perf_counter() - t0
        res["judge"] = {"model": kind, "samples": n_samples, "length": jl, "batch": j_batch, "seconds": secs,
                        "tokens_per_s": n_samples * jl / secs}
        log(f"judge ({kind}): {n_samples} x {jl} tokens in {secs:.1f} s")
    else:
        res["judge"] = {"skipped": f"time budget ({left():.0f} s left)"}

    res["total_wall_s"] = time.perf_counter() - t_start
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu.json" if os.environ.get("OUT") else
                            "benchmarks/results/gpu.json" if not dry else "benchmarks/results/gpu_dry_run.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    log(f"done in {res['total_wall_s']:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

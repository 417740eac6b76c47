"""elflow's training step against a re-implementation of the reference listing's step, same machine.

THE REFERENCE HERE IS OUR RE-IMPLEMENTATION of the training step in the explainer's listing (condensed from
the authors' JAX code), not the authors' code, which we cannot run. What it keeps from the listing:
  - one branch per step for the whole batch (decode with probability 0.2, else denoise);
  - denoise: the x0 pass net([z, 0]) on every row, the xs pass net([z, x0]) on the self-conditioned rows
    (half the batch; a masked JAX implementation would run it on every row, so this is generous to it),
    then the trained pass and its backward;
  - decode: one trained pass with the decode head;
  - Muon with fp32 Newton-Schulz on every 2-D matrix (heads included), Adam on the rest, an optimiser
    step and an EMA update after every batch (no amortisation).
Its expected step time is 0.8 x (denoise step) + 0.2 x (decode step).

The reference evaluates Newton-Schulz as torch's Muon does (five iterations, `--ns-method iterate`), in fp32.

elflow's step is `elflow.train.train_step` as `elflow bench train` runs it (both branches mixed per row,
the xs pass reused from the trained pass, Newton-Schulz in fp32 on a CPU evaluated spectrally), three times:
one optimiser step per batch (the same configuration), the same with the iterated Newton-Schulz (to
separate the two gains), and --accum micro-batches per optimiser step.

    python benchmarks/reference_step.py               # both configurations of the issue (~15 min on 2 cores)
    python benchmarks/reference_step.py --quick       # tiny sizes, seconds (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from elflow.experiments.bench import StandInSpace, bench, matmul_peak
from elflow.model import ELF, get_config
from elflow.optim import EMA, ELFOptimizer

CONFIGS = {
    # name: (preset overrides, L, batch), the two configurations quoted in the issue (T5-small space)
    "elf-b L256 B4": (dict(), 256, 4),
    "d4 w256 L128 B16": (dict(depth=4, hidden=256, heads=4), 128, 16),
}
QUICK = {"d2 w64 L32 B4": (dict(depth=2, hidden=64, heads=4, vocab_size=1000), 32, 4)}
QUOTED_AUTHORS_S = {"elf-b L256 B4": 20.0, "d4 w256 L128 B16": 5.5}


def reference_step(net, space, opt, ema, tokens, branch: str, g) -> None:
    """One step of the listing's recipe on a whole batch (one branch), fp32."""
    B, L = tokens.shape
    x = space.encode(tokens).float()
    dev = x.device
    w = torch.exp(torch.rand(B, device=dev, generator=g) * (torch.log(torch.tensor(6.0)) - torch.log(torch.tensor(1.5)))
                  + torch.log(torch.tensor(1.5))) - 1
    if branch == "denoise":
        t = torch.sigmoid(0.8 * torch.randn(B, device=dev, generator=g) - 1.5)
        e = 2.0 * torch.randn(x.shape, device=dev, generator=g)
        tt = t[:, None, None]
        z = tt * x + (1 - tt) * e
        clip = (1 - tt).clamp_min(0.05)
        v = (x - z) / clip
        sc = torch.arange(B, device=dev) < B // 2  # half the rows self-conditioned
        with torch.no_grad():
            x0 = net(z, t, w)  # every row
            xs = net(z[sc], t[sc], w[sc], x0[sc])  # the self-conditioned rows
        target = v.clone()
        v_c, v_u = (xs - z[sc]) / clip[sc], (x0[sc] - z[sc]) / clip[sc]
        target[sc] = v[sc] + (1 - 1 / w[sc])[:, None, None] * (v_c - v_u)
        x_prev = torch.where(sc[:, None, None], x0, torch.zeros_like(x0))
        x_pred = net(z, t, w, x_prev)
        loss = (((x_pred - z) / clip - target) ** 2).mean()
    else:
        p = torch.sigmoid(0.8 * torch.randn(B, L, 1, device=dev, generator=g) + 0.8)
        zt = p * x + (1 - p) * 5.0 * torch.randn(x.shape, device=dev, generator=g)
        logits = net(zt, torch.ones(B, device=dev), w, decode=True)
        loss = F.cross_entropy(logits.transpose(1, 2), tokens)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    ema.update(net)


def time_reference(overrides, L, B, iters: int, warmup: int) -> dict:
    torch.manual_seed(0)
    cfg = get_config("elf-b", max_length=max(L, 1024), **overrides)
    net = ELF(cfg).train()
    space = StandInSpace(cfg.dim, cfg.vocab_size, L)
    opt = ELFOptimizer(list(net.named_parameters()), lr=1e-4, ns_dtype=torch.float32, ns_method="iterate")
    ema = EMA(net)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B, L), generator=g)
    out = {}
    for branch in ("denoise", "decode"):
        for _ in range(warmup):
            reference_step(net, space, opt, ema, tokens, branch, g)
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            reference_step(net, space, opt, ema, tokens, branch, g)
            ts.append(time.perf_counter() - t0)
        out[branch + "_s"] = min(ts)
    out["expected_step_s"] = 0.8 * out["denoise_s"] + 0.2 * out["decode_s"]
    out["tokens_per_s"] = B * L / out["expected_step_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--accum", type=int, default=4, help="elflow's amortised variant: micro-batches per step")
    ap.add_argument("--only", default=None, help="run only the configuration whose name contains this")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before timing (each branch, each run)")
    ap.add_argument("--iters", type=int, default=2, help="timed steps (the minimum is reported for the reference)")
    ap.add_argument("--out", default="benchmarks/results/reference_step.jsonl")
    args = ap.parse_args(argv)
    configs = QUICK if args.quick else CONFIGS
    iters, warmup = (1, 1) if args.quick else (args.iters, args.warmup)
    results = []
    for name, (ov, L, B) in configs.items():
        if args.only and args.only not in name:
            continue
        peak = matmul_peak("cpu", torch.float32)
        ref = time_reference(ov, L, B, iters, warmup)
        common = dict(preset="elf-b", depth=ov.get("depth"), hidden=ov.get("hidden"), heads=ov.get("heads"),
                      vocab_size=ov.get("vocab_size"), length=L, batch=B, device="cpu", warmup=warmup, iters=iters)
        one = bench("train", breakdown=True, **common)
        iterated = bench("train", ns_method="iterate", breakdown=True, **common)
        amort = bench("train", accum=args.accum, **common)
        rec = {"config": name, "L": L, "batch": B, "peak_flops_per_s": peak["flops_per_s"],
               "authors_quoted_step_s": QUOTED_AUTHORS_S.get(name),
               "reference_reimpl": ref,
               "elflow_step_s": one["seconds_per_iter"], "elflow_tokens_per_s": one["tokens_per_s"],
               "elflow_breakdown_s": one["breakdown_seconds"], "elflow_utilisation": one["utilisation"],
               "elflow_flops_breakdown": one["flops_breakdown"], "elflow_ns_method": one["ns_method"],
               "elflow_iterated_ns_step_s": iterated["seconds_per_iter"],
               "elflow_iterated_ns_breakdown_s": iterated["breakdown_seconds"],
               "elflow_accum": args.accum, "elflow_accum_step_s": amort["seconds_per_iter"],
               "elflow_accum_tokens_per_s": amort["tokens_per_s"], "elflow_accum_utilisation": amort["utilisation"]}
        rec["speedup_vs_reimpl_same_config"] = rec["elflow_tokens_per_s"] / ref["tokens_per_s"]
        rec["speedup_vs_reimpl_amortised"] = rec["elflow_accum_tokens_per_s"] / ref["tokens_per_s"]
        if rec["authors_quoted_step_s"]:
            quoted_tps = B * L / rec["authors_quoted_step_s"]
            rec["speedup_vs_quoted_same_config"] = rec["elflow_tokens_per_s"] / quoted_tps
            rec["speedup_vs_quoted_amortised"] = rec["elflow_accum_tokens_per_s"] / quoted_tps
        rec["warmup"], rec["iters"] = warmup, iters
        print(json.dumps(rec), flush=True)
        results.append(rec)
    if not args.quick:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How accurate and how fast Muon's Newton-Schulz is, evaluated three ways, on ELF-B's matrix shapes.

For a gradient-like matrix (Gaussian plus a rank-8 part, as gradients are near low rank) the five quintic
steps are evaluated
    fp32 iterate    torch's iteration in fp32 (elflow's choice on CPUs before spectral evaluation)
    fp32 spectral   the same polynomial through eigh of the Gram matrix (elflow's CPU default)
    bf16 iterate    torch.optim.Muon's own (the GPU default)
and each is compared with the exact value, U phi^5(S) V^T from a float64 SVD. We report the relative
Frobenius error, the cosine with the exact update, and the fp32 times on this device (bf16 on a CPU without
native bf16 units takes minutes per matrix; its time is only measured with --time-bf16).

    python benchmarks/muon_accuracy.py            # one JSON line per shape, appended to results/
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from elflow.newton_schulz import newton_schulz

SHAPES = {"attn.proj": (768, 768), "attn.qkv": (2304, 768), "mlp.w12": (4096, 768), "mlp.w3": (768, 2048),
          "decode readout": (32100, 512)}
COEF = (3.4445, -4.7750, 2.0315)


def gradient_like(m, n, g):
    low = torch.randn(m, 8, generator=g) @ torch.randn(8, n, generator=g)
    return torch.randn(m, n, generator=g) + 3 * low / 8 ** 0.5


def exact(G: torch.Tensor) -> torch.Tensor:
    a, b, c = COEF
    u, s, vh = torch.linalg.svd(G.double(), full_matrices=False)
    s = s / G.double().norm()
    for _ in range(5):
        s = a * s + b * s ** 3 + c * s ** 5
    return (u * s) @ vh


def timed(fn, repeats: int = 2):
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    return out, (time.perf_counter() - t0) / repeats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-bf16", action="store_true", help="also time the bf16 iteration (slow on AVX2)")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 iteration entirely")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "muon_accuracy_methods.jsonl"))
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    for name, (m, n) in SHAPES.items():
        G = gradient_like(m, n, g)
        ref = exact(G)
        rec = {"matrix": name, "shape": [m, n], "threads": torch.get_num_threads()}
        runs = {"fp32_iterate": lambda: newton_schulz(G, dtype=torch.float32, method="iterate"),
                "fp32_spectral": lambda: newton_schulz(G, dtype=torch.float32, method="spectral")}
        if not args.no_bf16 and name != "decode readout":  # bf16 on the readout: many minutes here
            runs["bf16_iterate"] = lambda: newton_schulz(G, dtype=torch.bfloat16, method="iterate")
        for key, fn in runs.items():
            if key.startswith("bf16") and not args.time_bf16:
                out, sec = fn(), None
            else:
                out, sec = timed(fn)
            d = out.double()
            rec[key] = {"rel_error": ((d - ref).norm() / ref.norm()).item(),
                        "cosine": torch.nn.functional.cosine_similarity(d.flatten(), ref.flatten(), dim=0).item(),
                        "seconds": sec}
        print(json.dumps(rec), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()

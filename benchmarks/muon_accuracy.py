"""How accurate (and how fast, on this device) Muon's Newton-Schulz is in bf16 against fp32.

For ELF-B's matrix shapes, a gradient-like matrix (Gaussian plus a rank-8 part, as gradients are
near low rank) is orthogonalised with 5 quintic Newton-Schulz steps in bf16 (what torch.optim.Muon
does) and in fp32; we report the relative Frobenius difference of the updates, their cosine, and the
singular-value range of each (the iteration maps singular values into roughly [0.7, 1.2], not to 1).

    python benchmarks/muon_accuracy.py            # prints one JSON line per shape
"""

from __future__ import annotations

import json
import time

import torch

from elflow.optim import newton_schulz

SHAPES = {"attn.proj": (768, 768), "attn.qkv": (2304, 768), "mlp.w12": (4096, 768), "mlp.w3": (768, 2048)}


def gradient_like(m, n, g):
    low = torch.randn(m, 8, generator=g) @ torch.randn(8, n, generator=g)
    return torch.randn(m, n, generator=g) + 3 * low / 8 ** 0.5


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for name, (m, n) in SHAPES.items():
        G = gradient_like(m, n, g)
        t0 = time.perf_counter()
        u32 = newton_schulz(G, dtype=torch.float32)
        t32 = time.perf_counter() - t0
        t0 = time.perf_counter()
        u16 = newton_schulz(G, dtype=torch.bfloat16).float()
        t16 = time.perf_counter() - t0
        rel = ((u16 - u32).norm() / u32.norm()).item()
        cos = torch.nn.functional.cosine_similarity(u16.flatten(), u32.flatten(), dim=0).item()
        s32, s16 = torch.linalg.svdvals(u32), torch.linalg.svdvals(u16)
        print(json.dumps({"matrix": name, "shape": [m, n], "rel_frobenius_diff": rel, "cosine": cos,
                          "sv_fp32": [s32.min().item(), s32.max().item()],
                          "sv_bf16": [s16.min().item(), s16.max().item()],
                          "cpu_seconds_fp32": t32, "cpu_seconds_bf16": t16}), flush=True)


if __name__ == "__main__":
    main()

"""Where evaluating Newton-Schulz spectrally beats iterating it, on this device (the by-shape rule's data).

For a k x (a k) Gaussian matrix, the best of 5 timings of `newton_schulz(method="iterate")` over that of
`method="spectral"` (fp32): above 1, spectral is faster. elflow.newton_schulz.spectral_pays encodes the crossover
measured on the project's 2-core Zen 3: k >= 384, or the larger side >= max(2k, 512).

    python benchmarks/ns_crossover.py       # a table, and one JSON line per cell in results/ns_crossover.jsonl
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from elflow.newton_schulz import newton_schulz, spectral_pays

KS = (32, 64, 128, 192, 256, 384, 512, 768)
ASPECTS = (1, 1.5, 2, 3, 4, 8)


def best(fn, n: int = 5) -> float:
    fn()
    b = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        b = min(b, time.perf_counter() - t)
    return b


def main() -> None:
    out = Path(__file__).parent / "results" / "ns_crossover.jsonl"
    print("speed-up of spectral over iterate (* = the by-shape rule picks spectral)")
    print("k      " + " ".join(f"{a:>7}" for a in ASPECTS))
    with open(out, "a") as f:
        for k in KS:
            cells = []
            for a in ASPECTS:
                g = torch.randn(k, int(k * a))
                ti = best(lambda: newton_schulz(g, method="iterate"))
                ts = best(lambda: newton_schulz(g, method="spectral"))
                rule = spectral_pays(*g.shape)
                cells.append(f"{ti / ts:6.2f}{'*' if rule else ' '}")
                f.write(json.dumps({"k": k, "n": g.shape[1], "iterate_s": ti, "spectral_s": ts,
                                    "speedup": ti / ts, "rule_picks_spectral": rule,
                                    "threads": torch.get_num_threads()}) + "\n")
            print(f"{k:<6} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()

"""Markdown tables from benchmarks/results/*.jsonl (paste into benchmarks/RESULTS.md).

    python benchmarks/report.py
"""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).parent / "results"


def rows(name):
    p = R / name
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def main() -> None:
    print("| command | s/iter | tokens/s | model GFLOP/s | peak GFLOP/s (op) | utilisation | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows("cpu.jsonl"):
        print(f"| `{r['command']}` | {r['seconds_per_iter']:.3g} | {r['tokens_per_s']:.4g} | "
              f"{r['flops_per_s'] / 1e9:.3g} | {r['peak_flops_per_s'] / 1e9:.3g} ({r['peak']['op']}) | "
              f"{100 * r['utilisation']:.0f}% | {r['peak_memory_bytes'] / 2 ** 20:.0f} |")
    for r in rows("reference_step.jsonl"):
        print(f"\n{r['config']}: reference re-impl {r['reference_reimpl']['expected_step_s']:.3g} s/step "
              f"({r['reference_reimpl']['tokens_per_s']:.3g} tok/s); elflow {r['elflow_step_s']:.3g} s/step "
              f"({r['elflow_tokens_per_s']:.3g} tok/s, x{r['speedup_vs_reimpl_same_config']:.2f}); "
              f"elflow accum {r['elflow_accum']} {r['elflow_accum_tokens_per_s']:.3g} tok/s "
              f"(x{r['speedup_vs_reimpl_amortised']:.2f}); breakdown {r['elflow_breakdown_s']}")


if __name__ == "__main__":
    main()

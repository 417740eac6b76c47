"""Markdown tables from benchmarks/results/*.jsonl (paste into benchmarks/RESULTS.md).

    python benchmarks/report.py                                   # the default files
    python benchmarks/report.py cpu_quiet.jsonl reference_step_spectral.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

R = Path(__file__).parent / "results"


def rows(name):
    p = R / name
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def bench_table(name: str) -> None:
    print("| command | s/iter | tokens/s | model GFLOP/s | peak GFLOP/s (op) | utilisation | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows(name):
        cmd = r.get("command") or f"elflow bench {r['mode']} --preset {r['preset']} --length {r['length']} " \
                                  f"--batch {r['batch']} --dtype {r['dtype']}"
        print(f"| `{cmd}` | {r['seconds_per_iter']:.3g} | {r['tokens_per_s']:.4g} | "
              f"{r['flops_per_s'] / 1e9:.3g} | {r['peak_flops_per_s'] / 1e9:.3g} ({r['peak']['op']}) | "
              f"{100 * r['utilisation']:.0f}% | {r['peak_memory_bytes'] / 2 ** 20:.0f} |")


def step_table(name: str) -> None:
    print("| configuration | reference re-impl s/step | authors (quoted) s | elflow s/step | vs quoted | vs re-impl "
          "| elflow, iterated NS | elflow accum: s / tok/s | accum vs quoted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows(name):
        ref = r["reference_reimpl"]
        print(f"| {r['config']} | {ref['expected_step_s']:.3g} | {r.get('authors_quoted_step_s')} | "
              f"{r['elflow_step_s']:.3g} | x{r.get('speedup_vs_quoted_same_config', float('nan')):.2f} | "
              f"x{r['speedup_vs_reimpl_same_config']:.2f} | {r.get('elflow_iterated_ns_step_s', float('nan')):.3g} | "
              f"{r['elflow_accum_step_s']:.3g} / {r['elflow_accum_tokens_per_s']:.3g} | "
              f"x{r.get('speedup_vs_quoted_amortised', float('nan')):.2f} |")
    for r in rows(name):
        print(f"\n{r['config']} breakdown (s): {json.dumps({k: round(v, 2) for k, v in r['elflow_breakdown_s'].items()})}")
        if "elflow_iterated_ns_breakdown_s" in r:
            print(f"  iterated NS: {json.dumps({k: round(v, 2) for k, v in r['elflow_iterated_ns_breakdown_s'].items()})}")
        print(f"  FLOPs (G): {json.dumps({k: round(v / 1e9, 1) for k, v in r['elflow_flops_breakdown'].items()})}")


def main(argv=None) -> None:
    names = (argv if argv is not None else sys.argv[1:]) or ["cpu.jsonl", "reference_step.jsonl"]
    for name in names:
        print(f"\n### {name}\n")
        (step_table if name.startswith("reference_step") else bench_table)(name)


if __name__ == "__main__":
    main()

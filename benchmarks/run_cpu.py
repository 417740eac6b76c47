"""The CPU figures of benchmarks/RESULTS.md: `elflow bench` on tiny, demo and elf-b, and cost against L and batch.

Each configuration runs in its own process (so peak memory is that configuration's) and appends one JSON
line to benchmarks/results/cpu.jsonl; `python benchmarks/report.py` turns the lines into tables.

    python benchmarks/run_cpu.py presets      # tiny, demo, elf-b: forward, train, sample (fp32 and bf16)
    python benchmarks/run_cpu.py scaling      # elf-b forward against L = 256 .. 2048, and against batch
    python benchmarks/run_cpu.py --dry-run presets   # print the commands only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

B1 = ["--warmup", "0", "--iters", "1"]  # the ELF-B runs: one timed iteration (each is seconds to minutes)
GROUPS = {
    "presets": [
        ["forward", "--preset", "tiny", "--batch", "8", "--iters", "5"],
        ["train", "--preset", "tiny", "--batch", "8", "--iters", "5", "--warmup", "2"],
        ["sample", "--preset", "tiny", "--batch", "8", "--steps", "32"],
        ["forward", "--preset", "demo", "--batch", "8"],
        ["train", "--preset", "demo", "--batch", "8", "--breakdown", "--warmup", "2"],
        ["sample", "--preset", "demo", "--batch", "8", "--steps", "32", "--iters", "1"],
        ["forward", "--preset", "elf-b", "--length", "1024", "--batch", "1", "--warmup", "1", "--iters", "2"],
        ["forward", "--preset", "elf-b", "--length", "1024", "--batch", "1", "--dtype", "bf16", *B1],
        ["sample", "--preset", "elf-b", "--length", "1024", "--batch", "1", "--steps", "32", *B1],
        ["forward", "--preset", "tiny", "--batch", "8", "--iters", "5", "--dtype", "bf16"],
        ["forward", "--preset", "demo", "--batch", "8", "--dtype", "bf16"],
    ],
    "scaling": [
        *[["forward", "--preset", "elf-b", "--length", str(L), "--batch", "1", "--warmup", "1", "--iters", "1"]
          for L in (256, 512, 1024, 2048)],
        *[["forward", "--preset", "elf-b", "--length", "256", "--batch", str(b), "--warmup", "1", "--iters", "1"]
          for b in (1, 2, 4, 8)],
        *[["forward", "--preset", "demo", "--length", "64", "--batch", str(b), "--iters", "3"] for b in (1, 4, 16, 64)],
    ],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("groups", nargs="+", choices=list(GROUPS))
    ap.add_argument("--out", default="benchmarks/results/cpu.jsonl")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for group in args.groups:
        for cmd in GROUPS[group]:
            full = [sys.executable, "-m", "elflow.cli", "bench", *cmd, "--device", "cpu", "--json"]
            print(" ".join(full[1:]), flush=True)
            if args.dry_run:
                continue
            res = subprocess.run(full, capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr[-2000:], file=sys.stderr)
                continue
            rec = json.loads(res.stdout.strip().splitlines()[-1])
            rec["group"], rec["command"] = group, "elflow bench " + " ".join(cmd)
            with open(out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"  {rec['seconds_per_iter']:.3g} s/iter  {rec['tokens_per_s']:.4g} tok/s  "
                  f"util {100 * rec['utilisation']:.1f}%  mem {rec['peak_memory_bytes'] / 2**20:.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

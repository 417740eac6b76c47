"""CPU denormals in training: the conditional quickstart's step time with them flushed (what `train` does)
and with them kept, each in its own process on the same machine.

Each process trains `--warm` steps (the readout becomes confident and its log-softmax gradient fills with
denormals), then times the next `--timed` steps. One JSON object goes to benchmarks/results/denormals.json.

    python benchmarks/denormals.py               # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import argparse, contextlib, json, sys, time
import elflow.train as T
from elflow.quickstart import COND_STEPS, add_arguments, conditional_config, task_pairs_file

keep, warm, timed, out = sys.argv[1] == "keep", int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if keep:
    T.flushed_denormals = contextlib.nullcontext
parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(["--conditional", "--steps", str(COND_STEPS)])  # the demonstration's own settings
cfg = conditional_config(args, task_pairs_file("copy", args.seed, args.cache_dir)[2]).resolved()
T.train(cfg, out, overwrite=True, stop_after=warm, quiet=True)
t0 = time.perf_counter()
T.train(cfg, out, resume=True, stop_after=timed, quiet=True)
print(json.dumps({"seconds_per_step": (time.perf_counter() - t0) / timed}))
"""


def run_one(mode: str, warm: int, timed: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, "-c", CHILD, mode, str(warm), str(timed), str(Path(tmp) / "run")],
                             capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"denormals benchmark: the {mode} run failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["seconds_per_step"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", type=int, default=60, help="steps before timing (default: 60)")
    ap.add_argument("--timed", type=int, default=40, help="timed steps (default: 40)")
    ap.add_argument("--out", default="benchmarks/results/denormals.json")
    args = ap.parse_args(argv)
    import torch

    from elflow.util.devices import device_name
    from elflow.util.files import atomic_write_json

    flushed = run_one("flush", args.warm, args.timed)
    kept = run_one("keep", args.warm, args.timed)
    result = {"cpu": device_name("cpu"), "torch": torch.__version__, "config": "quickstart --conditional (demo)",
              "warm_steps": args.warm, "timed_steps": args.timed, "flushed_s_per_step": round(flushed, 3),
              "kept_s_per_step": round(kept, 3), "kept_over_flushed": round(kept / flushed, 2),
              "date": time.strftime("%Y-%m-%d")}
    atomic_write_json(Path(args.out), result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

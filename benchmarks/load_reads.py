"""Loading an ELF-B-sized run to sample, or resuming it: which files are opened, how many bytes are read, and
how long it takes, for two checkouts of elflow on the same run folder (each in its own interpreter; Python's
audit hook sees every open); a load to sample also against one verified read of the run's EMA file (read,
hashed and parsed, in a fresh process too): `load_over_ema_read`, whose target is at most 1.5.

    python benchmarks/load_reads.py --before /tmp/elflow-before/src --out /tmp/load-bench \\
        --results benchmarks/results/load_reads.json
    python benchmarks/load_reads.py --what resume --before /tmp/elflow-before/src --out /tmp/load-bench \\
        --results benchmarks/results/resume_reads.json

A resume (`elflow train --out COPY --resume --steps 2`) runs on a fresh copy of the run each time: it reads the
step-1 checkpoint, trains one step and saves step 2; the opens and bytes counted are those of the step-1
checkpoint's files, the time is the whole command's (its step and save included).

The run: `elflow train --preset elf-b` (by the earlier checkout, whose record both read) for one optimiser step at batch 1 and length 16 over a 512-dimensional
random table of MiniLM's tokenizer (the network, EMA and optimiser state of ELF-B's size, 30,522 tokens instead
of T5's 32,100); made once in --out and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from few_step_text import cpu_model  # (this folder is on the path when a script here runs)

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, os, sys, time
opened, watching = [], [False]

def hook(event, args):
    if watching[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        opened.append(os.path.abspath(os.fsdecode(args[0])))

sys.addaudithook(hook)
from elflow.runs.load import load_for_sampling
watching[0] = True
t0 = time.perf_counter()
net, space = load_for_sampling(sys.argv[1], device="cpu")
seconds = time.perf_counter() - t0
watching[0] = False
print(json.dumps({"opened": opened, "seconds": seconds,
                  "optim_imported": "elflow.optim" in sys.modules, "train_imported": "elflow.train" in sys.modules}))
"""

EMA_PROBE = r"""
import json, sys, time
from pathlib import Path
from elflow.runs.checkpoint import load_tensors, read_state
ckpt = max((Path(sys.argv[1]) / "checkpoints").iterdir())
entry = read_state(ckpt)["files"]["ema.safetensors"]
t0 = time.perf_counter()
tensors = load_tensors(ckpt / "ema.safetensors", entry["sha256"], entry["bytes"])  # read, hashed, parsed
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "tensors": len(tensors)}))
"""

RESUME_PROBE = r"""
import json, os, sys, time
opened = []

def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        opened.append(os.path.abspath(os.fsdecode(args[0])))

sys.addaudithook(hook)
from elflow.cli import main
t0 = time.perf_counter()
code = main(["train", "--out", sys.argv[1], "--resume", "--steps", "2", "--quiet", "--device", "cpu"])
seconds = time.perf_counter() - t0
print(json.dumps({"opened": opened, "seconds": seconds, "code": code}))
"""


def make_run(out: Path, src: str) -> Path:
    """The run, made by the elflow in `src` (the earlier one: both read its record)."""
    run = out / "elf-b"
    if (run / "checkpoints").is_dir():
        return run
    cmd = [sys.executable, "-m", "elflow.cli", "train", "--preset", "elf-b", "--space", "random-table:minilm",
           "--space-dim", "512", "--length", "16", "--batch", "1", "--steps", "1", "--warmup", "0", "--dtype",
           "fp32", "--device", "cpu", "--out", str(run), "--quiet"]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": src})
    return run


def probe(src: str, run: Path, what: str = "sample") -> dict:
    ckpt = max((run / "checkpoints").iterdir())
    target = run
    if what == "resume":  # a fresh copy: the resume writes its own checkpoint
        target = run.parent / "resume-copy"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(run, target)
        ckpt = target / "checkpoints" / ckpt.name
    try:
        done = subprocess.run([sys.executable, "-c", PROBE if what == "sample" else RESUME_PROBE, str(target)],
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0:
            sys.exit(f"load_reads.py: {what} with {src} failed:\n{done.stderr[-2000:]}")
        return _counted(json.loads(done.stdout.splitlines()[-1]), ckpt)
    finally:
        if what == "resume":
            shutil.rmtree(target, ignore_errors=True)


def _counted(seen: dict, ckpt: Path) -> dict:
    """The opens and bytes of the files of the checkpoint folder `ckpt` that `seen` (a probe's output) lists."""
    files = {}
    for path in seen["opened"]:
        p = Path(path)
        if p.parent == ckpt.resolve():
            entry = files.setdefault(p.name, {"opens": 0, "bytes": 0})
            entry["opens"] += 1
            entry["bytes"] += p.stat().st_size
    return {"seconds": seen["seconds"], "files": files, "bytes_read": sum(f["bytes"] for f in files.values()),
            **{k: seen[k] for k in ("optim_imported", "train_imported") if k in seen}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the src/ folder of the elflow to compare with")
    p.add_argument("--out", default="/tmp/load-bench", help="where the ELF-B-sized run is made (reused)")
    p.add_argument("--results", default=None, help="write the JSON here too")
    p.add_argument("--repeats", type=int, default=3, help="loads per checkout (the time is the fastest)")
    p.add_argument("--what", choices=("sample", "resume"), default="sample",
                   help="load to sample, or resume the run (on a copy, one step)")
    args = p.parse_args()
    if not 1 <= args.repeats <= 20:
        sys.exit("load_reads.py: --repeats must be from 1 to 20")
    t0 = time.time()
    run = make_run(Path(args.out), args.before)
    result = {"what": args.what, "cpu": cpu_model(), "run": str(run), "made_in_s": round(time.time() - t0, 1)}
    for name, src in (("before", args.before), ("after", str(ROOT / "src"))):
        runs = [probe(src, run, args.what) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["seconds"])
        result[name] = {**best, "seconds_all": [round(r["seconds"], 3) for r in runs]}
    result["bytes_ratio"] = result["before"]["bytes_read"] / max(result["after"]["bytes_read"], 1)
    result["time_ratio"] = result["before"]["seconds"] / result["after"]["seconds"]
    if args.what == "sample":  # against one verified read of the EMA file, in a fresh process too (target <= 1.5)
        reads = []
        for _ in range(args.repeats):
            done = subprocess.run([sys.executable, "-c", EMA_PROBE, str(run)], capture_output=True, text=True,
                                  check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
            reads.append(json.loads(done.stdout.splitlines()[-1])["seconds"])
        result["ema_read_seconds"] = round(min(reads), 3)
        result["load_over_ema_read"] = {k: round(result[k]["seconds"] / min(reads), 2) for k in ("before", "after")}
    text = json.dumps(result, indent=1)
    print(text)
    if args.results:
        Path(args.results).write_text(text + "\n")


if __name__ == "__main__":
    main()

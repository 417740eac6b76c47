#!/usr/bin/env bash
# Runs made by the code before the package redesign (commit 30b6465, old_side.py: a plain and a short-run-option
# run of 6 steps, each also stopped at step 3), read by today's code: samples of the full runs against the old
# code's samples, and the stopped runs resumed to step 6 against the old uninterrupted runs, bit for bit.
#   usage: check.sh OLD WORK   (OLD: old_side.py's folder with NAME-samples-old.jsonl written by the old code's
#   `elflow sample OLD/NAME-full --num 6 --steps 8 --seed 0`; WORK: a scratch folder)
set -e
OLD=$1 WORK=$2
export HF_HUB_OFFLINE=1
for name in plain options; do
  rm -rf "$WORK/$name-part" "$WORK/$name-samples.jsonl"
  elflow sample "$OLD/$name-full" --num 6 --steps 8 --seed 0 --out "$WORK/$name-samples.jsonl" > /dev/null 2>&1
  cp -r "$OLD/$name-part" "$WORK/$name-part"   # stopped at step 3 by the old code
  rm -rf "$WORK/$name-part/checkpoints/step_0000006"
  python - "$OLD" "$WORK" "$name" <<'PY'
import json, pathlib, sys
old, work, n = sys.argv[1:]
p = pathlib.Path(work, f"{n}-part", "metrics.jsonl")  # the log as the stopped run left it
p.write_text("".join(l + "\n" for l in p.read_text().splitlines() if json.loads(l).get("step", 0) <= 3))
texts = lambda f: [json.loads(l)["text"] for l in open(f)]
print(n, "samples identical to the old code's:", texts(f"{old}/{n}-samples-old.jsonl") == texts(f"{work}/{n}-samples.jsonl"))
PY
  elflow train --out "$WORK/$name-part" --resume --quiet > /dev/null
  python - "$OLD" "$WORK" "$name" <<'PY'
import pathlib, sys
import torch
from safetensors.torch import load_file
old, work, n = sys.argv[1:]
a, b = pathlib.Path(old, f"{n}-full/checkpoints/step_0000006"), pathlib.Path(work, f"{n}-part/checkpoints/step_0000006")
for f in ("model.safetensors", "ema.safetensors"):
    x, y = load_file(a / f), load_file(b / f)
    print(n, f, "bit-identical to the old code's uninterrupted run:", x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x))
def flat(o, pre=""):
    items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, (list, tuple)) else None
    if items is None:
        yield pre, o
    else:
        for k, v in items:
            yield from flat(v, f"{pre}/{k}")
oa, ob = (dict(flat(torch.load(d / "optimizer.pt", weights_only=True))) for d in (a, b))
print(n, "optimizer.pt bit-identical:", oa.keys() == ob.keys() and all(
    torch.equal(oa[k], ob[k]) if torch.is_tensor(oa[k]) else oa[k] == ob[k] for k in oa))
PY
done

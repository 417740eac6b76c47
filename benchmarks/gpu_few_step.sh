#!/usr/bin/env bash
# The few-step comparisons on one GPU machine, in one command from the repository root:
#
#   A  benchmarks/few_step_cond.py: PD and flow-map students of the conditional demonstration's model, BLEU on
#      held-out lines at 1, 2, 4 and 8 steps, three distillation seeds, the jump diagnostic
#   B  benchmarks/few_step_text.py: the unconditional students of the quickstart model (250 steps) judged by a
#      250-step judge, 256 samples a side (the model's held-out split holds 418 rows: 256 MAUVE references, the
#      other 162 scored as held-out text, disjoint); MAUVE's features kept in mauve_features.npz (mauve-text is not
#      needed there: `few_step_text.py --report-only --mauve-from` computes MAUVE from them elsewhere)
#
# A and B run side by side (the demo network leaves a GPU mostly idle: each step is a few thousand small
# kernels). Each skips the stages whose outputs exist in its work folder and starts no stage past the deadline;
# each writes its results after every seed.
#
#   OUT                 where the results go (default runs/gpu_few_step): cond/results.json, cond/few_step_cond.png,
#                       text/results.json, text/few_step.png, mauve_features.npz, runs.tar.gz, cond.log, text.log
#   FEW_STEP_BUDGET_S   seconds from the start after which no stage starts (default 400)
#   FEW_STEP_WORK       work folder: runs, samples, checkpoints (default /tmp/few_step)
#   FEW_STEP_SIZE       full (default) or tiny (a CPU check of the whole script in a few minutes)
#   DEVICE              cuda (default) or cpu
#   COND_EXTRA, TEXT_EXTRA  more flags for A and B (later flags win: COND_EXTRA="--steps-per-round 80")
#   PYTHON              the interpreter (default python3)
#
# Needs torch, transformers, tokenizers, safetensors, numpy, sacrebleu, matplotlib and tqdm. elflow runs from
# src/; what else it reads travels in .gpu/: .gpu/site (the MiniLM tokenizer package without its weights: the
# quickstart's space is a random table over that tokenizer) and .gpu/cache (the built-in corpus, the GPT-2 BPE
# ranks, token stores), copied to ELFLOW_CACHE (default /tmp/elflow-gpu-cache) before the runs.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
T0=$(date +%s)
OUT=${OUT:-$ROOT/runs/gpu_few_step}
WORK=${FEW_STEP_WORK:-/tmp/few_step}
SIZE=${FEW_STEP_SIZE:-full}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
export ELFLOW_CACHE=${ELFLOW_CACHE:-/tmp/elflow-gpu-cache}
export FEW_STEP_DEADLINE=$(( T0 + ${FEW_STEP_BUDGET_S:-400} ))
export PYTHONPATH="$ROOT/.gpu/site:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export USE_HUB_KERNELS=0  # transformers 5 would otherwise ask for the `kernels` package to load the judge
export MPLBACKEND=Agg
mkdir -p "$OUT" "$WORK" "$ELFLOW_CACHE"

say() { echo "[gpu_few_step $(( $(date +%s) - T0 )) s] $*"; }

case "$SIZE" in
  full)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
    COND=(--teacher-train-steps 500 --teacher-batch 32 --seeds 0 1 2 --steps-per-round 60 --batch 32 --lr 1e-3
          --ema-decay 0.95 --heldout 512 --sample-batch 512 --eval-steps 1 2 4 8 --teacher-full-steps 64
          --diag-lines 128 --diag-grid 64)
    TEXT=(--teacher-train-steps 250 --judge-steps 250 --seeds 0 1 --steps-per-round 30 --batch 32 --fm-batch match
          --lr 1e-3 --ema-decay 0.95 --num 256 --sample-batch 256 --eval-steps 1 2 4 8 --teacher-full-steps 32) ;;
  tiny)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    COND=(--teacher-train-steps 6 --teacher-batch 8 --seeds 0 1 --student-steps 2,1 --teacher-steps 4
          --steps-per-round 2 --batch 4 --lr 1e-3 --ema-decay 0.5 --heldout 16 --sample-batch 16 --eval-steps 1 2
          --teacher-full-steps 4 --diag-lines 4 --diag-grid 4)
    TEXT=(--teacher-train-steps 6 --judge-steps 6 --seeds 0 --student-steps 2,1 --teacher-steps 4
          --steps-per-round 2 --batch 4 --fm-batch match --lr 1e-3 --ema-decay 0.5 --num 12 --sample-batch 12
          --eval-steps 1 2 --teacher-full-steps 0) ;;
  *) echo "gpu_few_step: FEW_STEP_SIZE must be full or tiny, got '$SIZE'" >&2; exit 2 ;;
esac
COND+=(${COND_EXTRA:-})
TEXT+=(${TEXT_EXTRA:-})

say "OUT=$OUT WORK=$WORK SIZE=$SIZE DEVICE=$DEVICE deadline in ${FEW_STEP_BUDGET_S:-400} s"
if [ -d .gpu/cache ]; then cp -R .gpu/cache/. "$ELFLOW_CACHE/"; fi
"$PY" - <<EOF || { echo "gpu_few_step: elflow does not import here (see above)" >&2; exit 2; }
import platform, torch, elflow, elflow.cli
print("python", platform.python_version(), "torch", torch.__version__, "elflow", elflow.__version__,
      "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
if "$DEVICE".startswith("cuda") and not torch.cuda.is_available():
    raise SystemExit("gpu_few_step: DEVICE=$DEVICE but torch sees no CUDA device")
EOF
say "setup done"

( "$PY" benchmarks/few_step_cond.py --out "$WORK/cond" --results "$OUT/cond" --device "$DEVICE" "${COND[@]}" \
    > "$OUT/cond.log" 2>&1; echo "exit $?" >> "$OUT/cond.log" ) &
A=$!
( "$PY" benchmarks/few_step_text.py --out "$WORK/text" --results "$OUT/text" --device "$DEVICE" \
    --judge-device "$DEVICE" --teacher-via train --no-mauve --features "$OUT/mauve_features.npz" "${TEXT[@]}" \
    > "$OUT/text.log" 2>&1; echo "exit $?" >> "$OUT/text.log" ) &
B=$!
wait $A; say "A (conditional) ended: $(tail -1 "$OUT/cond.log")"
wait $B; say "B (unconditional) ended: $(tail -1 "$OUT/text.log")"

# the small records of both: commands, eval reports, loss logs, run records, samples (no checkpoints)
( cd "$WORK" && find . \( -name checkpoints -o -name '.replaced-run' \) -prune -o -type f \
    \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' \) -print | tar -czf "$OUT/runs.tar.gz" -T - )
if [ "$(stat -c %s "$OUT/runs.tar.gz")" -gt 15000000 ]; then  # too big to come back: without the samples
  ( cd "$WORK" && find . \( -name checkpoints -o -name '.replaced-run' \) -prune -o -type f \
      \( -name '*.json' -o -name '*.log' -o -name metrics.jsonl \) -print | tar -czf "$OUT/runs.tar.gz" -T - )
fi
say "done; in $OUT:"
ls -la "$OUT" "$OUT"/cond "$OUT"/text 2>/dev/null
grep -h "done in\|skipped\|error\|failed" "$OUT/cond.log" "$OUT/text.log" | grep -v "^\$" | tail -80

"""Few-step text generation: progressive distillation (PD) against the flow-map student, one teacher, one judge.

Everything goes through the `elflow` CLI (subprocess), in this order, each stage skipped when its output is
already in --out (so a stopped run continues where it stopped):

  teacher    `elflow quickstart --out OUT/teacher --steps T`: the demo preset on the built-in Shakespeare corpus
  judge      `elflow train-judge --out OUT/judge --steps J --seed 0 --device cpu`: one offline judge for every row
  references 2 x --num rows of the teacher's held-out split (`elflow.eval.scoring.heldout_texts`): the first
             half is MAUVE's reference set for every row, the second half is scored as a row ("held-out text")
  per seed s:
    PD       `elflow distill OUT/teacher --objective pd --student-steps 16,8,4,2,1 --teacher-steps 16
              --steps-per-round R --batch B --micro-batch B --lr LR --ema-decay E --seed s --out OUT/pd-s<s>`
    flow map `elflow distill OUT/teacher --objective flow-map --steps 5R --batch B --micro-batch B --lr LR --ema-decay E --seed s
              --out OUT/fm-s<s>` (the same optimiser steps as PD's rounds together, the same batch and rate)
  evaluation (per seed, right after that seed's students)
             `elflow eval --checkpoint RUN --num N --steps K --seeds s --batch 32 --judge OUT/judge --mauve
              --references OUT/refs.jsonl --no-heldout --json --out OUT/eval/<row>`
             teacher at K = 1, 2, 4, 8 and its default 32 (its own sampler defaults), each PD student at its own
             step count (OUT/pd-s<s>/<K>-step, K = 1, 2, 4, 8), the flow map at every K; sampling seed s for the
             students of training seed s and for the one teacher (its spread is the sampling noise alone);
             the teacher's own step count last (--teacher-full-steps, 0 skips it).

Writes RESULTS/results.json (settings, every number per seed, wall times, the CPU) and RESULTS/few_step.png
(Gen-PPL and MAUVE against sampling steps: mean over seeds, each seed's points).

The run reported in docs/few_step.md (a shared 2-core CPU, under load from other jobs):

    OMP_NUM_THREADS=2 python benchmarks/few_step_text.py --out /tmp/fs --teacher-train-steps 100 \\
        --judge-steps 80 --steps-per-round 5 --batch 4 --ema-decay 0.5 --num 48 --seeds 0 1 --teacher-full-steps 0 \\
        --results benchmarks/results/few_step_text --copy-png docs/few_step.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(cmd: list[str], log: Path) -> tuple[float, str]:
    """Run `cmd`, its stderr into `log`; (wall seconds, stdout). Exits with the command's last lines on failure."""
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "a") as err:
        err.write("$ " + " ".join(cmd) + "\n")
        err.flush()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.time() - t0
    if p.returncode != 0:
        tail = log.read_text().replace("\r", "\n").splitlines()[-5:]
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n" + "\n".join(tail))
    print(f"  done in {wall:.0f} s", flush=True)
    return wall, p.stdout


def load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def save(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def last_losses(run_dir: Path) -> dict | None:
    """The last training line of a run's metrics.jsonl (loss, step, elapsed)."""
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return None
    last = None
    for line in f.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "train":
            last = rec
    return None if last is None else {k: last.get(k) for k in ("step", "loss", "elapsed")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/few_step", help="work folder (runs, samples, eval reports)")
    ap.add_argument("--results", default="benchmarks/results/few_step_text", help="results.json and the PNG")
    ap.add_argument("--copy-png", default=None, help="also copy the PNG here (e.g. docs/few_step.png)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="distillation seeds (and sampling seeds)")
    ap.add_argument("--teacher-train-steps", type=int, default=250, help="quickstart --steps (its default 250)")
    ap.add_argument("--judge-steps", type=int, default=200, help="train-judge --steps")
    ap.add_argument("--student-steps", default="16,8,4,2,1", help="PD rounds")
    ap.add_argument("--teacher-steps", type=int, default=16, help="PD: teacher steps over [0, 1]")
    ap.add_argument("--steps-per-round", type=int, default=16, help="PD optimiser steps per round")
    ap.add_argument("--total-steps", type=int, default=None,
                    help="flow-map optimiser steps (default: PD's rounds together)")
    ap.add_argument("--batch", type=int, default=4, help="distillation batch (both methods)")
    ap.add_argument("--lr", type=float, default=5e-4, help="distillation learning rate (both methods)")
    ap.add_argument("--ema-decay", type=float, default=0.98, help="distillation EMA decay (both methods)")
    ap.add_argument("--eval-steps", type=int, nargs="+", default=[1, 2, 4, 8], help="sampling steps K")
    ap.add_argument("--teacher-full-steps", type=int, default=32, help="the teacher's own step count, also judged")
    ap.add_argument("--num", type=int, default=64, help="samples per row and seed (and references)")
    ap.add_argument("--sample-batch", type=int, default=32)
    ap.add_argument("--teacher-evals", action=argparse.BooleanOptionalAction, default=True,
                    help="judge the teacher with each seed (--no-teacher-evals: the students alone)")
    ap.add_argument("--report-only", action="store_true", help="only gather results.json and the plot")
    args = ap.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    results_dir = Path(args.results)
    rounds = [int(x) for x in args.student_steps.split(",")]
    total = args.total_steps or args.steps_per_round * len(rounds)
    state_file = out / "state.json"
    state = load(state_file) or {"walls": {}, "commands": {}}

    def stage(name: str, cmd: list[str], done) -> str | None:
        if done() or args.report_only:
            return None
        wall, stdout = run(cmd, log)
        state["walls"][name] = wall
        state["commands"][name] = " ".join(cmd)
        save(state_file, state)
        return stdout

    teacher, judge = out / "teacher", out / "judge"
    stage("teacher", ["elflow", "quickstart", "--out", str(teacher), "--steps", str(args.teacher_train_steps)],
          lambda: (teacher / "report.json").is_file())
    stage("judge", ["elflow", "train-judge", "--out", str(judge), "--steps", str(args.judge_steps), "--seed", "0",
                    "--device", "cpu"], lambda: (judge / "elflow_judge.json").is_file())

    refs, real = out / "refs.jsonl", out / "heldout.jsonl"
    if not refs.is_file() and not args.report_only:
        from elflow.eval.scoring import heldout_texts

        texts, what = heldout_texts(str(teacher), 2 * args.num)
        if len(texts) < 2 * args.num:
            sys.exit(f"only {len(texts)} held-out rows; need {2 * args.num}")
        real.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[args.num:2 * args.num]))
        refs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:args.num]))
        state["references"] = f"first {args.num} of {what}; the held-out row: the next {args.num}"
        save(state_file, state)

    evals = out / "eval"

    def judge_flags() -> list[str]:
        return ["--judge", str(judge), "--mauve", "--references", str(refs), "--no-heldout", "--json"]

    def evaluate(name: str, checkpoint: Path, k: int, seeds: list[int]) -> None:
        report = evals / f"{name}.json"
        if report.is_file() or args.report_only:
            return
        cmd = ["elflow", "eval", "--checkpoint", str(checkpoint), "--num", str(args.num), "--steps", str(k),
               "--seeds", *map(str, seeds), "--batch", str(args.sample_batch), *judge_flags(),
               "--out", str(evals / name), "--overwrite"]
        wall, stdout = run(cmd, log)
        res = json.loads(stdout.strip().splitlines()[-1])
        res["wall_s"] = wall
        res["command"] = " ".join(cmd)
        save(report, res)

    # the held-out row: real text against the references
    if not (evals / "heldout.json").is_file() and not args.report_only:
        cmd = ["elflow", "eval", str(real), *judge_flags(), "--report", str(evals / "heldout.report.json"),
               "--overwrite"]
        wall, stdout = run(cmd, log)
        res = json.loads(stdout.strip().splitlines()[-1])
        res.update(wall_s=wall, command=" ".join(cmd))
        save(evals / "heldout.json", res)

    for s in args.seeds:  # one complete group per seed: the teacher sampled with seed s, then s's students
        for k in args.eval_steps if args.teacher_evals else []:
            evaluate(f"teacher-s{s}-k{k}", teacher, k, [s])
        pd, fm = out / f"pd-s{s}", out / f"fm-s{s}"
        stage(f"pd-s{s}", ["elflow", "distill", str(teacher), "--objective", "pd", "--student-steps",
                           args.student_steps, "--teacher-steps", str(args.teacher_steps), "--steps-per-round",
                           str(args.steps_per_round), "--batch", str(args.batch), "--micro-batch", str(args.batch), "--lr", str(args.lr),
                           "--ema-decay", str(args.ema_decay), "--seed", str(s), "--out", str(pd), "--quiet"],
              lambda: f"pd-s{s}" in state["walls"])
        stage(f"fm-s{s}", ["elflow", "distill", str(teacher), "--objective", "flow-map", "--steps", str(total),
                           "--batch", str(args.batch), "--micro-batch", str(args.batch), "--lr", str(args.lr), "--ema-decay", str(args.ema_decay),
                           "--seed", str(s), "--out", str(fm), "--quiet"],
              lambda: f"fm-s{s}" in state["walls"])
        for k in args.eval_steps:
            if k in rounds:
                evaluate(f"pd-s{s}-k{k}", pd / f"{k}-step", k, [s])
            evaluate(f"fm-s{s}-k{k}", fm, k, [s])
        gather(args, out, results_dir, rounds, total, state)  # partial results after every seed

    if args.teacher_full_steps:  # last: the most expensive row (0 skips it)
        for s in args.seeds:
            evaluate(f"teacher-s{s}-k{args.teacher_full_steps}", teacher, args.teacher_full_steps, [s])
    gather(args, out, results_dir, rounds, total, state)
    return 0


def gather(args, out: Path, results_dir: Path, rounds: list[int], total: int, state: dict) -> dict:
    """results.json and the plot from the eval reports present in OUT/eval."""
    import statistics

    evals = out / "eval"
    keep = ("gen_ppl", "entropy", "mauve", "num_samples", "num_empty")
    settings_keys = ("sampler", "steps", "gamma", "omega", "grid", "batch_size")

    def per_seed(rep: dict) -> list[dict]:
        return [{k: r.get(k) for k in ("seed", *keep)} for r in rep.get("per_seed", [])]

    def settings(rep: dict) -> dict:
        return {k: rep.get(k) for k in settings_keys if k in rep}

    rows = []
    ks = list(args.eval_steps)
    for method, prefix in (("teacher", "teacher"), ("PD", "pd"), ("flow map", "fm")):
        full = [args.teacher_full_steps] if method == "teacher" and args.teacher_full_steps else []
        for k in [*ks, *full]:
            seeds, sett, walls = [], None, 0.0
            for s in args.seeds:
                rep = load(evals / f"{prefix}-s{s}-k{k}.json")
                if rep:
                    seeds += per_seed(rep)
                    sett = settings(rep)
                    walls += rep["wall_s"]
            if seeds:
                rows.append({"model": method, "steps": k, "settings": sett, "per_seed": seeds, "wall_s": walls})
    for r in rows:
        for m in ("gen_ppl", "entropy", "mauve"):
            vals = [p[m] for p in r["per_seed"] if p.get(m) is not None]
            r[m] = statistics.fmean(vals) if vals else None
            r[m + "_spread"] = (max(vals) - min(vals)) / 2 if len(vals) > 1 else None
            r[m + "_values"] = vals
    held = load(evals / "heldout.json")
    held_row = None if held is None else {m: held.get(m) for m in keep}

    trainings = {}
    for s in args.seeds:
        pd, fm = out / f"pd-s{s}", out / f"fm-s{s}"
        trainings[f"pd-s{s}"] = {"wall_s": state["walls"].get(f"pd-s{s}"), "command": state["commands"].get(f"pd-s{s}"),
                                 "rounds": {n: last_losses(pd / f"{n}-step") for n in rounds}}
        trainings[f"fm-s{s}"] = {"wall_s": state["walls"].get(f"fm-s{s}"), "command": state["commands"].get(f"fm-s{s}"),
                                 "last": last_losses(fm)}
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    result = {
        "what": "PD students and the flow-map student of one quickstart teacher, judged by one offline judge",
        "cpu": cpu_model(), "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(), "torch": torch_version,
        "settings": {"teacher_train_steps": args.teacher_train_steps, "judge_steps": args.judge_steps,
                     "seeds": args.seeds, "pd_rounds": rounds, "pd_teacher_steps": args.teacher_steps,
                     "pd_steps_per_round": args.steps_per_round, "pd_total_steps": args.steps_per_round * len(rounds),
                     "flow_map_steps": total, "batch": args.batch, "lr": args.lr, "ema_decay": args.ema_decay,
                     "num_samples_per_seed": args.num, "eval_steps": args.eval_steps,
                     "teacher_full_steps": args.teacher_full_steps, "mauve_references": state.get("references"),
                     "mauve": "elflow eval --mauve: judge last hidden state, clusters auto (a tenth of the texts), "
                              "seed 25"},
        "commands": state["commands"], "walls_s": state["walls"],
        "teacher": {"wall_s": state["walls"].get("teacher"), "last": last_losses(out / "teacher")},
        "trainings": trainings, "heldout_text": held_row, "rows": rows,
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    save(results_dir / "results.json", result)
    plot(result, results_dir / "few_step.png", args)
    if args.copy_png:
        Path(args.copy_png).write_bytes((results_dir / "few_step.png").read_bytes())
    return result


def plot(result: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"teacher": "tab:gray", "PD": "tab:blue", "flow map": "tab:red"}
    for ax, metric, label in ((axes[0], "gen_ppl", "judge perplexity (Gen-PPL, lower is better)"),
                              (axes[1], "mauve", "MAUVE vs held-out text (higher is better)")):
        for model, c in colors.items():
            rows = sorted((r for r in result["rows"] if r["model"] == model and r.get(metric) is not None
                           and r["steps"] in args.eval_steps), key=lambda r: r["steps"])
            if not rows:
                continue
            ax.plot([r["steps"] for r in rows], [r[metric] for r in rows], "-o", color=c, label=model)
            for r in rows:
                ax.scatter([r["steps"]] * len(r[metric + "_values"]), r[metric + "_values"], color=c, s=12,
                           alpha=0.5, marker="x")
            full = [r for r in result["rows"] if r["model"] == model and r["steps"] not in args.eval_steps]
            for r in full:
                if r.get(metric) is not None:
                    ax.scatter([r["steps"]], [r[metric]], color=c, marker="*", s=80,
                               label=f"{model}, {r['steps']} steps")
        held = result.get("heldout_text") or {}
        if held.get(metric) is not None:
            ax.axhline(held[metric], color="k", ls="--", lw=0.8, label="held-out text")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sampling steps")
        ax.set_title(label, fontsize=10)
        if metric == "gen_ppl":
            ax.set_yscale("log")
    axes[1].legend(fontsize=8)
    s = result["settings"]
    fig.suptitle(f"quality against steps: PD ({len(s['pd_rounds'])} rounds x {s['pd_steps_per_round']}) vs flow map "
                 f"({s['flow_map_steps']} steps), batch {s['batch']}, seeds {s['seeds']}, {s['num_samples_per_seed']} "
                 f"samples/seed; {result['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

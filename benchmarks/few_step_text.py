"""Few-step text generation: progressive distillation (PD) against the flow-map student, one teacher, one judge.

Everything goes through the `elflow` CLI (subprocess), in this order, each stage skipped when its output is
already in --out (so a stopped run continues where it stopped):

  teacher    `elflow quickstart --out OUT/teacher --steps T`: the demo preset on the built-in Shakespeare corpus
  judge      `elflow train-judge --out OUT/judge --steps J --seed 0 --device cpu`: one offline judge for every row
  references rows of the teacher's held-out split (`elflow.eval.scoring.heldout_texts`): the first --num are
             MAUVE's reference set for every row, the next --num (or as many as the split has left, at least
             MIN_TEXTS) are scored as a row ("held-out text"); both sets are held out and disjoint. The
             quickstart's split holds 418 rows: --num 256 leaves 162 for the held-out row, and a --num that
             leaves fewer than MIN_TEXTS is refused before the first stage, with the count
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

On a machine without mauve-text (a GPU machine with torch alone): --no-mauve judges Gen-PPL and entropy only and
--features FILE.npz keeps the judge's features of every sample set and of the references (what `elflow eval
--mauve` clusters); `--report-only --mauve-from FILE.npz` on a machine with mauve-text then adds MAUVE to every
row, as `elflow eval --mauve` computes it from the same features. --device runs the teacher, the judge's
training and every evaluation there; --teacher-via train trains the teacher with `elflow train --defaults
quickstart` (the quickstart's model without its report); --deadline stops starting stages at a unix time.

The run reported in docs/few_step.md (a 2-core AMD EPYC, idle; run with --seeds 0 1, then again with --seeds
0 1 2, which added seed 2):

    OMP_NUM_THREADS=2 python benchmarks/few_step_text.py --out W --teacher-train-steps 250 --judge-steps 250 \\
        --steps-per-round 5 --batch 4 --ema-decay 0.5 --num 256 --seeds 0 1 2 --teacher-full-steps 0 \\
        --results benchmarks/results/few_step_text --copy-png docs/few_step.png
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from script_args import DECAY, RATE, ROWS, SAMPLES, SAMPLING_STEPS, STEPS, check, main_of, parser

from elflow.eval.mauve import MIN_TEXTS  # the fewest texts MAUVE scores a side: the held-out row's least
from elflow.util.errors import ELFError

ROOT = Path(__file__).resolve().parent.parent
ELFLOW = [sys.executable, "-m", "elflow.cli"]  # the `elflow` command, also where it is not installed
FEATURES = "features"  # OUT/features/<row>.npy: the judge's features of a sample set


def shown(cmd: list[str]) -> str:
    """A command as a person types it: `elflow ...` for the CLI."""
    if cmd[:len(ELFLOW)] == ELFLOW:
        cmd = ["elflow", *cmd[len(ELFLOW):]]
    return " ".join(cmd)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpu_name(device: str | None) -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if str(device).startswith("cuda") and torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        return None


class Failed(Exception):
    """A command that failed: its line and its last lines of output."""


def run(cmd: list[str], log: Path, in_process: bool = False, env: dict | None = None,
        soft: bool = False) -> tuple[float, str]:
    """Run `cmd`, its stderr into `log`; (wall seconds, stdout). `in_process`: an `elflow` command run by the
    CLI's own entry point in this process (no start-up). Exits with the command's last lines on failure (raises
    Failed with them if `soft`)."""
    print("$ " + shown(cmd), flush=True)
    t0 = time.time()
    with open(log, "a") as err:
        err.write("$ " + shown(cmd) + "\n")
        err.flush()
        if in_process and cmd[:len(ELFLOW)] == ELFLOW:
            from elflow.cli import main as elflow_main

            out, msgs = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(msgs):
                code = elflow_main(cmd[len(ELFLOW):])
            err.write(msgs.getvalue())
            stdout = out.getvalue()
        else:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, check=False)
            code, stdout = p.returncode, p.stdout
    wall = time.time() - t0
    if code != 0:
        tail = log.read_text().replace("\r", "\n").splitlines()[-5:]
        if soft:
            raise Failed(f"failed ({code}): {shown(cmd)}: " + " / ".join(t for t in tail[-2:] if t.strip()))
        sys.exit(f"failed ({code}): {shown(cmd)}\n" + "\n".join(tail))
    print(f"  done in {wall:.0f} s", flush=True)
    return wall, stdout


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


def build_parser() -> argparse.ArgumentParser:
    ap = parser("few_step_text", __doc__)
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
    ap.add_argument("--student-dtype", choices=("auto", "bf16", "fp32"), default=None,
                    help="both students' precision (default: the teacher's)")
    ap.add_argument("--ema-decay", type=float, default=0.98, help="distillation EMA decay (both methods)")
    ap.add_argument("--eval-steps", type=int, nargs="+", default=[1, 2, 4, 8], help="sampling steps K")
    ap.add_argument("--teacher-full-steps", type=int, default=32, help="the teacher's own step count, also judged")
    ap.add_argument("--num", type=int, default=64, help="samples per row and seed (and references)")
    ap.add_argument("--sample-batch", type=int, default=32)
    ap.add_argument("--teacher-evals", action=argparse.BooleanOptionalAction, default=True,
                    help="judge the teacher with each seed (--no-teacher-evals: the students alone)")
    ap.add_argument("--report-only", action="store_true", help="only gather results.json and the plot")
    ap.add_argument("--device", default=None,
                    help="cuda or cpu: the teacher's training and every evaluation (default: cuda when available)")
    ap.add_argument("--judge-device", default="cpu", help="where the judge trains (train-judge --device)")
    ap.add_argument("--teacher-via", choices=("quickstart", "train"), default="quickstart",
                    help="quickstart: `elflow quickstart` (with its report); train: `elflow train --defaults "
                         "quickstart`, the same model without the report")
    ap.add_argument("--fm-batch", default=None,
                    help="the flow map's batch (default: --batch); 'match': the batch that gives the flow map PD's "
                         "teacher forward passes in as many optimiser steps (benchmarks/few_step_cond.py)")
    ap.add_argument("--mauve", action=argparse.BooleanOptionalAction, default=True,
                    help="MAUVE in every evaluation (needs mauve-text; --no-mauve: Gen-PPL and entropy only)")
    ap.add_argument("--features", default=None,
                    help="also keep the judge's features of every sample set and of the references in this .npz")
    ap.add_argument("--mauve-from", default=None,
                    help="with --report-only: MAUVE of every row from the features in this .npz (--features)")
    ap.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=True,
                    help="run `elflow eval` in this process (no start-up per row); trainings always run apart")
    ap.add_argument("--deadline", type=float, default=None,
                    help="unix time after which no stage starts (default: $FEW_STEP_DEADLINE if set)")
    return ap


def parse_args(argv):
    """The command line, every flag checked (script_args.check) before any stage: ELFError naming the first bad
    one."""
    args = build_parser().parse_args(argv)
    if args.deadline is None and os.environ.get("FEW_STEP_DEADLINE"):
        try:
            args.deadline = float(os.environ["FEW_STEP_DEADLINE"])
        except ValueError:
            raise ELFError(f"FEW_STEP_DEADLINE must be a unix time in seconds, got "
                           f"{os.environ['FEW_STEP_DEADLINE']!r}") from None
    if args.mauve_from and not args.report_only:
        raise ELFError("--mauve-from adds MAUVE to gathered results: pass it with --report-only")
    if args.mauve_from and not Path(args.mauve_from).is_file():
        raise ELFError(f"--mauve-from {args.mauve_from}: no such file")
    if args.fm_batch not in (None, "match"):
        try:
            args.fm_batch = int(args.fm_batch)
        except ValueError:
            raise ELFError(f"--fm-batch must be an integer or 'match', got {args.fm_batch!r}") from None
    try:
        rounds = [int(x) for x in args.student_steps.split(",")]
    except ValueError:
        raise ELFError(f"--student-steps must be integers such as 16,8,4,2,1, got {args.student_steps!r}") from None
    args.student_rounds = rounds
    check(args, counts={"num": SAMPLES, "batch": ROWS, "steps_per_round": STEPS, "total_steps": STEPS,
                        "judge_steps": STEPS, "teacher_train_steps": STEPS, "sample_batch": ROWS,
                        "teacher_steps": SAMPLING_STEPS, "eval_steps": SAMPLING_STEPS, "student_rounds": SAMPLING_STEPS,
                        "teacher_full_steps": (*SAMPLING_STEPS, 0),
                        **({"fm_batch": ROWS} if isinstance(args.fm_batch, int) else {})},
          scales={"lr": RATE, "ema_decay": DECAY}, seeds=("seeds",), folders=("out", "results"),
          files=("copy_png", "features"))
    return args


def main(argv=None) -> int:
    return main_of("few_step_text", lambda: run_stages(parse_args(argv)))


def run_stages(args) -> int:
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for flag, dev in (("--device", args.device), ("--judge-device", args.judge_device)):
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise ELFError(f"{flag} {dev}: this machine has no CUDA device; pass {flag} cpu")
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # `elflow distill` takes the GPU when it sees one
    t_start = time.time()
    walls: dict[str, list[float]] = {}

    def expected(kind: str) -> float:
        """The median wall of the stages of `kind` so far (0 before the first)."""
        import statistics

        return statistics.median(walls[kind]) if walls.get(kind) else 0.0

    def allowed(name: str, kind: str) -> bool:
        """Whether a stage may start: not past --deadline, nor expected (the longest of its kind) to end past it."""
        if args.deadline is None:
            return True
        left = args.deadline - time.time()
        if left <= 0 or expected(kind) > left:
            print(f"skipped {name}: {left:.0f} s to the deadline", flush=True)
            state.setdefault("skipped", []).append(name) if name not in state.get("skipped", []) else None
            return False
        return True

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    results_dir = Path(args.results)
    rounds = [int(x) for x in args.student_steps.split(",")]
    total = args.total_steps or args.steps_per_round * len(rounds)
    state_file = out / "state.json"
    state = load(state_file) or {"walls": {}, "commands": {}}

    if not args.report_only and not (out / "refs.jsonl").is_file():  # before any training: enough held-out rows?
        held_rows = heldout_rows(out / "teacher")
        if held_rows < args.num + MIN_TEXTS:
            sys.exit(too_few_rows(held_rows, args.num))

    def stage(name: str, cmd: list[str], done, kind: str | None = None) -> str | None:
        if done() or args.report_only or not allowed(name, kind or name):
            return None
        try:
            wall, stdout = run(cmd, log, env=env, soft=kind is not None)  # a seed's failed student: noted
        except Failed as e:
            print(f"  {name}: {e}", flush=True)
            state.setdefault("failed", {})[name] = str(e)
            save(state_file, state)
            return None
        walls.setdefault(kind or name, []).append(wall)
        state["walls"][name] = wall
        state["commands"][name] = shown(cmd)
        if name in state.get("skipped", []):
            state["skipped"].remove(name)
        save(state_file, state)
        return stdout

    teacher, judge = out / "teacher", out / "judge"
    if args.teacher_via == "quickstart":
        stage("teacher", [*ELFLOW, "quickstart", "--out", str(teacher), "--steps", str(args.teacher_train_steps)],
              lambda: (teacher / "report.json").is_file())
    else:
        stage("teacher", [*ELFLOW, "train", "--defaults", "quickstart", "--steps", str(args.teacher_train_steps),
                          "--device", args.device, "--out", str(teacher), "--quiet"],
              lambda: "teacher" in state["walls"] or (teacher / "report.json").is_file())
    stage("judge", [*ELFLOW, "train-judge", "--out", str(judge), "--steps", str(args.judge_steps), "--seed", "0",
                    "--device", args.judge_device], lambda: (judge / "elflow_judge.json").is_file())
    if not (teacher / "run.json").is_file() or not (judge / "elflow_judge.json").is_file():
        if args.report_only:
            sys.exit(f"few_step_text: {out} holds no teacher or judge; run without --report-only first")
        gather(args, out, results_dir, rounds, total, state)
        print("few_step_text: no teacher or judge before the deadline; nothing more to do", flush=True)
        return 0

    refs, real = out / "refs.jsonl", out / "heldout.jsonl"
    if not refs.is_file() and not args.report_only:
        from elflow.eval.scoring import heldout_texts

        texts, what = heldout_texts(str(teacher), 2 * args.num)
        if len(texts) < args.num + MIN_TEXTS:
            sys.exit(too_few_rows(len(texts), args.num))
        held = texts[args.num:2 * args.num]
        real.write_text("".join(json.dumps({"text": t}) + "\n" for t in held))
        refs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:args.num]))
        state["references"] = f"first {args.num} of {what}; the held-out row: the next {len(held)}"
        save(state_file, state)

    evals = out / "eval"

    def judge_flags() -> list[str]:
        mauve = ["--mauve", "--references", str(refs)] if args.mauve else []
        return ["--judge", str(judge), *mauve, "--no-heldout", "--device", args.device, "--json"]

    def evaluate(name: str, checkpoint: Path, k: int, seeds: list[int]) -> None:
        report = evals / f"{name}.json"
        if report.is_file() or args.report_only or not allowed(name, "eval"):
            return
        cmd = [*ELFLOW, "eval", "--checkpoint", str(checkpoint), "--num", str(args.num), "--steps", str(k),
               "--seeds", *map(str, seeds), "--batch", str(args.sample_batch), *judge_flags(),
               "--out", str(evals / name), "--overwrite"]
        try:
            wall, stdout = run(cmd, log, in_process=args.in_process, env=env, soft=True)
        except Failed as e:  # a row without a score (every sample empty, say): noted, the others go on
            print(f"  {name}: {e}", flush=True)
            state.setdefault("failed", {})[name] = str(e)
            save(state_file, state)
            return
        walls.setdefault("eval", []).append(wall)
        res = json.loads(stdout.strip().splitlines()[-1])
        res["wall_s"] = wall
        res["command"] = shown(cmd)
        if args.features:
            features(name, {s: evals / name / f"samples_seed{s}.jsonl" for s in seeds})
        save(report, res)

    judged: dict = {}

    def features(name: str, files: dict) -> None:
        """OUT/features/<name>-s<seed>.npy: the judge's features of the non-empty texts of each samples file, as
        `elflow eval --mauve` featurises them."""
        import numpy as np

        from elflow.eval.judge import load_judge
        from elflow.eval.mauve import judge_features

        if "judge" not in judged:
            judged["judge"] = load_judge(str(judge), "fp32", args.device)
        model, tok = judged["judge"]
        for seed, f in files.items():
            texts = [json.loads(x)["text"] for x in Path(f).read_text().splitlines() if x.strip()]
            kept = [t for t in texts if t.strip()]
            feats = judge_features(kept, model, tok, 8).cpu().numpy()
            (out / FEATURES).mkdir(exist_ok=True)
            np.save(out / FEATURES / (f"{name}-s{seed}.npy" if seed is not None else f"{name}.npy"), feats)

    # the held-out row: real text against the references
    if not (evals / "heldout.json").is_file() and not args.report_only and allowed("heldout", "eval"):
        cmd = [*ELFLOW, "eval", str(real), *judge_flags(), "--report", str(evals / "heldout.report.json"),
               "--overwrite"]
        wall, stdout = run(cmd, log, in_process=args.in_process, env=env)
        res = json.loads(stdout.strip().splitlines()[-1])
        res.update(wall_s=wall, command=shown(cmd))
        if args.features:
            features("references", {None: refs})
            features("heldout", {None: real})
        save(evals / "heldout.json", res)

    dtype = ["--dtype", args.student_dtype] if args.student_dtype else []
    for s in args.seeds:  # one complete group per seed: the teacher sampled with seed s, then s's students
        for k in args.eval_steps if args.teacher_evals else []:
            evaluate(f"teacher-s{s}-k{k}", teacher, k, [s])
        pd, fm = out / f"pd-s{s}", out / f"fm-s{s}"
        stage(f"pd-s{s}", [*ELFLOW, "distill", str(teacher), "--objective", "pd", "--student-steps",
                           args.student_steps, "--teacher-steps", str(args.teacher_steps), "--steps-per-round",
                           str(args.steps_per_round), "--batch", str(args.batch), "--micro-batch", str(args.batch), "--lr", str(args.lr),
                           "--ema-decay", str(args.ema_decay), "--seed", str(s), "--out", str(pd), "--quiet", *dtype],
              lambda: f"pd-s{s}" in state["walls"], kind="pd")
        fm_batch = fm_batch_for(args, teacher, rounds, total, state)
        stage(f"fm-s{s}", [*ELFLOW, "distill", str(teacher), "--objective", "flow-map", "--steps", str(total),
                           "--batch", str(fm_batch), "--micro-batch", str(fm_batch), "--lr", str(args.lr),
                           "--ema-decay", str(args.ema_decay), "--seed", str(s), "--out", str(fm), "--quiet", *dtype],
              lambda: f"fm-s{s}" in state["walls"], kind="fm")
        for k in args.eval_steps:
            if k in rounds and f"pd-s{s}" in state["walls"]:
                evaluate(f"pd-s{s}-k{k}", pd / f"{k}-step", k, [s])
            if f"fm-s{s}" in state["walls"]:
                evaluate(f"fm-s{s}-k{k}", fm, k, [s])
        gather(args, out, results_dir, rounds, total, state)  # partial results after every seed

    if args.teacher_full_steps:  # last: the most expensive row (0 skips it)
        for s in args.seeds:
            evaluate(f"teacher-s{s}-k{args.teacher_full_steps}", teacher, args.teacher_full_steps, [s])
    gather(args, out, results_dir, rounds, total, state)
    if args.features:
        pack_features(out, Path(args.features))
    print(f"few_step_text: done in {time.time() - t_start:.0f} s; {results_dir / 'results.json'}", flush=True)
    return 0


def heldout_rows(teacher: Path) -> int:
    """Rows in the held-out split the references come from: the trained teacher's (its record), else that of the
    quickstart's settings, which the teacher is trained with (the split depends on the data, the tokenizer, the
    length, --val-fraction and the seed, not on the steps). Reads the corpus's token store (prepared once); the
    count is checked again on the trained teacher before the references are written."""
    from elflow.util.errors import ELFError

    if (teacher / "run.json").is_file():
        from elflow.eval.scoring import heldout_texts

        try:
            return len(heldout_texts(str(teacher), 10 ** 9)[0])
        except ELFError:
            pass  # a teacher not trained to the end yet: the quickstart's split, which it will have
    try:
        from elflow.config import TrainConfig
        from elflow.data.datasets import run_data
        from elflow.space import build_space, tokenizer_spec

        cfg = TrainConfig.named("quickstart").resolved()
        return len(run_data(cfg, build_space(tokenizer_spec(cfg.space)), cfg.length)[1])
    except (ELFError, OSError) as e:
        sys.exit(f"few_step_text: the teacher's held-out split cannot be read: {e}")


def too_few_rows(rows: int, num: int) -> str:
    """The refusal of a --num whose reference set and held-out row do not fit in the held-out split."""
    return (f"few_step_text: the teacher's held-out split holds {rows} rows; --num {num} needs {num + MIN_TEXTS} "
            f"(a reference set of {num} and a scored held-out row of at least {MIN_TEXTS}, disjoint): pass --num "
            f"{rows - MIN_TEXTS} or fewer")


def fm_batch_for(args, teacher: Path, rounds: list[int], total: int, state: dict) -> int:
    """--fm-batch, else --batch; 'match': the batch whose teacher forward passes over `total` steps equal PD's
    (few_step_cond.budget, from the teacher's recipe), kept in the state as the budget."""
    if isinstance(args.fm_batch, int) and not isinstance(args.fm_batch, bool):
        if args.fm_batch < 1:
            sys.exit(f"few_step_text: --fm-batch must be >= 1, got {args.fm_batch}")
        return args.fm_batch
    if args.fm_batch != "match":
        return args.batch
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from few_step_cond import budget

    recipe = load(teacher / "run.json")["record"]["recipe"]
    state["budget"] = budget(recipe, rounds, args.teacher_steps, args.steps_per_round, args.batch, total, None)
    return state["budget"]["fm_batch"]


def pack_features(out: Path, path: Path) -> None:
    """Every OUT/features/*.npy in one .npz (its keys the file names without .npy)."""
    import numpy as np

    arrays = {f.stem: np.load(f) for f in sorted((out / FEATURES).glob("*.npy"))}
    if arrays:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **arrays)


def mauve_from(path: Path, rows: list[dict], held: dict | None) -> dict:
    """MAUVE of every row's seeds and of the held-out text against the references, from the features in `path`
    (`elflow eval --mauve`'s computation on the same features: clusters a tenth of the texts, seed 25)."""
    import numpy as np

    from elflow.eval.mauve import mauve_from_features

    feats = np.load(path)
    if "references" not in feats:
        sys.exit(f"few_step_text: {path} holds no features of the references")
    q = feats["references"]
    prefix = {"teacher": "teacher", "PD": "pd", "flow map": "fm"}
    for r in rows:
        for p in r["per_seed"]:
            key = f"{prefix[r['model']]}-s{p['seed']}-k{r['steps']}-s{p['seed']}"
            if key in feats:
                res = mauve_from_features(feats[key], q, num_buckets="auto", seed=25)
                p["mauve"] = res["mauve"]
                p["mauve_settings"] = {k: res[k] for k in ("texts", "clusters", "seed")}
    if held is not None and "heldout" in feats:
        held["mauve"] = mauve_from_features(feats["heldout"], q, num_buckets="auto", seed=25)["mauve"]
    return {"features": str(path), "keys": len(feats.files)}


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
    held = load(evals / "heldout.json")
    held_row = None if held is None else {m: held.get(m) for m in keep}
    mauve_note = mauve_from(Path(args.mauve_from), rows, held_row) if args.mauve_from else None
    for r in rows:
        for m in ("gen_ppl", "entropy", "mauve"):
            vals = [p[m] for p in r["per_seed"] if p.get(m) is not None]
            r[m] = statistics.fmean(vals) if vals else None
            r[m + "_spread"] = (max(vals) - min(vals)) / 2 if len(vals) > 1 else None
            r[m + "_values"] = vals

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
        "gpu": gpu_name(args.device),
        "python": platform.python_version(), "torch": torch_version,
        "settings": {"teacher_train_steps": args.teacher_train_steps, "judge_steps": args.judge_steps,
                     "seeds": args.seeds, "pd_rounds": rounds, "pd_teacher_steps": args.teacher_steps,
                     "pd_steps_per_round": args.steps_per_round, "pd_total_steps": args.steps_per_round * len(rounds),
                     "flow_map_steps": total, "batch": args.batch, "lr": args.lr, "ema_decay": args.ema_decay,
                     "num_samples_per_seed": args.num, "eval_steps": args.eval_steps,
                     "teacher_full_steps": args.teacher_full_steps, "mauve_references": state.get("references"),
                     "mauve": "elflow eval --mauve: judge last hidden state, clusters auto (a tenth of the texts), "
                              "seed 25", "mauve_from_features": mauve_note, "device": args.device,
                     "judge_device": args.judge_device, "teacher_via": args.teacher_via,
                     "fm_batch": (state.get("budget") or {}).get("fm_batch") or args.fm_batch or args.batch,
                     "budget": state.get("budget")},
        "skipped_past_deadline": state.get("skipped", []), "failed_rows": state.get("failed", {}),
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

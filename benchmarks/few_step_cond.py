"""Few-step sampling of a conditional model, scored by BLEU on held-out lines: progressive distillation (PD)
against the flow-map student, both distilled from one teacher on the same data with the same budget of teacher
forward passes.

Everything that trains or samples goes through the `elflow` CLI, in this order, each stage skipped when its
output is already in --out (a stopped run continues where it stopped):

  held-out   the first --heldout held-out lines of the task (`elflow.data.corpus.task_pairs_file`: every 50th
             verse line, never trained on) as OUT/heldout.jsonl ({"input", "output"})
  teacher    the conditional demonstration's model, `elflow quickstart --conditional` trained by the command it
             runs (`elflow train --defaults quickstart --data PAIRS --source-length 24 --length 48 --source-slot
             fixed --skip none --time-scale 1 --head-modulation false --table-readout 0 ...`, the same settings
             without the demonstration's BLEU curve and report; --teacher-via quickstart runs the demonstration
             itself, --teacher PATH takes a trained one)
  per seed s:
    PD       `elflow distill TEACHER --objective pd --student-steps 16,8,4,2,1 --teacher-steps T
              --steps-per-round R --batch B --lr LR --ema-decay E --seed s --out OUT/pd-s<s>`
    flow map `elflow distill TEACHER --objective flow-map --steps S --batch BF --lr LR --ema-decay E --seed s
              --out OUT/fm-s<s>`, S and BF chosen so that its teacher forward passes equal PD's (below)
    BLEU     `elflow eval --task OUT/heldout.jsonl --checkpoint RUN --num N --steps K --seed s --guidance G
              --json --out OUT/eval/<row>` for K = 1, 2, 4, 8: the teacher (its own sampler: ODE, omega 1, its
              grid), each PD round's student at its own step count (ODE on the uniform grid: the step of exactly
              1/K it was trained to take), the flow map at every K (its map sampler, uniform grid); every model
              with the teacher's source guidance G (a second, source-dropped pass per step). Sampling seed s for
              the students of distillation seed s and for the teacher (the teacher's spread is sampling noise
              alone). --probe-guidance adds the same rows at other guidance scales.
    jumps    (--diagnose) the flow map's error against the teacher's many-step solution by jump length: the
             teacher's M-step Euler path (uniform grid) from one noise draw per held-out source; every jump of
             length 2^-k between its grid points taken by the flow map, by the teacher's single Euler step and by
             the PD student whose step has that length, compared with where the path is at the jump's end; with
             three self-conditioning slots (zeros; the teacher's guess at the jump's start, as the distillation
             trains; the path's previous guess, as a sampler feeds it) and with guidance 1 and G.
  the teacher at its own 64 steps (--teacher-full-steps) for reference

The budget of teacher forward passes (passes of one row through the frozen teacher), from the teacher's recipe
(decode share d, self-conditioning share p): a PD round whose student takes n steps of a T-step teacher grid
gives each non-decode row one pass for the self-conditioning slot on a share p and T / n sub-step passes, so
R B (1 - d) (p + T / n) per round; a flow-map step gives each non-decode row p + 1 passes (the slot, the
teacher's velocity at the jump's end), S BF (1 - d) (p + 1) in all. With neither --fm-steps nor --fm-batch, S is
PD's optimiser steps in all and BF the batch that makes the budgets equal; with one of them, the other is
derived so; with both, the JSON states the ratio. (The teacher passes counted as batched calls, what a
latency-bound GPU pays, are in the JSON too: 1 + T / n per PD step, 2 per flow-map step.)

Writes RESULTS/results.json (settings, the budget, every BLEU per seed, wall times of every distillation and of
sampling per step count, loss curves, the jump errors, the machine) and RESULTS/few_step_cond.png (BLEU against
steps, one line per model, the seeds' range shaded; the jump errors beside it).

The verdict per step count compares the flow map with PD beyond the seed spread: one side's lowest BLEU over
the distillation seeds above the other side's highest. A single seed has no spread, so a step count with fewer
than --verdict-seeds (3) seeds on either side is "undecided (N seed(s))", and goal_met is null with the reason
in goal_reason, however large the gap between the means.

--report-only gathers results.json and the plot again from a work folder alone (its eval reports, loss logs,
state.json, teacher/run.json and heldout.jsonl: what gpu_few_step.sh packs into runs.tar.gz; no checkpoint),
keeping the machine recorded there; pass the settings of the run that made it.

    python benchmarks/few_step_cond.py --out runs/few_step_cond --device cuda --seeds 0 1 2

On one GPU machine, with the unconditional re-scoring beside it: `bash benchmarks/gpu_few_step.sh`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from script_args import DECAY, GUIDANCE, RATE, ROWS, SAMPLES, SAMPLING_STEPS, STEPS, check, main_of, parser

from elflow.util.errors import ELFError

ROOT = Path(__file__).resolve().parent.parent
ELFLOW = [sys.executable, "-m", "elflow.cli"]  # the `elflow` command, also where it is not installed
ROUNDS = "16,8,4,2,1"
MODELS = (("teacher", "teacher"), ("PD", "pd"), ("flow map", "fm"))
EMPTY = "gives only empty texts"  # elflow eval's refusal of a sample set without a word


class Stop(ELFError):
    """Bad input or a failed stage: one line, exit 2."""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(device: str) -> dict:
    info = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "python": platform.python_version(), "device": device}
    try:
        import torch

        info["torch"] = torch.__version__
        if device.startswith("cuda") and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def save(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def shown(cmd: list[str]) -> str:
    """A command as a person types it: `elflow ...` for the CLI."""
    if cmd[:len(ELFLOW)] == ELFLOW:
        cmd = ["elflow", *cmd[len(ELFLOW):]]
    return " ".join(cmd)


def train_records(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    out = []
    if f.is_file():
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("kind") == "train" and isinstance(rec.get("loss"), (int, float)):
                out.append({"step": rec.get("step"), "loss": rec["loss"]})
    return out


def curve_summary(recs: list[dict]) -> dict | None:
    """The loss curve, and whether it still falls: the mean loss of its last fifth against the fifth before."""
    if not recs:
        return None
    n = max(1, len(recs) // 5)
    last = statistics.fmean(r["loss"] for r in recs[-n:])
    before = statistics.fmean(r["loss"] for r in recs[-2 * n:-n]) if len(recs) >= 2 * n else None
    return {"first": recs[0], "last": recs[-1], "curve": recs, "last_fifth_mean": last, "previous_fifth_mean": before,
            "relative_change": None if before is None else (last - before) / before}


def summary(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "half_range": None, "min": None, "max": None}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "half_range": (max(values) - min(values)) / 2 if len(values) > 1 else None,
            "min": min(values), "max": max(values)}


# ----------------------------------------------------------------------------------------------------------
# the budget
def budget(recipe: dict, rounds: list[int], teacher_steps: int, per_round: int, batch: int,
           fm_steps: int | None, fm_batch: int | None) -> dict:
    """Expected teacher forward passes (one row through the teacher) of PD and of the flow map, and the flow
    map's steps and batch that make them equal (whichever of the two is not given)."""
    d, p = float(recipe["decode_prob"]), float(recipe["self_cond_prob"])
    per_row_pd = {n: (1 - d) * (p + teacher_steps // n) for n in rounds}
    pd_total = sum(per_round * batch * v for v in per_row_pd.values())
    per_row_fm = (1 - d) * (p + 1)
    pd_steps = per_round * len(rounds)
    if fm_steps is None and fm_batch is None:
        fm_steps = pd_steps
    if fm_batch is None:
        fm_batch = max(1, round(pd_total / (fm_steps * per_row_fm)))
    elif fm_steps is None:
        fm_steps = max(1, round(pd_total / (fm_batch * per_row_fm)))
    fm_total = fm_steps * fm_batch * per_row_fm
    return {"unit": "expected passes of one row through the frozen teacher (its decode rows take none)",
            "decode_prob": d, "self_cond_prob": p,
            "pd_per_row_by_round": {str(n): v for n, v in per_row_pd.items()},
            "pd_passes_per_step_by_round": {str(n): batch * v for n, v in per_row_pd.items()},
            "pd_optimiser_steps": pd_steps, "pd_batch": batch, "pd_teacher_passes": pd_total,
            "fm_per_row": per_row_fm, "fm_passes_per_step": fm_batch * per_row_fm,
            "fm_optimiser_steps": fm_steps, "fm_batch": fm_batch, "fm_teacher_passes": fm_total,
            "fm_over_pd": fm_total / pd_total if pd_total else None,
            "pd_teacher_calls": sum(per_round * (1 + teacher_steps // n) for n in rounds),
            "fm_teacher_calls": 2 * fm_steps,
            "calls_note": "batched teacher calls (what a latency-bound GPU pays): a PD step makes 1 + T/n, a "
                          "flow-map step 2, each on the rows that need it"}


def pair_shares(max_jump_den: int, draws: int = 200_000) -> dict:
    """The flow map's training pairs (elflow.flowmap.draw_time_pairs) by jump length: the share within each
    bin around 2^-k (edges at the geometric midpoints), measured and from the density 2 (1 - d)."""
    import torch

    from elflow.flowmap import DIAGONAL_SHARE, draw_time_pairs

    s, t = draw_time_pairs(draws, torch.Generator().manual_seed(0))
    d = (t - s).double()
    jumps = jump_lengths(max_jump_den)
    out = []
    for i, j in enumerate(jumps):  # jumps descend from 1
        hi = 1.0 if i == 0 else math.sqrt(j * jumps[i - 1])
        lo = 0.0 if i == len(jumps) - 1 else math.sqrt(j * jumps[i + 1])
        measured = float(((d >= lo) & (d < hi if i else d <= hi)).double().mean())
        exact = (2 * hi - hi * hi) - (2 * lo - lo * lo)  # integral of 2 (1 - x) over [lo, hi]
        out.append({"jump": j, "bin": [lo, hi], "share": measured, "share_exact": exact})
    return {"diagonal_share": DIAGONAL_SHARE, "draws": draws, "bins": out}


def jump_lengths(den: int) -> list[float]:
    out, j = [], 1
    while j <= den:
        out.append(1.0 / j)
        j *= 2
    return out


# ----------------------------------------------------------------------------------------------------------
# the jump diagnostic
def one_jump(net, z, t: float, t_next: float, slot, omega, guidance: float, keep, known, t_eps: float,
             target: bool):
    """One step from (z, t) to t_next as elflow's samplers take it (elflow.sampler.integrate): a flow map's jump
    (`target`) or an Euler step, with source guidance `guidance` (a second pass with the source dropped) and
    the known positions held."""
    import torch

    B = z.shape[0]
    tt = torch.full((B,), float(t), device=z.device)
    at = {"target": torch.full((B,), float(t_next), device=z.device)} if target else {}
    x = net(z, tt, omega, slot, **at)
    if guidance != 1.0:
        z_u, s_u = z.masked_fill(keep, 0.0), slot.masked_fill(keep, 0.0)
        x_u = net(z_u, tt, omega, s_u, **at).masked_fill(keep, 0.0)
        x = x_u + guidance * (x - x_u)  # at free positions z_u = z: the velocities combine as the guesses do
    x = torch.where(keep, known, x)
    v = torch.where(keep, 0.0, (x - z) / max(1.0 - float(t), t_eps))
    return z + (float(t_next) - float(t)) * v


def diagnose(teacher_dir: Path, fm_dir: Path | None, pd_dirs: dict, sources: list[str], grid_steps: int,
             guidances: list[float], device: str, noise_seed: int = 0, teacher_jumps: bool = True) -> dict:
    """Jump errors against the teacher's `grid_steps`-step Euler path (module docstring): records
    {model, guidance, slot, jump, start, mse, rel}, mse the mean squared error per free position and dimension,
    rel that over the mean square of the path's own move over the jump. `teacher_jumps`: also the teacher's
    own single Euler steps (the same for every distillation seed)."""
    import torch

    from elflow.generate import conditioning
    from elflow.runs.load import load_for_sampling
    from elflow.sampler import integrate

    teacher, space = load_for_sampling(str(teacher_dir), device=device)
    rec = teacher.record
    recipe, t_eps = rec.recipe, rec.recipe.t_eps
    L = teacher.config.max_length
    dev = next(teacher.parameters()).device
    _, known_mask, known = conditioning(space, L, len(sources), sources, rec.source_length, None, None, dev,
                                        rec.source_slot)
    keep = known_mask[..., None]
    free = (~known_mask).float()[..., None]
    B, C = len(sources), teacher.config.dim
    omega = torch.ones(B, device=dev)
    z0 = recipe.noise_scale * torch.randn(B, L, C, generator=torch.Generator(device=dev).manual_seed(noise_seed),
                                          device=dev)
    grid = torch.linspace(0, 1, grid_steps + 1)
    times = [float(v) for v in grid]

    def pin(a):
        return torch.where(keep, known, a)

    def err(a, b, start):
        sq = ((a - b) ** 2 * free).sum((1, 2)) / (free.sum((1, 2)) * C)
        move = ((b - start) ** 2 * free).sum((1, 2)) / (free.sum((1, 2)) * C)
        return float(sq.mean()), float((sq / move.clamp_min(1e-12)).mean())

    students = [("teacher Euler", teacher, False, None)] if teacher_jumps else []
    if fm_dir is not None:
        students.append(("flow map", load_for_sampling(str(fm_dir), device=device, space=space)[0], True, None))
    for n, path in sorted(pd_dirs.items()):
        students.append((f"PD {n}-step", load_for_sampling(str(path), device=device, space=space)[0], False, n))
    records, checks = [], []
    with torch.no_grad():
        for g in guidances:
            zs, slots = [pin(z0)], [pin(torch.zeros_like(z0))]

            def keep_path(i, t, z, x, zs=zs, slots=slots):
                zs.append(z)
                slots.append(x)

            integrate(teacher, z0, grid, sampler="ode", omega=omega, guidance=g, known=known, known_mask=known_mask,
                      recipe=recipe, callback=keep_path)
            # the path's own steps, retaken: the diagnostic steps as the sampler does
            again = one_jump(teacher, zs[0], times[0], times[1], slots[0], omega, g, keep, known, t_eps, False)
            checks.append({"guidance": g, "first_step_max_abs_diff": float((again - zs[1]).abs().max())})
            own = {}
            for name, net, is_map, n in students:
                jumps = [1.0 / n] if n else jump_lengths(grid_steps)
                for jump in jumps:
                    stride = round(jump * grid_steps)
                    if stride < 1 or grid_steps % stride:
                        continue
                    for i in range(0, grid_steps, stride):
                        j = i + stride
                        if i not in own:
                            x_own = teacher(zs[i], torch.full((B,), times[i], device=dev), omega, pin(torch.zeros_like(z0)))
                            own[i] = pin(x_own)
                        for slot_name, slot in (("zeros", pin(torch.zeros_like(z0))), ("teacher guess", own[i]),
                                                ("path", slots[i])):
                            X = one_jump(net, zs[i], times[i], times[j], slot, omega, g, keep, known, t_eps, is_map)
                            mse, rel = err(X, zs[j], zs[i])
                            records.append({"model": name, "guidance": g, "slot": slot_name, "jump": jump,
                                            "start": times[i], "mse": mse, "rel": rel})
    return {"records": records, "checks": checks, "lines": B, "grid_steps": grid_steps, "noise_seed": noise_seed}


def jump_table(records: list[dict]) -> list[dict]:
    """Mean over starts (and seeds) per model, guidance, slot and jump length; the error of the jump from noise
    (start 0) beside it."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["model"], r["guidance"], r["slot"], r["jump"]), []).append(r)
    out = []
    for (model, g, slot, jump), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], -kv[0][3])):
        zero = [r for r in rs if r["start"] == 0.0]
        out.append({"model": model, "guidance": g, "slot": slot, "jump": jump, "jumps": len(rs),
                    "mse": statistics.fmean(r["mse"] for r in rs), "rel": statistics.fmean(r["rel"] for r in rs),
                    "mse_from_noise": statistics.fmean(r["mse"] for r in zero) if zero else None,
                    "rel_from_noise": statistics.fmean(r["rel"] for r in zero) if zero else None})
    return out


# ----------------------------------------------------------------------------------------------------------
# running the CLI
class Runner:
    """Runs `elflow` commands (a subprocess each, or in this process for --in-process evaluations), logs them
    to OUT/commands.log, keeps wall times in OUT/state.json and refuses to start a stage past the deadline."""

    def __init__(self, out: Path, deadline: float | None, device: str, in_process: bool):
        self.out, self.deadline, self.device, self.in_process = out, deadline, device, in_process
        self.log = out / "commands.log"
        self.state_file = out / "state.json"
        self.state = load(self.state_file) or {"walls": {}, "commands": {}}
        self.state.setdefault("skipped", [])
        self.walls: dict[str, list[float]] = {}
        self.t0 = time.time()

    def say(self, text: str) -> None:
        print(f"[{time.time() - self.t0:6.0f} s] {text}", flush=True)

    def allowed(self, name: str, kind: str) -> bool:
        """Whether a stage of `kind` may start: not past the deadline, nor expected to end past it (the
        longest wall of that kind so far)."""
        if self.deadline is None:
            return True
        left, expect = self.deadline - time.time(), self.expected(kind)
        if left <= 0 or expect > left:
            self.say(f"skipped {name}: {left:.0f} s to the deadline, a {kind} stage takes ~{expect:.0f} s")
            if name not in self.state["skipped"]:
                self.state["skipped"].append(name)
            return False
        return True

    def expected(self, kind: str) -> float:
        """The median wall of the stages of `kind` so far (0 before the first)."""
        walls = self.walls.get(kind)
        return statistics.median(walls) if walls else 0.0

    def record(self, name: str, kind: str, cmd: list[str], wall: float) -> None:
        self.walls.setdefault(kind, []).append(wall)
        self.state["walls"][name] = wall
        self.state["commands"][name] = shown(cmd)
        if name in self.state["skipped"]:
            self.state["skipped"].remove(name)
        save(self.state_file, self.state)

    def attempt(self, name: str, kind: str, cmd: list[str], **kw) -> tuple[float, str | None] | None:
        """`run`, with a failure noted (state "failed", the line said) instead of raised: None then. A run of
        one command fails alone; the stages that do not need it go on."""
        try:
            return self.run(name, kind, cmd, **kw)
        except Stop as e:
            self.say(f"  {name}: {e}")
            self.state.setdefault("failed", {})[name] = str(e)
            save(self.state_file, self.state)
            return None

    def env(self) -> dict:
        env = dict(os.environ)
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # `elflow distill` takes the GPU when it sees one
        return env

    def run(self, name: str, kind: str, cmd: list[str], in_process: bool = False,
            allow: str | None = None) -> tuple[float, str | None]:
        """(wall seconds, stdout) of `cmd` (ELFLOW + arguments); Stop with its last lines if it fails, unless
        its error says `allow` (then stdout is None)."""
        self.say("$ " + shown(cmd))
        with open(self.log, "a") as f:
            f.write("$ " + shown(cmd) + "\n")
        t0 = time.time()
        if in_process and self.in_process:
            from elflow.cli import main

            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(cmd[len(ELFLOW):])
            stdout = out.getvalue()
            with open(self.log, "a") as f:
                f.write(err.getvalue())
        else:
            with open(self.log, "a") as f:
                p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=self.env(), check=False)
            code, stdout = p.returncode, p.stdout
        wall = time.time() - t0
        if code != 0:
            tail = self.log.read_text().replace("\r", "\n").splitlines()[-4:]
            if allow and any(allow in line for line in tail):
                self.say(f"  {name}: {allow}")
                return wall, None
            raise Stop(f"{name} failed (exit {code}): {shown(cmd)}" + ("\n" + "\n".join(tail) if tail else ""))
        self.say(f"  {name} done in {wall:.1f} s")
        self.record(name, kind, cmd, wall)
        return wall, stdout


# ----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = parser("few_step_cond", __doc__)
    ap.add_argument("--out", default="runs/few_step_cond", help="work folder (runs, samples, eval reports)")
    ap.add_argument("--results", default="benchmarks/results/few_step_cond", help="results.json and the PNG")
    ap.add_argument("--copy-png", default=None, help="also copy the PNG here (e.g. docs/few_step_cond.png)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--task", choices=("copy", "shuffle"), default="copy", help="the demonstration's task")
    ap.add_argument("--teacher", default=None, help="a trained conditional teacher to use (default: train OUT/teacher)")
    ap.add_argument("--teacher-via", choices=("train", "quickstart"), default="train",
                    help="train: the demonstration's `elflow train` command alone; quickstart: `elflow quickstart "
                         "--conditional` with its BLEU curve and report (sampled on the CPU)")
    ap.add_argument("--teacher-train-steps", type=int, default=500, help="the teacher's optimiser steps (500: the "
                                                                           "demonstration's)")
    ap.add_argument("--teacher-batch", type=int, default=32, help="the teacher's batch (32: the demonstration's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="distillation seeds (and sampling seeds)")
    ap.add_argument("--student-steps", default=ROUNDS, help="PD rounds (ending at 1)")
    ap.add_argument("--teacher-steps", type=int, default=16, help="PD: the teacher's grid over [0, 1]")
    ap.add_argument("--steps-per-round", type=int, default=60, help="PD optimiser steps per round")
    ap.add_argument("--batch", type=int, default=32, help="PD batch (and the flow map's with --fm-match steps)")
    ap.add_argument("--fm-steps", type=int, default=None, help="flow-map optimiser steps (default: PD's in all)")
    ap.add_argument("--fm-batch", type=int, default=None,
                    help="flow-map batch (default: the one that gives PD's teacher passes in --fm-steps)")
    ap.add_argument("--lr", type=float, default=1e-3, help="distillation learning rate (both)")
    ap.add_argument("--student-dtype", choices=("auto", "bf16", "fp32"), default=None,
                    help="both students' precision (default: the teacher's)")
    ap.add_argument("--ema-decay", type=float, default=0.95, help="distillation EMA decay (both)")
    ap.add_argument("--eval-steps", type=int, nargs="+", default=[1, 2, 4, 8], help="sampling steps K")
    ap.add_argument("--teacher-full-steps", type=int, default=64, help="the teacher's own steps, one more row (0: none)")
    ap.add_argument("--heldout", type=int, default=512, help="held-out lines scored")
    ap.add_argument("--guidance", type=float, default=2.0, help="source guidance of every sampler (the teacher's)")
    ap.add_argument("--probe-guidance", type=float, nargs="*", default=[1.0],
                    help="also score the teacher and the students at these guidance scales")
    ap.add_argument("--probe-seeds", type=int, nargs="*", default=None,
                    help="the seeds scored at --probe-guidance (default: the first of --seeds)")
    ap.add_argument("--sample-batch", type=int, default=256, help="rows per sampling batch")
    ap.add_argument("--diagnose", action=argparse.BooleanOptionalAction, default=True,
                    help="the jump errors against the teacher's many-step path")
    ap.add_argument("--diag-lines", type=int, default=128, help="held-out sources of the jump diagnostic")
    ap.add_argument("--diag-grid", type=int, default=64, help="steps of the teacher's path (a power of 2)")
    ap.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=True,
                    help="run `elflow eval` in this process (no start-up per row); trainings always run apart")
    ap.add_argument("--deadline", type=float, default=None,
                    help="unix time after which no stage starts (default: $FEW_STEP_DEADLINE if set)")
    ap.add_argument("--cache-dir", default=None, help="elflow's cache (default: $ELFLOW_CACHE or ~/.cache/elflow)")
    ap.add_argument("--verdict-seeds", type=int, default=3,
                    help="distillation seeds each student needs at a step count before a gap counts as beyond the "
                         "seed spread (fewer: that step count, and the goal, are undecided; at least 2)")
    ap.add_argument("--report-only", action="store_true",
                    help="only gather results.json and the plot from what --out holds (its eval reports, loss logs, "
                         "state.json, teacher/run.json and heldout.jsonl; no checkpoint is read)")
    return ap


def parse_args(argv):
    """The command line, every flag checked (script_args.check) before any stage: Stop naming the first bad one."""
    args = build_parser().parse_args(argv)
    if args.deadline is None and os.environ.get("FEW_STEP_DEADLINE"):
        try:
            args.deadline = float(os.environ["FEW_STEP_DEADLINE"])
        except ValueError:
            raise Stop(f"FEW_STEP_DEADLINE must be a unix time in seconds, got {os.environ['FEW_STEP_DEADLINE']!r}")
    check(args, counts={"teacher_train_steps": STEPS, "teacher_batch": ROWS, "teacher_steps": SAMPLING_STEPS,
                        "steps_per_round": STEPS, "batch": ROWS, "fm_steps": STEPS, "fm_batch": ROWS,
                        "heldout": SAMPLES, "sample_batch": ROWS, "diag_lines": SAMPLES,
                        "diag_grid": SAMPLING_STEPS, "eval_steps": SAMPLING_STEPS,
                        "teacher_full_steps": (*SAMPLING_STEPS, 0),
                        "verdict_seeds": (1000, "one seed has no spread; the verdict reads a few a side", 2)},
          scales={"lr": RATE, "ema_decay": DECAY, "guidance": GUIDANCE, "probe_guidance": GUIDANCE},
          seeds=("seeds", "probe_seeds"), folders=("out", "results"), files=("copy_png",))
    if args.teacher is not None:
        check_teacher(Path(args.teacher))
    try:
        args.rounds = [int(x) for x in args.student_steps.split(",")]
    except ValueError:
        raise Stop(f"--student-steps must be integers such as {ROUNDS}, got {args.student_steps!r}") from None
    if args.rounds[-1] != 1 or any(b >= a for a, b in zip(args.rounds, args.rounds[1:])):
        raise Stop(f"--student-steps must fall strictly and end at 1, got {args.student_steps}")
    if args.diag_grid & (args.diag_grid - 1):
        raise Stop(f"--diag-grid must be a power of 2, got {args.diag_grid}")
    if len(set(args.seeds)) != len(args.seeds):
        raise Stop(f"--seeds must be distinct, got {args.seeds}")
    if args.probe_seeds is None:
        args.probe_seeds = args.seeds[:1]
    args.probe_guidance = [g for g in args.probe_guidance if g != args.guidance]
    return args


def check_teacher(teacher: Path) -> None:
    """--teacher: an elflow run of a conditional model (trained on pairs), read before any stage."""
    if not (teacher / "run.json").is_file():
        raise Stop(f"--teacher {teacher} holds no elflow run (no run.json)")
    from elflow.runs.load import read_record

    if not read_record(str(teacher)).conditional:
        raise Stop(f"--teacher {teacher} is not a conditional model (trained on pairs): train one with "
                   "--source-length, or leave --teacher out to train OUT/teacher")


def main(argv=None) -> int:
    return main_of("few_step_cond", lambda: run(parse_args(argv)))


def run(args) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Stop(f"--device {device}: this machine has no CUDA device; pass --device cpu")
    args.device = device
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results_dir = Path(args.results)
    r = Runner(out, args.deadline, device, args.in_process)
    if not (args.report_only and r.state.get("machine")):  # report-only: the machine the runs were made on
        r.state["machine"] = machine(device)
    cache = ["--cache-dir", args.cache_dir] if args.cache_dir else []

    # held-out lines and the teacher's data
    from elflow.data.corpus import task_pairs_file

    train_pairs, held, pairs_file = task_pairs_file(args.task, 0, args.cache_dir)
    heldout = out / "heldout.jsonl"
    if not heldout.is_file():
        if len(held) < args.heldout:
            raise Stop(f"the {args.task} task holds {len(held)} held-out lines; pass --heldout {len(held)} or fewer")
        heldout.write_text("".join(json.dumps({"input": s, "output": t}) + "\n" for s, t in held[:args.heldout]))
    lines = [json.loads(x) for x in heldout.read_text().splitlines()]
    r.state["heldout"] = {"lines": len(lines), "of": len(held), "train_pairs": len(train_pairs),
                          "what": f"the first {len(lines)} held-out lines of the {args.task} task (every 50th verse "
                                  "line, never trained on)"}

    teacher = Path(args.teacher).resolve() if args.teacher else out / "teacher"
    if args.teacher or args.report_only:
        if not (teacher / "run.json").is_file():
            raise Stop(f"{teacher} holds no elflow run (no run.json)"
                       + ("" if args.teacher else "; run without --report-only first"))
    elif "teacher" not in r.state["walls"]:
        from elflow.experiments.quickstart import COND_LENGTH, COND_SOURCE

        again = (teacher / "run.json").is_file()  # a stopped run continues
        if args.teacher_via == "quickstart":
            cmd = [*ELFLOW, "quickstart", "--conditional", "--task", args.task, "--out", str(teacher), "--steps",
                   str(args.teacher_train_steps), "--batch", str(args.teacher_batch), "--num", "100", *cache,
                   *(["--resume"] if again else [])]
        elif again:
            cmd = [*ELFLOW, "train", "--out", str(teacher), "--resume", "--device", device, "--quiet", *cache]
        else:
            cmd = [*ELFLOW, "train", "--defaults", "quickstart", "--data", str(pairs_file), "--source-length",
                   str(COND_SOURCE), "--length", str(COND_LENGTH), "--source-slot", "fixed", "--skip", "none",
                   "--time-scale", "1", "--head-modulation", "false", "--table-readout", "0", "--batch",
                   str(args.teacher_batch), "--steps", str(args.teacher_train_steps), "--seed", "0",
                   "--sample-every", "0", "--ckpt-every", str(args.teacher_train_steps), "--device", device,
                   "--out", str(teacher), "--quiet", *cache]
        r.run("teacher", "teacher", cmd)
    stored = load(teacher / "run.json")
    record = stored["record"]
    if not (record.get("task") or {}).get("source_length"):
        raise Stop(f"{teacher} is not a conditional model (trained on pairs)")
    stored_data = (stored.get("train") or {}).get("data")
    if stored_data and Path(stored_data).name != pairs_file.name:
        raise Stop(f"{teacher} was trained on {stored_data}, not on the {args.task} task's {pairs_file.name}: its "
                   "held-out lines would not be held out")
    bud = budget(record["recipe"], args.rounds, args.teacher_steps, args.steps_per_round, args.batch,
                 args.fm_steps, args.fm_batch)
    r.state["budget"] = bud
    save(r.state_file, r.state)

    evals = out / "eval"
    G = args.guidance

    def evaluate(name: str, run_dir: Path, k: int, seed: int, guidance: float, extra: list[str]) -> None:
        report = evals / f"{name}.json"
        if report.is_file() or args.report_only or not r.allowed(name, "eval"):
            return
        cmd = [*ELFLOW, "eval", "--task", str(heldout), "--checkpoint", str(run_dir), "--num", str(len(lines)),
               "--steps", str(k), "--seed", str(seed), "--guidance", f"{guidance:g}", "--batch",
               str(args.sample_batch), "--device", device, *extra, "--json", "--out", str(evals / name),
               "--overwrite", *cache]
        done = r.attempt(name, "eval", cmd, in_process=True, allow=EMPTY)
        if done is None:
            return
        wall, stdout = done
        if stdout is None:  # a model whose every output is empty scores no word: BLEU 0
            res = {"bleu": 0.0, "note": "every output empty (elflow eval scores none)", "steps": k,
                   "guidance": guidance, "seed": seed, "num_examples": len(lines)}
        else:
            res = json.loads(stdout.strip().splitlines()[-1])
        res.update(wall_s=wall, command=shown(cmd))
        save(report, res)

    pd_sampling = ["--sampler", "ode", "--gamma", "0", "--omega", "1", "--grid", "uniform"]
    for s in args.seeds:
        scales = [G, *(args.probe_guidance if s in args.probe_seeds else [])]
        for g in scales:
            tag = "" if g == G else f"-g{g:g}"
            for k in args.eval_steps:
                evaluate(f"teacher-s{s}-k{k}{tag}", teacher, k, s, g, [])
        pd, fm = out / f"pd-s{s}", out / f"fm-s{s}"
        if f"pd-s{s}" not in r.state["walls"] and not args.report_only and r.allowed(f"pd-s{s}", "pd"):
            r.attempt(f"pd-s{s}", "pd", [
                *ELFLOW, "distill", str(teacher), "--objective", "pd", "--student-steps", args.student_steps,
                "--teacher-steps", str(args.teacher_steps), "--steps-per-round", str(args.steps_per_round),
                "--batch", str(args.batch), "--micro-batch", str(args.batch), "--lr", f"{args.lr:g}",
                "--ema-decay", f"{args.ema_decay:g}", "--seed", str(s), "--log-every", "5", "--keep", "1",
                "--out", str(pd), "--quiet", *(["--resume"] if (pd / "distill.json").is_file() else []),
                *(["--dtype", args.student_dtype] if args.student_dtype else []), *cache])
        if f"fm-s{s}" not in r.state["walls"] and not args.report_only and r.allowed(f"fm-s{s}", "fm"):
            r.attempt(f"fm-s{s}", "fm", [
                *ELFLOW, "distill", str(teacher), "--objective", "flow-map", "--steps",
                str(bud["fm_optimiser_steps"]), "--batch", str(bud["fm_batch"]), "--micro-batch",
                str(bud["fm_batch"]), "--lr", f"{args.lr:g}", "--ema-decay", f"{args.ema_decay:g}", "--seed",
                str(s), "--log-every", "5", "--keep", "1", "--out", str(fm), "--quiet",
                *(["--resume"] if (fm / "run.json").is_file() else []),
                *(["--dtype", args.student_dtype] if args.student_dtype else []), *cache])
        for g in scales:
            tag = "" if g == G else f"-g{g:g}"
            for k in args.eval_steps:
                if k in args.rounds and (pd / f"{k}-step" / "run.json").is_file() and f"pd-s{s}" in r.state["walls"]:
                    evaluate(f"pd-s{s}-k{k}{tag}", pd / f"{k}-step", k, s, g, pd_sampling)
                if f"fm-s{s}" in r.state["walls"]:
                    evaluate(f"fm-s{s}-k{k}{tag}", fm, k, s, g, [])
        diag = out / "diag" / f"s{s}.json"
        if (args.diagnose and not diag.is_file() and not args.report_only and f"fm-s{s}" in r.state["walls"]
                and f"pd-s{s}" in r.state["walls"] and r.allowed(f"diag-s{s}", "diag")):
            r.say(f"jump diagnostic, seed {s}")
            t0 = time.time()
            pd_dirs = {n: pd / f"{n}-step" for n in args.rounds if (pd / f"{n}-step" / "run.json").is_file()}
            try:
                res = diagnose(teacher, fm, pd_dirs, [x["input"] for x in lines[:args.diag_lines]], args.diag_grid,
                               sorted({1.0, G}), device, teacher_jumps=s == args.seeds[0])
            except Exception as e:  # noqa: BLE001 (a diagnostic: its failure is noted, the comparison goes on)
                r.say(f"  diag-s{s} failed: {type(e).__name__}: {e}")
                r.state.setdefault("failed", {})[f"diag-s{s}"] = f"{type(e).__name__}: {e}"
                save(r.state_file, r.state)
                res = None
            if res is not None:
                res["wall_s"] = time.time() - t0
                r.say(f"  diag-s{s} done in {res['wall_s']:.1f} s")
                r.walls.setdefault("diag", []).append(res["wall_s"])
                res["seed"] = s
                save(diag, res)
        gather(args, out, results_dir, r, bud, teacher, lines)  # partial results after every seed

    if args.teacher_full_steps:
        for s in args.seeds:
            evaluate(f"teacher-s{s}-k{args.teacher_full_steps}", teacher, args.teacher_full_steps, s, G, [])
    gather(args, out, results_dir, r, bud, teacher, lines)
    r.say(f"results: {results_dir / 'results.json'}")
    return 0


def teacher_path(teacher: Path, command: str | None) -> str:
    """Where the teacher was trained (its command's --out: a report gathered elsewhere names the run's folder,
    not the copy it read), else `teacher`."""
    words = (command or "").split()
    return words[words.index("--out") + 1] if "--out" in words[:-1] else str(teacher)


def judge(args, pairs: list[tuple[int, dict | None, dict | None]]) -> tuple[list[dict], bool | None, str]:
    """(verdict per step count, goal met, why) from the PD and flow-map rows at each step count (None where a
    row is missing). "Beyond the seed spread" needs --verdict-seeds distillation seeds on each side: the flow
    map's lowest seed above PD's highest (or PD's lowest above the flow map's highest); with fewer, that step
    count is undecided and so is the goal (None), whatever the gap between the means."""
    need = args.verdict_seeds
    verdict = []
    for k, pd_row, fm_row in pairs:
        if not (pd_row and fm_row):
            continue
        p, f = pd_row["bleu"], fm_row["bleu"]
        n_pd, n_fm = len(pd_row["per_seed"]), len(fm_row["per_seed"])
        n = min(n_pd, n_fm)
        v = {"steps": k, "pd": p["mean"], "fm": f["mean"], "fm_minus_pd": f["mean"] - p["mean"],
             "fm_at_least_pd": f["mean"] >= p["mean"], "seeds": [n_pd, n_fm], "seeds_needed": need}
        if n < need:
            v.update(fm_above_beyond_spread=None, pd_above_beyond_spread=None,
                     verdict=f"undecided ({n} seed{'s' * (n != 1)})")
        else:
            v.update(fm_above_beyond_spread=f["min"] > p["max"], pd_above_beyond_spread=p["min"] > f["max"])
            v["verdict"] = ("flow map better beyond the seed spread" if v["fm_above_beyond_spread"] else
                            "PD better beyond the seed spread" if v["pd_above_beyond_spread"] else
                            "within the seed spread")
        verdict.append(v)
    missing = sorted(({1, 2} | set(args.eval_steps)) - {v["steps"] for v in verdict})
    if missing:
        return verdict, None, f"undecided: no PD and flow-map rows at {missing} steps"
    decided = [v for v in verdict if v["fm_above_beyond_spread"] is not None]
    worse = [v["steps"] for v in decided if v["pd_above_beyond_spread"]]
    if worse:
        return verdict, False, f"not met: PD above the flow map beyond the seed spread at {worse} steps"
    below = [v["steps"] for v in decided if not v["fm_at_least_pd"]]
    if below:
        return verdict, False, f"not met: the flow map's mean below PD's at {below} steps"
    short = [v for v in verdict if v["fm_above_beyond_spread"] is None]
    if short:
        counts = sorted({min(v["seeds"]) for v in short})
        return verdict, None, (f"undecided: {'/'.join(map(str, counts))} distillation seed(s) per student at "
                               f"{[v['steps'] for v in short]} steps; beyond the seed spread needs {need} on each "
                               "side")
    within = [v["steps"] for v in verdict if v["steps"] in (1, 2) and not v["fm_above_beyond_spread"]]
    if within:
        return verdict, False, f"not met: the flow map not above PD beyond the seed spread at {within} steps"
    return verdict, True, (f"met: the flow map's mean at least PD's at every step count and its lowest of {need}+ "
                           "seeds above PD's highest at 1 and 2 steps")


def gather(args, out: Path, results_dir: Path, r: Runner, bud: dict, teacher: Path, lines: list[dict]) -> dict:
    """results.json and the plot from what OUT holds."""
    from elflow.eval.metrics import bleu

    evals = out / "eval"
    G = args.guidance
    rows = []
    ks = list(args.eval_steps) + ([args.teacher_full_steps] if args.teacher_full_steps else [])
    for g in [G, *args.probe_guidance]:
        tag = "" if g == G else f"-g{g:g}"
        for model, prefix in MODELS:
            for k in ks if model == "teacher" and g == G else args.eval_steps:
                per_seed = []
                for s in args.seeds:
                    rep = load(evals / f"{prefix}-s{s}-k{k}{tag}.json")
                    if rep:
                        per_seed.append({"seed": s, "bleu": rep["bleu"], "wall_s": rep["wall_s"],
                                         "sampling_s": rep.get("seconds")})
                if not per_seed:
                    continue
                reps = [load(evals / f"{prefix}-s{p['seed']}-k{k}{tag}.json") for p in per_seed]
                rep = next((x for x in reps if "sampler" in x), reps[0])
                settings = {key: rep.get(key) for key in ("sampler", "steps", "gamma", "omega", "guidance", "grid",
                                                           "batch_size", "dtype")}
                empty = [p["seed"] for p, x in zip(per_seed, reps) if "note" in x]
                rows.append({"model": model, "steps": k, "guidance": g, "settings": settings,
                             "per_seed": per_seed, "seeds_with_every_output_empty": empty, "bleu": summary([p["bleu"] for p in per_seed]),
                             "sampling_s": summary([p["sampling_s"] for p in per_seed if p["sampling_s"] is not None])})

    def row(model, k):
        return next((x for x in rows if x["model"] == model and x["steps"] == k and x["guidance"] == G), None)

    verdict, goal, reason = judge(args, [(k, row("PD", k), row("flow map", k)) for k in args.eval_steps])

    trainings = {}
    for s in args.seeds:
        pd, fm = out / f"pd-s{s}", out / f"fm-s{s}"
        trainings[f"pd-s{s}"] = {"wall_s": r.state["walls"].get(f"pd-s{s}"),
                                 "command": r.state["commands"].get(f"pd-s{s}"),
                                 "rounds": {str(n): curve_summary(train_records(pd / f"{n}-step")) for n in args.rounds}}
        trainings[f"fm-s{s}"] = {"wall_s": r.state["walls"].get(f"fm-s{s}"),
                                 "command": r.state["commands"].get(f"fm-s{s}"),
                                 "loss": curve_summary(train_records(fm))}
    diag_records, diag_meta = [], []
    for s in args.seeds:
        d = load(out / "diag" / f"s{s}.json")
        if d:
            diag_records += [{**x, "seed": s} for x in d["records"]]
            diag_meta.append({k: d[k] for k in ("seed", "checks", "lines", "grid_steps", "noise_seed", "wall_s")})
    try:
        shares = pair_shares(args.diag_grid)
    except Exception as e:  # noqa: BLE001 (a diagnostic: its absence is noted, not fatal)
        shares = {"error": str(e)}
    result = {
        "what": "BLEU on held-out lines of the conditional demonstration's model and of its few-step students: "
                "progressive distillation and one flow-map student, the same teacher, data and teacher passes",
        "machine": r.state.get("machine"),
        "settings": {k: getattr(args, k) for k in (
            "task", "teacher_via", "teacher_train_steps", "teacher_batch", "seeds", "student_steps", "teacher_steps",
            "steps_per_round", "batch", "lr", "ema_decay", "eval_steps", "teacher_full_steps", "guidance",
            "probe_guidance", "probe_seeds", "sample_batch", "heldout", "diag_lines", "diag_grid", "student_dtype",
            "verdict_seeds")},
        "teacher": {"path": teacher_path(teacher, r.state["commands"].get("teacher")),
                    "wall_s": r.state["walls"].get("teacher"),
                    "command": r.state["commands"].get("teacher"), "loss": curve_summary(train_records(teacher))},
        "heldout": r.state.get("heldout"),
        "copy_the_source_bleu": bleu([x["input"] for x in lines], [x["output"] for x in lines]),
        "budget": bud,
        "sampling": {"teacher": "its own: ODE, omega 1, its grid (logit-normal)",
                     "PD": "ODE, omega 1, uniform grid (each round's student at its own step count)",
                     "flow map": "its map sampler, omega 1, uniform grid",
                     "guidance": f"{G:g} for every model: a second pass per step with the source dropped, "
                                 "v = v_u + g (v_c - v_u); neither student was trained with the source dropped, "
                                 "so each one's source-dropped pass is what it kept of its teacher's"},
        "rows": rows, "verdict": verdict,
        "goal_met": goal, "goal_reason": reason,
        "goal": "the flow map at least as good as PD at every step count, better at 1 and 2 beyond the seed "
                f"spread (its lowest seed above PD's highest, with at least {args.verdict_seeds} distillation "
                "seeds on each side); null: undecided",
        "trainings": trainings, "walls_s": r.state["walls"], "commands": r.state["commands"],
        "skipped_past_deadline": r.state.get("skipped", []), "failed": r.state.get("failed", {}),
        "jumps": {"table": jump_table(diag_records), "runs": diag_meta, "training_pairs": shares,
                  "pd_pairs": "each PD round trains on one jump length, 1/n for its n-step student"},
    }
    save(results_dir / "results.json", result)
    try:
        plot(result, results_dir / "few_step_cond.png", args)
        if args.copy_png:
            Path(args.copy_png).write_bytes((results_dir / "few_step_cond.png").read_bytes())
    except ImportError as e:
        r.say(f"no plot: {e}")
    return result


def plot(result: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = [x for x in result["jumps"]["table"] if x["guidance"] == args.guidance and x["slot"] == "path"]
    fig, axes = plt.subplots(1, 2 if table else 1, figsize=(11 if table else 6, 4), squeeze=False)
    ax = axes[0][0]
    colors = {"teacher": "tab:gray", "PD": "tab:blue", "flow map": "tab:red"}
    for model, c in colors.items():
        rows = sorted((x for x in result["rows"] if x["model"] == model and x["guidance"] == args.guidance
                       and x["steps"] in args.eval_steps), key=lambda x: x["steps"])
        if not rows:
            continue
        ks = [x["steps"] for x in rows]
        n = len(rows[0]["per_seed"])
        ax.plot(ks, [x["bleu"]["mean"] for x in rows], "-o", color=c, label=f"{model} ({n} seed{'s' * (n != 1)})")
        ax.fill_between(ks, [x["bleu"]["min"] for x in rows], [x["bleu"]["max"] for x in rows], color=c, alpha=0.2)
        full = [x for x in result["rows"] if x["model"] == model and x["steps"] not in args.eval_steps
                and x["guidance"] == args.guidance]
        for x in full:
            ax.axhline(x["bleu"]["mean"], color=c, ls="--", lw=0.8, label=f"{model}, {x['steps']} steps")
    ax.set_xscale("log", base=2)
    ax.set_xticks(args.eval_steps, [str(k) for k in args.eval_steps])
    ax.set_xlabel("sampling steps")
    ax.set_ylabel("BLEU on held-out lines")
    ax.set_title(f"{args.task}: BLEU against steps (guidance {args.guidance:g}; mean, seeds' range shaded)",
                 fontsize=9)
    ax.legend(fontsize=8)
    if table:
        ax = axes[0][1]
        styles = {"teacher Euler": ("tab:gray", "-o")}
        for model in sorted({x["model"] for x in table}):
            # (the teacher's own step of the path's length with the path's slot is the path itself: error 0)
            rows = sorted((x for x in table if x["model"] == model and x["rel"] > 1e-9), key=lambda x: x["jump"])
            color, style = styles.get(model, ("tab:red", "-o") if model == "flow map" else ("tab:blue", "s"))
            ax.plot([x["jump"] for x in rows], [x["rel"] for x in rows], style, color=color,
                    label=model if not model.startswith("PD") or model == f"PD {max(args.rounds)}-step" else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("jump length t' - t")
        ax.set_ylabel("relative squared error vs the teacher's path")
        ax.set_title(f"jumps against the teacher's {args.diag_grid}-step path (slot: the path's guess)", fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        labels = ["PD students" if lab.startswith("PD") else lab for lab in labels]
        ax.legend(handles, labels, fontsize=8)
    b = result["budget"]
    m = result.get("machine") or {}
    fig.suptitle(f"PD {len(args.rounds)} rounds x {args.steps_per_round} steps, batch {b['pd_batch']} vs flow map "
                 f"{b['fm_optimiser_steps']} steps, batch {b['fm_batch']}: {b['pd_teacher_passes']:.3g} / "
                 f"{b['fm_teacher_passes']:.3g} teacher passes; {result['heldout']['lines']} lines; "
                 f"{m.get('gpu') or m.get('cpu')}\nverdict: {result.get('goal_reason')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

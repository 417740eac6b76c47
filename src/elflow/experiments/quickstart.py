"""`elflow quickstart`: the offline default (train the demo model, sample, report against baselines that learn
nothing), and its conditional and distillation demonstrations."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from elflow.config import RUN_DEFAULTS, TrainConfig
from elflow.data.corpus import task_pairs_file
from elflow.data.datasets import build_dataset
from elflow.distill import distill, round_dir
from elflow.eval.diagnostics import corpus_vocabulary, validation_report, word_stats
from elflow.eval.metrics import bleu
from elflow.eval.scoring import sample_and_score
from elflow.flow import distilled_defaults
from elflow.generate import generate, settings_for
from elflow.lifecycle.claim import check_run_dir, stored_config
from elflow.methods import get_method
from elflow.model import ShortRunOptions
from elflow.runs.checkpoint import latest_checkpoint, read_state
from elflow.runs.folder import REPORT_FILE, RUN_FILE, SAMPLES_FILE
from elflow.runs.load import load_for_sampling
from elflow.runs.log import plot_losses
from elflow.runs.stored import own_files_added
from elflow.space import fixed_vectors
from elflow.train import train
from elflow.util.devices import default_device
from elflow.util.errors import ELFError
from elflow.util.files import FolderLock, atomic_write, atomic_write_json, check_own, read_json

# the quickstart's run: the "quickstart" settings of TrainConfig (its steps, batch and length); the demo model
# samples with the velocity-corrected sampler in 64 steps at omega 3 (its record's sampling defaults: its
# previews, its report and `elflow sample` use them)
QUICKSTART = RUN_DEFAULTS["quickstart"][0]
DEMO_STEPS, DEMO_BATCH, DEMO_LENGTH = QUICKSTART["steps"], QUICKSTART["batch"], QUICKSTART["length"]
DEMO_SAMPLER, DEMO_SAMPLE_STEPS, DEMO_OMEGA = "vc", 64, 3.0


COND_STEPS = 500  # the conditional demonstration's: where the copy task's held-out BLEU levels off (RESULTS.md, 10)


def preset_overrides(args) -> dict:
    """The quickstart preset's settings this command's flags replace when given (--lr, --space). The preset's
    table readout needs fixed token vectors: a --space without them (an encoder, a learned table) drops it."""
    over = {name: getattr(args, name) for name in ("lr", "space") if getattr(args, name, None) is not None}
    options = QUICKSTART["short_run"]
    table = "space" not in over or fixed_vectors(over["space"])  # one frozen vector per token: the readout's table
    if options.get("table_readout") and not table:
        over["short_run"] = {**options, "table_readout": 0.0}
    return over


def demo_config(args):
    """The "quickstart" settings preset of TrainConfig, with this command's flags on top."""
    given = dict(length=args.length, batch=args.batch, steps=args.steps, seed=args.seed,
                 sampling={"steps": args.sample_steps, "sampler": args.sampler, "omega": args.omega})
    return TrainConfig.named("quickstart", **given, **preset_overrides(args))


@torch.no_grad()
def report(run_dir, sampler: str = DEMO_SAMPLER, steps: int = DEMO_SAMPLE_STEPS, omega: float = DEMO_OMEGA, num: int = 32,
           seed: int = 0, cache_dir=None, printer=print) -> dict:
    """Samples and learning figures for a trained run; written to <run>/report.json and samples.jsonl."""

    run_dir = Path(run_dir)
    for name, what in ((SAMPLES_FILE, "the report's samples"), (REPORT_FILE, "the run's report")):
        check_own(run_dir / name, what)  # a link, fifo or device there: refused before any work
    tc = stored_config(run_dir)
    net, space = load_for_sampling(run_dir, device="cpu")
    length = tc.length or net.config.max_length
    train_set, val_set = build_dataset(tc.data, space, length, layout=tc.layout, val_fraction=tc.val_fraction,
                                       seed=tc.seed, cache_dir=cache_dir)
    trained, planned = net.origin.step, tc.steps
    t0 = time.perf_counter()
    val = validation_report(net, space, val_set, net.record.recipe, seed=seed)
    settings = settings_for(net.record, steps=steps, sampler=sampler, omega=omega, seed=seed, batch_size=16)
    vocab = corpus_vocabulary(space.decode(train_set.tokens[: min(len(train_set), 4000)]))
    own_files_added(run_dir, SAMPLES_FILE, REPORT_FILE)  # the report's files, the run's own from now on
    records, gen_stats = sample_and_score(get_method(net.record.method), net, space, num, settings,
                                          lambda texts: word_stats(texts, vocab), run_dir / SAMPLES_FILE,
                                          {"length": length}, length, progress=True)
    texts = [r["text"] for r in records]
    real_stats = word_stats(space.decode(val_set.tokens[:num]), vocab)
    out = {"steps_trained": trained, "steps_planned": planned, "validation": val, "samples": gen_stats,
           "real_text": real_stats, "sampler": sampler, "steps": steps, "omega": omega, "num": num,
           "seconds": time.perf_counter() - t0}
    atomic_write_json(run_dir / REPORT_FILE, out)

    plot_losses(run_dir)  # loss.png again, now with the Gaussian baseline's held-out loss

    printer(f"\n=== the model: {trained_steps(trained, planned)} ===")
    printer("\n=== samples (" + f"{sampler}, {steps} steps, omega {omega}) ===")
    for t in texts[:4]:
        printer("  " + t[:400].replace("\n", " "))
    printer("\n=== is it learning? held-out denoising loss (v-space MSE) per time bin ===")
    printer(f"  {'t':<12}{'rows':>6}{'model':>10}{'baseline':>10}   baseline = per-dim Gaussian posterior mean")
    for b in val["bins"]:
        printer(f"  {b['t']:<12}{b['rows']:>6}{b['model']:>10.3f}{b['baseline']:>10.3f}")
    printer(f"  {'all':<12}{'':>6}{val['model_loss']:>10.3f}{val['baseline_loss']:>10.3f}")
    acc = val["decode_accuracy"]
    printer("  decode accuracy (token readout of p x + (1 - p) 5 n): "
            + ", ".join(f"{k}: {v:.1%}" for k, v in acc.items()))
    printer(f"\n  {'':<18}{'word entropy':>13}{'corpus words':>14}{'distinct':>10}")
    for name, s in (("samples", gen_stats), ("held-out text", real_stats)):
        printer(f"  {name:<18}{s['word_entropy']:>13.2f}{s['corpus_word_share']:>14.1%}{s['distinct_ratio']:>10.2f}")
    return out


COND_LENGTH, COND_SOURCE = 48, 24  # MiniLM tokens: a verse line takes about 12, its shuffle about the same


COND_STAGES = 4  # points of the BLEU-against-steps curve


def conditional_config(args, pairs_file: Path):
    """The conditional demonstration's settings: the quickstart's, trained on pairs in the fixed source slot,
    with the released network (no short-run option: on the copy task each of them slows learning,
    benchmarks/RESULTS.md, section 10, and without the Gaussian skip no guess passes z's noise on)."""
    given = dict(data=str(pairs_file), task={"source_length": COND_SOURCE, "source_slot": "fixed"},
                 length=COND_LENGTH, batch=args.batch, steps=args.steps, seed=args.seed, sample_every=0,
                 ckpt_every=max(args.steps // COND_STAGES, 1))
    return TrainConfig.named("quickstart", **given, **{**preset_overrides(args),
                                                      "short_run": ShortRunOptions().to_dict()})


@torch.no_grad()
def curve_point(run_dir, held: list[tuple[str, str]], steps: int, seed: int = 0) -> dict:
    """{"step", "bleu"}: BLEU of the run's newest checkpoint (its EMA weights) with guidance 2 on `held`."""
    net, space = load_for_sampling(run_dir, device="cpu")
    settings = settings_for(net.record, steps=steps, guidance=2.0, seed=seed, batch_size=32)
    records = generate(net, space, len(held), settings, sources=[s for s, _ in held],
                       source_length=net.record.source_length, progress=False, source_slot=net.record.source_slot)
    return {"step": net.origin.step, "lines": len(held),
            "bleu": bleu([r["text"] for r in records], [t for _, t in held])}


def _step_of(checkpoint: str) -> int:
    return int(read_state(Path(checkpoint))["step"])


def plot_curve(curve: list[dict], rows: list[dict], path: Path, task: str) -> Path:
    """bleu.png: held-out BLEU (guidance 2) against training steps, with copying the source and the source-
    dropped model of the final run as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot([c["step"] for c in curve], [c["bleu"] for c in curve], marker="o", label="guidance 2")
    for r, style in zip(rows[:2], ("--", ":")):
        ax.axhline(r["bleu"], ls=style, color="0.4", label=f"{r['model']} (final)")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out BLEU")
    ax.set_title(f"elflow quickstart --conditional --task {task}")
    ax.legend()
    fig.tight_layout()
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return path


# the rows of the conditional report: the model with its source dropped, then guided
REPORT_GUIDANCES = (("source dropped (guidance 0)", 0.0), ("guidance 1", 1.0), ("guidance 2", 2.0))


@torch.no_grad()
def conditional_report(run_dir, held: list[tuple[str, str]], num: int, steps: int, seed: int = 0,
                       printer=print, task: str = "shuffle", curve: list[dict] | None = None) -> dict:
    """BLEU on held-out lines: copying the source, the model with its source dropped (guidance 0: the
    unconditional pass alone), with guidance 1 and 2; with `curve` ({"step", "bleu"} points of the training),
    bleu.png of it."""
    run_dir = Path(run_dir)
    for name in (REPORT_FILE, *(f"samples_guidance{g:g}.jsonl" for _, g in REPORT_GUIDANCES)):
        check_own(run_dir / name, "the report's files")  # a link, fifo or device there: refused before any work
    net, space = load_for_sampling(run_dir, device="cpu")
    held = held[:num]
    sources, refs = [s for s, _ in held], [t for _, t in held]
    rows = [{"model": "copy the source", "bleu": bleu(sources, refs)}]
    t0 = time.perf_counter()
    for name, guidance in REPORT_GUIDANCES:
        settings = settings_for(net.record, steps=steps, guidance=guidance, seed=seed, batch_size=32)
        samples_file = run_dir / f"samples_guidance{guidance:g}.jsonl"
        records, score = sample_and_score(get_method(net.record.method), net, space, len(sources), settings,
                                          lambda texts: bleu(texts, refs), samples_file,
                                          references=refs, sources=sources,
                                          source_length=net.record.source_length, progress=True,
                                          source_slot=net.record.source_slot)
        rows.append({"model": name, "bleu": score, **settings.to_dict()})
        if guidance == 2.0:
            examples = records[:3]
    out = {"task": task, "held_out": len(held), "rows": rows, "curve": curve or [],
           "seconds": time.perf_counter() - t0}
    own_files_added(run_dir, REPORT_FILE)
    atomic_write_json(run_dir / REPORT_FILE, out)
    if curve:
        plot_curve(curve, rows, run_dir / "bleu.png", task)
    printer(f"\n=== BLEU on {len(held)} held-out lines (sacrebleu, lowercase; ODE, {steps} steps) ===")
    for r in rows:
        printer(f"  {r['model']:<30}{r['bleu']:>8.2f}")
    if curve:
        printer(f"\n=== BLEU (guidance 2) against training steps, {curve[0].get('lines', '?')} held-out lines ===")
        printer("  " + "  ".join(f"step {c['step']}: {c['bleu']:.2f}" for c in curve))
    printer("\n=== examples (guidance 2) ===")
    for r in examples:
        printer(f"  source:    {r['source']}\n  output:    {r['text']}\n  reference: {r['reference']}\n")
    return out


def trained_steps(trained: int, planned: int | None) -> str:
    """'trained 62 of 250 steps (stopped early: --resume continues it)', or 'trained 250 of 250 steps'."""
    if not isinstance(planned, int):
        return f"trained {trained} steps"
    early = " (stopped early: --resume continues it)" if trained < planned else ""
    return f"trained {trained} of {planned} steps{early}"


def train_and_report(args, cfg, out: Path, command: str, what: str, make_report) -> tuple[float | None, float]:
    """Train `cfg` into `out` (unless --report-only), then `make_report()` holding the run folder's lock;
    returns (training seconds, None with --report-only; report seconds). What --resume and --overwrite may do
    with `out` is checked before anything is said or done."""
    t0 = time.perf_counter()
    if not args.report_only:
        check_run_dir(out, cfg, args.resume, args.overwrite, default_device())
        print(f"{command}: training {what} in {out}", file=sys.stderr)
        train(cfg, out, resume=args.resume, overwrite=args.overwrite, cache_dir=args.cache_dir, command=command)
    elif not (out / RUN_FILE).exists():
        raise ELFError(f"{out} holds no run; run `{command}` without --report-only first")
    t1 = time.perf_counter()
    with FolderLock(out, f"{command} (report)"):
        make_report()
    return (None if args.report_only else t1 - t0), time.perf_counter() - t1


def total_time(work: str, work_s: float | None, report_s: float) -> str:
    """'total time 5.2 min (training 4.0 min, report 1.2 min)': what the command took, the parts named;
    'total time 1.2 min (report only)' when nothing was trained (`work_s` None)."""
    if work_s is None:
        return f"total time {report_s / 60:.1f} min (report only)"
    return (f"total time {(work_s + report_s) / 60:.1f} min ({work} {work_s / 60:.1f} min, "
            f"report {report_s / 60:.1f} min)")


def run_conditional(args) -> int:
    """Train the demonstration in COND_STAGES stages, a point of the BLEU curve after each (kept in
    curve.json, so that --resume measures only what is new), then the report."""
    if args.curve_num < 1:
        raise ELFError(f"--curve-num must be >= 1, got {args.curve_num}")
    out = Path(args.out if args.out != "runs/demo" else "runs/demo-cond")
    train_pairs, held, pairs_file = task_pairs_file(args.task, args.seed, args.cache_dir)
    cfg = conditional_config(args, pairs_file).resolved()
    cfg.validate()
    command = "elflow quickstart --conditional"
    curve_file, curve_held = out / "curve.json", held[:args.curve_num]
    t0 = time.perf_counter()
    if not args.report_only:
        check_run_dir(out, cfg, args.resume, args.overwrite, default_device())
        print(f"{command}: training the demo model on {len(train_pairs)} pairs of the {args.task} task "
              f"({args.steps} steps, BLEU measured after every {cfg.ckpt_every}) in {out}", file=sys.stderr)
        fresh = not args.resume
        for stage in range(1, COND_STAGES + 1):
            end = min(args.steps, stage * cfg.ckpt_every) if stage < COND_STAGES else args.steps
            ckpt = None if fresh else latest_checkpoint(out, warn=lambda *_: None)
            done = _step_of(str(ckpt)) if ckpt is not None else 0
            if done < end:
                train(cfg, out, resume=not fresh, overwrite=fresh and args.overwrite, cache_dir=args.cache_dir,
                      command=command, stop_after=end - done)
                fresh = False
            curve = read_json(curve_file, kind=list) if curve_file.exists() and done > 0 else []
            if not any(c["step"] == end for c in curve):
                with FolderLock(out, f"{command} (BLEU curve)"):
                    point = curve_point(out, curve_held, args.sample_steps, args.seed)
                    curve = [c for c in curve if c["step"] < point["step"]] + [point]
                    atomic_write_json(curve_file, curve)
                print(f"step {end}: held-out BLEU {curve[-1]['bleu']:.2f} (guidance 2, {len(curve_held)} lines)",
                      file=sys.stderr)
    elif not (out / RUN_FILE).exists():
        raise ELFError(f"{out} holds no run; run `{command}` without --report-only first")
    t1 = time.perf_counter()
    curve = read_json(curve_file, kind=list) if curve_file.exists() else []
    with FolderLock(out, f"{command} (report)"):
        conditional_report(out, held, max(args.num, 1), args.sample_steps, args.seed, task=args.task, curve=curve)
    print(f"\n{total_time('training', None if args.report_only else t1 - t0, time.perf_counter() - t1)}; "
          f"figures: {out / 'report.json'}"
          + (f", {out / 'bleu.png'}" if curve else ""))
    return 0


PD_STUDENTS, PD_TEACHER_STEPS = (4, 2, 1), 16


@torch.no_grad()
def distillation_report(teacher_dir, rounds: dict, num: int = 32, seed: int = 0, cache_dir=None,
                        printer=print) -> dict:
    """Teacher and students side by side on held-out figures: decode accuracy of each network, and the word
    statistics of its samples at 1, 2 and 4 steps (students at their own step count) beside real text."""

    teacher_dir = Path(teacher_dir)
    tc = stored_config(teacher_dir)
    teacher, space = load_for_sampling(teacher_dir, device="cpu")
    length = tc.length or teacher.config.max_length
    train_set, val_set = build_dataset(tc.data, space, length, layout=tc.layout, val_fraction=tc.val_fraction,
                                       seed=tc.seed, cache_dir=cache_dir)
    vocab = corpus_vocabulary(space.decode(train_set.tokens[: min(len(train_set), 4000)]))
    models = [("teacher", teacher, (1, 2, 4))]
    models += [(f"student ({n} steps)", load_for_sampling(rounds[n], device="cpu", space=space)[0], (n,))
               for n in sorted(rounds, reverse=True)]
    rows = []
    for name, net, counts in models:
        acc = validation_report(net, space, val_set, net.record.recipe, rows=64, seed=seed)["decode_accuracy"]["p=1.0"]
        for n in counts:
            settings = settings_for(net.record, seed=seed, batch_size=16, **distilled_defaults(n))  # students' too
            _, stats = sample_and_score(get_method(net.record.method), net, space, num, settings,
                                        lambda texts: word_stats(texts, vocab), length=length, progress=True)
            rows.append({"model": name, "steps": n, "decode_accuracy": acc, **stats, **settings.to_dict()})
    real = word_stats(space.decode(val_set.tokens[:num]), vocab)
    out = {"rows": rows, "real_text": real, "num": num}
    atomic_write_json(Path(rounds[min(rounds)]).parent / REPORT_FILE, out)
    printer(f"\n=== teacher and students (SDE gamma 1.5, omega 2.5; {num} samples each) ===")
    printer(f"  {'model':<20}{'steps':>6}{'word entropy':>14}{'corpus words':>14}{'decode acc.':>13}")
    for r in rows:
        printer(f"  {r['model']:<20}{r['steps']:>6}{r['word_entropy']:>14.2f}{r['corpus_word_share']:>14.1%}"
                f"{r['decode_accuracy']:>13.1%}")
    printer(f"  {'held-out text':<20}{'':>6}{real['word_entropy']:>14.2f}{real['corpus_word_share']:>14.1%}")
    return out


def run_distill(args) -> int:
    teacher = Path(args.out)
    if not (teacher / RUN_FILE).exists():
        raise ELFError(f"{teacher} holds no run to distil; run `elflow quickstart` first (or pass its --out)")
    if args.distill_steps < 1:
        raise ELFError(f"--distill-steps must be >= 1, got {args.distill_steps}")
    out = teacher.parent / f"{teacher.name}-pd"
    t0 = time.perf_counter()
    if not args.report_only:
        print(f"elflow quickstart --distill: {teacher} (16-step grid) -> 4, 2, 1 steps, {args.distill_steps} steps "
              f"per round, in {out}", file=sys.stderr)
        rounds = distill(teacher, out, student_steps=PD_STUDENTS, teacher_steps=PD_TEACHER_STEPS,
                         steps_per_round=args.distill_steps, ema_decay=0.98, resume=args.resume,
                         overwrite=args.overwrite, cache_dir=args.cache_dir, batch=args.batch, seed=args.seed,
                         log_every=10, ckpt_every=max(args.distill_steps // 2, 1), keep=2)
    else:
        rounds = {n: round_dir(out, n) for n in PD_STUDENTS}
        missing = [str(p) for p in rounds.values() if not (p / RUN_FILE).exists()]
        if missing:
            raise ELFError(f"no distilled rounds in {out} ({', '.join(missing)}); run without --report-only first")
    t1 = time.perf_counter()
    distillation_report(teacher, rounds, max(args.num, 1), args.seed, args.cache_dir)
    print(f"\n{total_time('distillation', t1 - t0, time.perf_counter() - t1)}; figures: {out / 'report.json'}")
    return 0

"""`elflow eval`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

from elflow.cli.common import add_arguments as add_tracking
from elflow.cli.common import add_sampling_arguments, check_counts, check_sampling_flags
from elflow.data.corpus import read_pairs, read_sources
from elflow.data.tasks import PAIR_TASKS
from elflow.eval.judge import load_judge
from elflow.eval.mauve import clusters_for, mauve_against
from elflow.eval.metrics import (
    DTYPES,
    PROTOCOL_ALIASES,
    PROTOCOLS,
    bleu,
    generative_perplexity,
    judge_score,
    mean_and_stderr,
    read_references,
    read_texts,
    rouge,
    summary_of,
)
from elflow.eval.scoring import heldout_texts, judged_heldout, read_real_texts, sample_and_score
from elflow.generate import check_sampled, write_samples
from elflow.lifecycle.outputs import Outputs, check_out, default_folder, own_run
from elflow.methods import get_method, settings_from_args
from elflow.runs.folder import REPORT_FILE
from elflow.runs.load import load_for_sampling
from elflow.runs.tracking import Tracker, require_wandb
from elflow.util import jsonio
from elflow.util.budget import LENGTH_BOUND, SAMPLES_BOUND, check_seeds
from elflow.util.devices import check_device
from elflow.util.distributed import DIST_TIMEOUT_HELP, DIST_TIMEOUT_MINUTES, check_dist_timeout, process_group
from elflow.util.errors import ELFError
from elflow.util.files import FolderHold, atomic_write_json, check_stdout_open, print_result


def _heldout(args, checkpoint, num: int, judge, main: bool = True) -> dict | None:
    """The held-out text's figures under `judge` for the report (None with --no-heldout, and on every rank but
    rank 0: `main`); a model without held-out text gives a note instead. Every rank reads the held-out text,
    since reading the run's data may prepare its store, which the ranks do together; rank 0 alone judges it."""
    if not args.heldout:
        return None
    if checkpoint is None:
        return {"note": "no held-out text to judge: the samples do not name the elflow run they came from"}
    try:
        texts, what = heldout_texts(checkpoint, num, args.cache_dir)
    except ELFError as e:
        return {"note": f"no held-out text to judge: {e}"}
    if not main:
        return None
    settings = {"batch_size": args.batch_size, "protocol": args.protocol, "max_length": args.max_length,
                "judge_dtype": args.judge_dtype}
    return {**judged_heldout(texts, str(args.judge), judge, settings, args.cache_dir, progress=not args.json),
            "texts": what}


def _heldout_line(held: dict | None) -> str | None:
    if held is None:
        return None
    if "gen_ppl" not in held:
        return f"held-out text: {held['note']}"
    return f"held-out text: {_format(held)} [{held['texts']}{'; cached' if held.get('cached') else ''}]"


def _track(args, folder: Path, report: dict, tables: dict, job_type: str) -> None:
    """The report in a W&B run (--wandb): its figures as the run's summary, its settings as its config,
    `tables` ({key: (columns, rows)}) as tables."""
    tracker = Tracker.start(args.wandb, args.wandb_run, folder, {k: v for k, v in report.items()
                                                                 if not isinstance(v, (list, dict))},
                            job_type=job_type, quiet=getattr(args, "json", False))
    if tracker is None:
        return
    try:
        flat = {k: v for k, v in report.items() if isinstance(v, (int, float))}
        for k, v in (report.get("heldout") or {}).items():
            if isinstance(v, (int, float)):
                flat[f"heldout/{k}"] = v
        tracker.summary(flat)
        for key, (columns, rows) in tables.items():
            tracker.table(key, columns, rows)
    finally:
        tracker.finish()


TEXT_TASKS = ("translation", "summarization")


def add_arguments(p) -> None:
    p.add_argument("samples", nargs="?", help="JSONL of samples (the `text` field, as `elflow sample` writes)")
    p.add_argument("--field", default="text", help="JSONL field holding each sample's text")
    p.add_argument("--task", default="unconditional", metavar="TASK",
                   help="unconditional: Gen-PPL + entropy of SAMPLES or of --checkpoint's samples; "
                        "translation / summarization: BLEU / ROUGE of SAMPLES against --references; "
                        "wmt14-de-en, xsum or a FILE.jsonl of {input, output} pairs: generate with --checkpoint "
                        "(a conditional model) on the validation set and score BLEU (wmt14-de-en, files by "
                        "default) or ROUGE (xsum, or --metric rouge)")
    p.add_argument("--metric", choices=("bleu", "rouge"), default=None,
                   help="the score of a FILE.jsonl task (default bleu)")
    p.add_argument("--references", help="references for --task translation/summarization, or the real texts --mauve "
                   "compares the samples with: a .jsonl file (--reference-field) or a text file with one text per line")
    p.add_argument("--reference-field", default=None,
                   help="JSONL field of the references (default: text; output for a pairs FILE.jsonl)")
    p.add_argument("--source-field", default="input", help="the source field of a pairs FILE.jsonl")
    g = p.add_argument_group("judge")
    g.add_argument("--judge", default="gpt2-large",
                   help="hub id or local folder with a causal LM and its tokenizer (offline: `elflow train-judge`)")
    g.add_argument("--judge-dtype", choices=tuple(DTYPES), default="fp32", help="judge precision")
    g.add_argument("--batch-size", type=int, default=8, help="judge batch size (does not change the result)")
    g.add_argument("--protocol", choices=(*PROTOCOLS, *PROTOCOL_ALIASES), default="elf",
                   help="elf: the paper's; elf-released: the released code's target weights; mdlm: MDLM/Duo entropy")
    g.add_argument("--max-length", type=int, default=None, help="truncation length (default: judge context)")
    g.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    g.add_argument("--dist-timeout", type=float, default=DIST_TIMEOUT_MINUTES, metavar="MINUTES",
                   help=DIST_TIMEOUT_HELP)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    o.add_argument("--report", default=None,
                   help="report file (default: next to the samples, or in --out); never inside a run folder but the "
                        "evaluated run's own eval/")
    s = p.add_argument_group("generate first (instead of SAMPLES)")
    s.add_argument("--checkpoint", default=None, help="run folder, checkpoint or hub id to sample from")
    s.add_argument("--num", "--num-samples", type=int, default=1000,
                   help="samples per seed, examples for conditional tasks (default 1000); under torchrun spell it "
                        "--num-samples")
    s.add_argument("--length", type=int, default=None, help="sequence length (default: the model's)")
    add_sampling_arguments(s)
    s.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="one sample set per seed; mean +- s.e. (default: --seed, else 0)")
    s.add_argument("--out", default=None,
                   help="folder for the samples and the report (default: RUN/eval/SETTINGS, RUN/eval/CKPT/SETTINGS for "
                        "a checkpoint folder CKPT of RUN); never inside a run folder but the evaluated run's own eval/")
    s.add_argument("--encoder", default=None,
                   help="T5 encoder folder or hub id for the released checkpoints (default t5-small)")
    o.add_argument("--overwrite", action="store_true",
                   help="replace an existing report (and samples with --checkpoint)")
    g.add_argument("--heldout", action=argparse.BooleanOptionalAction, default=True,
                   help="also judge as many rows of the held-out split of the data the model was trained on (an "
                        "elflow run's; cached per judge and data) and print them beside the samples' figures "
                        "(default: on)")
    g.add_argument("--mauve", action="store_true",
                   help="also MAUVE of the samples against real text (--references, else as many rows of the held-out "
                        "split of the model's training data), on the judge's last hidden state (docs/evaluation.md)")
    g.add_argument("--mauve-clusters", type=_clusters, default="auto",
                   help="MAUVE's k-means clusters (auto: a tenth of the texts)")
    g.add_argument("--mauve-seed", type=int, default=25, help="MAUVE's seed (PCA and k-means)")
    g.add_argument("--cache-dir", default=None, help="tokenization and held-out judging cache "
                                                     "(default: $ELFLOW_CACHE or ~/.cache/elflow)")

    add_tracking(p)


def _clusters(text: str):
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 2, got {text!r}")
    return n


def _check_flags(args) -> None:
    """The plain ranges of eval's own flags, checked before anything is read, sampled or judged."""
    if args.batch_size < 1:
        raise ELFError(f"--batch-size must be an integer >= 1, got {args.batch_size}")
    if args.max_length is not None and args.max_length < 1:
        raise ELFError(f"--max-length must be an integer >= 1 (the judge's tokens kept per text), got "
                       f"{args.max_length}; leave it out for the judge's context")
    check_counts(args, num=SAMPLES_BOUND, length=LENGTH_BOUND)
    seeds = args.seeds or []
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ELFError(f"--seeds names seed {', '.join(map(str, twice))} more than once; each seed gives one sample "
                       "set: pass distinct seeds")
    if args.num is not None:
        check_seeds(len(seeds) or 1, args.num)


def _mauve_references(args, checkpoint, num: int) -> tuple[list[str], str]:
    """The real texts --mauve compares the samples with (blank ones dropped), and what they are: --references,
    else `num` held-out rows of the data the elflow run `checkpoint` was trained on. Read before the judge is
    loaded; a set without any text is one line naming it."""
    if args.references:
        return read_real_texts(args.references, args.reference_field or "text"), str(args.references)
    if checkpoint is None:
        raise ELFError("--mauve compares the samples with real text: pass --references FILE (.jsonl, or one text "
                       "per line), or samples that name the elflow run they came from")
    try:
        refs, what = heldout_texts(checkpoint, num, args.cache_dir)
    except ELFError as e:
        raise ELFError(f"--mauve has no held-out text to compare with ({e}); pass --references FILE") from None
    refs = [t for t in refs if t.strip()]
    if not refs:
        raise ELFError(f"--mauve has no held-out text to compare with ({what} are all empty); pass --references FILE")
    return refs, what


def _mauve(args, refs: list[str], judge):
    model, tok = judge
    return mauve_against(refs, model, tok, num_buckets=args.mauve_clusters, seed=args.mauve_seed,
                         batch_size=args.batch_size, max_length=args.max_length)


def _mauve_line(res: dict, what: str) -> str:
    m = res["mauve_settings"]
    return (f"mauve {res['mauve']:.4f} against {what} ({m['texts'][0]} samples, {m['texts'][1]} references, "
            f"{m['clusters']} clusters, seed {m['seed']})")


def _sampled_from(samples_path) -> str | None:
    """The model a samples file was drawn from (the "checkpoint" that `elflow sample` writes in each line)."""
    from contextlib import closing

    try:
        with closing(jsonio.iter_jsonl(Path(samples_path).expanduser(), allow_nonfinite=True)) as lines:
            _, first = next(lines, (0, None))
    except (OSError, ELFError):
        return None
    value = first.get("checkpoint") if isinstance(first, dict) else None
    return value if isinstance(value, str) else None


def _settings(args) -> dict:
    return {"judge": str(args.judge), "judge_dtype": args.judge_dtype, "batch_size": args.batch_size,
            "protocol": args.protocol}


def _emit(report: dict, path: Path, args, summary: str, outputs: Outputs, writers: dict | None = None,
          tables: dict | None = None) -> None:
    """Write the report and the other outputs (`writers`: {path: function(path, overwrite)}) together, print the
    report (as JSON with --json, else `summary`), and with --wandb log it (`tables`: see _track)."""
    clean = jsonio.json_safe(report)
    outputs.write({**(writers or {}), path: lambda p, overwrite: atomic_write_json(p, clean, overwrite)})
    if args.json:
        print_result(json.dumps(clean), f"wrote the report {path}")
    else:
        print(summary)
        print(f"report: {path}")
    if getattr(args, "wandb", None):
        _track(args, path.parent, clean, tables or {}, "eval")


def _samples_writer(records: list[dict], meta: dict):
    return lambda path, overwrite: write_samples(path, records, meta, overwrite)


def _format(res: dict) -> str:
    return (f"gen_ppl {res['gen_ppl']:.3f}  entropy {res['entropy']:.4f}  "
            f"({res['num_samples']} samples, {res['num_empty']} empty skipped, {res['num_tokens']} tokens, "
            f"{res['num_truncated']} truncated at {res['max_length']})")


def _check_texts(texts: list[str], where: str) -> None:
    """A sample set that would give no number (no texts, or only empty ones) is an error, not a NaN."""
    if not texts:
        raise ELFError(f"{where} holds no samples; nothing to evaluate")
    if not any(t.strip() for t in texts):
        raise ELFError(f"all {len(texts)} samples of {where} are empty; nothing to evaluate")


def _check_result(res: dict, where: str) -> None:
    if not math.isfinite(res["gen_ppl"]) or not math.isfinite(res["entropy"]):
        raise ELFError(f"the samples of {where} give no finite score ({res['num_samples']} scored, "
                       f"{res['num_tokens']} tokens counted); nothing is written")


def _report_path(args, default: Path, allowed: Path | None, outputs: Outputs) -> Path:
    """--report, checked as any output (not inside a run folder but under `allowed`), else `default`, a place
    of eval's own (beside the samples it scores, or in the eval folder)."""
    if args.report:
        return outputs.add(args.report, "--report", allowed)
    return outputs.add(default, "--report", inside_checked=True)


def _run_text_task(args) -> int:
    if not args.samples:
        raise ELFError(f"--task {args.task} needs a SAMPLES.jsonl file of hypotheses")
    hyps = read_texts(args.samples, args.field)
    _check_texts(hyps, args.samples)
    if args.references is None:
        raise ELFError(f"--task {args.task} needs --references FILE (.jsonl or one reference per line)")
    refs = read_references(args.references, args.reference_field or "text")
    if len(refs) != len(hyps):
        raise ELFError(f"{args.samples} has {len(hyps)} hypotheses but {args.references} has {len(refs)} "
                       "references; they must pair up line by line")
    outputs = Outputs(args.overwrite)
    path = _report_path(args, Path(args.samples).with_suffix(f".{args.task}.json"), None, outputs)
    if args.task == "translation":
        res = {"bleu": bleu(hyps, refs), "tokenize": "13a", "lowercase": True, "effective_order": True}
        summary = f"BLEU {res['bleu']:.2f} ({len(hyps)} pairs)"
    else:
        res = {**rouge(hyps, refs), "stemmer": True, "f1_x100": True}
        summary = f"ROUGE-1 {res['rouge1']:.2f}  ROUGE-2 {res['rouge2']:.2f}  ROUGE-L {res['rougeL']:.2f}"
    report = {"task": args.task, **res, "num_pairs": len(hyps), "samples": str(args.samples),
              "references": str(args.references)}
    _emit(report, path, args, summary, outputs)
    return 0


def _score(metric: str, hyps: list[str], refs: list[str]) -> tuple[dict, str]:
    if metric == "bleu":
        res = {"bleu": bleu(hyps, refs), "tokenize": "13a", "lowercase": True, "effective_order": True}
        return res, f"BLEU {res['bleu']:.2f} ({len(hyps)} pairs)"
    res = {**rouge(hyps, refs), "stemmer": True, "f1_x100": True}
    return res, f"ROUGE-1 {res['rouge1']:.2f}  ROUGE-2 {res['rouge2']:.2f}  ROUGE-L {res['rougeL']:.2f}"


def _validation_pairs(task: str, num: int, source_field: str, reference_field: str) -> tuple[list, list]:
    if task.endswith(".jsonl"):
        sources, refs = read_sources(task, source_field, reference_field)
        if any(r is None for r in refs):
            raise ELFError(f"{task}: every record needs a reference in {reference_field!r}")
    else:
        pairs = list(read_pairs(task, split="validation", max_documents=num))
        sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    return sources[:num], refs[:num]


def _out_folder(args, tag: str | None = None) -> tuple[Path, Path | None]:
    """The eval folder (--out, else the model's own: RUN/eval[/CKPT][/TAG], see outputs.default_folder) and the
    place the evaluated run's outputs may take (RUN/eval); --out is checked as a folder output: no link, no
    device, not a file, not inside a run folder but under RUN/eval."""
    ckpt = Path(args.checkpoint).expanduser()
    run = own_run(ckpt)
    allowed = run / "eval" if run is not None else None
    if args.out:
        return check_out(args.out, args.overwrite, "--out", folder=True, allowed=allowed), allowed
    out = default_folder(ckpt, "eval", Path("eval-" + ckpt.name) / "eval")
    out = out / tag if tag else out
    return check_out(out, args.overwrite, "--out", folder=True, allowed=allowed), allowed


def _run_conditional_task(args, part: tuple[int, int] = (0, 1)) -> int:
    task = args.task
    if task not in PAIR_TASKS and not task.endswith(".jsonl"):
        raise ELFError(f"unknown --task {task!r}: choose unconditional, translation, summarization, "
                       f"{', '.join(PAIR_TASKS)} or a FILE.jsonl of pairs")
    if args.checkpoint is None:
        raise ELFError(f"--task {task} generates first: pass --checkpoint RUN (a conditional model)")
    metric = args.metric or (PAIR_TASKS[task]["metric"] if task in PAIR_TASKS else "bleu")
    out, allowed = _out_folder(args)
    name = Path(task).stem if task.endswith(".jsonl") else task
    outputs = Outputs(args.overwrite)
    samples_path = outputs.add(out / f"{name}.samples.jsonl", inside_checked=True)
    report_path = _report_path(args, out / f"{name}.{metric}.json", allowed, outputs)
    sources, refs = _validation_pairs(task, args.num, args.source_field, args.reference_field or "output")
    net, space = load_for_sampling(args.checkpoint, device=args.device, space=args.encoder)
    if not net.record.conditional:
        raise ELFError(f"{args.checkpoint} is not a conditional model (it was not trained on pairs); "
                       f"--task {task} needs one")
    settings = settings_from_args(net.record, args)
    with _hold(out, part):
        return _conditional_task(args, task, metric, net, space, settings, sources, refs, samples_path,
                                 report_path, outputs, part)


def _hold(out: Path, part: tuple[int, int]):
    """The lock on an eval folder, taken by the rank that writes it (rank 0)."""
    from contextlib import nullcontext

    return FolderHold(out, "elflow eval") if part[0] == 0 else nullcontext()


def _conditional_task(args, task, metric, net, space, settings, sources, refs, samples_path, report_path,
                      outputs, part) -> int:
    t0 = time.time()

    def score(texts):
        check_sampled(texts, f"{args.checkpoint} on {task}")
        return _score(metric, texts, refs)

    records, (res, summary) = sample_and_score(
        get_method(net.record.method), net, space, len(sources), settings, score, None, None, args.length, refs,
        progress=not args.json, part=part, sources=sources, source_length=net.record.source_length,
        source_slot=net.record.source_slot)
    report = {"task": task, "metric": metric, **res, "num_examples": len(records), **settings.to_dict(),
              "checkpoint": str(args.checkpoint), "samples": str(samples_path), "seconds": time.time() - t0}
    if part[0] == 0:
        writers = {samples_path: _samples_writer(records, {**settings.to_dict(), "checkpoint": str(args.checkpoint)})}
        _emit(report, report_path, args, f"{summary}  ({len(records)} examples, {settings.sampler}, "
              f"{settings.steps} steps, guidance {settings.guidance:g}, omega {settings.omega:g})", outputs, writers,
              {"examples": (["source", "output", "reference"],
                            [[r.get("source"), r["text"], r.get("reference")] for r in records[:100]])})
    return 0


def run(args) -> int:
    if args.json:
        check_stdout_open("--json")
    check_sampling_flags(args)
    _check_flags(args)
    check_dist_timeout(args.dist_timeout)
    args.device = check_device(args.device)
    if args.wandb:
        require_wandb()
    if args.mauve and args.task != "unconditional":
        raise ELFError(f"--mauve compares unconditional samples with real text; --task {args.task} scores pairs")
    if args.task in TEXT_TASKS:
        return _run_text_task(args)
    if args.task == "unconditional" and (args.samples is None) == (args.checkpoint is None):
        raise ELFError("pass either SAMPLES.jsonl to judge, or --checkpoint RUN to sample first (not both)")
    try:
        with process_group(args.device, args.dist_timeout) as (rank, world, device):  # under torchrun: sharded
            args.device = str(device)
            if args.task != "unconditional":
                return _run_conditional_task(args, (rank, world))
            return _run_unconditional(args, (rank, world))
    except BaseException as e:
        if not isinstance(e, Exception):  # Ctrl-C or SIGTERM: what became of the output, for the closing line
            e.outcome = "nothing of this eval was written; run it again to start afresh"
        raise


def _run_unconditional(args, part: tuple[int, int]) -> int:
    if args.samples is not None:
        return _judge_samples_file(args, part)
    t0 = time.time()
    if args.out:
        _out_folder(args)  # a refused --out is said before the model is read
    net, space = load_for_sampling(args.checkpoint, device=args.device, space=args.encoder,
                                      max_length=args.length)
    settings = settings_from_args(net.record, args)
    seeds = args.seeds or [settings.seed]
    out, allowed = _out_folder(args, settings.tag())
    outputs = Outputs(args.overwrite)
    report_path = _report_path(args, out / REPORT_FILE, allowed, outputs)
    seeds = {seed: outputs.add(out / f"samples_seed{seed}.jsonl", inside_checked=True) for seed in seeds}
    refs, what = _mauve_references(args, args.checkpoint, args.num) if args.mauve else ([], "")
    if args.mauve:
        clusters_for(args.num, len(refs), args.mauve_clusters)  # too few texts: said before any sampling
    with _hold(out, part):
        return _sample_and_judge(args, net, space, settings, seeds, report_path, outputs, (refs, what), t0, part)


def _judge_samples_file(args, part: tuple[int, int]) -> int:
    t0 = time.time()
    main = part[0] == 0
    texts = read_texts(args.samples, args.field)  # before loading the judge: fail fast on bad input
    _check_texts(texts, args.samples)
    outputs = Outputs(args.overwrite)
    source = own_run(_sampled_from(args.samples))
    path = _report_path(args, Path(args.samples).with_suffix(".eval.json"),
                        source / "eval" if source is not None else None, outputs)
    refs, what = _mauve_references(args, _sampled_from(args.samples), len(texts)) if args.mauve else ([], "")
    if args.mauve:
        clusters_for(sum(1 for t in texts if t.strip()), len(refs), args.mauve_clusters)
    model, tok = load_judge(args.judge, args.judge_dtype, args.device)
    mauve = _mauve(args, refs, (model, tok)) if args.mauve else None
    res = generative_perplexity(texts, model, tok, args.batch_size, args.protocol, args.max_length,
                                progress=not args.json and main, part=part)
    _check_result(res, args.samples)
    scores = mauve(texts) if mauve else {}
    held = _heldout(args, _sampled_from(args.samples), len(texts), (model, tok), main)
    report = {**summary_of(res), **scores, **_settings(args), "samples": str(args.samples),
              "seconds": time.time() - t0, **({"heldout": held} if held else {})}
    if main:
        lines = [f"samples: {_format(res)}", _mauve_line(scores, what) if scores else None, _heldout_line(held)]
        _emit(report, path, args, "\n".join(filter(None, lines)), outputs)
    return 0


def _sample_and_judge(args, net, space, settings, seeds, report_path, outputs, references, t0, part) -> int:
    main = part[0] == 0
    refs, what = references
    model, tok = load_judge(args.judge, args.judge_dtype, args.device)
    judge = judge_score(model, tok, args.batch_size, args.protocol, args.max_length, part)
    if args.mauve:
        mauve = _mauve(args, refs, (model, tok))
        judge_only = judge
        judge = lambda texts: {**judge_only(texts), **mauve(texts)}  # noqa: E731
    per_seed, writers = [], {}
    for seed, path in seeds.items():  # {seed: its samples file}

        def score(texts, seed=seed):
            check_sampled(texts, f"{args.checkpoint} (seed {seed})")
            return judge(texts)

        chosen = replace(settings, seed=seed)
        records, res = sample_and_score(get_method(net.record.method), net, space, args.num, chosen, score,
                                        None, None, args.length, progress=not args.json, part=part)
        _check_result(res, f"seed {seed}")
        writers[path] = _samples_writer(records, {**chosen.to_dict(), "checkpoint": str(args.checkpoint)})
        per_seed.append({"seed": seed, **res})
        if not args.json and main:
            print(f"seed {seed}: {_format(res)}" + (f"  mauve {res['mauve']:.4f}" if "mauve" in res else ""))
    ppl, ppl_se = mean_and_stderr([r["gen_ppl"] for r in per_seed])
    ent, ent_se = mean_and_stderr([r["entropy"] for r in per_seed])
    report = {"gen_ppl": ppl, "gen_ppl_stderr": ppl_se, "entropy": ent, "entropy_stderr": ent_se,
              "num_samples": sum(r["num_samples"] for r in per_seed),
              "num_empty": sum(r["num_empty"] for r in per_seed),
              "num_tokens": sum(r["num_tokens"] for r in per_seed), "num_seeds": len(per_seed), **_settings(args),
              "checkpoint": str(args.checkpoint), "method": net.record.method, "num": args.num, "length": args.length,
              **settings.to_dict(),
              "seeds": list(seeds), "per_seed": per_seed, "seconds": time.time() - t0}
    se = lambda x: f" +- {x:.3f}" if x is not None else ""  # noqa: E731
    summary = (f"samples: gen_ppl {ppl:.3f}{se(ppl_se)}  entropy {ent:.4f}{se(ent_se)}  over {len(per_seed)} "
               f"seed(s) ({settings.describe()})")
    columns = ["seed", "gen_ppl", "entropy", "num_samples", "num_empty", "num_tokens"]
    if args.mauve:
        mv, mv_se = mean_and_stderr([r["mauve"] for r in per_seed])
        report.update(mauve=mv, mauve_stderr=mv_se, mauve_settings=per_seed[0]["mauve_settings"])
        summary += "\n" + _mauve_line({"mauve": mv, "mauve_settings": per_seed[0]["mauve_settings"]}, what) + \
            (f" (mean over seeds{se(mv_se)})" if len(per_seed) > 1 else "")
        columns.append("mauve")
    held = _heldout(args, args.checkpoint, args.num, (model, tok), main)
    if held:
        report["heldout"] = held
    if main:
        _emit(report, report_path, args, "\n".join(filter(None, [summary, _heldout_line(held)])), outputs, writers,
              {"per_seed": (columns, [[r[c] for c in columns] for r in per_seed])})
    return 0

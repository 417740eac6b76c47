"""`elflow sample`: its flags and its run (the work is the library's)."""

from __future__ import annotations

import sys
from pathlib import Path

from elflow.cli.common import add_sampling_arguments, check_samples_out, check_sampling_flags
from elflow.data.corpus import read_sources
from elflow.experiments.viewer import trajectory_document, write_page
from elflow.generate import check_sampled, gather_records, write_samples
from elflow.lifecycle.outputs import Outputs
from elflow.methods import get_method, require, settings_from_args
from elflow.runs.load import load_for_sampling
from elflow.util.devices import check_device
from elflow.util.distributed import DIST_TIMEOUT_HELP, DIST_TIMEOUT_MINUTES, check_dist_timeout, process_group
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_json, print_result


def add_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT",
                   help="an elflow run folder or checkpoint folder, a released checkpoint_<step> file or its "
                        "folder, or a hub id such as embedded-language-flows/ELF-B-owt-torch")
    add_sampling_arguments(p)
    p.add_argument("--num", "--num-samples", type=int, default=16,
                   help="number of samples, one per source with --source (default 16); under torchrun spell it "
                        "--num-samples, as torchrun takes --num for its own --numa-binding")
    p.add_argument("--length", type=int, default=None, help="positions per sample (default: the model's)")
    p.add_argument("--source", default=None, metavar="FILE.jsonl|TEXT",
                   help="conditional models: the sources to translate / summarise (a .jsonl file or one text)")
    p.add_argument("--source-field", default="input", help="the source field of --source records")
    p.add_argument("--reference-field", default="output", help="the reference field of --source records")
    p.add_argument("--prompt", default=None,
                   help="text held fixed at the start of every sample (continuation); it comes back as the model's "
                        "tokenizer writes it: lowercased by an uncased one such as MiniLM's")
    p.add_argument("--suffix", default=None,
                   help="text held fixed at the end of every sample (infilling); lowercased by an uncased tokenizer, "
                        "as --prompt")
    p.add_argument("--out", default="samples.jsonl", help="JSONL output (one object per sample)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dist-timeout", type=float, default=DIST_TIMEOUT_MINUTES, metavar="MINUTES",
                   help=DIST_TIMEOUT_HELP)
    p.add_argument("--raw-weights", action="store_true", help="use the trained weights instead of the EMA")
    p.add_argument("--encoder", default=None,
                   help="T5 encoder folder or hub id for the released checkpoints (default t5-small)")
    p.add_argument("--trajectory", nargs="*", type=int, default=None, metavar="STEP",
                   help="record how the first batch's samples emerge: the decode readout of the sampler's guess "
                        "at these steps (counted from 1, the first, to N, the last; default: every step), written "
                        "to OUT.trajectory.json (view it with `elflow view`); each recorded step costs one more "
                        "network pass")
    p.add_argument("--html", action="store_true",
                   help="also write the trajectory viewer page OUT.trajectory.html (implies --trajectory)")
    p.add_argument("--quiet", action="store_true", help="do not print the texts")


def run(args) -> int:
    check_sampling_flags(args)  # before the model loads
    check_dist_timeout(args.dist_timeout)
    args.device = check_device(args.device)
    check_samples_out(args.out)
    if args.html and args.trajectory is None:
        args.trajectory = []
    outputs = Outputs(args.overwrite)  # every output checked before any work, written together at the end
    outputs.add(args.out)
    traj_path = Path(args.out).with_suffix(".trajectory.json") if args.trajectory is not None else None
    page_path = Path(args.out).with_suffix(".trajectory.html") if args.html else None
    for extra in (traj_path, page_path):
        if extra is not None:
            outputs.add(extra, "--out")
    if args.length is not None and args.length < 1:
        raise ELFError(f"--length must be >= 1, got {args.length}")
    if args.trajectory and min(args.trajectory) < 1:
        raise ELFError(f"--trajectory steps count from 1 (the first sampling step), got {min(args.trajectory)}")
    # under torchrun: each rank draws its batches
    with process_group(args.device, args.dist_timeout) as (rank, world, device):
        records, meta, space = _sample(args, rank, world, device)
    return 0 if rank else _write(args, outputs, records, meta, space, traj_path, page_path)


def _sample(args, rank: int, world: int, device):
    """(the records of every rank in index order, the settings written with them, the space)."""
    net, space = load_for_sampling(args.checkpoint, device=str(device), space=args.encoder,
                                   use_ema=not args.raw_weights, max_length=args.length)
    record = net.record
    method = get_method(record.method)
    settings = settings_from_args(record, args)
    for flag, value, feature in (("--source", args.source, "pairs"), ("--prompt", args.prompt, "known"),
                                 ("--suffix", args.suffix, "known"), ("--html", args.html or None, "trajectory"),
                                 ("--trajectory", args.trajectory, "trajectory")):
        if value is not None:
            require(method, feature, flag, args.checkpoint)
    trained = record.length
    length = args.length or net.config.max_length
    if length > trained:
        given = f"--length {length}" if args.length is not None else \
            f"the default --length, the network's {length} positions,"
        print(f"warning: {given} is longer than the {trained} positions the model was trained on; "
              "expect poorer samples", file=sys.stderr)
    known, refs = {}, None  # what the samples hold fixed
    if args.source is not None:
        if not record.conditional:
            raise ELFError("this model was not trained on pairs: a source means nothing to it; "
                           "to continue a text, pass --prompt")
        if args.prompt or args.suffix:
            raise ELFError("--source cannot be combined with --prompt or --suffix")
        known["sources"], refs = read_sources(args.source, args.source_field, args.reference_field)
        known["source_length"] = record.source_length
        known["source_slot"] = record.source_slot
        args.num = len(known["sources"])
    elif record.conditional and (args.prompt or args.suffix):
        raise ELFError("this is a conditional model: pass --source, not --prompt / --suffix")
    known.update({k: v for k, v in (("prompt", args.prompt), ("suffix", args.suffix)) if v is not None})
    if args.trajectory is not None:
        n = settings.steps
        bad = sorted(s for s in args.trajectory or [] if not 1 <= s <= n)
        if bad:
            raise ELFError(f"--trajectory steps must lie in 1..{n} (sampling with {n} steps), got {bad}")
        known["trajectory"] = {s - 1 for s in args.trajectory} if args.trajectory else set(range(n))  # 0-based
    records = method.generate(net, space, args.num, settings, args.length, progress=not args.quiet and rank == 0,
                              part=(rank, world), flags=_stored_counts(args, net.origin), **known)
    records = gather_records(records, world)
    for r, ref in zip(records, refs or []):
        if ref is not None:
            r["reference"] = ref
    meta = {**settings.to_dict(), "length": args.length or net.config.max_length, "ema": not args.raw_weights,
            "checkpoint": str(args.checkpoint), **{k: known[k] for k in ("prompt", "suffix") if k in known}}
    return records, meta, space


def _stored_counts(args, origin) -> dict:
    """The counts of the sampling's size check that no flag gave, named by where they come from: the stored
    record's field and its file, or a released model's defaults, and the batch size's default, which is the
    caller's (elflow.util.budget.elf_sampling's `flags`)."""
    path, file = Path(origin.path), origin.record_file
    counts = (("steps", "steps", "sampling.steps", "steps"), ("length", "length", "network.max_length", "length"))
    named = {key: f"record.{field} of {file}" if file else f"the released model's {what} ({path})"
             for flag, key, field, what in counts if getattr(args, flag, None) is None}
    return {**named, **({"batch_size": "the default --batch"} if getattr(args, "batch", None) is None else {})}


def _write(args, outputs: Outputs, records, meta, space, traj_path, page_path) -> int:
    rows = [r.pop("trajectory") for r in records if "trajectory" in r]  # kept apart from the samples file
    check_sampled([r["text"] for r in records], args.checkpoint)
    writers = {outputs.paths[0]: lambda p, overwrite: write_samples(p, records, meta, overwrite)}
    if traj_path is not None:
        seen = [{"step": pts[0]["step"] + 1, "t": pts[0]["t"],
                 **{k: [p[k] for p in pts] for k in ("ids", "shown", "known")},
                 "texts": [p["text"] for p in pts]} for pts in zip(*rows)]  # per recorded step (from 1)
        doc = trajectory_document(space.tokenizer, seen, records[:len(rows)], {**meta, "space": space.space_id})
        writers[outputs.paths[1]] = lambda p, overwrite: atomic_write_json(p, doc, overwrite)
        if page_path is not None:
            writers[outputs.paths[2]] = lambda p, overwrite: write_page(doc, p, overwrite)
    outputs.write(writers)
    shown, said = [], []  # what goes to standard output, then to standard error
    if traj_path is not None:
        shown.append("how sample 0 emerges (decode readout of the guess at each chosen step):")
        m = min(6, len(seen))  # up to six of the recorded steps, spread out, the last one included
        for k in sorted({round(j * (len(seen) - 1) / max(m - 1, 1)) for j in range(m)}):
            shown.append(f"  step {seen[k]['step']:>3} of {meta['steps']} (t = {seen[k]['t']:.3f}): "
                         f"{seen[k]['texts'][0][:200]}")
        said.append(f"wrote the trajectory of {len(rows)} samples x {len(seen)} steps to {traj_path}")
        if page_path is not None:
            said.append(f"wrote {page_path}; open it in a browser")
    if not args.quiet:
        shown += [f"--- sample {r['index']}\n{r['text']}" for r in records]
    written = f"wrote {len(records)} samples to {args.out}"
    if shown:  # (standard output closed: the texts are in --out, as with --quiet)
        print_result("\n".join(shown), written + (f" and their trajectory to {traj_path}" if traj_path else ""),
                     "the texts", "--quiet prints none", closed_ok=True)
    for line in said + [written]:
        print(line, file=sys.stderr)
    return 0

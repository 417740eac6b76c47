"""From a loaded model to texts: `elflow sample`.

    SamplingSettings             the sampler's settings, defined once (sample, eval, sweep, quickstart)
    conditioning(...)            texts -> the positions held fixed: a source, a prompt, a suffix
    generate(net, space, n, s)   -> records {"index", "text", ...}; batch i is seeded by (seed, i)
    write_samples(path, ...)     the one JSONL writer (atomic; every line holds the settings it was made with)
    sample_records(net, ...)     generate, or a token-level baseline's sampler for its settings (sample, eval)

A conditional model's source, an unconditional model's prompt (fixed at the start) and suffix (fixed at the
end) all take one path: their positions are encoded so that known tokens attend only to known tokens, held
at their clean embeddings during sampling (`flow.sample(known=..., known_mask=...)`), and kept as they are in
the output.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from elflow.checkpoint import Loaded, few_step_defaults, load_for_sampling
from elflow.data import encoder_mask, pair_layout
from elflow.flow import SAMPLERS, Recipe, check_sampling_args, decode_tokens, generate_tokens
from elflow.methods import BaselineSampling, sample_records as baseline_records, sampling_settings
from elflow.utils import ELFError, atomic_write, autocast, check_device, check_output

__all__ = ["SamplingSettings", "settings_for", "conditioning", "extract_targets", "generate", "write_samples",
           "add_sampling_arguments", "add_arguments", "run"]


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample: the step count, the step kind and its back-off gamma, the self-conditioning guidance
    omega, the source guidance (conditional models), the time grid, the seed, the batch size and the
    autocast precision."""

    steps: int = 32
    sampler: str = "sde"
    gamma: float = 1.5
    omega: float = 3.0
    guidance: float = 1.0
    grid: str = "logit_normal"
    seed: int = 0
    batch_size: int = 8
    dtype: str = "fp32"
    noise_scale: float = 2.0  # the model's own: z0 = noise_scale N(0, 1), as it was trained
    t_eps: float = 0.05

    def check(self) -> "SamplingSettings":
        try:
            check_sampling_args(self.steps, self.gamma, self.omega, self.guidance, self.sampler)
        except ValueError as e:
            raise ELFError(str(e)) from None
        if self.batch_size < 1:
            raise ELFError(f"the batch size must be >= 1, got {self.batch_size}")
        if self.grid not in ("logit_normal", "uniform"):
            raise ELFError(f"grid must be 'logit_normal' or 'uniform', got {self.grid!r}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


def settings_for(loaded: Loaded, **given) -> SamplingSettings:
    """The model's own defaults (a conditional or distilled model's recipe), overridden by the values given
    (None = not given)."""
    stored = dict(loaded.settings.get("sampling") or {})
    if loaded.settings.get("distilled_steps") or loaded.settings.get("distilled"):
        n = given.get("steps") or loaded.settings.get("distilled_steps") or 8
        stored = {**stored, **few_step_defaults(n)}  # the few-step settings depend on the step count alone
    names = {f.name for f in fields(SamplingSettings)}
    chosen = {k: loaded.recipe[k] for k in ("noise_scale", "t_eps") if k in loaded.recipe}
    chosen.update({k: v for k, v in stored.items() if k in names})
    chosen.update({k: v for k, v in given.items() if k in names and v is not None})
    return replace(SamplingSettings(), **chosen).check()


# ----------------------------------------------------------------------------------------------------------
# known positions


def conditioning(space, length: int, batch: int, sources: list[str] | None = None, source_length: int | None = None,
                 prompt: str | None = None, suffix: str | None = None, device=None):
    """(known ids (B, L) long, known_mask (B, L) bool, known (B, L, C) clean embeddings), or None if nothing
    is held fixed. `sources` (one per row) fill the first positions of a conditional model's rows, cut to
    `source_length`; `prompt` the first positions and `suffix` the last positions of every row."""
    if sources is None and prompt is None and suffix is None:
        return None
    pad = space.pad_id
    if sources is not None:
        if not source_length:
            raise ELFError("this model was not trained on pairs: a source means nothing to it; "
                           "to continue a text, pass --prompt")
        src_ids = space.tokenize(sources, eos=False)
        empty = [i for i, s in enumerate(src_ids) if not s]
        if empty:
            raise ELFError(f"source {empty[0] + 1} is empty (after tokenization); every row needs a source")
        cut = sum(len(s) > source_length for s in src_ids)
        if cut:
            print(f"warning: {cut} of {len(src_ids)} sources are longer than {source_length} tokens and were cut",
                  file=sys.stderr)
        lay = pair_layout(src_ids, [[] for _ in src_ids], length, source_length, pad)
        ids, known_mask = lay["ids"], lay["source_mask"]
    else:
        head = space.tokenize([prompt], eos=False)[0] if prompt else []
        tail = space.tokenize([suffix], eos=False)[0] if suffix else []
        if prompt is not None and not head or suffix is not None and not tail:
            raise ELFError("the prompt or suffix is empty after tokenization")
        if len(head) + len(tail) >= length:
            raise ELFError(f"the prompt and suffix take {len(head) + len(tail)} tokens, but a sample has "
                           f"{length} positions: shorten them or pass a larger --length")
        row = torch.full((length,), pad, dtype=torch.long)
        mask = torch.zeros(length, dtype=torch.bool)
        row[: len(head)] = torch.tensor(head, dtype=torch.long)
        mask[: len(head)] = True
        if tail:
            row[length - len(tail):] = torch.tensor(tail, dtype=torch.long)
            mask[length - len(tail):] = True
        ids, known_mask = row.expand(batch, length).clone(), mask.expand(batch, length).clone()
    ids, known_mask = ids.to(device), known_mask.to(device)
    x = space.encode(ids, encoder_mask(known_mask, known_mask)).float()  # known tokens see only known tokens
    return ids, known_mask, x * known_mask[..., None]


def extract_targets(ids: torch.Tensor, source_len: torch.Tensor, keep: int, eos_id: int) -> torch.Tensor:
    """A conditional model's outputs: each row shifted left by its source length, the first `keep` positions
    kept (positions past the row's end read `eos_id`), every id from the first EOS on set to EOS. (B, keep)."""
    B, L = ids.shape
    pos = source_len.to(ids.device)[:, None] + torch.arange(keep, device=ids.device)[None, :]  # (B, keep)
    out = ids.gather(1, pos.clamp(max=L - 1)).masked_fill(pos >= L, eos_id)
    after = (out == eos_id).long().cumsum(1) > 0
    return out.masked_fill(after, eos_id)


# ----------------------------------------------------------------------------------------------------------
# texts


def _texts(space, ids: torch.Tensor, known_ids, known_mask, source_len, keep: int | None) -> list[str]:
    """Decoded texts: a conditional model's target; otherwise the whole row with the known tokens as given and
    the generated stretch between prompt and suffix cut at its first EOS."""
    if source_len is not None:
        return space.decode(extract_targets(ids, source_len, keep, space.eos_id).cpu())
    if known_mask is None:
        return space.decode(ids.cpu())
    eos = space.eos_id
    texts = []
    for row, k, m in zip(ids.cpu().tolist(), known_ids.cpu().tolist(), known_mask.cpu().tolist()):
        head = m.index(False)
        tail = len(m) - m[::-1].index(False)
        middle = row[head:tail]
        middle = middle[: middle.index(eos)] if eos in middle else middle
        texts.append(space.tokenizer.decode(k[:head] + middle + k[tail:], skip_special_tokens=True))
    return texts


@torch.no_grad()
def generate(net, space, num: int, settings: SamplingSettings = SamplingSettings(), length: int | None = None,
             sources: list[str] | None = None, source_length: int | None = None, prompt: str | None = None,
             suffix: str | None = None, progress: bool = True, trajectory: set[int] | None = None,
             drop_source: bool = False):
    """`num` samples as records {"index", "text"} (+ "source"); with `trajectory` also the decode readout of
    the first batch's guesses at those steps, {step: (t, texts)}. Batch i draws from a generator seeded by
    (seed, i), so the same settings give the same texts in any batch split of the same size.

    `drop_source`: the source-dropped model of a conditional network, as training drops a source: the
    source positions hold zeros for every pass, the readout's included (guidance 0 alone drops the source
    from the denoiser's passes only; the readout still sees it)."""
    settings.check()
    if num < 1:
        raise ELFError(f"the number of samples must be >= 1, got {num}")
    if sources is not None and len(sources) != num:
        raise ELFError(f"{len(sources)} sources for {num} samples")
    trained = net.config.max_length
    length = length or trained
    if length > trained:
        raise ELFError(f"--length {length} exceeds the longest sequence this network covers ({trained})")
    from tqdm.auto import tqdm

    device = next(net.parameters()).device
    records, traj_out = [], {}
    bar = tqdm(total=num, desc="sample", unit="text", disable=not progress, file=sys.stderr)
    for b, start in enumerate(range(0, num, settings.batch_size)):
        bs = min(settings.batch_size, num - start)
        g = torch.Generator(device=device).manual_seed(settings.seed * 100_003 + b)
        batch_sources = sources[start:start + bs] if sources is not None else None
        cond = conditioning(space, length, bs, batch_sources, source_length, prompt, suffix, device)
        known_ids, known_mask, known = cond if cond is not None else (None, None, None)
        if drop_source and known is not None:
            known = torch.zeros_like(known)
        seen = {}

        def keep(i, t, z, x):
            if b == 0 and trajectory and i in trajectory:
                seen[i] = (float(t), x.clone())

        with autocast(device, settings.dtype):
            ids, _ = generate_tokens(net, bs, length, settings.steps, settings.sampler, settings.gamma,
                                     settings.omega, settings.grid, settings.guidance, known, known_mask, g,
                                     Recipe(noise_scale=settings.noise_scale, t_eps=settings.t_eps), device=device,
                                     callback=keep if trajectory else None)
            for i, (t, x) in sorted(seen.items()):
                traj_out[i] = (t, space.decode(decode_tokens(net, x, settings.omega).cpu()))
        if known_mask is not None:
            ids = torch.where(known_mask, known_ids, ids)  # known tokens are given, not generated
        src_len = known_mask.sum(1) if batch_sources is not None else None
        keep_n = length - source_length if batch_sources is not None else None
        for j, text in enumerate(_texts(space, ids, known_ids, known_mask, src_len, keep_n)):
            rec = {"index": start + j, "text": text}
            if batch_sources is not None:
                rec["source"] = batch_sources[j]
            records.append(rec)
        bar.update(bs)
    bar.close()
    return (records, traj_out) if trajectory else records


def sample_records(net, space, num: int, settings, length: int | None = None, progress: bool = True) -> list[dict]:
    """Records {"index", "text"}: ELF's `generate`, or for BaselineSampling settings the baseline's sampler."""
    if isinstance(settings, BaselineSampling):
        return baseline_records(settings.method, net, space, num, settings, length or net.config.max_length)
    return generate(net, space, num, settings, length, progress=progress)


def write_samples(path, records: list[dict], settings: dict, overwrite: bool = True) -> Path:
    """The samples JSONL: one object per sample, {"index", "text", (source, reference), then the settings}.
    Written atomically (a reader never sees half a file)."""
    path = Path(path)
    check_output(path, overwrite)
    with atomic_write(path, "w") as f:
        for r in records:
            f.write(json.dumps({**r, **settings}) + "\n")
    return path


# ----------------------------------------------------------------------------------------------------------
# `elflow sample`


def add_sampling_arguments(p) -> None:
    """The sampler flags; unset ones take the model's own defaults (a conditional or distilled model's),
    else SamplingSettings'."""
    d = SamplingSettings()
    p.add_argument("--steps", type=int, default=None, help=f"sampling steps N (default {d.steps})")
    p.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help=f"ode: Euler; sde: the released SDE-style step; vc: variance-consistent re-noising "
                        f"(default {d.sampler})")
    p.add_argument("--gamma", type=float, default=None, help=f"SDE back-off scale (default {d.gamma})")
    p.add_argument("--omega", type=float, default=None, help=f"self-conditioning guidance scale (default {d.omega})")
    p.add_argument("--guidance", type=float, default=None,
                   help="source guidance of conditional models: v = v_u + g (v_c - v_u) (default 1; 2 for the "
                        "released conditional models)")
    p.add_argument("--grid", choices=["logit_normal", "uniform"], default=None,
                   help=f"time grid (default {d.grid})")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default 0)")
    p.add_argument("--batch", type=int, default=None, help=f"samples per batch (default {d.batch_size})")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="autocast precision (default fp32)")
    p.add_argument("--temperature", type=float, default=None,
                   help="AR and MDLM baselines: divide the logits by this (default 1); --steps sets an MDLM's "
                        "reverse steps (default 64)")
    p.add_argument("--top-p", type=float, default=None, help="AR baselines: nucleus sampling mass (default 1)")


ELF_ONLY_SAMPLING = ("sampler", "gamma", "omega", "guidance", "grid", "dtype")  # flags a baseline's sampler lacks


def sampling_from_args(loaded: Loaded, args):
    """SamplingSettings for an ELF model, BaselineSampling for a baseline; a flag that the model's sampler
    does not take is a one-line error."""
    if loaded.method != "elf":
        given = [n for n in ELF_ONLY_SAMPLING if getattr(args, n, None) is not None]
        if given:
            raise ELFError(f"--{given[0]} applies to ELF models; this is a {loaded.method.upper()} baseline, whose "
                           f"sampler takes {'--temperature and --top-p' if loaded.method == 'ar' else '--steps and --temperature'}")
        return sampling_settings(loaded.method, steps=args.steps, temperature=args.temperature,
                                 top_p=args.top_p, seed=args.seed, batch_size=args.batch)
    for name in ("temperature", "top_p"):
        if getattr(args, name, None) is not None:
            raise ELFError(f"--{name.replace('_', '-')} applies to the AR and MDLM baselines; an ELF model's sampler "
                           "takes --steps, --sampler, --omega, --gamma")
    return settings_for(loaded, steps=args.steps, sampler=args.sampler, gamma=args.gamma, omega=args.omega,
                        guidance=args.guidance, grid=args.grid, seed=args.seed, batch_size=args.batch,
                        dtype=args.dtype)


def read_sources(value: str, field: str = "input", reference_field: str = "output") -> tuple[list[str], list]:
    """--source: a .jsonl file of records (the source in `field`, a reference in `reference_field` if there)
    or one source text. Returns (sources, references or None per row)."""
    path = Path(value).expanduser()
    if not path.suffix == ".jsonl":
        return [value], [None]
    if not path.is_file():
        raise ELFError(f"--source {value}: no such file")
    sources, refs = [], []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ELFError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
            raise ELFError(f"{path}:{n}: no text field {field!r} (pass --source-field)")
        sources.append(obj[field])
        refs.append(obj.get(reference_field))
    if not sources:
        raise ELFError(f"{path} holds no sources")
    return sources, refs


def add_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT",
                   help="an elflow run folder or checkpoint folder, an authors' checkpoint_<step> file or its "
                        "folder, or a hub id such as embedded-language-flows/ELF-B-owt-torch")
    add_sampling_arguments(p)
    p.add_argument("--num", type=int, default=16, help="number of samples (with --source: one per source)")
    p.add_argument("--length", type=int, default=None, help="positions per sample (default: the model's)")
    p.add_argument("--source", default=None, metavar="FILE.jsonl|TEXT",
                   help="conditional models: the sources to translate / summarise (a .jsonl file or one text)")
    p.add_argument("--source-field", default="input", help="the source field of --source records")
    p.add_argument("--reference-field", default="output", help="the reference field of --source records")
    p.add_argument("--prompt", default=None, help="text held fixed at the start of every sample (continuation)")
    p.add_argument("--suffix", default=None, help="text held fixed at the end of every sample (infilling)")
    p.add_argument("--out", default="samples.jsonl", help="JSONL output (one object per sample)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--raw-weights", action="store_true", help="use the trained weights instead of the EMA")
    p.add_argument("--encoder", default=None,
                   help="T5 encoder folder or hub id for the authors' checkpoints (default t5-small)")
    p.add_argument("--trajectory", nargs="*", type=int, default=None, metavar="STEP",
                   help="print the decode readout of the current guess at these steps (default: 6 spread out)")
    p.add_argument("--quiet", action="store_true", help="do not print the texts")


def run(args) -> int:
    args.device = check_device(args.device)
    check_output(args.out, args.overwrite)  # before any work
    if args.length is not None and args.length < 1:
        raise ELFError(f"--length must be >= 1, got {args.length}")
    loaded, space = load_for_sampling(args.checkpoint, device=args.device, space=args.encoder,
                                      use_ema=not args.raw_weights, max_length=args.length)
    settings = sampling_from_args(loaded, args)
    if loaded.method != "elf":
        return _run_baseline(args, loaded, space, settings)
    trained = loaded.settings.get("length") or loaded.net.config.max_length
    if args.length is not None and args.length > trained:
        print(f"warning: --length {args.length} is longer than the {trained} positions the model was trained on; "
              "expect poorer samples", file=sys.stderr)
    source_length = loaded.settings.get("source_length")
    sources = refs = None
    if args.source is not None:
        if not loaded.conditional:
            raise ELFError("this model was not trained on pairs: a source means nothing to it; "
                           "to continue a text, pass --prompt")
        if args.prompt or args.suffix:
            raise ELFError("--source cannot be combined with --prompt or --suffix")
        sources, refs = read_sources(args.source, args.source_field, args.reference_field)
        args.num = len(sources)
    elif loaded.conditional and (args.prompt or args.suffix):
        raise ELFError("this is a conditional model: pass --source, not --prompt / --suffix")
    traj = None
    if args.trajectory is not None:
        n = settings.steps
        traj = set(args.trajectory) if args.trajectory else {round(i * (n - 1) / 5) for i in range(6)}
        bad = [s for s in traj if not 0 <= s < n]
        if bad:
            raise ELFError(f"--trajectory steps must lie in 0..{n - 1}, got {sorted(bad)}")
    net = loaded.net
    out = generate(net, space, args.num, settings, args.length, sources, source_length, args.prompt, args.suffix,
                   progress=not args.quiet, trajectory=traj)
    records, seen = out if traj else (out, {})
    if refs is not None:
        for r, ref in zip(records, refs):
            if ref is not None:
                r["reference"] = ref
    meta = {**settings.to_dict(), "length": args.length or net.config.max_length, "ema": not args.raw_weights,
            "checkpoint": str(args.checkpoint)}
    if args.prompt is not None:
        meta["prompt"] = args.prompt
    if args.suffix is not None:
        meta["suffix"] = args.suffix
    write_samples(args.out, records, meta)
    if seen:
        print("how sample 0 emerges (decode readout of the guess at each chosen step):")
        for i, (t, texts) in sorted(seen.items()):
            print(f"  step {i:>3} (t = {t:.3f}): {texts[0][:200]}")
    if not args.quiet:
        for r in records:
            print(f"--- sample {r['index']}\n{r['text']}")
    print(f"wrote {len(records)} samples to {args.out}", file=sys.stderr)
    return 0


def _run_baseline(args, loaded: Loaded, space, settings: BaselineSampling) -> int:
    """`elflow sample` on a token-level baseline: its sampler, the same JSONL."""
    from elflow.checkpoint import only_elf

    for flag, value in (("--source", args.source), ("--prompt", args.prompt), ("--suffix", args.suffix),
                        ("--trajectory", args.trajectory)):
        if value is not None:
            only_elf(loaded.method, args.checkpoint, flag)
    length = args.length or loaded.net.config.max_length
    records = sample_records(loaded.net, space, args.num, settings, length)
    meta = {**settings.to_dict(), "length": length, "ema": not args.raw_weights, "checkpoint": str(args.checkpoint)}
    write_samples(args.out, records, meta)
    if not args.quiet:
        for r in records:
            print(f"--- sample {r['index']}\n{r['text']}")
    print(f"wrote {len(records)} samples to {args.out}", file=sys.stderr)
    return 0

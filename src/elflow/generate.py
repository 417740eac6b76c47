"""From a network to texts: the one text generator (the settings it takes, elflow.sampler.SamplingSettings, are
imported here too).

Knows nothing of training: a loaded model (elflow.runs.load) and its space are all it needs. A conditional
model's source, a prompt (fixed at the start) and a suffix (fixed at the end) take one path: their positions
are encoded so that known tokens attend only to known tokens, held at their clean embeddings while sampling,
and kept as they are in the output. Batch i draws from a generator seeded by (seed, i).
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import fields
from pathlib import Path

import torch

from elflow.data.layout import PACKED, encoder_mask, pair_layout
from elflow.data.origins import CUT_TEXT, PIECE_CHARS, RUN_CHARS, cut_pieces
from elflow.flow import DISTILLED_STEPS, SAMPLING_DEFAULTS, Recipe, distilled_defaults
from elflow.sampler import GenerationDefaults, SamplingSettings, check_network_dtype, decode_tokens, generate_tokens
from elflow.util.budget import check_elf_sampling
from elflow.util.devices import autocast
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write


def default_sampling(conditional: bool = False, distilled_steps: int | None = None,
                     self_conditioned: bool = True, flow_map_steps: int | None = None) -> GenerationDefaults:
    """The settings a kind of model samples with when no flag is given: a text model's, a conditional model's,
    a progressively distilled model's few-step ones (at its step count), a flow-map student's jumps (at its
    default step count, on a uniform grid), and omega 1 for a network without self-conditioning (nothing for
    omega to guide by). The one statement of these rules."""
    values = dict(SAMPLING_DEFAULTS["conditional" if conditional else "text"])
    if distilled_steps:
        values.update(distilled_defaults(distilled_steps))
    if flow_map_steps:
        values.update(SAMPLING_DEFAULTS["flow-map"], steps=int(flow_map_steps))
    if not self_conditioned:
        values["omega"] = 1.0
    return GenerationDefaults(**values)


# the sampling flags an ELF model's sampler takes (besides --seed and --batch)
ELF_KNOBS = ("steps", "sampler", "gamma", "omega", "guidance", "grid", "dtype")


def settings_for(record, **given) -> SamplingSettings:
    """A model's sampler settings (its record's, elflow.runs.record.RunRecord): its stored defaults with the
    values `given` on top (None = not given); a progressively distilled model's sampler, gamma and omega follow
    the step count it samples with."""
    stored = SamplingSettings(**record.sampling.to_dict())
    pd = record.distillation if record.distillation and record.distillation.objective == "pd" else None
    if pd is not None:
        n = given.get("steps") or pd.student_steps or DISTILLED_STEPS
        stored = stored.replace(**distilled_defaults(n))
    names = {f.name for f in fields(SamplingSettings)}
    bad = sorted(k for k, v in given.items() if k not in names and v is not None)
    if bad:
        raise ELFError(f"unknown sampling setting {bad[0]!r}; the settings are {', '.join(sorted(names))}")
    return stored.replace(**{k: v for k, v in given.items() if v is not None and k in names}).check(record.recipe)


def count_tokens(space, text: str) -> int:
    """How many ids `text` has (no EOS), tokenized piece by piece, each piece cut just before whitespace as
    training cuts long texts (elflow.data.reading.tokenize's pieces, elflow.data.origins.cut_pieces), so that no word is split: the tokenizer holds one
    piece at a time, whatever the text's length."""
    return sum(len(ids) for piece in cut_pieces(text, PIECE_CHARS, CUT_TEXT, RUN_CHARS)
               for ids in space.tokenize([piece], eos=False))


def warn_sources_cut(space, sources: list[str], source_length: int) -> int:
    """One warning (once per command: elflow.cli shows a text once) for the sources longer than the model's
    `source_length` tokens, which are cut to that many as training cuts them: how many, and how many tokens
    go. Returns the number of sources cut."""
    firsts = space.tokenize(sources, eos=False, max_tokens=source_length + 1)  # the cut ones hold one more
    cut = [count_tokens(space, text) for text, ids in zip(sources, firsts) if len(ids) > source_length]
    if cut:
        many = len(cut) != 1
        warnings.warn(f"{len(cut)} of {len(sources)} source{'s' if len(sources) != 1 else ''} "
                      f"{'are' if many else 'is'} longer than the {source_length} source tokens this model was "
                      f"trained with and {'were' if many else 'was'} cut to {source_length} "
                      f"({sum(cut) - len(cut) * source_length} of {sum(cut)} tokens dropped)", stacklevel=2)
    return len(cut)


# ----------------------------------------------------------------------------------------------------------
# known positions
def conditioning(space, length: int, batch: int, sources: list[str] | None = None, source_length: int | None = None,
                 prompt: str | None = None, suffix: str | None = None, device=None, source_slot: str = PACKED):
    """(known ids (B, L) long, known_mask (B, L) bool, known (B, L, C) clean embeddings), or None if nothing
    is held fixed. `sources` (one per row) fill the first positions of a conditional model's rows, cut to
    `source_length` (and padded to it with the "fixed" `source_slot`: the model's stored settings say which);
    `prompt` the first positions and `suffix` the last positions of every row."""
    if sources is None and prompt is None and suffix is None:
        return None
    pad = space.pad_id
    if sources is not None:
        if not source_length:
            raise ELFError("this model was not trained on pairs: a source means nothing to it; "
                           "to continue a text, pass --prompt")
        src_ids = space.tokenize(sources, eos=False, max_tokens=source_length)  # cut where the layout cuts
        empty = [i for i, s in enumerate(src_ids) if not s]
        if empty:
            raise ELFError(f"source {empty[0] + 1} is empty (after tokenization); every row needs a source")
        lay = pair_layout(src_ids, [[] for _ in src_ids], length, source_length, pad, source_slot)
        ids, known_mask = lay["ids"], lay["source_mask"]
    else:
        head = space.tokenize([prompt], eos=False, max_tokens=length)[0] if prompt else []  # (more is refused)
        tail = space.tokenize([suffix], eos=False, max_tokens=length)[0] if suffix else []
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
def _shown(ids: torch.Tensor, known_mask, source_len, keep: int | None, eos: int) -> list[list[int]]:
    """Per row, the positions whose tokens make its text: a conditional model's target (the positions after
    its source, up to the first EOS); otherwise the row up to its first EOS, or with known tokens (a prompt, a
    suffix) all of them, and the generated stretch between them up to its first EOS."""
    if source_len is not None:
        out = extract_targets(ids, source_len, keep, eos).cpu().tolist()
        starts = source_len.cpu().tolist()
        return [list(range(s, s + (r.index(eos) if eos in r else len(r)))) for r, s in zip(out, starts)]
    rows = ids.cpu().tolist()
    if known_mask is None:
        return [list(range(r.index(eos) if eos in r else len(r))) for r in rows]
    shown = []
    for row, m in zip(rows, known_mask.cpu().tolist()):
        head = m.index(False)
        tail = len(m) - m[::-1].index(False)
        middle = row[head:tail]
        end = head + (middle.index(eos) if eos in middle else len(middle))
        shown.append([*range(head), *range(head, end), *range(tail, len(m))])
    return shown


def _texts(space, ids: torch.Tensor, shown: list[list[int]]) -> list[str]:
    """Decoded texts of the shown positions (`_shown`), special tokens skipped."""
    rows = ids.cpu().tolist()
    return space.tokenizer.batch_decode([[r[p] for p in s] for r, s in zip(rows, shown)], skip_special_tokens=True)


def generation_batches(num: int, batch_size: int, seed: int, part: tuple[int, int] = (0, 1)):
    """(batch number, first sample index, rows, seed) of the batches of `num` samples that rank part[0] of
    part[1] draws: every part[1]-th batch of `batch_size` rows. Batch b draws from a generator seeded by
    (seed, b) alone, so the batches of all ranks together are the samples of one process."""
    rank, world = part
    for b, start in enumerate(range(0, num, batch_size)):
        if b % world == rank:
            yield b, start, min(batch_size, num - start), seed * 100_003 + b


def gather_records(records: list[dict], world: int) -> list[dict]:
    """Every rank's records (each with its "index"), on every rank, in the order of their indices."""
    if world > 1:
        import torch.distributed as dist

        parts = [None] * world
        dist.all_gather_object(parts, records)
        records = [r for part in parts for r in part]
    return sorted(records, key=lambda r: r["index"])


def check_generate_args(net, space, settings, sources, prompt, suffix, part, recipe=None, trajectory=None,
                        flags=None) -> None:
    """What `generate` is given, checked before anything is drawn (ELFError naming the first that is wrong): an
    ELF network (a module with its config) whose float32 weights are on cpu or cuda, its embedding space (of the
    network's width), SamplingSettings, sources a list of texts, prompt and suffix texts, part (rank, ranks), a
    Recipe or None, trajectory None or a collection of steps, flags None or a dict of names."""
    config = getattr(net, "config", None)
    if not isinstance(net, torch.nn.Module) or not isinstance(getattr(config, "dim", None), int):
        raise ELFError(f"generate: net must be an ELF network (elflow.load or load_for_sampling gives one), got "
                       f"{type(net).__name__}")
    p = next(net.parameters(), None)
    if p is None or p.device.type not in ("cpu", "cuda"):
        raise ELFError(f"generate: the network's weights are on {p.device if p is not None else 'no device'}; "
                       "elflow samples on cpu or cuda (net.to('cpu'))")
    check_network_dtype(net, "generate")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ELFError(f"generate: recipe must be None (the network's own) or a Recipe, got {type(recipe).__name__}")
    if flags is not None and not (isinstance(flags, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                  for k, v in flags.items())):
        raise ELFError(f"generate: flags must be None or a dict of names (count -> where it comes from), got "
                       f"{type(flags).__name__}")
    if trajectory is not None and not isinstance(trajectory, (set, frozenset, list, tuple)):
        raise ELFError(f"generate: trajectory must be None or a set of sampling steps, got {type(trajectory).__name__}")
    if not all(hasattr(space, a) for a in ("tokenizer", "tokenize", "encode", "eos_id", "dim")):
        raise ELFError(f"generate: space must be the network's embedding space (load_for_sampling gives it), got "
                       f"{type(space).__name__}")
    if space.dim != config.dim:
        raise ELFError(f"generate: the space's vectors have {space.dim} dimensions, the network's {config.dim}: "
                       "pass the space the network was trained in (load_for_sampling gives it)")
    if not isinstance(settings, SamplingSettings):
        raise ELFError(f"generate: settings must be SamplingSettings, got {type(settings).__name__}")
    if sources is not None and (not isinstance(sources, list) or not all(isinstance(x, str) for x in sources)):
        raise ELFError("generate: sources must be a list of texts, one per sample")
    for name, text in (("prompt", prompt), ("suffix", suffix)):
        if text is not None and not isinstance(text, str):
            raise ELFError(f"generate: {name} must be a text, got {type(text).__name__}")
    if not (isinstance(part, (tuple, list)) and len(part) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                              for x in part) and 0 <= part[0] < part[1]):
        raise ELFError(f"generate: part must be (rank, ranks) with 0 <= rank < ranks, got {part!r}")


@torch.no_grad()
def generate(net, space, num: int, settings: SamplingSettings = SamplingSettings(), length: int | None = None,
             sources: list[str] | None = None, source_length: int | None = None, prompt: str | None = None,
             suffix: str | None = None, progress: bool = True, trajectory: set[int] | None = None,
             part: tuple[int, int] = (0, 1), drop_source: bool = False, source_slot: str = PACKED,
             recipe: Recipe | None = None, flags: dict | None = None) -> list[dict]:
    """`num` samples as records {"index", "text"} (+ "source"). With `trajectory` (sampling steps), each record
    of the first batch also holds "trajectory": the decode readout of the sampler's guess at those steps (at
    the last step, of the sample itself), a list of {"step", "t" (the time the guess was made at), "ids" (the
    row's ids, known positions as given), "shown" (the positions its text is made of), "known" (the positions
    held fixed), "text"}. Batch i draws from a generator seeded by (seed, i), so the same settings give the
    same texts in any batch split of the same size; `part` = (rank, ranks) draws only that rank's batches
    (`generation_batches`; `gather_records` puts the ranks' records together).

    `source_slot`: where the targets start, as the model was trained (its record's task). `recipe`: the path's
    constants and the training times the logit-normal grid is drawn from, as the model was trained (its
    record's; default: the released recipe, or the record of a network loaded by elflow.load).
    `drop_source`: the source-dropped model of a conditional network, as training drops a source: the
    source positions hold zeros for every pass, the readout's included (guidance 0 alone drops the source
    from the denoiser's passes only; the readout still sees it). `flags`: where each count of the size check
    comes from, for its message (elflow.util.budget.elf_sampling; default: the flags --steps, --batch, ...)."""
    recipe, length = _checked(net, space, num, settings, length, sources, prompt, suffix, trajectory, part, recipe,
                              flags)
    from tqdm.auto import tqdm

    if sources is not None and source_length and part[0] == 0:
        warn_sources_cut(space, sources, source_length)
    records = []
    batches = list(generation_batches(num, settings.batch_size, settings.seed, part))
    bar = tqdm(total=sum(bs for _, _, bs, _ in batches), desc="sample", unit="text", disable=not progress,
               file=sys.stderr)
    for b, start, bs, seed in batches:
        batch_sources = sources[start:start + bs] if sources is not None else None
        records += _batch(net, space, settings, recipe, length, start, bs, seed, batch_sources, source_length,
                          prompt, suffix, source_slot, drop_source, trajectory if b == 0 else None)
        bar.update(bs)
    bar.close()
    return records


def _checked(net, space, num, settings, length, sources, prompt, suffix, trajectory, part, recipe, flags=None):
    """`generate`'s arguments checked (ELFError naming the first that is wrong) and the size of the work
    against this machine: (the recipe it samples with, the length)."""
    check_generate_args(net, space, settings, sources, prompt, suffix, part, recipe, trajectory, flags)
    if recipe is None:
        record = getattr(net, "record", None)
        recipe = record.recipe if record is not None else Recipe()
    settings.check(recipe)
    if settings.sampler == "map" and not getattr(net.config, "target_time", False):
        raise ELFError("the map sampler jumps with a flow-map student (elflow distill --objective flow-map); this "
                       "network takes no target time: choose --sampler ode, sde or vc")
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ELFError(f"the number of samples must be >= 1, got {num}")
    if sources is not None and len(sources) != num:
        raise ELFError(f"{len(sources)} sources for {num} samples")
    trained = net.config.max_length
    length = trained if length is None else length
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= trained:
        raise ELFError(f"--length must be an integer from 1 to {trained} (the longest sequence this network covers), "
                       f"got {length!r}")
    if trajectory is not None and not all(isinstance(i, int) and 0 <= i < settings.steps for i in trajectory):
        raise ELFError(f"trajectory steps must be integers from 0 to {settings.steps - 1} (0-based sampling steps), "
                       f"got {sorted(trajectory, key=str)[:5]}")
    known = sources is not None or prompt is not None or suffix is not None
    check_elf_sampling(net.config, steps=settings.steps, batch_size=settings.batch_size, num=num, length=length,
                       trajectory_steps=len(trajectory or ()), guided=known and settings.guidance != 1,
                       table_readout=bool(getattr(getattr(net, "options", None), "table_readout", 0)),
                       flags=flags, device=next(net.parameters()).device)
    return recipe, length


def _batch(net, space, settings, recipe, length, start, bs, seed, batch_sources, source_length, prompt, suffix,
           source_slot, drop_source, trajectory) -> list[dict]:
    """The records of one batch of `generate` (rows start .. start + bs, drawn from a generator seeded by
    `seed`); with `trajectory`, each with the readouts of the sampler's guesses at those steps."""
    device = next(net.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    cond = conditioning(space, length, bs, batch_sources, source_length, prompt, suffix, device, source_slot)
    known_ids, known_mask, known = cond if cond is not None else (None, None, None)
    if drop_source and known is not None:
        known = torch.zeros_like(known)
    src_len = known_mask.sum(1) if batch_sources is not None else None
    keep_n = length - source_length if batch_sources is not None else None
    seen = {}

    def keep(i, t, z, x):  # the readout of this step's guess; at the last step of z, which is the sample
        if i in trajectory:
            seen[i] = (float(t), decode_tokens(net, z if i == settings.steps - 1 else x, settings.omega))

    def given(ids):  # known tokens are given, not generated
        return ids if known_mask is None else torch.where(known_mask, known_ids, ids)

    with autocast(device, settings.dtype):
        ids, _ = generate_tokens(net, bs, length, settings.steps, settings.sampler, settings.gamma,
                                 settings.omega, settings.grid, settings.guidance, known, known_mask, g,
                                 recipe, device=device, callback=keep if trajectory else None)
    held = [[] for _ in range(bs)] if known_mask is None else [r.nonzero().flatten().tolist() for r in known_mask]
    readouts = []  # per recorded step, per row: (ids, shown positions, text)
    for i, (t, guess) in sorted(seen.items()):
        guess = given(guess)
        shown = _shown(guess, known_mask, src_len, keep_n, space.eos_id)
        readouts.append((i, t, guess.cpu().tolist(), shown, _texts(space, guess, shown)))
    ids = given(ids)
    shown = _shown(ids, known_mask, src_len, keep_n, space.eos_id)
    records = []
    for j, text in enumerate(_texts(space, ids, shown)):
        rec = {"index": start + j, "text": text}
        if batch_sources is not None:
            rec["source"] = batch_sources[j]
        if readouts:
            rec["trajectory"] = [{"step": i, "t": t, "ids": rows[j], "shown": cols[j], "known": held[j],
                                  "text": texts[j]} for i, t, rows, cols, texts in readouts]
        records.append(rec)
    return records


def write_samples(path, records: list[dict], settings: dict, overwrite: bool = True) -> Path:
    """The samples JSONL: one object per sample, {"index", "text", (source, reference), then the settings}.
    Written atomically (a reader never sees half a file) under the output rule (`elflow.util.files.check_output`: without
    `overwrite` a file at `path` is never replaced, not even one that appeared while the samples were made);
    the caller checks `path` with `check_output` before the work."""
    path = Path(path)
    with atomic_write(path, "w", overwrite) as f:
        for r in records:
            f.write(json.dumps({**r, **settings}) + "\n")
    return path


def check_sampled(texts: list[str], model: str, outcome: str = "nothing is written") -> None:
    """A sample set in which every text is empty gives no score (no Gen-PPL, no MAUVE, a BLEU of nothing): one
    line saying that `model` gave only empty texts, and `outcome` (what became of the output)."""
    if not any(t.strip() for t in texts):
        raise ELFError(f"{model} gives only empty texts (all {len(texts)} samples are empty: a model that ends "
                       f"every sample at once, or weights that are not finite); there is nothing to score: {outcome}")

"""Evaluation: generative perplexity under a judge LM with unigram entropy, BLEU and ROUGE.

The unconditional protocol of the paper, as `protocol="elf"`:
  - drop empty texts (counted); retokenise all remaining texts together with the judge's tokenizer,
    no BOS, truncated to the judge's context (1,024 for GPT-2 Large), right-padded with EOS (pad = EOS)
    to the longest sample of the whole set, so the batch size cannot change the result;
  - NLL of tokens 1..n-1 given their prefix; counted targets: every non-EOS token plus the row's first EOS
    (so a padded sample is also scored on ending, and the longest sample is not);
  - gen_ppl = exp(sum NLL / number of counted targets) over the whole set (token-weighted);
  - entropy = mean over samples of -sum p ln p of the unigram frequencies of each sample's non-pad ids.
Other protocols (docs/evaluation.md compares them): "elf-official" weights targets
as the authors' metric code does (first-EOS flag + non-EOS flag, summed: tokens after an EOS inside a text
count twice); "mdlm" takes the entropy over the whole padded row, EOS padding included, as MDLM/Duo do over
their fixed-length samples.

    load_judge(path_or_id, dtype)             -> (model, tokenizer)
    generative_perplexity(texts, model, tok)  -> {"gen_ppl", "entropy", "num_samples", "num_empty", ...}
    unigram_entropy(ids), bleu(hyps, refs), rouge(hyps, refs), read_texts(path, field)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from elflow.utils import (ELFError, FolderHold, atomic_write_json, check_device, check_output, first_line,
                          hub_reachable, process_group, utf8_lines)

__all__ = [
    "sample_and_score",
    "judge_score",
    "plot_tradeoff",
    "PROTOCOLS",
    "DTYPES",
    "read_texts",
    "unigram_entropy",
    "target_weights",
    "load_judge",
    "judge_context",
    "generative_perplexity",
    "bleu",
    "rouge",
    "mean_and_stderr",
]

PROTOCOLS = ("elf", "elf-official", "mdlm")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------------------------------------
# inputs


def read_texts(jsonl_path: str | os.PathLike, field: str = "text") -> list[str]:
    """The `field` of every line of a JSONL file (as `elflow sample` writes them); blank lines are skipped."""
    path = Path(jsonl_path).expanduser()
    if not path.is_file():
        raise ELFError(f"samples file {str(path)!r} does not exist; pass a .jsonl file written by `elflow sample`")
    texts = []
    for lineno, line in enumerate(utf8_lines(path), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ELFError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object")
        if not isinstance(obj, dict) or field not in obj:
            keys = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ELFError(f"{path}:{lineno}: no {field!r} field (found: {keys}); choose the field with --field")
        if not isinstance(obj[field], str):
            raise ELFError(f"{path}:{lineno}: field {field!r} is {type(obj[field]).__name__}, not a string")
        texts.append(obj[field])
    return texts


def _read_references(path: str | os.PathLike, field: str) -> list[str]:
    """References: a .jsonl file (read from `field`) or a text file with one reference per line."""
    path = Path(path).expanduser()
    if path.suffix in (".jsonl", ".json"):
        return read_texts(path, field)
    if not path.is_file():
        raise ELFError(f"references file {str(path)!r} does not exist")
    lines = utf8_lines(path)
    return [line.rstrip("\r") for line in lines]


# ----------------------------------------------------------------------------------------------------------
# metrics


def unigram_entropy(ids: Sequence[int] | torch.Tensor) -> float:
    """-sum_v p_v ln p_v over the unigram frequencies p_v of the ids (natural log); 0 for no ids."""
    ids = torch.as_tensor(ids).reshape(-1)
    if ids.numel() == 0:
        return 0.0
    _, counts = torch.unique(ids, return_counts=True)
    p = counts.double() / ids.numel()
    return float(-(p * p.log()).sum())


def target_weights(ids: torch.Tensor, eos_id: int, protocol: str = "elf") -> torch.Tensor:
    """(N, L) padded ids -> (N, L-1) weights of the targets ids[:, 1:].

    "elf"/"mdlm": 1 for a non-EOS target or the first EOS of the row, else 0 (MDLM's `first_eos + token_mask`
    on bool tensors is a logical or, which is the same set). "elf-official": [cumulative EOS count == 1] +
    [target != EOS] as integers, so a token between the first and second EOS of a row counts twice.
    """
    is_eos = ids == eos_id
    count = is_eos.cumsum(-1)
    if protocol in ("elf", "mdlm"):
        w = (~is_eos) | (is_eos & (count == 1))
    elif protocol == "elf-official":
        w = (count == 1).long() + (~is_eos).long()
    else:
        raise ELFError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    return w[:, 1:].long()


def bleu(hyps: Sequence[str], refs: Sequence[str] | Sequence[Sequence[str]]) -> float:
    """sacrebleu corpus BLEU, lowercase, effective order. refs: one string per hypothesis, or a list of
    references per hypothesis (all hypotheses must have the same number)."""
    import sacrebleu

    hyps, refs = list(hyps), list(refs)
    if len(hyps) != len(refs):
        raise ELFError(f"{len(hyps)} hypotheses but {len(refs)} references; they must pair up line by line")
    if refs and not isinstance(refs[0], str):
        k = len(refs[0])
        if any(len(r) != k for r in refs):
            raise ELFError("every hypothesis needs the same number of references")
        streams = [[r[j] for r in refs] for j in range(k)]
    else:
        streams = [refs]
    return float(sacrebleu.corpus_bleu(hyps, streams, lowercase=True, use_effective_order=True).score)


def rouge(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, float]:
    """rouge-score ROUGE-1/2/L with the Porter stemmer: mean F1 x 100 over the pairs."""
    from rouge_score import rouge_scorer

    hyps, refs = list(hyps), list(refs)
    if len(hyps) != len(refs):
        raise ELFError(f"{len(hyps)} hypotheses but {len(refs)} references; they must pair up line by line")
    if not hyps:
        raise ELFError("no hypotheses to score")
    keys = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(keys), use_stemmer=True)
    totals = dict.fromkeys(keys, 0.0)
    for h, r in zip(hyps, refs):
        scores = scorer.score(r, h)  # (target, prediction)
        for k in keys:
            totals[k] += scores[k].fmeasure
    return {k: 100.0 * v / len(hyps) for k, v in totals.items()}


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error (sample std / sqrt(n)); no standard error for a single value."""
    v = torch.tensor(list(values), dtype=torch.float64)
    if v.numel() == 0:
        return float("nan"), None
    if v.numel() == 1:
        return float(v[0]), None
    return float(v.mean()), float(v.std(unbiased=True) / math.sqrt(v.numel()))


# ----------------------------------------------------------------------------------------------------------
# the judge


def load_judge(path_or_id: str | os.PathLike, dtype: str = "fp32", device: str | torch.device | None = None):
    """A causal LM and its tokenizer from a local folder or a hub id (never with remote code).

    The tokenizer's pad is set to its EOS (the protocol pads with EOS). dtype: "fp32" or "bf16".
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ELFError(f"judge dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if device is None:
        from elflow.utils import default_device
        device = default_device()
    name = str(path_or_id)
    folder = Path(name).expanduser()
    kw = dict(trust_remote_code=False)
    if folder.is_dir():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype], **kw)
        except Exception as e:  # transformers' own errors, and torch's refusal of pickled weights
            raise ELFError(f"judge folder {str(folder)!r} does not hold a loadable causal LM and tokenizer "
                           f"({first_line(e)}); it needs config.json, safetensors weights and the tokenizer "
                           "files (save_pretrained writes them); pickled weights are never loaded") from None
    elif folder.exists() or name.startswith((".", "/", "~")) or name.endswith(os.sep) or name.count("/") > 1:
        raise ELFError(f"judge folder {name!r} does not exist; pass a folder holding a causal LM and its "
                       "tokenizer, or a hub id such as gpt2-large")
    else:
        def load(local_only: bool):
            tok = AutoTokenizer.from_pretrained(name, local_files_only=local_only, **kw)
            lm = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype], local_files_only=local_only, **kw)
            return lm, tok

        hint = (f"No local folder is called {name!r} and the judge is not in the Hugging Face cache. Without "
                "the hub, train the offline judge (`elflow train-judge --out runs/judge`) and pass "
                "`--judge runs/judge`; its numbers are comparable only with each other, not with GPT-2 Large.")
        try:
            model, tokenizer = load(local_only=True)
        except (OSError, ValueError):
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
            if offline or not hub_reachable():
                raise ELFError(f"cannot load judge {name!r}: the Hugging Face hub is not reachable"
                               f"{' (HF_HUB_OFFLINE is set)' if offline else ''}. {hint}") from None
            try:
                model, tokenizer = load(local_only=False)
            except (OSError, ValueError) as e:
                raise ELFError(f"cannot load judge {name!r} from the hub ({str(e).splitlines()[0]}). {hint}")
    if tokenizer.eos_token_id is None:
        raise ELFError(f"the judge tokenizer of {name!r} has no EOS token; the protocol pads with EOS")
    tokenizer.pad_token = tokenizer.eos_token
    model.eval().to(device)
    return model, tokenizer


def judge_context(model, tokenizer) -> int:
    """The judge's context length: the model's position limit, else the tokenizer's, else 1024."""
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        v = getattr(model.config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    m = getattr(tokenizer, "model_max_length", None)
    return int(m) if isinstance(m, int) and 0 < m < 1_000_000 else 1024


# ----------------------------------------------------------------------------------------------------------
# generative perplexity


@torch.no_grad()
def generative_perplexity(texts: Iterable[str], model, tokenizer, batch_size: int = 8, protocol: str = "elf",
                          max_length: int | None = None, progress: bool = False,
                          part: tuple[int, int] = (0, 1)) -> dict:
    """Generative perplexity and mean unigram entropy of `texts` under a causal LM `model` (see module doc).
    `part` = (rank, ranks) under torchrun: every rank judges every ranks-th batch of the same batches one
    process would judge, and the per-sample sums are added up over the ranks (every rank gets the result).

    Returns gen_ppl, entropy, num_samples (scored), num_empty (skipped), num_tokens (sum of target weights),
    nll_sum, num_truncated, seq_len (the common padded length), max_length, protocol, judge_dtype, and
    per_sample {"nll", "tokens", "entropy", "length"} in the order of the non-empty texts.
    """
    from tqdm.auto import tqdm

    if protocol not in PROTOCOLS:
        raise ELFError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    if batch_size < 1:
        raise ELFError(f"batch size must be at least 1, got {batch_size}")
    texts = list(texts)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ELFError("the judge tokenizer has no EOS token; the protocol pads with EOS")
    max_length = int(max_length or judge_context(model, tokenizer))
    encoded = tokenizer([t for t in texts if t], add_special_tokens=False, verbose=False)["input_ids"] if any(texts) else []
    num_truncated = sum(len(x) > max_length for x in encoded)
    seqs = [x[:max_length] for x in encoded if len(x) > 0]
    num_empty = len(texts) - len(seqs)
    result = {"protocol": protocol, "max_length": max_length, "num_samples": len(seqs), "num_empty": num_empty,
              "num_truncated": num_truncated, "judge_dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
    if not seqs:
        return {**result, "gen_ppl": float("nan"), "entropy": float("nan"), "num_tokens": 0, "nll_sum": 0.0,
                "seq_len": 0, "per_sample": {"nll": [], "tokens": [], "entropy": [], "length": []}}

    # one padded matrix for the whole set: (N, L), EOS-padded on the right
    lengths = torch.tensor([len(s) for s in seqs])
    L = int(lengths.max())
    ids = torch.full((len(seqs), L), eos, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    weights = target_weights(ids, eos, protocol)  # (N, L-1)

    if protocol == "mdlm":
        entropies = [unigram_entropy(row) for row in ids]
    else:
        entropies = [unigram_entropy(row[:n]) for row, n in zip(ids, lengths.tolist())]

    # Every weight past a row's first pad position is zero and the judge is causal, so each batch only needs
    # its columns up to (longest row in the batch) + 1; longest rows first so memory peaks at once.
    device = next(model.parameters()).device
    order = torch.argsort(lengths, descending=True, stable=True)
    nll_sum = torch.zeros(len(seqs), dtype=torch.float64)
    rank, world = part
    mine = range(rank * batch_size, len(seqs), world * batch_size)
    for start in tqdm(mine, disable=not progress, desc="judging", unit="batch"):
        idx = order[start:start + batch_size]
        width = min(int(lengths[idx].max()) + 1, L)
        rows = ids[idx, :width].to(device)  # (b, width)
        attn = (torch.arange(width)[None, :] < lengths[idx][:, None]).long().to(device)
        logits = model(input_ids=rows, attention_mask=attn).logits  # (b, width, V)
        nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), rows[:, 1:], reduction="none")  # (b, width-1)
        w = weights[idx, :width - 1].to(device)
        nll = torch.where(w > 0, nll, torch.zeros_like(nll))  # a masked pad position may hold inf/nan
        nll_sum[idx] = (nll.double() * w).sum(-1).cpu()
    if world > 1:  # each sample's sum comes from one rank, zeros from the others: the sum is exact
        import torch.distributed as dist

        summed = nll_sum.to(device)
        dist.all_reduce(summed)
        nll_sum = summed.cpu()
    tokens = weights.sum(-1)  # (N,)
    total_nll, total_tokens = float(nll_sum.sum()), int(tokens.sum())
    gen_ppl = math.exp(total_nll / total_tokens) if total_tokens > 0 else float("nan")
    return {**result, "gen_ppl": gen_ppl, "entropy": float(sum(entropies) / len(entropies)),
            "num_tokens": total_tokens, "nll_sum": total_nll, "seq_len": L,
            "per_sample": {"nll": nll_sum.tolist(), "tokens": tokens.tolist(), "entropy": entropies,
                           "length": lengths.tolist()}}


# ----------------------------------------------------------------------------------------------------------
# command line


def sample_and_score(method, net, space, num: int, settings, score, path=None, meta: dict | None = None,
                     length: int | None = None, references=None, progress: bool = False, overwrite: bool = True,
                     part: tuple[int, int] = (0, 1), **known) -> tuple[list[dict], dict]:
    """Sample, write, judge: `num` samples of `net` with `settings` (its method's, elflow.methods: an ELF model's
    SamplingSettings or a baseline's BaselineSampling; `known`: sources, prompt, suffix), each with its
    reference if given, written to `path` (if any) with the settings and `meta` (generate.write_samples), and
    `score(texts)`. Returns (records, the score). `part` = (rank, ranks) under torchrun: each rank draws its
    batches, every rank gets all the records (rank 0 alone writes them) and scores them (a sharded judge)."""
    from elflow.generate import gather_records, write_samples

    records = method.sample(net, space, num, settings, length, progress=progress and part[0] == 0, part=part,
                            **known)
    records = gather_records(records, part[1])
    for r, ref in zip(records, references or []):
        r["reference"] = ref
    if path is not None and part[0] == 0:
        write_samples(path, records, {**settings.to_dict(), **(meta or {})}, overwrite=overwrite)
    return records, score([r["text"] for r in records])


def judge_score(model, tokenizer, batch_size: int = 8, protocol: str = "elf", max_length=None,
                progress: bool = False, part: tuple[int, int] = (0, 1)):
    """A `score` for sample_and_score: the generative_perplexity result without its per-sample lists."""
    return lambda texts: _public(generative_perplexity(texts, model, tokenizer, batch_size, protocol, max_length,
                                                       progress=progress, part=part))


def plot_tradeoff(curves: list[dict], path, title: str, xlabel: str, ylabel: str, reference=(),
                  log_y: bool | None = None, shade_below: float | None = None):
    """Quality against diversity: one line per curve {"label", "points": [(x, y, annotation)], "dashed"},
    its points in the order given and annotated; `reference` points (label, x, y) as stars (held-out text).
    `log_y` None: a log scale when the values span more than a factor of 5. `shade_below`: the x below which
    samples are degenerate, shaded when it lies inside the plot. Written atomically; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from elflow.utils import atomic_write

    fig, ax = plt.subplots(figsize=(7, 5))
    for i, c in enumerate(curves):
        xs, ys = [p[0] for p in c["points"]], [p[1] for p in c["points"]]
        ax.plot(xs, ys, marker="s" if c.get("dashed") else "o", linestyle="--" if c.get("dashed") else "-",
                color=f"C{i}", label=c["label"])
        for x, y, note in c["points"]:
            ax.annotate(note, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=f"C{i}")
    for label, x, y in reference:
        ax.scatter([x], [y], marker="*", s=120, color="black", label=label, zorder=3)
    ys = [p[1] for c in curves for p in c["points"]] + [y for _, _, y in reference]
    if log_y or (log_y is None and ys and max(ys) / max(min(ys), 1e-9) > 5):
        ax.set_yscale("log")
    x0, x1 = ax.get_xlim()
    if shade_below is not None and x0 < shade_below < x1:
        ax.axvspan(x0, shade_below, color="0.92", zorder=0, label=f"entropy < {shade_below:g} (degenerate)")
        ax.set_xlim(x0, x1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return path


def heldout_texts(checkpoint, num: int, cache_dir=None) -> tuple[list[str], str]:
    """(texts, what they are): `num` rows of the held-out split of the data the elflow run, checkpoint or model
    folder `checkpoint` was trained on, at its length, decoded by its tokenizer and cut at the first EOS as
    samples are. ELFError saying why when there are none (an authors' checkpoint, a conditional model, data that
    cannot be read from here)."""
    from elflow.checkpoint import stored_training
    from elflow.encoders import build_space
    from elflow.runconfig import TrainConfig
    from elflow.train import run_data

    stored = stored_training(checkpoint) if checkpoint else None
    train = (stored or {}).get("train") or {}
    if "data" not in train:
        raise ELFError("the model records no training data elflow can read")
    cfg = TrainConfig.from_dict(train).resolved()
    if cfg.source_length:
        raise ELFError("a conditional model's held-out text is a task's references (--task)")
    spec = stored["space"]
    space = build_space(spec if spec.get("kind") == "tokens" else {"kind": "tokens", "of": spec})
    length = cfg.length or stored["settings"].get("length")
    try:
        _, val = run_data(cfg, space, length, cache_dir)
    except (ELFError, OSError) as e:
        raise ELFError(f"its training data {cfg.data!r} cannot be read here ({e})") from None
    if len(val) == 0:
        raise ELFError("the run held out no data (--val-fraction 0)")
    texts = space.decode(val.tokens[:num])
    return texts, f"{len(texts)} rows of {length} tokens of the held-out split of {cfg.data}"


def _judge_identity(judge: str) -> dict:
    """What tells two judges apart in the cache key: a folder's path and its files' sizes and times, or a hub
    id."""
    folder = Path(judge).expanduser()
    if folder.is_dir():
        return {"folder": str(folder.resolve()),
                "files": sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()
                                if p.is_file())}
    return {"hub": judge}


def judged_heldout(texts: list[str], judge_name: str, judge, settings: dict, cache_dir=None,
                   progress: bool = False) -> dict:
    """The judge's figures of held-out `texts` (generative_perplexity without the per-sample lists), cached
    under <cache>/judged by the texts, the judge and the counting settings."""
    from elflow.utils import cache_root

    digest = hashlib.sha256()
    for t in texts:
        digest.update(t.encode("utf-8", "surrogatepass") + b"\0")
    key = hashlib.sha256(json.dumps({"texts": digest.hexdigest(), "judge": _judge_identity(judge_name),
                                     **settings}, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_root(cache_dir) / "judged" / f"{key}.json"
    try:
        return {**json.loads(path.read_text()), "cached": True}
    except (OSError, ValueError):
        pass
    model, tok = judge
    res = _public(generative_perplexity(texts, model, tok, settings["batch_size"], settings["protocol"],
                                        settings["max_length"], progress=progress))
    atomic_write_json(path, res)
    return {**res, "cached": False}


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
    from elflow.tracking import Tracker

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
    from elflow.generate import add_sampling_arguments

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
    p.add_argument("--references", help="references for --task translation/summarization: a .jsonl file "
                   "(--reference-field) or a text file with one reference per line")
    p.add_argument("--reference-field", default=None,
                   help="JSONL field of the references (default: text; output for a pairs FILE.jsonl)")
    p.add_argument("--source-field", default="input", help="the source field of a pairs FILE.jsonl")
    g = p.add_argument_group("judge")
    g.add_argument("--judge", default="gpt2-large",
                   help="hub id or local folder with a causal LM and its tokenizer (offline: `elflow train-judge`)")
    g.add_argument("--judge-dtype", choices=tuple(DTYPES), default="fp32", help="judge precision")
    g.add_argument("--batch-size", type=int, default=8, help="judge batch size (does not change the result)")
    g.add_argument("--protocol", choices=PROTOCOLS, default="elf",
                   help="elf: the paper's; elf-official: the authors' target weights; mdlm: MDLM/Duo entropy")
    g.add_argument("--max-length", type=int, default=None, help="truncation length (default: judge context)")
    g.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    o.add_argument("--report", default=None, help="report file (default: next to the samples, or in --out)")
    s = p.add_argument_group("generate first (instead of SAMPLES)")
    s.add_argument("--checkpoint", default=None, help="run folder, checkpoint or hub id to sample from")
    s.add_argument("--num", "--num-samples", type=int, default=1000,
                   help="samples per seed, examples for conditional tasks (default 1000); under torchrun spell it "
                        "--num-samples")
    s.add_argument("--length", type=int, default=None, help="sequence length (default: the model's)")
    add_sampling_arguments(s)
    s.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="one sample set per seed; mean +- s.e. (default: --seed, else 0)")
    s.add_argument("--out", default=None, help="folder for the samples and the report")
    s.add_argument("--encoder", default=None,
                   help="T5 encoder folder or hub id for the authors' checkpoints (default t5-small)")
    o.add_argument("--overwrite", action="store_true", help="replace an existing report (and samples with --checkpoint)")
    g.add_argument("--heldout", action=argparse.BooleanOptionalAction, default=True,
                   help="also judge as many rows of the held-out split of the data the model was trained on (an "
                        "elflow run's; cached per judge and data) and print them beside the samples' figures "
                        "(default: on)")
    g.add_argument("--cache-dir", default=None, help="tokenization and held-out judging cache "
                                                     "(default: $ELFLOW_CACHE or ~/.cache/elflow)")
    from elflow.tracking import add_arguments as add_tracking

    add_tracking(p)


def _sampled_from(samples_path) -> str | None:
    """The model a samples file was drawn from (the "checkpoint" that `elflow sample` writes in each line)."""
    try:
        with open(Path(samples_path).expanduser(), encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        value = json.loads(first).get("checkpoint") if first else None
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _settings(args) -> dict:
    return {"judge": str(args.judge), "judge_dtype": args.judge_dtype, "batch_size": args.batch_size,
            "protocol": args.protocol}


def _public(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "per_sample"}


def _emit(report: dict, path: Path, as_json: bool, summary: str, args=None, tables: dict | None = None) -> None:
    """Write the report, print it (as JSON, or `summary`), and with --wandb log it (`tables`: see _track)."""
    clean = json.loads(json.dumps(report, default=str), parse_constant=lambda c: None)
    atomic_write_json(path, clean, bool(getattr(args, "overwrite", False)))
    if as_json:
        print(json.dumps(clean))
    else:
        print(summary)
        print(f"report: {path}")
    if args is not None and getattr(args, "wandb", None):
        _track(args, path.parent, clean, tables or {}, "eval")


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


def _run_text_task(args) -> int:
    if not args.samples:
        raise ELFError(f"--task {args.task} needs a SAMPLES.jsonl file of hypotheses")
    hyps = read_texts(args.samples, args.field)
    _check_texts(hyps, args.samples)
    if args.references is None:
        raise ELFError(f"--task {args.task} needs --references FILE (.jsonl or one reference per line)")
    refs = _read_references(args.references, args.reference_field or "text")
    if len(refs) != len(hyps):
        raise ELFError(f"{args.samples} has {len(hyps)} hypotheses but {args.references} has {len(refs)} "
                       "references; they must pair up line by line")
    if args.task == "translation":
        res = {"bleu": bleu(hyps, refs), "tokenize": "13a", "lowercase": True, "effective_order": True}
        summary = f"BLEU {res['bleu']:.2f} ({len(hyps)} pairs)"
    else:
        res = {**rouge(hyps, refs), "stemmer": True, "f1_x100": True}
        summary = f"ROUGE-1 {res['rouge1']:.2f}  ROUGE-2 {res['rouge2']:.2f}  ROUGE-L {res['rougeL']:.2f}"
    report = {"task": args.task, **res, "num_pairs": len(hyps), "samples": str(args.samples),
              "references": str(args.references)}
    path = Path(args.report) if args.report else Path(args.samples).with_suffix(f".{args.task}.json")
    check_output(path, args.overwrite, "--report")
    _emit(report, path, args.json, summary, args)
    return 0


def _score(metric: str, hyps: list[str], refs: list[str]) -> tuple[dict, str]:
    if metric == "bleu":
        res = {"bleu": bleu(hyps, refs), "tokenize": "13a", "lowercase": True, "effective_order": True}
        return res, f"BLEU {res['bleu']:.2f} ({len(hyps)} pairs)"
    res = {**rouge(hyps, refs), "stemmer": True, "f1_x100": True}
    return res, f"ROUGE-1 {res['rouge1']:.2f}  ROUGE-2 {res['rouge2']:.2f}  ROUGE-L {res['rougeL']:.2f}"


def _validation_pairs(task: str, num: int, source_field: str, reference_field: str) -> tuple[list, list]:
    from elflow.data import read_pairs
    from elflow.generate import read_sources

    if task.endswith(".jsonl"):
        sources, refs = read_sources(task, source_field, reference_field)
        if any(r is None for r in refs):
            raise ELFError(f"{task}: every record needs a reference in {reference_field!r}")
    else:
        pairs = list(read_pairs(task, split="validation", max_documents=num))
        sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    return sources[:num], refs[:num]


def _run_conditional_task(args, part: tuple[int, int] = (0, 1)) -> int:
    from elflow.checkpoint import load_for_sampling
    from elflow.data import PAIR_TASKS
    from elflow.methods import settings_from_args

    task = args.task
    if task not in PAIR_TASKS and not task.endswith(".jsonl"):
        raise ELFError(f"unknown --task {task!r}: choose unconditional, translation, summarization, "
                       f"{', '.join(PAIR_TASKS)} or a FILE.jsonl of pairs")
    if args.checkpoint is None:
        raise ELFError(f"--task {task} generates first: pass --checkpoint RUN (a conditional model)")
    if args.num < 1:
        raise ELFError(f"--num must be >= 1, got {args.num}")
    metric = args.metric or (PAIR_TASKS[task]["metric"] if task in PAIR_TASKS else "bleu")
    ckpt = Path(args.checkpoint).expanduser()
    out = Path(args.out) if args.out else (ckpt if ckpt.is_dir() else Path("eval-" + ckpt.name)) / "eval"
    name = Path(task).stem if task.endswith(".jsonl") else task
    samples_path, report_path = out / f"{name}.samples.jsonl", Path(args.report or out / f"{name}.{metric}.json")
    for path in (samples_path, report_path):
        check_output(path, args.overwrite)
    sources, refs = _validation_pairs(task, args.num, args.source_field, args.reference_field or "output")
    loaded, space = load_for_sampling(args.checkpoint, device=args.device, space=args.encoder)
    if not loaded.conditional:
        raise ELFError(f"{args.checkpoint} is not a conditional model (it was not trained on pairs); "
                       f"--task {task} needs one")
    settings = settings_from_args(loaded, args)
    with _hold(out, part):
        return _conditional_task(args, task, metric, loaded, space, settings, sources, refs, samples_path,
                                 report_path, part)


def _hold(out: Path, part: tuple[int, int]):
    """The lock on an eval folder, taken by the rank that writes it (rank 0)."""
    from contextlib import nullcontext

    return FolderHold(out, "elflow eval") if part[0] == 0 else nullcontext()


def _conditional_task(args, task, metric, loaded, space, settings, sources, refs, samples_path, report_path,
                      part) -> int:
    from elflow.methods import get_method

    t0 = time.time()
    records, (res, summary) = sample_and_score(
        get_method(loaded.method), loaded.net, space, len(sources), settings, lambda texts: _score(metric, texts, refs),
        samples_path, {"checkpoint": str(args.checkpoint)}, args.length, refs, progress=not args.json,
        overwrite=args.overwrite, part=part, sources=sources, source_length=loaded.settings["source_length"],
        source_slot=loaded.settings.get("source_slot", "packed"))
    report = {"task": task, "metric": metric, **res, "num_examples": len(records), **settings.to_dict(),
              "checkpoint": str(args.checkpoint), "samples": str(samples_path), "seconds": time.time() - t0}
    if part[0] == 0:
        _emit(report, report_path, args.json, f"{summary}  ({len(records)} examples, {settings.sampler}, "
              f"{settings.steps} steps, guidance {settings.guidance:g}, omega {settings.omega:g})", args,
              {"examples": (["source", "output", "reference"],
                            [[r.get("source"), r["text"], r.get("reference")] for r in records[:100]])})
    return 0


def run(args) -> int:
    args.device = check_device(args.device)
    if args.wandb:
        from elflow.tracking import require

        require()
    if args.task in TEXT_TASKS:
        return _run_text_task(args)
    if args.task == "unconditional" and (args.samples is None) == (args.checkpoint is None):
        raise ELFError("pass either SAMPLES.jsonl to judge, or --checkpoint RUN to sample first (not both)")
    with process_group(args.device) as (rank, world, device):  # under torchrun: sampling and judging sharded
        args.device = str(device)
        if args.task != "unconditional":
            return _run_conditional_task(args, (rank, world))
        return _run_unconditional(args, (rank, world))


def _run_unconditional(args, part: tuple[int, int]) -> int:
    t0 = time.time()
    main = part[0] == 0
    if args.samples is not None:
        texts = read_texts(args.samples, args.field)  # before loading the judge: fail fast on bad input
        _check_texts(texts, args.samples)
        check_output(Path(args.report) if args.report else Path(args.samples).with_suffix(".eval.json"),
                     args.overwrite, "--report")
        model, tok = load_judge(args.judge, args.judge_dtype, args.device)
        res = generative_perplexity(texts, model, tok, args.batch_size, args.protocol, args.max_length,
                                    progress=not args.json and main, part=part)
        _check_result(res, args.samples)
        held = _heldout(args, _sampled_from(args.samples), len(texts), (model, tok), main)
        report = {**_public(res), **_settings(args), "samples": str(args.samples), "seconds": time.time() - t0,
                  **({"heldout": held} if held else {})}
        path = Path(args.report) if args.report else Path(args.samples).with_suffix(".eval.json")
        if main:
            _emit(report, path, args.json, "\n".join(filter(None, [f"samples: {_format(res)}",
                                                                  _heldout_line(held)])), args)
        return 0

    from elflow.checkpoint import load_for_sampling
    from elflow.methods import settings_from_args

    loaded, space = load_for_sampling(args.checkpoint, device=args.device, space=args.encoder,
                                      max_length=args.length)
    settings = settings_from_args(loaded, args)
    seeds = args.seeds or [settings.seed]
    ckpt = Path(args.checkpoint).expanduser()
    out = (Path(args.out) if args.out else (ckpt if ckpt.is_dir() else Path("eval-" + ckpt.name)) / "eval"
           / settings.tag())
    report_path = Path(args.report) if args.report else out / "report.json"
    for path in [report_path] + [out / f"samples_seed{seed}.jsonl" for seed in seeds]:
        check_output(path, args.overwrite)
    with _hold(out, part):
        return _sample_and_judge(args, loaded, space, settings, seeds, out, report_path, t0, part)


def _sample_and_judge(args, loaded, space, settings, seeds, out, report_path, t0, part) -> int:
    from elflow.methods import get_method

    main = part[0] == 0
    model, tok = load_judge(args.judge, args.judge_dtype, args.device)
    judge = judge_score(model, tok, args.batch_size, args.protocol, args.max_length, part)
    per_seed = []
    for seed in seeds:
        _, res = sample_and_score(get_method(loaded.method), loaded.net, space, args.num, replace(settings, seed=seed),
                                  judge, out / f"samples_seed{seed}.jsonl", {"checkpoint": str(args.checkpoint)},
                                  args.length, progress=not args.json, overwrite=args.overwrite, part=part)
        _check_result(res, f"seed {seed} ({out / f'samples_seed{seed}.jsonl'})")
        per_seed.append({"seed": seed, **res})
        if not args.json and main:
            print(f"seed {seed}: {_format(res)}")
    ppl, ppl_se = mean_and_stderr([r["gen_ppl"] for r in per_seed])
    ent, ent_se = mean_and_stderr([r["entropy"] for r in per_seed])
    report = {"gen_ppl": ppl, "gen_ppl_stderr": ppl_se, "entropy": ent, "entropy_stderr": ent_se,
              "num_samples": sum(r["num_samples"] for r in per_seed), "num_empty": sum(r["num_empty"] for r in per_seed),
              "num_tokens": sum(r["num_tokens"] for r in per_seed), "num_seeds": len(per_seed), **_settings(args),
              "checkpoint": str(args.checkpoint), "method": loaded.method, "num": args.num, "length": args.length,
              **settings.to_dict(),
              "seeds": list(seeds), "per_seed": per_seed, "seconds": time.time() - t0}
    held = _heldout(args, args.checkpoint, args.num, (model, tok), main)
    if held:
        report["heldout"] = held
    se = lambda x: f" +- {x:.3f}" if x is not None else ""  # noqa: E731
    summary = (f"samples: gen_ppl {ppl:.3f}{se(ppl_se)}  entropy {ent:.4f}{se(ent_se)}  over {len(per_seed)} "
               f"seed(s) ({settings.describe()})")
    columns = ["seed", "gen_ppl", "entropy", "num_samples", "num_empty", "num_tokens"]
    if main:
        _emit(report, report_path, args.json, "\n".join(filter(None, [summary, _heldout_line(held)])), args,
              {"per_seed": (columns, [[r[c] for c in columns] for r in per_seed])})
    return 0

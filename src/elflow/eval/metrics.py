"""The paper's metrics: generative perplexity under a judge with its token weights, unigram entropy, BLEU and
ROUGE, and reading samples files. docs/evaluation.md states the protocol."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from elflow.util import jsonio
from elflow.util.devices import AUTOCAST_DTYPES
from elflow.util.errors import ELFError

PROTOCOLS = ("elf", "elf-released", "mdlm")
PROTOCOL_ALIASES = {"elf-official": "elf-released"}  # an earlier name, still read


def protocol_of(name: str) -> str:
    """A protocol's name, an earlier alias read as the name it now has."""
    return PROTOCOL_ALIASES.get(name, name)


DTYPES = dict(zip(AUTOCAST_DTYPES, (torch.float32, torch.bfloat16)))  # the judge's precisions


# ----------------------------------------------------------------------------------------------------------
# inputs
MAX_TEXTS_BYTES = 1 << 30  # a samples or references file, whose texts are all held in memory


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"))


def check_input_file(path: Path, what: str, hint: str) -> Path:
    """`path` as an input file that can be read: one line naming `what` and the path for one that does not
    exist, cannot be examined, or is a folder, a device, a fifo or a socket (never opened: reading one would
    block or never end), then `hint` (what to pass instead)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise ELFError(f"{what} {str(path)!r} does not exist; {hint}") from None
    except OSError as e:
        raise ELFError(f"{what} {str(path)!r} cannot be read ({e.strerror or e}); {hint}") from None
    for test, kind in _KINDS:
        if test(mode):
            raise ELFError(f"{what} {str(path)!r} is {kind}, not a regular file; {hint}")
    return path


def read_texts(jsonl_path: str | os.PathLike, field: str = "text") -> list[str]:
    """The `field` of every line of a JSONL file (as `elflow sample` writes them); blank lines are skipped. The
    file is read by the bounded reader (elflow.util.jsonio): a regular file of at most MAX_TEXTS_BYTES, each
    line at most jsonio.MAX_LINE_BYTES; a line that is binary, not UTF-8, not JSON, nested too deeply or holds a
    huge integer is one error naming the file and the line."""
    path = check_input_file(Path(jsonl_path).expanduser(), "samples file",
                            "pass a .jsonl file written by `elflow sample`")
    texts = []
    for lineno, obj in jsonio.iter_jsonl(path, max_bytes=MAX_TEXTS_BYTES, allow_nonfinite=True):
        if not isinstance(obj, dict) or field not in obj:
            keys = ", ".join(obj)[:200] if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
            raise ELFError(f"{path} line {lineno}: no {field!r} field (found: {keys}); choose the field with --field")
        if not isinstance(obj[field], str):
            raise ELFError(f"{path} line {lineno}: field {field!r} is {type(obj[field]).__name__}, not a string")
        texts.append(obj[field])
    return texts


def read_references(path: str | os.PathLike, field: str) -> list[str]:
    """References: a .jsonl file (read from `field`) or a UTF-8 text file with one reference per line, each
    read by the bounded reader (at most MAX_TEXTS_BYTES)."""
    path = check_input_file(Path(path).expanduser(), "references file",
                            "pass a .jsonl file or a text file with one reference per line")
    if path.suffix in (".jsonl", ".json"):
        return read_texts(path, field)
    data = jsonio.read_limited(path, MAX_TEXTS_BYTES, "references")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ELFError(f"{path} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); elflow "
                       "reads UTF-8: convert the file (iconv -f latin1 -t utf-8)") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
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
    on bool tensors is a logical or, which is the same set). "elf-released": [cumulative EOS count == 1] +
    [target != EOS] as integers, so a token between the first and second EOS of a row counts twice.
    """
    is_eos = ids == eos_id
    count = is_eos.cumsum(-1)
    protocol = protocol_of(protocol)
    if protocol in ("elf", "mdlm"):
        w = (~is_eos) | (is_eos & (count == 1))
    elif protocol == "elf-released":
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

    protocol = protocol_of(protocol)
    if protocol not in PROTOCOLS:
        raise ELFError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    if batch_size < 1:
        raise ELFError(f"batch size must be at least 1, got {batch_size}")
    texts = list(texts)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ELFError("the judge tokenizer has no EOS token; the protocol pads with EOS")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ELFError(f"max_length must be an integer >= 1 (judge tokens kept per text), got {max_length!r}")
    max_length = int(max_length or judge_context(model, tokenizer))
    kept = [t for t in texts if t]
    encoded = tokenizer(kept, add_special_tokens=False, verbose=False)["input_ids"] if kept else []
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


def judge_score(model, tokenizer, batch_size: int = 8, protocol: str = "elf", max_length=None,
                progress: bool = False, part: tuple[int, int] = (0, 1)):
    """A `score` for sample_and_score: the generative_perplexity result without its per-sample lists."""
    return lambda texts: summary_of(generative_perplexity(texts, model, tokenizer, batch_size, protocol, max_length,
                                                       progress=progress, part=part))


def summary_of(result: dict) -> dict:
    """A judge's figures without their per-sample lists (what reports and tables keep)."""
    return {k: v for k, v in result.items() if k != "per_sample"}

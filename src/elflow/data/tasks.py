"""TODO."""

from __future__ import annotations
import json
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_text


# Conditional data sets on the hub: name -> (dataset id, config, default split, (source, target) getter).
PAIR_PRESETS = {
    "wmt14": ("wmt14", "de-en", lambda ex: (ex["translation"]["de"], ex["translation"]["en"])),
    "wmt14-de-en": ("wmt14", "de-en", lambda ex: (ex["translation"]["de"], ex["translation"]["en"])),
    "xsum": ("EdinburghNLP/xsum", None, lambda ex: (ex["document"], ex["summary"])),
}


# named conditional tasks: hub data, layout and the recipe values that differ from OpenWebText's
PAIR_TASKS = {
    "wmt14-de-en": {"data": "wmt14-de-en", "length": 128, "source_length": 64, "decode_noise_scale": 1.0,
                    "warmup": 5000, "metric": "bleu",
                    "pretokenized": "embedded-language-flows/wmt14_de-en_{split}_t5"},
    "xsum": {"data": "xsum", "length": 1088, "source_length": 1024, "decode_noise_scale": 1.0, "warmup": 5000,
             "metric": "rouge", "pretokenized": "embedded-language-flows/xsum_{split}_t5"},
}


def shuffled_line_pairs(docs: list[str], min_words: int = 4, max_words: int = 14, every: int = 50,
                        seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """A conditional task made from plain text: each line of `min_words`..`max_words` words is a target, its
    words in a random order (fixed by `seed` and the line's index) the source. Returns (train, held out):
    every `every`-th line is held out."""
    import random

    lines = [" ".join(l.split()) for d in docs for l in d.splitlines()]
    lines = [l for l in lines if min_words <= len(l.split()) <= max_words]
    train, held = [], []
    for i, line in enumerate(lines):
        words = line.split()
        random.Random(seed * 1_000_003 + i).shuffle(words)
        (held if i % every == every - 1 else train).append((" ".join(words), line))
    return train, held


def pretokenized_pairs(rows, name: str = "data") -> tuple[list[list[int]], list[list[int]]]:
    """(sources, targets) ids from records of the authors' pre-tokenized sets: condition_input_ids = the
    source, input_ids = the target (both already without special tokens)."""
    sources, targets = [], []
    for i, ex in enumerate(rows):
        try:
            src, tgt = ex["condition_input_ids"], ex["input_ids"]
        except KeyError as e:
            raise ELFError(f"{name}: record {i} has no column {e}; pre-tokenized pairs need "
                           "'condition_input_ids' (source) and 'input_ids' (target)") from None
        sources.append([int(t) for t in src])
        targets.append([int(t) for t in tgt])
    return sources, targets


COND_TASKS = {"copy": "write the source line out again", "shuffle": "restore the word order of a line whose words "
              "were shuffled"}


def task_pairs(task: str, docs: list[str], seed: int = 0):
    """(train, held out) (source, target) pairs of a conditional demonstration task made from `docs`: the
    lines of `data.shuffled_line_pairs`, the source shuffled ("shuffle") or the line itself ("copy")."""

    train, held = shuffled_line_pairs(docs, seed=seed)
    if task == "copy":
        return [(t, t) for _, t in train], [(t, t) for _, t in held]
    return train, held


def task_pairs_file(task: str, seed: int = 0, cache_dir=None):
    """(train pairs, held-out pairs, the .jsonl file of the train pairs in the cache, written once) of a
    conditional demonstration task on the built-in corpus."""
    from elflow.data.corpus import read_documents
    from elflow.util.files import cache_root

    train, held = task_pairs(task, list(read_documents("builtin", cache_dir=cache_dir)), seed)
    path = cache_root(cache_dir) / "pairs" / f"shakespeare-{task}-{seed}.jsonl"
    if not path.exists():
        atomic_write_text(path, "".join(json.dumps({"input": s, "output": t}) + "\n" for s, t in train))
    return train, held, path

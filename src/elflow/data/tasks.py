"""The named conditional tasks (hub data sets, layouts, metrics) and the demonstration tasks made from plain
text (copy a line; restore a line whose words were shuffled)."""

from __future__ import annotations

# Conditional data sets on the hub: name -> (dataset id, config, default split, (source, target) getter).
PAIR_PRESETS = {
    "wmt14": ("wmt14", "de-en", lambda ex: (ex["translation"]["de"], ex["translation"]["en"])),
    "wmt14-de-en": ("wmt14", "de-en", lambda ex: (ex["translation"]["de"], ex["translation"]["en"])),
    "xsum": ("EdinburghNLP/xsum", None, lambda ex: (ex["document"], ex["summary"])),
}


# named conditional tasks: hub data, layout, warm-up and metric (their recipe is every conditional run's)
PAIR_TASKS = {
    "wmt14-de-en": {"data": "wmt14-de-en", "length": 128, "source_length": 64, "warmup": 5000,
                    "metric": "bleu",
                    "pretokenized": "embedded-language-flows/wmt14_de-en_{split}_t5"},
    "xsum": {"data": "xsum", "length": 1088, "source_length": 1024, "warmup": 5000,
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


COND_TASKS = {"copy": "write the source line out again", "shuffle": "restore the word order of a line whose words "
              "were shuffled"}


def task_pairs(task: str, docs: list[str], seed: int = 0):
    """(train, held out) (source, target) pairs of a conditional demonstration task made from `docs`: the
    lines of `data.shuffled_line_pairs`, the source shuffled ("shuffle") or the line itself ("copy")."""

    train, held = shuffled_line_pairs(docs, seed=seed)
    if task == "copy":
        return [(t, t) for _, t in train], [(t, t) for _, t in held]
    return train, held

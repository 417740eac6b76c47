"""Texts from a model, judged: sample, write and score in one call, and the held-out text of a run's own data
(cached, judged once) to put beside its samples."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from elflow.config import TrainConfig
from elflow.data.datasets import run_data
from elflow.eval.metrics import generative_perplexity, read_references, summary_of
from elflow.generate import gather_records, write_samples
from elflow.runs.load import read_model_parts
from elflow.runs.stored import training_settings
from elflow.space import build_space, tokenizer_spec
from elflow.util import jsonio
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_json, cache_root


def sample_and_score(method, net, space, num: int, settings, score, path=None, meta: dict | None = None,
                     length: int | None = None, references=None, progress: bool = False, overwrite: bool = True,
                     part: tuple[int, int] = (0, 1), **known) -> tuple[list[dict], dict]:
    """Sample, write, judge: `num` samples of `net` with `settings` (its method's, elflow.methods: an ELF model's
    SamplingSettings or a baseline's BaselineSampling; `known`: sources, prompt, suffix), each with its
    reference if given, written to `path` (if any) with the settings and `meta` (generate.write_samples), and
    `score(texts)`. Returns (records, the score). `part` = (rank, ranks) under torchrun: each rank draws its
    batches, every rank gets all the records (rank 0 alone writes them) and scores them (a sharded judge)."""
    records = method.generate(net, space, num, settings, length, progress=progress and part[0] == 0, part=part,
                            **known)
    records = gather_records(records, part[1])
    for r, ref in zip(records, references or []):
        r["reference"] = ref
    if path is not None and part[0] == 0:
        write_samples(path, records, {**settings.to_dict(), **(meta or {})}, overwrite=overwrite)
    return records, score([r["text"] for r in records])


def heldout_texts(checkpoint, num: int, cache_dir=None) -> tuple[list[str], str]:
    """(texts, what they are): `num` rows of the held-out split of the data the elflow run, checkpoint or model
    folder `checkpoint` was trained on, at its length, decoded by its tokenizer and cut at the first EOS as
    samples are. ELFError saying why when there are none (a released checkpoint, a conditional model, data that
    cannot be read from here)."""
    stored = read_model_parts(checkpoint, weights=False) if checkpoint else None
    settings = training_settings(stored.origin.path) if stored else {}
    if not settings:
        raise ELFError("the model records no training data elflow can read")
    record = stored.record
    cfg = TrainConfig.of_run(record, settings, f"{checkpoint}'s run.json").resolved()
    if cfg.conditional:
        raise ELFError("a conditional model's held-out text is a task's references (--task)")
    space = build_space(tokenizer_spec(record.space.build_spec()))
    length = cfg.length
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


def _cached_figures(path: Path) -> dict | None:
    """A judge's figures cached in `path` (read by the bounded reader, NaN allowed: a figure of no tokens), or
    None when there are none or they are not figures (a damaged cache entry is judged again)."""
    if not path.is_file():
        return None
    try:
        figures = jsonio.read_json(path, max_bytes=jsonio.RECORD_BYTES, own=True, allow_nonfinite=True)
    except ELFError:
        return None
    numbers = ("gen_ppl", "entropy", "nll_sum")
    if not all(isinstance(figures.get(k), (int, float)) and not isinstance(figures.get(k), bool) for k in numbers):
        return None
    count = figures.get("num_tokens")
    return figures if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None


def judged_heldout(texts: list[str], judge_name: str, judge, settings: dict, cache_dir=None,
                   progress: bool = False) -> dict:
    """The judge's figures of held-out `texts` (generative_perplexity without the per-sample lists), cached
    under <cache>/judged by the texts, the judge and the counting settings."""
    digest = hashlib.sha256()
    for t in texts:
        digest.update(t.encode("utf-8", "surrogatepass") + b"\0")
    key = hashlib.sha256(json.dumps({"texts": digest.hexdigest(), "judge": _judge_identity(judge_name),
                                     **settings}, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_root(cache_dir) / "judged" / f"{key}.json"
    cached = _cached_figures(path)
    if cached is not None:
        return {**cached, "cached": True}
    model, tok = judge
    res = summary_of(generative_perplexity(texts, model, tok, settings["batch_size"], settings["protocol"],
                                        settings["max_length"], progress=progress))
    atomic_write_json(path, res)
    return {**res, "cached": False}


def read_real_texts(path, field: str = "text", flag: str = "--references") -> list[str]:
    """The real texts MAUVE compares samples with: the non-blank texts of `path` (a .jsonl file's `field`, or one
    text per line); a file without any is one line naming it (before any judging)."""
    texts = read_references(path, field)
    kept = [t for t in texts if t.strip()]
    if not kept:
        held = f"only {len(texts)} empty texts" if texts else "nothing: it is empty"
        raise ELFError(f"{flag} {path} holds no text ({held}); MAUVE compares the samples with real texts: pass a "
                       "file of them")
    return kept

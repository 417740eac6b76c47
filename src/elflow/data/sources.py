"""A source cut into tasks for the tokenizing workers: lines of a .jsonl, whole small .txt files, pieces of a
large .txt cut before a whitespace run, hub records, pre-tokenized rows; and the source's fingerprint."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterator

from elflow.data.corpus import (
    BUILTIN_NAMES,
    CLEAN_VERSION,
    SHAKESPEARE_SHA256,
    builtin_corpus,
    is_saved_dataset,
    is_t5_small,
    local_files,
    pretokenized_rows,
    read_documents,
    read_pairs,
)
from elflow.util.errors import ELFError
from elflow.util.files import sha256_file

WINDOW = 2  # tasks in flight per worker


_CUT = re.compile(rb"(?<=[!-~])[ \t\n\r\f\v]")  # just before an ASCII whitespace run that follows a visible char


CUT_TEXT = re.compile(r"(?<=[!-~])[ \t\n\r\f\v]")


# ----------------------------------------------------------------------------------------------------
# Sources: fingerprints and what they are
def resolve_source(source, cache_dir) -> Path | None:
    """The local path a source names (the built-in corpus's folder for 'builtin'), or None for a hub name."""
    if str(source) in BUILTIN_NAMES:
        return builtin_corpus(cache_dir)
    path = Path(str(source)).expanduser()
    return path if path.exists() else None


def _source_files(path: Path) -> list[Path]:
    if path.is_dir() and not any(path.rglob("*.txt")):  # a saved `datasets` folder: all its files
        return sorted(p for p in path.rglob("*") if p.is_file())
    return local_files(path)


def source_fingerprint(source, cache_dir=None, full_hash: bool = False) -> dict:
    """What identifies a source's content cheaply: the built-in corpus's checksum, the names, sizes and mtimes
    of local files (with `full_hash`, a sha256 of their contents as well), or a hub dataset's name."""
    if str(source) in BUILTIN_NAMES:
        return {"builtin": SHAKESPEARE_SHA256, "clean": CLEAN_VERSION}
    path = resolve_source(source, cache_dir)
    if path is None:
        return {"hub": str(source)}
    files = _source_files(path)
    listing = [[str(f.relative_to(path)) if path.is_dir() else f.name, f.stat().st_size, f.stat().st_mtime_ns]
               for f in files]
    out = {"files": len(files), "bytes": sum(x[1] for x in listing),
           "digest": hashlib.sha256(json.dumps(listing).encode()).hexdigest()}
    if full_hash:
        h = hashlib.sha256()
        for name, f in zip(listing, files):
            h.update(name[0].encode() + b"\0" + sha256_file(f).encode())
        out["sha256"] = h.hexdigest()
    return out


# ----------------------------------------------------------------------------------------------------
# Tasks: what the main process reads, and what a worker makes of it
def cut_pieces(data, size: int, pattern) -> list:
    """`data` (bytes or str) cut into pieces of at least `size`, each cut just before a whitespace run."""
    pieces, start = [], 0
    while len(data) - start > size:
        m = pattern.search(data, start + size)
        if m is None:
            break
        pieces.append(data[start:m.start()])
        start = m.start()
    pieces.append(data[start:])
    return pieces


def _line_batches(path: Path, chunk_bytes: int) -> Iterator[tuple[int, list[bytes], int]]:
    """(first line number, raw lines, bytes) of a .jsonl file, about `chunk_bytes` at a time."""
    lines, size, first = [], 0, 1
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not lines:
                first = lineno
            lines.append(raw)
            size += len(raw)
            if size >= chunk_bytes:
                yield first, lines, size
                lines, size = [], 0
    if lines:
        yield first, lines, size


def _file_pieces(path: Path, chunk_bytes: int) -> Iterator[tuple[int, bytes, bool]]:
    """(first line, bytes, at_start) pieces of a large text file, each at least `chunk_bytes` long (the last
    may be shorter), cut just before a whitespace run; memory: a few chunks."""
    line, at_start, buf = 1, True, b""
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            buf += block
            while len(buf) > 2 * chunk_bytes or (not block and buf):
                m = _CUT.search(buf, chunk_bytes) if block else None
                if m is None and block:
                    break  # no cut point yet: read more
                piece, buf = (buf[:m.start()], buf[m.start():]) if m is not None else (buf, b"")
                yield line, piece, at_start
                line += piece.count(b"\n")
                at_start = False
            if not block:
                return


def _text_tasks(path: Path, field: str, on_bad: str, chunk_bytes: int) -> Iterator[tuple[tuple, tuple]]:
    """(task, (bytes, piece flag)) for a local text source, in the source's order."""
    group, size = [], 0
    for file in local_files(path):
        name = str(file)
        if file.suffix == ".jsonl":
            if group:
                yield ("files", group, on_bad), (size, None)
                group, size = [], 0
            for first, lines, n in _line_batches(file, chunk_bytes):
                yield ("jsonl", name, first, lines, field, on_bad), (n, None)
        elif file.stat().st_size > chunk_bytes:
            if group:
                yield ("files", group, on_bad), (size, None)
                group, size = [], 0
            pieces = _file_pieces(file, chunk_bytes)
            piece = next(pieces, None)
            while piece is not None:
                following = next(pieces, None)
                first_line, raw, at_start = piece
                yield ("piece", name, first_line, raw, at_start, on_bad), (len(raw), (name, at_start,
                                                                                     following is None))
                piece = following
        else:
            raw = file.read_bytes()
            group.append((name, raw))
            size += len(raw)
            if size >= chunk_bytes:
                yield ("files", group, on_bad), (size, None)
                group, size = [], 0
    if group:
        yield ("files", group, on_bad), (size, None)


def _batched(items: Iterator, make, chunk_bytes: int, size_of) -> Iterator[tuple[tuple, tuple]]:
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
           cache_dir) -> tuple[Iterator, dict]:
    """The tasks that read `source`, and what the manifest says about how it was read."""
    name = str(source)
    path = resolve_source(source, cache_dir)
    rows = None
    if is_t5_small(space) and (path is None or path.is_dir()):
        rows = pretokenized_rows(source, split)
    elif path is not None and is_saved_dataset(path):
        raise ELFError(f"{name} is a saved `datasets` folder of the authors' pre-tokenized T5-small ids; prepare it "
                       "with --space t5-small (or a folder of T5-small's tokenizer named t5-small)")
    if rows is not None:
        columns = set(getattr(rows, "column_names", None) or next(iter(rows)).keys())
        if pairs != ("condition_input_ids" in columns):
            raise ELFError(f"{name} holds pre-tokenized {'pairs' if not pairs else 'documents'}: "
                           f"{'pass --source-length' if not pairs else 'leave out --source-length'} to read it")
        recs = (pretokenized_pairs if pairs else pretokenized_text)(rows, name)
        if max_documents is not None:
            import itertools

            recs = itertools.islice(recs, max_documents)
        kind = "pair-ids" if pairs else "ids"
        tasks = _batched(recs, lambda first, batch: (kind, batch), chunk_bytes,
                         lambda r: 2 * (len(r[0]) + len(r[1] if pairs else [])))
        return tasks, {"pretokenized": True, "unit": "doc"}
    if path is not None and not pairs:
        return _text_tasks(path, fields[0], on_bad, chunk_bytes), {"unit": "B", "total": sum(
            f.stat().st_size for f in local_files(path))}
    if path is not None and path.suffix == ".jsonl":
        def jsonl_pairs():
            for first, lines, n in _line_batches(path, chunk_bytes):
                yield ("pairs-jsonl", str(path), first, lines, fields, on_bad), (n, None)
        return jsonl_pairs(), {"unit": "B", "total": path.stat().st_size}
    if pairs:  # a hub pair set (or a clear error from read_pairs)
        it = read_pairs(source, fields[0], fields[1], on_bad, split, max_documents)
        return _batched(it, lambda first, b: ("pair-texts", first, b, name, on_bad), chunk_bytes,
                        lambda p: len(p[0]) + len(p[1])), {"unit": "doc"}
    it = read_documents(source, field=fields[0], on_bad=on_bad, split=split, max_documents=max_documents,
                        cache_dir=cache_dir)
    return _batched(it, lambda first, b: ("texts", first, b, name), chunk_bytes,
                    lambda t: len(t) if isinstance(t, str) else 1), {"unit": "doc"}

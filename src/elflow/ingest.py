"""Reading a source into a token store once, in chunks and in parallel, and the data sets read from stores.

`prepare_store(source, space, out)` (the `elflow prepare` command) tokenizes a source into a store
(`elflow.store`): the main process reads the source in chunks of about `chunk_bytes` (lines of a .jsonl,
whole small .txt files, or pieces of a large .txt cut just before a whitespace run, which tokenizes exactly
like the whole text), `workers` forked processes tokenize them, and the main process appends the results in
the source's order. Memory therefore stays at a few chunks per worker whatever the corpus size, and the
store is the same for any chunk size and any number of workers. A single document longer than a chunk (one
huge .txt file, or one long .jsonl line) is tokenized in pieces too. The authors' pre-tokenized sets are
copied as they are, without tokenizing.

`build_dataset` and `build_pairs` give a training and a validation split of a source's rows. The source is a
store folder (read as it is), or anything `prepare_store` reads: then the store is prepared once into the
cache, `<cache>/stores/<key>`, keyed by a cheap fingerprint of the source (file names, sizes and mtimes), the
tokenizer and the reading options. Under a process group, rank 0 prepares it while the other ranks wait on a
Gloo group of their own whose timeout (`PREPARE_TIMEOUT`) a long preparation does not reach, and a file
lock makes sure that one process per cache builds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections import deque
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator

import numpy as np

from elflow.data import (BUILTIN_NAMES, CLEAN_VERSION, SHAKESPEARE_SHA256, _bad, _is_t5_small, _warn, builtin_corpus,
                         check_on_bad, decode_text, field_text, is_saved_dataset, jsonl_object, local_files,
                         pretokenized_rows,
                         check_source_slot, read_documents, read_pairs, split_rows)
from elflow.store import (LOCK, PARTIAL, STORE_FILES, StoreRows, StoreWriter, TokenStore, file_lock, is_store,
                          remove_store_files, store_lock)
from elflow.utils import ELFError, cache_root, distributed, no_space_error, sha256_file

__all__ = ["CHUNK_BYTES", "PREPARE_TIMEOUT", "prepare_store", "text_store", "pair_store", "source_fingerprint",
           "build_dataset", "build_pairs", "auto_workers"]

CHUNK_BYTES = 1 << 20  # text per task
PIECE_CHARS = 1 << 16  # the longest text a tokenizer call sees
GROUP_CHARS = 1 << 18  # text per tokenizer call
STORE_KEY_VERSION = 1  # bump when what a cached store holds changes
PREPARE_TIMEOUT = timedelta(days=7)  # how long the other ranks wait for rank 0's preparation
WINDOW = 2  # tasks in flight per worker
_CUT = re.compile(rb"(?<=[!-~])[ \t\n\r\f\v]")  # just before an ASCII whitespace run that follows a visible char
_CUT_TEXT = re.compile(r"(?<=[!-~])[ \t\n\r\f\v]")


# ----------------------------------------------------------------------------------------------------
# Sources: fingerprints and what they are


def _resolve(source, cache_dir) -> Path | None:
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
    path = _resolve(source, cache_dir)
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


def _cut_pieces(data, size: int, pattern) -> list:
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


def _tokenize(space, texts: list[str], max_chars: int) -> list[np.ndarray]:
    """Each text's ids followed by EOS. Texts are cut into pieces of about `max_chars` (at most PIECE_CHARS:
    tokenizers are faster on pieces of tens of KB than on one long string), and tokenized GROUP_CHARS at a
    time, which bounds the tokenizer's own memory."""
    size = min(max_chars, PIECE_CHARS)
    pieces, owner = [], []
    for i, text in enumerate(texts):
        for piece in _cut_pieces(text, size, _CUT_TEXT) if len(text) > size else [text]:
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


def _document_ids(ids, eos_id: int, mask=None) -> np.ndarray:
    """A pre-tokenized document's ids with exactly one EOS at the end: the real tokens (by `mask` when the
    record has one), trailing EOS padding dropped."""
    ids = np.asarray(ids, dtype=np.int64)
    if mask is not None:
        ids = ids[: int(np.asarray(mask).sum())]
    real = np.flatnonzero(ids != eos_id)
    end = int(real[-1]) + 1 if real.size else 0
    return np.concatenate([ids[:end], np.asarray([eos_id], np.int64)])


def _run_task(task: tuple, space, max_chars: int):
    """One task's records: ("docs", [ids...]), ("piece", ids or None, nonblank) or ("pairs", [(src, tgt)...])."""
    kind = task[0]
    if kind == "jsonl":  # lines of a .jsonl file -> documents
        _, path, first, lines, field, on_bad = task
        texts = []
        for k, raw in enumerate(lines):
            obj = jsonl_object(raw, path, first + k, on_bad)
            text = field_text(obj, field, path, first + k, on_bad) if obj is not None else None
            if text is not None:
                texts.append(text)
        return "docs", _tokenize(space, texts, max_chars)
    if kind == "files":  # whole .txt files -> documents
        _, files, on_bad = task
        texts = [t for t in (decode_text(raw, path, on_bad) for path, raw in files) if t is not None]
        return "docs", _tokenize(space, texts, max_chars)
    if kind == "piece":  # a piece of a large .txt file -> its ids, no EOS
        _, path, first_line, raw, at_start, on_bad = task
        text = decode_text(raw, path, on_bad, first_line, at_start, whole=False)
        if text is None:
            return "piece", None, False
        return "piece", _tokenize(space, [text], max_chars)[0][:-1], bool(text.strip())
    if kind == "texts":  # documents read from a hub dataset
        _, first, texts, name = task
        for k, text in enumerate(texts):
            if not isinstance(text, str):
                raise ELFError(f"{name}: record {first + k + 1} holds a {type(text).__name__}, not a string; "
                               "choose the text field with --field")
        return "docs", _tokenize(space, texts, max_chars)
    if kind == "ids":  # pre-tokenized documents
        _, rows = task
        return "docs", [_document_ids(ids, space.eos_id, mask) for ids, mask in rows]
    if kind == "pairs-jsonl":  # lines of a .jsonl of pairs
        _, path, first, lines, fields, on_bad = task
        pairs = []
        for k, raw in enumerate(lines):
            obj = jsonl_object(raw, path, first + k, on_bad)
            src = field_text(obj, fields[0], path, first + k, on_bad) if obj is not None else None
            tgt = field_text(obj, fields[1], path, first + k, on_bad) if src is not None else None
            if src is not None and tgt is not None:
                pairs.append((src, tgt))
        return "pairs", _tokenize_pairs(space, pairs, max_chars)
    if kind == "pair-texts":  # pairs read from a hub dataset
        _, first, pairs, name, on_bad = task
        kept = []
        for k, (src, tgt) in enumerate(pairs):
            if not isinstance(src, str) or not isinstance(tgt, str):
                raise ELFError(f"{name}: record {first + k + 1} holds a {type(src).__name__} source and a "
                               f"{type(tgt).__name__} target, not strings; choose the fields with --source-field "
                               "and --target-field")
            if not src.strip():
                _bad(on_bad, f"{name}: record {first + k + 1} has an empty source")
                continue
            kept.append((src, tgt))
        return "pairs", _tokenize_pairs(space, kept, max_chars)
    if kind == "pair-ids":  # pre-tokenized pairs
        _, rows = task
        return "pairs", [(np.asarray(s, np.int64), np.asarray(t, np.int64)) for s, t in rows]
    raise ValueError(f"unknown task {kind!r}")


def _tokenize_pairs(space, pairs, max_chars):
    ids = _tokenize(space, [s for s, _ in pairs] + [t for _, t in pairs], max_chars)
    n = len(pairs)
    return [(ids[i][:-1], ids[n + i][:-1]) for i in range(n)]


_WORKER = {}  # the forked workers' space and chunk size (inherited from the main process)


def _in_worker(task):
    with contextlib.redirect_stderr(io.StringIO()) as err:  # warnings go back to the main process, in order
        result = _run_task(task, _WORKER["space"], _WORKER["max_chars"])
    return result, err.getvalue()


def _in_process(task, space, max_chars):
    with contextlib.redirect_stderr(io.StringIO()) as err:
        result = _run_task(task, space, max_chars)
    return result, err.getvalue()


def _ordered_results(tasks: Iterator, space, workers: int, max_chars: int) -> Iterator:
    """(meta, (result, warnings)) per task, in the tasks' order; `workers` > 1 runs them in forked processes,
    at most WINDOW per worker in flight (so the main process never reads far ahead)."""
    if workers <= 1:
        for task, meta in tasks:
            yield meta, _in_process(task, space, max_chars)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _WORKER.update(space=space, max_chars=max_chars)
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; the processes are the parallelism
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    pending: deque = deque()
    try:
        try:
            for task, meta in tasks:
                pending.append((meta, pool.submit(_in_worker, task)))
                if len(pending) >= WINDOW * workers:
                    meta, fut = pending.popleft()
                    yield meta, fut.result()
            while pending:
                meta, fut = pending.popleft()
                yield meta, fut.result()
        except BrokenProcessPool:
            raise ELFError("a prepare worker process died (killed by the system, perhaps for lack of memory); "
                           "run again with fewer --workers") from None
    finally:
        for _, fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        _WORKER.clear()
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


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


def _pretokenized_text(rows, name: str):
    for i, ex in enumerate(rows):
        if "input_ids" not in ex:
            raise ELFError(f"{name}: record {i} has no column 'input_ids'; a pre-tokenized set needs one")
        yield ex["input_ids"], ex.get("attention_mask")


def _pretokenized_pairs(rows, name: str):
    for i, ex in enumerate(rows):
        try:
            yield ex["condition_input_ids"], ex["input_ids"]
        except KeyError as e:
            raise ELFError(f"{name}: record {i} has no column {e}; pre-tokenized pairs need "
                           "'condition_input_ids' (source) and 'input_ids' (target)") from None


def _tasks(source, space, pairs: bool, fields, on_bad: str, split: str, max_documents, chunk_bytes: int,
           cache_dir) -> tuple[Iterator, dict]:
    """The tasks that read `source`, and what the manifest says about how it was read."""
    name = str(source)
    path = _resolve(source, cache_dir)
    rows = None
    if _is_t5_small(space) and (path is None or path.is_dir()):
        rows = pretokenized_rows(source, split)
    elif path is not None and is_saved_dataset(path):
        raise ELFError(f"{name} is a saved `datasets` folder of the authors' pre-tokenized T5-small ids; prepare it "
                       "with --space t5-small (or a folder of T5-small's tokenizer named t5-small)")
    if rows is not None:
        columns = set(getattr(rows, "column_names", None) or next(iter(rows)).keys())
        if pairs != ("condition_input_ids" in columns):
            raise ELFError(f"{name} holds pre-tokenized {'pairs' if not pairs else 'documents'}: "
                           f"{'pass --source-length' if not pairs else 'leave out --source-length'} to read it")
        recs = (_pretokenized_pairs if pairs else _pretokenized_text)(rows, name)
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


# ----------------------------------------------------------------------------------------------------
# Preparing a store


def auto_workers(total_bytes: int | None, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Worker processes for a source: the available cores, but one for a source of a few chunks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if total_bytes is None:
        return cores
    return max(1, min(cores, math.ceil(total_bytes / (8 * chunk_bytes))))


def _check_out(out: Path, source, overwrite: bool, cache_dir) -> None:
    if out.exists() and not out.is_dir():
        raise ELFError(f"--out {out} is a file, not a folder; choose another --out")
    path = _resolve(source, cache_dir)
    if path is not None and (out.resolve() == path.resolve() or path.resolve() in out.resolve().parents):
        raise ELFError(f"--out {out} lies inside the source {path}; write the store somewhere else")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        what = "a token store" if is_store(out) else "files"
        raise ELFError(f"--out {out} already holds {what}; pass --overwrite to replace the store (only a store's "
                       f"own files: {', '.join(n for n in STORE_FILES if not n.startswith('.') and PARTIAL not in n)}"
                       "), or choose another --out")


def prepare_store(source, space, out, *, pairs: bool = False, layout: str = "packed", source_length: int | None = None,
                  field: str = "text", source_field: str = "input", target_field: str = "output",
                  on_bad: str = "stop", split: str = "train", max_documents: int | None = None,
                  workers: int | None = None, chunk_bytes: int = CHUNK_BYTES, full_hash: bool = False,
                  overwrite: bool = False, progress: bool | None = None, cache_dir=None,
                  space_name: str | None = None) -> TokenStore:
    """Tokenize `source` into a store at `out` (the module docstring says how) and open it.

    pairs: (source, target) pairs (a .jsonl of `source_field` / `target_field` records, a named task or a hub
    pair set) instead of documents; `source_length` is recorded as the length the store was made for (the
    sources are kept whole and cut when rows are read). layout: the text layout recorded as the store's
    own. workers: processes (None: `auto_workers`). progress: a bar on stderr (None: when stderr is a
    terminal). Nothing that looks like a complete store is left when it fails or is stopped."""
    from tqdm.auto import tqdm

    check_on_bad(on_bad)
    if layout not in ("packed", "document"):
        raise ELFError(f"layout must be 'packed' or 'document', got {layout!r}")
    if chunk_bytes < 1:
        raise ELFError(f"the chunk size must be at least 1 byte, got {chunk_bytes}")
    out = Path(out).expanduser()
    _check_out(out, source, overwrite, cache_dir)
    t0, cpu0 = time.time(), time.process_time()
    fields = (source_field, target_field) if pairs else (field,)
    tasks, how = _tasks(source, space, pairs, fields, on_bad, split, max_documents, chunk_bytes, cache_dir)
    workers = auto_workers(how.get("total"), chunk_bytes) if workers is None else int(workers)
    if workers < 1:
        raise ELFError(f"--workers must be at least 1, got {workers}")
    created = not out.exists()
    lock = store_lock(out, wait=False)
    if lock is None:
        raise ELFError(f"{out} is being written by another `elflow prepare`; wait for it, or choose another --out")
    writer = None
    try:
        remove_store_files(out)  # the manifest first: a store being replaced never looks complete
        writer = StoreWriter(out, "pairs" if pairs else "text", space.vocab_size)
        bar = tqdm(total=how.get("total"), unit=how["unit"], unit_scale=True, disable=None if progress is None
                   else not progress, desc=f"prepare {Path(str(source)).name or source}", mininterval=1.0,
                   file=sys.stderr, dynamic_ncols=True)
        with bar:
            docs = _fill(writer, _ordered_results(tasks, space, workers, chunk_bytes), space.eos_id, on_bad,
                         max_documents, bar, t0)
        if docs == 0:
            raise ELFError(f"{source} holds no usable {'pairs' if pairs else 'text'}: every file, line or record was "
                           "empty or unreadable")
        manifest = {
            "layout": "pairs" if pairs else layout,
            "tokenizer": {"id": space.tokenizer_id, "space": space_name or getattr(space, "name", None),
                          "vocab_size": int(space.vocab_size), "eos_id": int(space.eos_id),
                          "pad_id": int(space.pad_id)},
            "source": {"name": str(source), "fingerprint": source_fingerprint(source, cache_dir, full_hash),
                       "fields": list(fields), "split": split, "on_bad": on_bad, "max_documents": max_documents,
                       "pretokenized": bool(how.get("pretokenized"))},
            **({"source_length": source_length} if pairs else {}),
            "build": {"workers": workers, "chunk_bytes": chunk_bytes, "seconds": round(time.time() - t0, 3),
                      "main_cpu_seconds": round(time.process_time() - cpu0, 3),
                      "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "elflow": _version()},
        }
        writer.finish(manifest)
        writer = None
    except OSError as e:
        if writer is not None:
            writer.abort()
        if no_space_error(e):
            raise ELFError(f"no space left on the device of {out} ({writer_tokens(writer)}); free some space or "
                           "choose another --out: nothing was kept") from None
        raise
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        try:
            os.unlink(out / LOCK)
        except FileNotFoundError:
            pass
        lock.close()
        if created and writer is not None:  # failed: a folder this call made goes again
            shutil.rmtree(out, ignore_errors=True)
    return TokenStore(out)


def writer_tokens(writer) -> str:
    return "nothing written" if writer is None else f"{writer.tokens:,} tokens had been written"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("elflow")
    except PackageNotFoundError:  # run from a checkout without `pip install`
        return "unknown"


def _fill(writer: StoreWriter, results: Iterator, eos_id: int, on_bad: str, max_documents, bar, t0) -> int:
    """Append the tasks' results to the store in order; returns the number of records."""
    docs = 0
    piece_state = None  # (file, nonblank so far, dropped) of the large file being read in pieces
    for (size, piece), (result, warnings) in results:
        kind = result[0]
        if warnings and not (kind == "piece" and not piece[1] and piece_state[2]):  # one warning per skipped file
            sys.stderr.write(warnings)
        if kind == "docs":
            take = result[1] if max_documents is None else result[1][: max_documents - docs]
            writer.add_documents(take)
            docs += len(take)
        elif kind == "pairs":
            take = result[1] if max_documents is None else result[1][: max_documents - docs]
            for src, tgt in take:
                writer.add(src, tgt)
            docs += len(take)
        else:  # a piece of a large text file
            name, at_start, last = piece
            if at_start:
                piece_state = [name, False, False]
            if not piece_state[2]:
                if result[1] is None:  # a bad piece, skipped: the whole file goes
                    writer.drop_record()
                    piece_state[2] = True
                else:
                    writer.extend(result[1])
                    piece_state[1] |= result[2]
            if last and not piece_state[2]:
                if piece_state[1]:
                    writer.extend(np.asarray([eos_id]))
                    writer.end_record()
                    docs += 1
                else:
                    writer.drop_record()
                    _bad(on_bad, f"{name} is empty")
        bar.update(size)
        elapsed = max(time.time() - t0, 1e-9)
        bar.set_postfix_str(f"{docs:,} docs, {writer.tokens / elapsed:,.0f} tok/s", refresh=False)
        if max_documents is not None and docs >= max_documents:
            break
    return docs


# ----------------------------------------------------------------------------------------------------
# Stores in the cache, prepared once


def _cache_key(kind: str, source, space, options: dict, cache_dir) -> str:
    key = {"v": STORE_KEY_VERSION, "kind": kind, "source": source_fingerprint(source, cache_dir),
           "tokenizer": space.tokenizer_id, "eos": space.eos_id, "pad": space.pad_id, **options}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _complete(folder: Path, warn: bool = False) -> TokenStore | None:
    if not (folder / "manifest.json").is_file():
        return None
    try:
        return TokenStore(folder)
    except ELFError as e:
        if warn:
            _warn(f"ignoring the damaged cached store {folder} ({e}); preparing it again")
        return None


def _cached(kind: str, source, space, options: dict, cache_dir, use_cache: bool) -> tuple[TokenStore, str]:
    """The cache's store of `source` (prepared now if missing: "miss", else "hit"), once across ranks."""
    def make():
        if not use_cache:
            tmp = Path(tempfile.mkdtemp(prefix="elflow-store-"))
            try:
                store = prepare_store(source, space, tmp, pairs=kind == "pairs", cache_dir=cache_dir, overwrite=True,
                                      **options)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # the memory maps stay valid
            return store, "miss"
        root = cache_root(cache_dir) / "stores"
        folder = root / _cache_key(kind, source, space, options, cache_dir)
        store = _complete(folder)
        if store is not None:
            return store, "hit"
        lock = file_lock(root / f"{folder.name}.lock")  # waits while another process prepares this store
        try:
            store = _complete(folder, warn=True)
            if store is not None:
                return store, "hit"
            return prepare_store(source, space, folder, pairs=kind == "pairs", cache_dir=cache_dir, overwrite=True,
                                 **options), "miss"
        finally:
            lock.close()

    return _once_across_ranks(make)


def _once_across_ranks(make):
    """`make()` on rank 0 first, then on the other ranks, which wait for it on a Gloo group whose timeout is
    PREPARE_TIMEOUT; every rank raises if it failed anywhere. Without a process group: `make()`."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return make()
    group = dist.new_group(backend="gloo", timeout=PREPARE_TIMEOUT)
    rank = dist.get_rank()
    result = None
    try:
        for turn in ("first", "then"):
            error = None
            if (rank == 0) == (turn == "first"):
                try:
                    result = make()
                except BaseException as e:  # noqa: BLE001 (re-raised below, after the other ranks know)
                    error = e
            flag = torch.tensor([0.0 if error is None else 1.0])
            dist.all_reduce(flag, group=group)
            if error is not None:
                raise error
            if flag.item():
                raise ELFError("another rank stopped while preparing the data (its message says why)")
        return result
    finally:
        dist.destroy_process_group(group)


def text_store(source, space, cache_dir=None, field: str = "text", on_bad: str = "stop", split: str = "train",
               max_documents: int | None = None, use_cache: bool = True) -> tuple[TokenStore, str]:
    """(store, "given" | "hit" | "miss"): `source` itself when it is a store folder (checked against the
    space's tokenizer), else its store in the cache, prepared once."""
    if is_store(source):
        store = TokenStore(source)
        store.check_space(space)
        return store, "given"
    options = {"field": field, "on_bad": on_bad, "split": split, "max_documents": max_documents}
    store, state = _cached("text", source, space, options, cache_dir, use_cache)
    return store, state


def pair_store(source, space, cache_dir=None, source_field: str = "input", target_field: str = "output",
               on_bad: str = "stop", split: str = "train", max_documents: int | None = None,
               use_cache: bool = True) -> tuple[TokenStore, str]:
    """Like `text_store`, for (source, target) pairs."""
    if is_store(source):
        store = TokenStore(source)
        store.check_space(space)
        return store, "given"
    options = {"source_field": source_field, "target_field": target_field, "on_bad": on_bad, "split": split,
               "max_documents": max_documents}
    return _cached("pairs", source, space, options, cache_dir, use_cache)


# ----------------------------------------------------------------------------------------------------
# Data sets read from stores


def _check_length(space, length: int) -> None:
    space.check_length(length)
    if length < 2:
        raise ELFError(f"sequence length must be at least 2, got {length}")


def _info(store: TokenStore, state: str, source, layout: str, length: int) -> dict:
    return {"source": str(source), "layout": layout, "length": length, "tokenizer": store.tokenizer_id,
            "records": store.count, "corpus_tokens": store.num_tokens, "cache": state, "store": str(store.folder)}


def build_dataset(source, space, length: int, layout: str = "packed", val_fraction: float = 0.01, seed: int = 0,
                  cache_dir=None, field: str = "text", on_bad: str = "stop", split: str = "train",
                  max_documents: int | None = None, pad_in_loss: bool = True, use_cache: bool = True
                  ) -> tuple[StoreRows, StoreRows]:
    """(train, validation) rows of `length` tokens of a text source in `layout`, read from its store (the
    source itself when it is a store folder, else its store in the cache, prepared once); the validation rows
    are chosen at random from `seed` (`data.split_rows`)."""
    if layout not in ("packed", "document"):
        raise ELFError(f"layout must be 'packed' or 'document', got {layout!r}")
    check_on_bad(on_bad)
    _check_length(space, length)
    store, state = text_store(source, space, cache_dir, field, on_bad, split, max_documents, use_cache)
    if store.kind != "text":
        raise ELFError(f"{source} holds (source, target) pairs; train on it with --source-length")
    if state == "given" and store.layout not in (None, layout) and distributed()[0] == 0:
        _warn(f"{source} was prepared for the {store.layout} layout; reading it as {layout} rows (--layout)")
    rows = StoreRows(store, layout, length, pad_in_loss, info=_info(store, state, source, layout, length))
    rows.info["sequences"] = len(rows)
    return split_rows(rows, val_fraction, seed)


def build_pairs(source, space, source_length: int = 64, length: int = 128, val_fraction: float = 0.01,
                seed: int = 0, cache_dir=None, source_field: str = "input", target_field: str = "output",
                on_bad: str = "stop", split: str = "train", max_documents: int | None = None,
                use_cache: bool = True, source_slot: str = "packed") -> tuple[StoreRows, StoreRows]:
    """Conditional (source, target) rows (`data.pair_layout`): every row holds its source (cut to
    `source_length`), then its target right after it (at `source_length` with the "fixed" `source_slot`),
    EOS-padded to `length`; `known` marks the source. The
    loss covers every other position, the padding included (that is how the model learns where a target ends).

    source: a pair store, a .jsonl file of {source_field, target_field} records, a named task ("wmt14-de-en",
    "xsum") or a hub dataset name read with the same fields. In T5-small's space, a folder saved with
    `datasets.save_to_disk` or a hub set holding the authors' pre-tokenized columns (condition_input_ids /
    input_ids) is used as it is, and a named task reads the authors' pre-tokenized copy."""
    check_on_bad(on_bad)
    if not 0 < source_length < length:
        raise ELFError(f"the source length {source_length} must be between 1 and the sequence length "
                       f"{length} - 1, so that a target fits")
    _check_length(space, length)
    store, state = pair_store(source, space, cache_dir, source_field, target_field, on_bad, split, max_documents,
                              use_cache)
    if store.kind != "pairs":
        raise ELFError(f"{source} holds text, not (source, target) pairs: prepare pairs with --source-length, or "
                       "train on it without --source-length")
    check_source_slot(source_slot)
    rows = StoreRows(store, "pairs", length, source_length=source_length, fixed_slot=source_slot == "fixed",
                     info={**_info(store, state, source, "pairs", length), "source_length": source_length,
                           "source_slot": source_slot})
    rows.info.update(sequences=len(rows), pairs=len(rows))
    cut = rows.sources_cut()
    if cut and distributed()[0] == 0:
        _warn(f"{cut} of {len(rows)} sources are longer than {source_length} tokens and were cut "
              "(raise --source-length to keep more)")
    return split_rows(rows, val_fraction, seed)

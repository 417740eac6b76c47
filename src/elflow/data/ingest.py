"""Preparing a token store from a source (`elflow prepare`): tasks read in chunks, tokenized by workers,
appended in order, the store published only when complete."""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import numpy as np

from elflow.data.corpus import check_on_bad, report_bad
from elflow.data.sources import resolve_source, source_fingerprint, source_tasks
from elflow.data.store import (
    LOCK,
    PARTIAL,
    STORE_FILES,
    StoreWriter,
    TokenStore,
    is_store,
    remove_store_files,
    store_lock,
)
from elflow.data.workers import ordered_results
from elflow.util.errors import ELFError
from elflow.util.files import no_space_error

CHUNK_BYTES = 1 << 20  # text per task


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
    path = resolve_source(source, cache_dir)
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
    tasks, how = source_tasks(source, space, pairs, fields, on_bad, split, max_documents, chunk_bytes, cache_dir)
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
            docs = _fill(writer, ordered_results(tasks, space, workers, chunk_bytes), space.eos_id, on_bad,
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
                    report_bad(on_bad, f"{name} is empty")
        bar.update(size)
        elapsed = max(time.time() - t0, 1e-9)
        bar.set_postfix_str(f"{docs:,} docs, {writer.tokens / elapsed:,.0f} tok/s", refresh=False)
        if max_documents is not None and docs >= max_documents:
            break
    return docs

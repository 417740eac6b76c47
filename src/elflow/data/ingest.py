"""Preparing a token store from a source (`elflow prepare`): tasks read in chunks, tokenized by workers,
appended in order, checked, and published only when complete; a store being replaced stays whole until its
successor is complete beside it and swapped in."""

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

from elflow.data.corpus import _warn, check_on_bad, report_bad, skipped_files
from elflow.data.layout import LAYOUTS, PACKED
from elflow.data.origins import OriginHashes, cheap_part, origin_changed, origin_fingerprint, resolve_origin
from elflow.data.reading import Piece, source_tasks
from elflow.data.store import (
    LOCK,
    PARTIAL,
    STAGE,
    STORE_FILES,
    StoreWriter,
    TokenStore,
    is_store,
    store_lock,
)
from elflow.data.store_folder import finish_swap, holds_store_files, locked_by_other, swap_in
from elflow.data.workers import available_cores, check_workers, ordered_results
from elflow.util.errors import ELFError
from elflow.util.files import NoSpace, disk_full

CHUNK_BYTES = 1 << 20  # text per task


UNKNOWN_SHARE = 0.2  # a store whose tokens are this much the unknown token is reported


BYTES_PER_TOKEN = 64  # a store with this many source bytes per token or more is reported


# ----------------------------------------------------------------------------------------------------
# Preparing a store
def auto_workers(total_bytes: int | None, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Worker processes for a source: the available cores, but one for a source of a few chunks."""
    cores = available_cores()
    if total_bytes is None:
        return cores
    return max(1, min(cores, math.ceil(total_bytes / (8 * chunk_bytes))))


def _check_out(out: Path, source, overwrite: bool, cache_dir) -> None:
    if out.exists() and not out.is_dir():
        raise ELFError(f"--out {out} is a file, not a folder; choose another --out")
    path = resolve_origin(source, cache_dir)
    if path is not None and (out.resolve() == path.resolve() or path.resolve() in out.resolve().parents):
        raise ELFError(f"--out {out} lies inside the source {path}; write the store somewhere else")
    if out.is_dir() and locked_by_other(out):  # a store being written (--overwrite is refused then too)
        raise ELFError(f"--out {out}: another elflow prepare is writing a token store there now; wait for it to "
                       "end (its store is then ready to use), or choose another --out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        what = "a token store" if is_store(out) else "files"
        raise ELFError(f"--out {out} already holds {what}; pass --overwrite to replace the store (only a store's "
                       f"own files: {', '.join(n for n in STORE_FILES if not n.startswith('.') and PARTIAL not in n)}"
                       "), or choose another --out")


def prepare_store(source, space, out, *, pairs: bool = False, layout: str = PACKED, source_length: int | None = None,
                  field: str = "text", source_field: str = "input", target_field: str = "output",
                  on_bad: str = "stop", split: str = "train", max_documents: int | None = None,
                  workers: int | None = None, chunk_bytes: int = CHUNK_BYTES, overwrite: bool = False,
                  progress: bool | None = None, cache_dir=None, space_name: str | None = None,
                  advice: str = "choose another --out") -> TokenStore:
    """Tokenize `source` into a store at `out` (the module docstring says how) and open it.

    pairs: (source, target) pairs (a .jsonl of `source_field` / `target_field` records, a named task or a hub
    pair set) instead of documents; `source_length` is recorded as the length the store was made for (the
    sources are kept whole and cut when rows are read). layout: the text layout recorded as the store's
    own. workers: processes, at most the available cores (None: `auto_workers`). progress: a bar on stderr
    (None: when stderr is a terminal). advice: what a message about a full disk tells to do besides freeing
    space. A store already in `out` (`overwrite`) stays whole until the new one is complete in
    `out/.prepare-new`, then the new one is swapped in; on any failure or signal nothing that looks like a
    complete store is left but the old one, and the exception's `outcome` says what became of the folder.
    A source that changed while it was read is an error; nothing of it is kept. The manifest records the
    source's fingerprint with the sha256 of each local file, taken as the file was read (`OriginHashes`), and
    how many bytes of bad input were skipped (--on-bad skip)."""
    from tqdm.auto import tqdm

    workers = _check_args(on_bad, layout, chunk_bytes, workers)
    out = Path(out).expanduser()
    _check_out(out, source, overwrite, cache_dir)
    t0, cpu0 = time.time(), time.process_time()
    fields = (source_field, target_field) if pairs else (field,)
    before = origin_fingerprint(source, cache_dir)
    hashes = OriginHashes()
    tasks, how = source_tasks(source, space, pairs, fields, on_bad, split, max_documents, chunk_bytes, cache_dir,
                              hashes)
    workers = auto_workers(how.get("total"), chunk_bytes) if workers is None else workers
    path = resolve_origin(source, cache_dir)
    for entry, why in skipped_files(path) if path is not None else []:
        _warn(f"warning: skipping {entry}: {why}, not a regular file")
    created = not out.exists()
    lock = _lock(out, created, advice)
    writer, replacing, unknown, read = None, False, 0, None
    try:
        finish_swap(out)  # a replacement that an earlier prepare left unfinished
        replacing = holds_store_files(out)
        stage = out / STAGE if replacing else out
        writer = StoreWriter(stage, "pairs" if pairs else "text", space.vocab_size)
        bar = tqdm(total=how.get("total"), unit=how["unit"], unit_scale=True, disable=None if progress is None
                   else not progress, desc=f"prepare {Path(str(source)).name or source}", mininterval=1.0,
                   file=sys.stderr, dynamic_ncols=True)
        with bar:
            read = _fill(writer, ordered_results(tasks, space, workers, chunk_bytes), space.eos_id, on_bad,
                         max_documents, bar, t0)
        if read.docs == 0:
            raise ELFError(f"{source} holds no usable {'pairs' if pairs else 'text'}: every file, line or record was "
                           "empty or unreadable")
        after = origin_fingerprint(source, cache_dir, hashes)
        if cheap_part(after) != before:
            raise origin_changed(source, _change(before, after))
        read.close(how)
        manifest = _manifest(source, space, space_name, pairs, layout, fields, after, split, on_bad, max_documents,
                             read, how, source_length, workers, chunk_bytes, t0, cpu0)
        unknown = writer.finish(manifest, count_id=_unknown_id(space))
        written, writer = writer.tokens, None
        if replacing:
            swap_in(out)
    except BaseException as e:
        written = writer_tokens(writer)
        outcome = _clean_up_surely(out, writer, created, replacing)
        if isinstance(e, (OSError, NoSpace)) and disk_full(e):
            raise ELFError(f"no space left on the device of {out} ({written}); free some space or {advice}: "
                           f"{outcome}") from None
        try:
            e.outcome = outcome  # what a command that reports the interruption says of the folder
        except AttributeError:
            pass
        raise
    finally:
        try:
            os.unlink(out / LOCK)
        except FileNotFoundError:
            pass
        lock.close()
    store = TokenStore(out)
    if read.skipped:
        _warn(f"warning: {read.skipped:,} bytes of {source} were bad input and were skipped (--on-bad skip; each "
              "is named above); the store holds the rest")
    _report_useless(source, space_name or getattr(space, "name", None), store, read.text_bytes, unknown)
    return store


def _check_args(on_bad: str, layout: str, chunk_bytes: int, workers) -> int | None:
    """prepare_store's settings checked (ELFError naming the first that is wrong); the worker count, capped."""
    check_on_bad(on_bad)
    if layout not in LAYOUTS:
        raise ELFError(f"layout must be 'packed' or 'document', got {layout!r}")
    if chunk_bytes < 1:
        raise ELFError(f"the chunk size must be at least 1 byte, got {chunk_bytes}")
    return check_workers(int(workers)) if workers is not None else None


def _lock(out: Path, created: bool, advice: str):
    """The store folder's lock, taken without waiting: another `elflow prepare` writing `out`, or a full disk
    (the folder removed again if this prepare created it), is one ELFError."""
    try:
        lock = store_lock(out, wait=False)
    except OSError as e:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        if disk_full(e):
            raise ELFError(f"no space left on the device of {out}; free some space or {advice}: nothing was "
                           "written") from None
        raise
    if lock is None:
        raise ELFError(f"{out} is being written by another `elflow prepare`; wait for it, or choose another --out")
    return lock


def _manifest(source, space, space_name, pairs, layout, fields, fingerprint, split, on_bad, max_documents, read, how,
              source_length, workers, chunk_bytes, t0, cpu0) -> dict:
    """The store's manifest: its layout, the tokenizer, where the text came from (its fingerprint as read) and
    how the store was built."""
    return {
        "layout": "pairs" if pairs else layout,
        "tokenizer": {"id": space.tokenizer_id, "space": space_name or getattr(space, "name", None),
                      "vocab_size": int(space.vocab_size), "eos_id": int(space.eos_id),
                      "pad_id": int(space.pad_id)},
        "source": {"name": str(source), "fingerprint": fingerprint, "fields": list(fields), "split": split,
                   "on_bad": on_bad, "max_documents": max_documents, "skipped_bytes": read.skipped,
                   "pretokenized": bool(how.get("pretokenized"))},
        **({"source_length": source_length} if pairs else {}),
        "build": {"workers": workers, "chunk_bytes": chunk_bytes, "seconds": round(time.time() - t0, 3),
                  "main_cpu_seconds": round(time.process_time() - cpu0, 3),
                  "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "elflow": _version()},
    }


def _clean_up(out: Path, writer, created: bool, replacing: bool) -> str:
    """Remove what a prepare that failed had written; returns what became of `out`, in words."""
    if writer is not None:
        writer.abort()
    if replacing:
        if finish_swap(out) == "finished":
            return f"the new store was complete and replaced the old one in {out}"
        return f"the store in {out} was kept as it was"
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return f"nothing was kept: {out}, which this prepare had made, was removed"
    return f"nothing was kept: its partial files were removed from {out}"


def _clean_up_surely(out: Path, writer, created: bool, replacing: bool) -> str:
    """`_clean_up`, finished even when a signal (SIGTERM, Ctrl-C) comes while it runs: it is done again from
    where it stands (each of its steps may be), then the signal's exception is raised, saying what became of
    the folder. An error of the clean-up itself is raised as it is."""
    late, outcome = None, f"its clean-up of {out} was stopped by signals again and again"
    for _ in range(8):
        try:
            outcome = _clean_up(out, writer, created, replacing)
            break
        except Exception:
            raise
        except BaseException as e:  # a signal's exception: raised below, once the clean-up is done
            late = late or e
    if late is not None:
        try:
            late.outcome = outcome
        except AttributeError:
            pass
        raise late
    return outcome


def _change(before: dict, after: dict) -> str:
    if before.get("files") != after.get("files"):
        return f"{before.get('files')} files when it was listed, {after.get('files')} now"
    if before.get("bytes") != after.get("bytes"):
        return f"{before.get('bytes'):,} bytes when it was listed, {after.get('bytes'):,} now"
    return "a file's modification time changed"


def _unknown_id(space) -> int | None:
    unk = getattr(getattr(space, "tokenizer", None), "unk_token_id", None)
    return unk if isinstance(unk, int) and unk != getattr(space, "eos_id", None) else None


def _report_useless(source, space_name, store: TokenStore, size: int | None, unknown: int) -> None:
    """A warning for a store whose tokenizer did not fit the text: most of its tokens unknown, or far fewer
    tokens than the `size` bytes of text it was given (skipped input aside) would give."""
    text = store.num_tokens - (store.count if store.kind == "text" else 0)  # the EOS aside
    why = []
    if unknown and unknown >= UNKNOWN_SHARE * max(text, 1):
        why.append(f"{unknown / max(text, 1):.0%} of its {text:,} tokens are the unknown token")
    if size and size >= BYTES_PER_TOKEN * max(text, 1):
        why.append(f"{size:,} bytes of text gave only {text:,} tokens")
    if why:
        _warn(f"warning: the store of {source} is likely useless: {'; '.join(why)}; the tokenizer of "
              f"{space_name or 'this space'} does not fit this text (text without spaces, another script or "
              "binary data?)")


def writer_tokens(writer) -> str:
    return "nothing written" if writer is None else f"{writer.tokens:,} tokens had been written"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("elflow")
    except PackageNotFoundError:  # run from a checkout without `pip install`
        return "unknown"


class Read:
    """What `_fill` read: records written, bytes handed to the tokenizing tasks (for a source counted in
    bytes), bytes of bad input skipped, and whether the source was read to its end (not cut by
    --max-documents)."""

    def __init__(self):
        self.docs, self.handed, self.skipped, self.complete = 0, 0, 0, True
        self.text_bytes: int | None = None

    def close(self, how: dict) -> None:
        """The totals, once the source is read: bad lines passed over while it was read (too long to be handed
        to a task) are the bytes of a source read to its end that no task was handed; `text_bytes` is what
        the tokenizer was given (None for a source not counted in bytes)."""
        if how.get("unit") != "B":
            return
        if self.complete:
            self.skipped += max(int(how.get("total") or 0) - self.handed, 0)
            self.handed = int(how.get("total") or 0)
        self.text_bytes = max(self.handed - self.skipped, 0)


def _fill(writer: StoreWriter, results: Iterator, eos_id: int, on_bad: str, max_documents, bar, t0) -> Read:
    """Append the tasks' results to the store in order; returns what was read (`Read`)."""
    read = Read()
    piece_state = None  # (file, nonblank so far, dropped, bytes) of the large file being read in pieces
    for (size, piece), (result, warnings) in results:
        part = isinstance(result, Piece)
        read.handed += size
        if warnings and not (part and not piece[1] and piece_state[2]):  # one warning per skipped file
            sys.stderr.write(warnings)
        if not part:  # documents or pairs
            read.docs += result.write(writer, None if max_documents is None else max_documents - read.docs)
            read.skipped += result.skipped
        else:  # a piece of a large text file
            name, at_start, last = piece
            if at_start:
                piece_state = [name, False, False, 0]
            piece_state[3] += size
            if not piece_state[2]:
                if result.ids is None:  # a bad piece, skipped: the whole file goes
                    writer.drop_record()
                    piece_state[2] = True
                else:
                    writer.extend(result.ids)
                    piece_state[1] |= result.nonblank
            if last and not piece_state[2]:
                if piece_state[1]:
                    writer.extend(np.asarray([eos_id]))
                    writer.end_record()
                    read.docs += 1
                else:
                    writer.drop_record()
                    report_bad(on_bad, f"{name} is empty")
                    read.skipped += piece_state[3]
            elif last:
                read.skipped += piece_state[3]
        bar.update(size)
        elapsed = max(time.time() - t0, 1e-9)
        bar.set_postfix_str(f"{read.docs:,} docs, {writer.tokens / elapsed:,.0f} tok/s", refresh=False)
        if max_documents is not None and read.docs >= max_documents:
            read.complete = False
            break
    return read

"""Tokenizing a source's tasks, in this process or in forked workers, in the source's order. Workers are at
most the available cores, leave SIGINT and SIGTERM to the main process and end with it."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
import time
from collections import deque
from typing import Iterator

import numpy as np

from elflow.data.corpus import decode_text, field_text, jsonl_object, report_bad
from elflow.data.sources import CUT_TEXT, WINDOW, cut_pieces
from elflow.util.errors import ELFError

PIECE_CHARS = 1 << 16  # the length of the pieces a tokenizer call sees (cut before whitespace)
RUN_CHARS = 1 << 20  # the longest piece: a run without whitespace longer than this is cut
GROUP_CHARS = 1 << 18  # text per tokenizer call
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends
PARENT_POLL = 1.0  # seconds between a worker's looks at its parent, where prctl is missing
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def available_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_workers(workers: int) -> int:
    """A number of worker processes: at least 1 and at most the available cores (ELFError otherwise)."""
    if workers < 1:
        raise ELFError(f"--workers must be at least 1, got {workers}")
    cores = available_cores()
    if workers > cores:
        raise ELFError(f"--workers {workers} is more than the {cores} CPU core{'s' if cores > 1 else ''} this process "
                       f"may use; pass at most {cores} (leave it out to use them all)")
    return workers


def _tokenize(space, texts: list[str], max_chars: int) -> list[np.ndarray]:
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
            src = field_text(obj, fields[0], path, first + k, on_bad, "--source-field") if obj is not None else None
            tgt = field_text(obj, fields[1], path, first + k, on_bad, "--target-field") if src is not None else None
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
                report_bad(on_bad, f"{name}: record {first + k + 1} has an empty source")
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


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_POLL)
        if os.getppid() != parent:
            os._exit(1)


def _worker_start(parent: int) -> None:
    """A worker's first act: SIGINT and SIGTERM ignored (the main process handles them and ends the pool; they
    were held back since the fork), and an end with the main process however it ends: the kernel's SIGKILL
    on Linux (PR_SET_PDEATHSIG), else a thread that watches the parent's pid."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    try:
        import ctypes

        asked = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        asked = False
    if not asked:
        threading.Thread(target=_watch_parent, args=(parent,), name="elflow-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the main process ended before this one could ask
        os._exit(1)


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM held back in this thread while workers may be forked, so that a new worker never runs
    the main process's handlers; a signal held back arrives when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _in_worker(task):
    with contextlib.redirect_stderr(io.StringIO()) as err:  # warnings go back to the main process, in order
        result = _run_task(task, _WORKER["space"], _WORKER["max_chars"])
    return result, err.getvalue()


def _in_process(task, space, max_chars):
    with contextlib.redirect_stderr(io.StringIO()) as err:
        result = _run_task(task, space, max_chars)
    return result, err.getvalue()


def ordered_results(tasks: Iterator, space, workers: int, max_chars: int) -> Iterator:
    """(meta, (result, warnings)) per task, in the tasks' order; `workers` > 1 (at most the available cores)
    runs them in forked processes (`_worker_start`), at most WINDOW per worker in flight (so the main process
    never reads far ahead)."""
    if workers <= 1:
        for task, meta in tasks:
            yield meta, _in_process(task, space, max_chars)
        return
    check_workers(workers)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _WORKER.update(space=space, max_chars=max_chars)
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; the processes are the parallelism
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_start,
                               initargs=(os.getpid(),))
    pending: deque = deque()
    try:
        try:
            for task, meta in tasks:
                with _signals_held():  # a submit may fork the workers
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

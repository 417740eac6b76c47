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

from elflow.data.sources import WINDOW
from elflow.util.errors import ELFError

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


def _in_process(task, space, max_chars):
    with contextlib.redirect_stderr(io.StringIO()) as err:  # warnings go back to the main process, in order
        result = task.run(space, max_chars)
    return result, err.getvalue()


def _in_worker(task):
    return _in_process(task, _WORKER["space"], _WORKER["max_chars"])


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

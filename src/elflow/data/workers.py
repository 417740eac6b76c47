"""Tokenizing a source's tasks, in this process or in forked workers, in the source's order. Workers are at
most the available cores, leave SIGINT and SIGTERM to the main process and end with it. Each worker has pipes of
its own (no lock is shared between processes), so a worker that dies, killed by the system or the OOM killer, is
seen at once through its process sentinel: one line, every other worker ended, nothing left waiting."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import deque
from typing import Iterator

from elflow.data.origins import WINDOW
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


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the `__cause__` of that exception in the main process:
    a failure of elflow's own code shows where it happened)."""

    def __str__(self):
        return self.args[0]


def _portable(e: BaseException) -> tuple:
    """An exception of a worker as it travels to the main process: itself where it pickles (an ELFError is
    re-raised there as the one line it is in one process), else its type and text."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        pickle.loads(pickle.dumps(e))
        return e, tb
    except Exception:  # noqa: BLE001 (an exception that does not pickle: its text travels)
        kind = ELFError if isinstance(e, ELFError) else RuntimeError
        return kind(f"{type(e).__name__}: {e}"), tb


def _worker_main(parent: int, space, max_chars: int, tasks, results, inherited: list) -> None:
    """A worker's life: tasks received from its own pipe (by a thread, so that the main process never waits
    to hand over a task while this process sends a result), run in order, each result or error sent back on
    its own pipe; ends when the main process closes the task pipe or ends."""
    _worker_start(parent)
    for conn in inherited:  # the main process's ends of every pipe, copied by the fork: not this worker's
        conn.close()
    import queue

    inbox: queue.Queue = queue.Queue()

    def receive():
        while True:
            try:
                inbox.put(tasks.recv())
            except (EOFError, OSError):
                inbox.put(None)
                return

    threading.Thread(target=receive, name="elflow-worker-inbox", daemon=True).start()
    while True:
        task = inbox.get()
        if task is None:
            break
        try:
            out = ("ok", _in_process(task, space, max_chars))
        except BaseException as e:  # noqa: BLE001 (sent to the main process, which raises it)
            out = ("error", _portable(e))
        try:
            results.send(out)
        except (OSError, EOFError):  # the main process is gone
            break
    os._exit(0)


def _ending(code: int | None) -> str:
    if code is None:
        return "it ended"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit status {code}"


class _Pool:
    """`workers` forked processes, each with a pipe for its tasks and one for its results."""

    def __init__(self, workers: int, space, max_chars: int):
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self.procs, self.sends, self.receives, self.busy = [], [], [], []
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered here is written again by a worker
        try:
            for _ in range(workers):
                task_r, task_w = ctx.Pipe(duplex=False)
                result_r, result_w = ctx.Pipe(duplex=False)
                inherited = [*self.sends, *self.receives, task_w, result_r]
                proc = ctx.Process(target=_worker_main, name="elflow-prepare-worker", daemon=True,
                                   args=(os.getpid(), space, max_chars, task_r, result_w, inherited))
                with _signals_held():  # a new worker never runs the main process's handlers
                    proc.start()
                task_r.close()
                result_w.close()
                self.procs.append(proc)
                self.sends.append(task_w)
                self.receives.append(result_r)
                self.busy.append(0)
        except BaseException:
            self.close()
            raise

    def died(self, k: int) -> ELFError:
        proc = self.procs[k]
        proc.join(timeout=1.0)
        why = "; the system kills so when memory runs out" if proc.exitcode == -signal.SIGKILL else ""
        return ELFError(f"a prepare worker process (pid {proc.pid}) died ({_ending(proc.exitcode)}{why}); nothing "
                        "of this prepare was kept: run again, with fewer --workers if memory is short")

    def send(self, task) -> int:
        """Hand `task` to the least busy worker; returns which."""
        k = min(range(len(self.procs)), key=lambda i: self.busy[i])
        try:
            self.sends[k].send(task)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise self.died(k) from None
        self.busy[k] += 1
        return k

    def receive(self, k: int):
        """The next result of worker k (its tasks' results come in the order it was given them); a worker
        that died, this one or another, is an ELFError at once."""
        from multiprocessing.connection import wait

        conn = self.receives[k]
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        while True:
            ready = wait([conn, *sentinels], timeout=1.0)
            if conn in ready:
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    raise self.died(k) from None
                break
            for s in ready:
                raise self.died(sentinels[s])
        self.busy[k] -= 1
        if status == "error":
            error, tb = payload
            error.__cause__ = RemoteTraceback(f"\n(in a prepare worker)\n{tb}")
            raise error
        return payload

    def close(self) -> None:
        """End every worker now (nothing of theirs is needed any more) and wait for each."""
        for proc in self.procs:
            if proc.exitcode is None:
                with contextlib.suppress(OSError):
                    proc.kill()
        for proc in self.procs:
            proc.join(timeout=10.0)
        for conn in (*self.sends, *self.receives):
            with contextlib.suppress(OSError):
                conn.close()


def ordered_results(tasks: Iterator, space, workers: int, max_chars: int) -> Iterator:
    """(meta, (result, warnings)) per task, in the tasks' order; `workers` > 1 (at most the available cores)
    runs them in forked processes (`_worker_start`), at most WINDOW per worker in flight (so the main process
    never reads far ahead). An error in a worker is raised here as it is (an ELFError: the same one line as in
    one process); a worker that dies is one ELFError, and every worker is ended before this returns or
    raises."""
    if workers <= 1:
        for task, meta in tasks:
            yield meta, _in_process(task, space, max_chars)
        return
    check_workers(workers)
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; the processes are the parallelism
    pool = None
    try:
        pool = _Pool(workers, space, max_chars)
        pending: deque = deque()
        tasks = iter(tasks)
        more = True
        while True:
            while more and len(pending) < WINDOW * workers:
                item = next(tasks, None)
                if item is None:
                    more = False
                    break
                task, meta = item
                pending.append((meta, pool.send(task)))
            if not pending:
                return
            meta, k = pending.popleft()
            yield meta, pool.receive(k)
    finally:
        if pool is not None:
            pool.close()
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old

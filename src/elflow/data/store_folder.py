"""A token store's folder: the names of its files, the lock its writer holds, and the replacement of one store
by another, built beside it in `.prepare-new` and swapped in whole (`swap_in`); a swap that was interrupted is
finished or undone by the next command that opens the folder (`finish_swap`, `recover`)."""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from elflow.util.errors import ELFError

IDS, OFFSETS, MANIFEST = "ids.bin", "offsets.bin", "manifest.json"


PARTIAL = ".partial"


LOCK = ".prepare.lock"


STAGE = ".prepare-new"  # the new store of a replacement, built here until it is complete, then swapped in


STORE_FILES = (MANIFEST, IDS, OFFSETS, IDS + PARTIAL, OFFSETS + PARTIAL, LOCK, STAGE)  # all that a store may own


def holds_store_files(folder) -> bool:
    """Whether `folder` holds any file of a store (complete or not), the lock aside."""
    return any(os.path.lexists(Path(folder) / n) for n in STORE_FILES if n != LOCK)


def file_lock(path, wait: bool = True):
    """An exclusive `flock` on the file `path` (created if missing), released when the returned file is closed
    or the process ends, even when it is killed. `wait=False` returns None when another process holds it."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        f.close()
        return None
    return f


def store_lock(folder, wait: bool = True):
    """The lock a store's writer holds: `folder/.prepare.lock` (see `file_lock`)."""
    return file_lock(Path(folder) / LOCK, wait)


def locked_by_other(folder: Path) -> bool:
    import fcntl

    if not (folder / LOCK).exists():
        return False
    with open(folder / LOCK, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


@contextmanager
def folder_flock(folder: Path, exclusive: bool):
    """A `flock` on the folder itself for the moment of a swap (exclusive) or of opening a store's files
    (shared): a reader never opens the arrays of one store with the manifest of another. Where the file
    system has no such locks, nothing is held."""
    import fcntl

    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------
# Replacing a store: the new one is complete in STAGE before the old one is touched
def swap_in(folder) -> None:
    """Replace the store in `folder` by the complete one in `folder/.prepare-new`: the old manifest goes first
    (the folder then holds no complete store), the new arrays replace the old ones, the new manifest comes
    last, and the stage goes. Interrupted anywhere, `finish_swap` completes it."""
    folder = Path(folder)
    stage = folder / STAGE
    with folder_flock(folder, exclusive=True):
        for name in (MANIFEST, IDS + PARTIAL, OFFSETS + PARTIAL):
            try:
                os.unlink(folder / name)
            except FileNotFoundError:
                pass
        for name in (IDS, OFFSETS, MANIFEST):
            if (stage / name).exists():
                os.replace(stage / name, folder / name)
        _sync_folder(folder)
        shutil.rmtree(stage, ignore_errors=True)


def finish_swap(folder) -> str | None:
    """A replacement that was interrupted (the caller holds the store's lock): finished when its new store was
    complete (its manifest is in the stage: "finished"), else undone, the stage removed and the old store as
    it was ("undone"). None when there was none."""
    folder = Path(folder)
    stage = folder / STAGE
    if not os.path.lexists(stage):
        return None
    if stage.is_dir() and not stage.is_symlink() and (stage / MANIFEST).is_file():
        swap_in(folder)
        return "finished"
    if stage.is_dir() and not stage.is_symlink():
        shutil.rmtree(stage)
    else:
        os.unlink(stage)
    return "undone"


def recover(folder: Path) -> None:
    """For a reader: a replacement interrupted in `folder` is finished or undone first (left alone while a
    prepare holds the folder: the old store stays whole until that prepare swaps its new one in)."""
    try:
        lock = store_lock(folder, wait=False)
    except OSError as e:
        raise ELFError(f"{folder} holds {STAGE}, left by an `elflow prepare --overwrite` that was stopped, and the "
                       f"folder cannot be written to finish or undo it ({e.strerror or e}); run `elflow prepare` "
                       "there again with --overwrite where it can be written") from None
    if lock is None:
        return
    try:
        what = finish_swap(folder)
    finally:
        try:
            os.unlink(folder / LOCK)
        except FileNotFoundError:
            pass
        lock.close()
    if what == "finished":
        print(f"warning: finished replacing the store in {folder}: the `elflow prepare --overwrite` that built "
              "its new one was stopped while swapping it in", file=sys.stderr)
    elif what == "undone":
        print(f"warning: removed the unfinished new store that a stopped `elflow prepare --overwrite` left in "
              f"{folder}; the store there is as it was", file=sys.stderr)

"""Where a command writes: the one check of every output path and the one writer of a command's files.

Every output path of every command is checked before any work by `check_out`: the file rule of
`util.files.check_output` (no link, device, fifo or socket; an existing file only with --overwrite; a writable
place), and no output inside a run folder (a folder holding run.json), whose files belong to the run, except
under the evaluated run's own `eval/` (or `sweep/`) folder, where eval's and sweep's defaults put them. A
command's files (eval's samples and report, sample's samples, trajectory and page) are written together once
everything is computed (`Outputs`): a command that is refused, fails or is stopped leaves none of them behind.
"""

from __future__ import annotations

import os
from pathlib import Path

from elflow.runs.folder import RUN_FILE, run_folders_holding
from elflow.util.errors import ELFError
from elflow.util.files import check_output, resolved


def own_run(checkpoint) -> Path | None:
    """The run folder (resolved) that the local folder `checkpoint` is or lies in: a run folder, one of its
    checkpoint folders; None for a hub id, a file, or a model folder outside every run."""
    if checkpoint is None:
        return None
    path = Path(checkpoint).expanduser()
    if not path.is_dir():
        return None
    runs = run_folders_holding(path)
    return runs[0] if runs else None


def default_folder(checkpoint, name: str, fallback: Path) -> Path:
    """The default output folder `name` ("eval", "sweep") of a model: RUN/NAME for a run folder, RUN/NAME/CKPT
    for its checkpoint folder CKPT (never inside the checkpoint, which the run prunes and replaces),
    FOLDER/NAME for a model folder outside every run, else `fallback` (a hub id)."""
    path = Path(checkpoint).expanduser()
    run = own_run(path)
    if run is None:
        return path / name if path.is_dir() else fallback
    for p in (path, *path.parents):  # the run as the path names it (relative stays relative)
        if (p / RUN_FILE).is_file() and p.resolve() == run:
            run_path = p
            break
    else:
        run_path = run
    return run_path / name if path.resolve() == run else run_path / name / path.resolve().name


def check_out(path, overwrite: bool = False, flag: str = "--out", folder: bool = False,
              allowed: Path | None = None) -> Path:
    """Check an output path before any work: the file rule (`check_output`) and the run rule
    (`check_outside_runs`); returns the path, expanded."""
    path = check_output(path, overwrite, flag, folder)
    check_outside_runs(path, flag, allowed)
    return path


def check_outside_runs(path, flag: str, allowed: Path | None = None) -> None:
    """Refuse an output `path` (file or folder) that is a run folder or lies inside one, unless it lies under
    `allowed` (the evaluated run's own RUN/eval or RUN/sweep) and that run is the innermost one holding it."""
    runs = run_folders_holding(path)
    if not runs:
        return
    resolved_path = resolved(path)
    if allowed is not None:
        allowed = resolved(allowed)
        if runs[0] == allowed.parent and (resolved_path == allowed or allowed in resolved_path.parents):
            return
    where = "is the folder of a run" if resolved_path == runs[0] else f"lies inside {runs[0]}, the folder of a run"
    own = f" (those of the run {allowed.parent} itself go under {allowed})" if allowed is not None else ""
    raise ELFError(f"{flag} {path} {where}; elflow writes no output among a run's files, which `train --overwrite` "
                   f"would take{own}: choose another {flag}")


class Outputs:
    """The files one command writes, each checked before any work (`add`) and written together at the end
    (`write`): a failure or a stop while writing removes the ones already written, so the set is complete or
    absent."""

    def __init__(self, overwrite: bool):
        self.overwrite = bool(overwrite)
        self.paths: list[Path] = []

    def add(self, path, flag: str = "--out", allowed: Path | None = None, inside_checked: bool = False) -> Path:
        """Check `path` (the output rule; not inside a run folder but under `allowed`, unless `inside_checked`:
        a place the caller chose and checked) and keep it; a path named twice is refused (two outputs that
        would overwrite each other)."""
        path = check_output(path, self.overwrite, flag) if inside_checked else check_out(
            path, self.overwrite, flag, allowed=allowed)
        key = os.path.abspath(path)
        if any(os.path.abspath(p) == key for p in self.paths):
            raise ELFError(f"{flag} {path} is named twice among this command's outputs; give each its own path")
        self.paths.append(path)
        return path

    def write(self, writers: dict) -> None:
        """`writers`: {path: function(path, overwrite)} for every path added, in the order to write them."""
        missing = [str(p) for p in self.paths if p not in writers]
        if missing:
            raise ValueError(f"no writer for {', '.join(missing)}")
        placed: list[Path] = []
        try:
            for path in self.paths:
                writers[path](path, self.overwrite)
                placed.append(path)
        except BaseException:
            for path in placed:
                try:
                    path.unlink()
                except OSError:
                    pass
            raise

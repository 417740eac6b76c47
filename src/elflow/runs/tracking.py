"""Weights & Biases: one W&B run per elflow run folder (resumed with it), its settings, records and samples."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from elflow.util import jsonio
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_json, check_own, own_folder

ID_FILE = "wandb-run.json"  # in a run folder: {"project", "id", "name"} of its W&B run


HELP_PROJECT = ("log to this Weights & Biases project (needs `pip install \"elflow[wandb]\"`; WANDB_MODE=offline "
                "logs without an account); default: no W&B logging")


def require_wandb():
    """The wandb module, with $WANDB_DIR usable where it is set (`check_wandb_dir`); a one-line ELFError when it
    is not installed."""
    try:
        import wandb
    except ImportError:
        raise ELFError("--wandb needs the wandb package, which is not installed: pip install \"elflow[wandb]\" "
                       "(or pip install wandb)") from None
    check_wandb_dir()
    return wandb


def _unusable_folder(path: Path) -> str:
    """Why W&B cannot write under `path` (made where missing), "" if it can: the path, or its nearest parent that
    exists, must be a folder this process may write."""
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a folder" if probe == path else f"{probe} is not a folder, so {path} cannot be made"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} cannot be written by this user" + ("" if probe == path else f", so {path} cannot be made")
    return ""


def check_wandb_dir() -> None:
    """$WANDB_DIR, where it is set, a folder W&B can write its files under (or make); checked before anything is
    written: one ELFError naming the variable otherwise."""
    chosen = os.environ.get("WANDB_DIR")
    if not chosen:
        return
    why = _unusable_folder(Path(chosen).expanduser())
    if why:
        raise ELFError(f"WANDB_DIR={chosen}: {why}; W&B writes its files there. Set WANDB_DIR to a folder you can "
                       "write, or unset it to keep them in the run folder")


def _stored(folder: Path, project: str) -> dict | None:
    """The W&B run recorded in `folder` for `project`, if any (a garbled record is none: the new run's id
    replaces it). A link, a fifo or a device in its place is an ELFError naming it (`check_own`)."""
    path = folder / ID_FILE
    check_own(path, "the id of the run's W&B run")
    if not os.path.lexists(path):
        return None
    try:
        info = jsonio.read_json(path, max_bytes=jsonio.RECORD_BYTES, own=True)
    except ELFError:
        return None
    return info if isinstance(info, dict) and info.get("project") == project and info.get("id") else None


def wandb_dir(folder: Path) -> Path:
    """The folder W&B writes its own files under (in a `wandb` folder): $WANDB_DIR where it is set, as W&B
    itself reads it, else the run folder, whose `wandb` folder is then made (never a link: `own_folder`)."""
    chosen = os.environ.get("WANDB_DIR")
    if not chosen:
        own_folder(folder / "wandb", "the run's W&B files")
        return folder
    path = Path(chosen).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ELFError(f"WANDB_DIR={chosen}: cannot be made a folder ({e.strerror or e}); W&B writes its files "
                       "there. Set WANDB_DIR to a folder you can write, or unset it") from None
    return path


class Tracker:
    """One W&B run. Numbers go to its history at the step given, texts to tables that grow row by row."""

    def __init__(self, run, wandb):
        self.run, self.wandb = run, wandb
        self.tables: dict[str, object] = {}

    @classmethod
    def start(cls, project: str | None, name: str | None, folder: str | os.PathLike, config: dict,
              job_type: str, keep_id: bool = False, quiet: bool = False) -> "Tracker | None":
        """A W&B run in `project` whose files go under FOLDER/wandb, or under $WANDB_DIR/wandb where WANDB_DIR is
        set (None when `project` is empty). With `keep_id`, the run's id is kept in FOLDER/wandb-run.json and a
        later start continues that run."""
        if not project:
            return None
        wandb = require_wandb()
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        stored = _stored(folder, project) if keep_id else None
        files = wandb_dir(folder)
        try:
            run = wandb.init(project=project, name=name or (stored or {}).get("name") or folder.resolve().name,
                             id=stored["id"] if stored else None, resume="allow", dir=str(files), config=config,
                             job_type=job_type,
                             settings=wandb.Settings(silent=quiet, console="off"))
        except Exception as e:  # no login, no network, a bad project name: wandb's own error, in one line
            first = " ".join(str(e).split())[:300]
            raise ELFError(f"Weights & Biases could not start a run in project {project!r} ({type(e).__name__}: "
                           f"{first}); log in with `wandb login`, or set WANDB_MODE=offline to keep the run in "
                           f"{files / 'wandb'} and `wandb sync` it later") from None
        if keep_id:
            atomic_write_json(folder / ID_FILE, {"project": project, "id": run.id, "name": run.name})
        return cls(run, wandb)

    def log(self, rec: dict, step: int | None = None) -> None:
        """The numbers of `rec` (others, and None, are left out) at `step`."""
        data = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                and k != "step"}
        if data:
            self.run.log(data, step=step)

    def samples(self, texts: list[str], step: int, key: str = "samples") -> None:
        """Texts made at training step `step`, added to the table `key` (columns step, index, text)."""
        self.table(key, ["step", "index", "text"], [[step, i, t] for i, t in enumerate(texts)], step)

    def table(self, key: str, columns: list[str], rows: list[list], step: int | None = None) -> None:
        """Rows added to the table `key` (one table per key, logged incrementally)."""
        if key not in self.tables:
            self.tables[key] = self.wandb.Table(columns=columns, log_mode="INCREMENTAL")
        for row in rows:
            self.tables[key].add_data(*row)
        self.run.log({key: self.tables[key]}, step=step)

    def image(self, key: str, path: str | os.PathLike) -> None:
        self.run.log({key: self.wandb.Image(str(path))})

    def summary(self, values: dict) -> None:
        """Final figures (numbers and strings) in the run's summary."""
        for k, v in values.items():
            if isinstance(v, (int, float, str)) and not isinstance(v, bool):
                self.run.summary[k] = v

    def finish(self, ok: bool = True) -> None:
        try:
            self.run.finish(exit_code=0 if ok else 1)
        except Exception as e:  # a failed upload must not hide the command's own outcome
            print(f"warning: Weights & Biases did not finish cleanly ({type(e).__name__}: {e})", file=sys.stderr)

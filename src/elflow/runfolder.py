"""The run folder: its lock, what --overwrite and --resume may do with it, and what a run writes there besides
its checkpoints (metrics.jsonl, TensorBoard, loss.png).

A command that writes a run folder holds it (`RunFolder`, rank 0): the lock, the clean-up of saves and
replacements that were interrupted, and the run being replaced, which is set aside (RUN/.replaced-run) and comes
back if the new run fails before its first checkpoint. `check_run_dir` says what --resume / --overwrite may do
with the folder as it is, before anything changes; `stored_config` reads the settings of the run it holds.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from elflow.checkpoint import (REPLACED, RUN_FILES, list_checkpoints, recover_replaced, remove_stale_temporaries,
                               restore_aside, set_aside)
from elflow.flow import TIME_BINS, time_bin_labels
from elflow.runconfig import TrainConfig, mutable_flags, resume_conflicts
from elflow.utils import ELFError, FolderHold, FolderLock, NoSpace, atomic_write, atomic_write_text, read_json

__all__ = ["RUN_FILES", "REPLACED", "RunFolder", "check_run_dir", "stored_config", "RunLogger", "plot_losses",
           "no_space", "read_metrics", "trim_metrics"]


class RunFolder:
    """Rank 0's hold on the run folder (`FolderHold`: made, locked, the folders it made removed after a
    failure), the clean-up of interrupted saves and replacements, and the run being replaced, which is set
    aside and comes back if the new run fails before its first checkpoint."""

    def __init__(self, out: Path, command: str):
        self.out, self.command = out, command
        self.hold = FolderHold(out, command)
        self.aside = out / REPLACED

    @property
    def lock(self):
        return self.hold.lock

    def open(self) -> None:
        self.hold.open()
        self.recover()
        for p in remove_stale_temporaries(self.out):
            print(f"removed {p}, left by a save that was interrupted", file=sys.stderr)

    def recover(self) -> None:
        """A replacement interrupted before the new run's first checkpoint: the old run comes back."""
        if recover_replaced(self.out, lambda d: bool(list_checkpoints(d))) == "restored":
            print(f"restored the run in {self.out} that an interrupted --overwrite was replacing", file=sys.stderr)

    def set_aside(self) -> None:
        """Move the run's own files (never other files) out of the way of the new run."""
        set_aside(self.out)

    def commit(self) -> None:
        """The new run has a checkpoint: the replaced run is dropped."""
        if self.aside.is_dir():
            shutil.rmtree(self.aside)

    def close(self, ok: bool) -> None:
        if self.hold.lock is None:  # the folder was never ours (another command holds it)
            return
        try:
            if not ok and self.aside.is_dir():
                restore_aside(self.out)
        finally:
            self.hold.close(ok)


def check_run_dir(out: Path, cfg: TrainConfig, resume: bool, overwrite: bool) -> None:
    """What --resume / --overwrite may do with the folder as it is; the folder is not changed here."""
    ours = {FolderLock.NAME, REPLACED}
    if not (out / "run.json").exists():
        if resume:
            raise ELFError(f"{out} holds no run to resume; check --out, or start the run without --resume")
        if out.is_dir() and any(p.name not in ours for p in out.iterdir()) and not overwrite:
            raise ELFError(f"{out} exists and is not an elflow run folder; choose another --out or pass --overwrite "
                           "(its files are left as they are)")
        return
    if overwrite:
        return
    if not resume:
        raise ELFError(f"{out} already holds a run; pass --resume to continue it or --overwrite to replace it")
    diff = resume_conflicts(stored_config(out), cfg)
    if diff:
        raise ELFError(f"{out} holds a different run ({'; '.join(diff)}); on --resume only "
                       f"{mutable_flags()} may change. Resume it with its "
                       "own settings, or choose another --out")


def stored_config(out: Path) -> TrainConfig:
    """The resolved and checked settings of the run in `out` (of the run an interrupted --overwrite set aside,
    which the next start brings back). A file that cannot be read, or a setting out of range, is a one-line
    error naming run.json and the setting as it is stored."""
    src = out
    if (out / REPLACED / "run.json").exists() and not list_checkpoints(out):
        src = out / REPLACED
    path = src / "run.json"
    if not path.exists():
        raise ELFError(f"{out} holds no run to resume; check --out, or start the run without --resume")
    return read_train_config(read_json(path).get("train"), path)


def read_train_config(train, path) -> TrainConfig:
    """A stored run description ("train" of run.json or of a checkpoint's state.json) as a checked
    TrainConfig; ELFError naming `path` and the stored setting."""
    if not isinstance(train, dict):
        raise ELFError(f"{path}: corrupted (\"train\" must be a JSON object of settings, got "
                       f"{type(train).__name__})")
    try:
        cfg = TrainConfig.from_dict(train).resolved()
    except (ValueError, KeyError, TypeError) as e:
        raise ELFError(f"{path}: its settings cannot be read ({type(e).__name__}: {e})") from None
    cfg.validate(stored=path)
    return cfg


def no_space(e: BaseException, out: Path) -> ELFError:
    """The one-line error of a full disk while writing the run in `out`, naming its last good checkpoint."""
    good = list_checkpoints(out)
    last = f"step {int(good[-1].name[5:])}" if good else "none"
    where = e.path if isinstance(e, NoSpace) else (getattr(e, "filename", None) or out)
    return ELFError(f"no space left on device: {where}; last good checkpoint: {last}; free some space, "
                    "then run again with --resume")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line that is not a JSON object (the half-written last line of a
    killed run) is passed over."""
    recs = []
    try:
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return recs
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            recs.append(rec)
    return recs


def trim_metrics(out: Path, step: int) -> int:
    """On resume from the checkpoint at `step`: metrics.jsonl keeps its records up to that step (a killed
    run logged past its last checkpoint; those steps are trained again) and loses a half-written last line.
    Returns how many lines went."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    raw = path.read_bytes().decode("utf-8", errors="replace")
    kept, dropped = [], 0
    for line in raw.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        steps = rec.get("step") if isinstance(rec, dict) else None
        if not isinstance(rec, dict) or (isinstance(steps, (int, float)) and steps > step):
            dropped += bool(line.strip())
            continue
        kept.append(line)
    if dropped or (raw and not raw.endswith("\n")):
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return dropped


class RunLogger:
    """Rank 0's output: a progress bar, metrics.jsonl, optional TensorBoard, the loss-curve PNG."""

    def __init__(self, out: Path, total: int, start: int, enabled: bool, tensorboard: bool, show: bool = True):
        self.out, self.enabled, self.show = out, enabled, show
        self.bar = None
        self.tb = None
        if enabled and show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(str(out / "tb"))
                except ImportError:
                    print("warning: TensorBoard is not installed (pip install tensorboard); logging to JSONL only",
                          file=sys.stderr)

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])

    def advance(self, n: int, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix(postfix, refresh=False)

    def write(self, msg: str) -> None:
        if self.enabled and self.show:
            (self.bar.write if self.bar is not None else print)(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def plot_losses(run_dir: Path) -> None:
    """loss.png: total, denoise and decode losses, and the denoising loss per time bin."""
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind", "train") == "train"
            and isinstance(r.get("step"), (int, float))]
    if not recs:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in recs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for key in ("loss", "loss_denoise", "loss_decode", "loss_per_token"):
        ys = [r.get(key) for r in recs]
        pts = [(s, y) for s, y in zip(steps, ys) if y is not None]
        if pts:
            a.plot(*zip(*pts), label=key, lw=1)
    a.set_yscale("log")
    a.set_xlabel("step")
    a.legend()
    a.set_title("training loss")
    for i, label in enumerate(time_bin_labels()):
        key = f"loss_{label}"
        pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
        if pts:
            b.plot(*zip(*pts), label=f"t in [{TIME_BINS[i]}, {TIME_BINS[i + 1]})", lw=1)
    if b.lines:  # ELF's denoising loss per time bin (a token-level baseline has none)
        b.set_yscale("log")
        b.legend(fontsize=7)
    b.set_xlabel("step")
    b.set_title("denoising loss per time bin")
    fig.tight_layout()
    with atomic_write(run_dir / "loss.png") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)



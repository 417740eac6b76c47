"""The run folder: its lock, what --overwrite and --resume may do with it, and what a run writes there besides
its checkpoints (metrics.jsonl, TensorBoard, loss.png).

A command that writes a run folder holds it (`RunFolder`, rank 0): the lock, the clean-up of saves and
replacements that were interrupted, and the run being replaced, which is set aside (RUN/.replaced-run) and comes
back if the new run fails before its first checkpoint. `check_run_dir` says what --resume / --overwrite may do
with the folder as it is, before anything changes; `stored_config` reads the settings of the run it holds.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

from elflow.checkpoint import list_checkpoints, remove_stale_temporaries
from elflow.flow import TIME_BINS, time_bin_labels
from elflow.runconfig import TrainConfig, mutable_flags, resume_conflicts
from elflow.tracking import ID_FILE
from elflow.utils import ELFError, FolderLock, atomic_write

__all__ = ["RUN_FILES", "REPLACED", "DECODER_STAGE", "RunFolder", "check_run_dir", "in_first_stage", "stored_config",
           "RunLogger", "plot_losses", "loss_figure", "training_records", "no_space"]


RUN_FILES = ("run.json", "metrics.jsonl", "loss.png", "checkpoints", "tb", "report.json", "samples.jsonl",
             "wandb", ID_FILE)
REPLACED = ".replaced-run"  # the run that --overwrite replaces, kept until the new run's first checkpoint
DECODER_STAGE = "decoder"  # the first stage of a --decoder separate run, a run folder of its own inside it


class RunFolder:
    """Rank 0's hold on the run folder: its lock, the clean-up of interrupted saves and replacements, and the
    run being replaced, which is set aside and comes back if the new run fails before its first checkpoint."""

    def __init__(self, out: Path, command: str):
        self.out, self.command = out, command
        self.lock = None
        self.created: list[Path] = []
        self.aside = out / REPLACED

    def open(self) -> None:
        p = self.out
        while not p.exists() and p != p.parent:
            self.created.append(p)
            p = p.parent
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ELFError(f"--out {self.out}: cannot create it ({e.strerror or e})") from None
        self.lock = FolderLock(self.out, self.command).acquire()
        self.recover()
        for p in remove_stale_temporaries(self.out):
            print(f"removed {p}, left by a save that was interrupted", file=sys.stderr)

    def recover(self) -> None:
        """A replacement interrupted before the new run's first checkpoint: the old run comes back."""
        if not self.aside.is_dir():
            return
        if list_checkpoints(self.out):
            shutil.rmtree(self.aside)
        else:
            self._restore_aside()
            print(f"restored the run in {self.out} that an interrupted --overwrite was replacing", file=sys.stderr)

    def set_aside(self) -> None:
        """Move the run's own files (never other files) out of the way of the new run."""
        self.aside.mkdir()
        for name in RUN_FILES:
            if (self.out / name).exists():
                os.rename(self.out / name, self.aside / name)

    def commit(self) -> None:
        """The new run has a checkpoint: the replaced run is dropped."""
        if self.aside.is_dir():
            shutil.rmtree(self.aside)

    def _restore_aside(self) -> None:
        # every run file now in the folder was written by the new run: the old run's were all set aside
        for name in RUN_FILES:
            new = self.out / name
            if new.is_dir():
                shutil.rmtree(new)
            elif new.exists():
                new.unlink()
            if (self.aside / name).exists():
                os.rename(self.aside / name, new)
        self.aside.rmdir()

    def close(self, ok: bool) -> None:
        if self.lock is None:  # the folder was never ours (another command holds it)
            return
        try:
            if not ok and self.aside.is_dir():
                self._restore_aside()
        finally:
            if self.lock is not None:
                self.lock.release()
            if not ok:
                for p in self.created:  # folders this command made, if it left nothing in them
                    try:
                        p.rmdir()
                    except OSError:
                        break


def check_run_dir(out: Path, cfg: TrainConfig, resume: bool, overwrite: bool, device=None) -> None:
    """What --resume / --overwrite may do with the folder as it is; the folder is not changed here. `device`:
    where the run resumes (a stored dtype "auto" is read as what it picks there)."""
    ours = {FolderLock.NAME, REPLACED, DECODER_STAGE}
    if not (out / "run.json").exists() and not in_first_stage(out):
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
    diff = resume_conflicts(stored_config(out), cfg, device)
    if diff:
        raise ELFError(f"{out} holds a different run ({'; '.join(diff)}); on --resume only "
                       f"{mutable_flags()} may change. Resume it with its "
                       "own settings, or choose another --out")


def in_first_stage(out: Path) -> bool:
    """Whether `out` holds a --decoder separate run that has not yet started its second stage."""
    return not (out / "run.json").exists() and (out / DECODER_STAGE / "run.json").exists()


def stored_config(out: Path) -> TrainConfig:
    """The resolved settings of the run in `out` (of the run an interrupted --overwrite set aside, which the
    next start brings back)."""
    src = out
    if (out / REPLACED / "run.json").exists() and not list_checkpoints(out):
        src = out / REPLACED
    try:
        if in_first_stage(src):  # a --decoder separate run still in its decoder stage: the stage holds its settings
            return TrainConfig.from_dict(json.loads((src / DECODER_STAGE / "run.json").read_text())["stage_of"]
                                         ).resolved()
        meta = json.loads((src / "run.json").read_text())
        return TrainConfig.from_dict(meta["train"]).resolved()
    except FileNotFoundError:
        raise ELFError(f"{out} holds no run to resume; check --out, or start the run without --resume") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ELFError(f"{out / 'run.json'} cannot be read ({type(e).__name__}: {e})") from None


class RunLogger:
    """Rank 0's output: a progress bar, metrics.jsonl, optional TensorBoard and Weights & Biases (the same
    records), the samples shown during training, the loss-curve PNG.

    `tracker` is the run's W&B run (elflow.tracking.Tracker, started with the run's settings as its config):
    it gets every metrics record at its step and the samples as a table, and is finished by `close`."""

    def __init__(self, out: Path, total: int, start: int, enabled: bool, tensorboard: bool, show: bool = True,
                 tracker=None):
        self.out, self.enabled, self.show = out, enabled, show
        self.bar = None
        self.tb = None
        self.tracker = tracker if enabled else None
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
        if self.tracker is not None:
            self.tracker.log(rec, step=rec.get("step"))

    @property
    def wants_samples(self) -> bool:
        """Whether samples made during training go anywhere (the terminal or W&B)."""
        return self.enabled and (self.show or self.tracker is not None)

    def samples(self, step: int, texts: list[str]) -> None:
        """The samples of the EMA model at `step`: printed, and added to W&B's samples table."""
        for i, text in enumerate(texts):
            self.write(f"[step {step}] sample {i}: {text[:300]}")
        if self.tracker is not None:
            self.tracker.samples(texts, step)

    def advance(self, n: int, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix(postfix, refresh=False)

    def write(self, msg: str) -> None:
        if self.enabled and self.show:
            (self.bar.write if self.bar is not None else print)(msg)

    def close(self, ok: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.tracker is not None:
            self.tracker.finish(ok)


LOSS_NAMES = {"loss": "total", "loss_denoise": "denoising (v-space MSE)", "loss_decode": "decoding (cross-entropy)",
              "loss_per_token": "next-token / masked-token cross-entropy"}


LEGEND_BELOW = dict(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)  # off the curves


def _value_axis(ax, values: list[float]) -> None:
    """A log axis with a handful of labelled ticks across the data's own range (a narrow range such as 1.1-1.6
    gets ticks inside it); a linear axis where some value is not positive (a log axis would drop it)."""
    from matplotlib import ticker

    values = [v for v in values if math.isfinite(v)]
    if not values or min(values) <= 0:
        ax.set_yscale("linear")
        return
    ax.set_yscale("log")
    lo, hi = min(values), max(values)
    if hi / lo < 1.02:  # a flat curve: one tick at its value
        ticks = [float(f"{lo:.3g}")]
    else:
        ticks = sorted({float(f"{lo * (hi / lo) ** (k / 5):.2g}") for k in range(6)})
    ax.yaxis.set_major_locator(ticker.FixedLocator(ticks))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(ticker.NullLocator())


def training_records(run_dir: Path) -> list[dict]:
    """The training records of RUN/metrics.jsonl (kind "train"), in order; a line cut short by a killed run is
    skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    recs = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            recs.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in recs if isinstance(r, dict) and r.get("kind", "train") == "train"]


def plot_losses(run_dir: Path) -> None:
    """RUN/loss.png (loss_figure), written atomically; nothing without training records."""
    fig = loss_figure(run_dir)
    if fig is None:
        return
    import matplotlib.pyplot as plt

    with atomic_write(run_dir / "loss.png") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def loss_figure(run_dir: Path):
    """The training losses (total, denoising, decoding) and the denoising loss per time bin of RUN/metrics.jsonl;
    where the run folder holds a held-out report (RUN/report.json of `elflow quickstart`), the per-dimension
    Gaussian baseline's held-out denoising loss beside them, dashed (overall on the left, per bin on the
    right). None without training records."""
    recs = training_records(run_dir)
    if not recs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        val = json.loads((run_dir / "report.json").read_text()).get("validation") or {}
    except (OSError, ValueError, AttributeError):
        val = {}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 5.2))
    shown = []
    for key, name in LOSS_NAMES.items():
        pts = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
        if pts:
            line, = a.plot(*zip(*pts), label=name, lw=1.2, marker="o" if len(pts) < 12 else None, ms=3)
            shown += [y for _, y in pts]
            if key == "loss_denoise" and isinstance(val.get("baseline_loss"), (int, float)):
                a.axhline(val["baseline_loss"], ls="--", lw=1.2, color=line.get_color(),
                          label="denoising: Gaussian baseline (held-out)")
                shown.append(val["baseline_loss"])
    _value_axis(a, shown)
    a.set_xlabel("optimiser step")
    a.set_ylabel("training loss")
    a.set_title("training loss")
    a.legend(**LEGEND_BELOW)
    baseline = {v["t"]: v["baseline"] for v in val.get("bins", []) if isinstance(v.get("baseline"), (int, float))}
    shown = []
    for i, label in enumerate(time_bin_labels()):
        pts = [(r["step"], r[f"loss_{label}"]) for r in recs if isinstance(r.get(f"loss_{label}"), (int, float))]
        if pts:
            line, = b.plot(*zip(*pts), label=f"t in [{TIME_BINS[i]}, {TIME_BINS[i + 1]})", lw=1.2,
                           marker="o" if len(pts) < 12 else None, ms=3)
            shown += [y for _, y in pts]
            if label in baseline:
                b.axhline(baseline[label], ls="--", lw=1.2, color=line.get_color())
                shown.append(baseline[label])
    if b.lines:  # ELF's denoising loss per time bin (a token-level baseline has none)
        if baseline:
            b.plot([], [], ls="--", color="0.4", label="Gaussian baseline (held-out), same colour")
        _value_axis(b, shown)
        b.legend(**LEGEND_BELOW)
    else:
        b.text(0.5, 0.5, "no denoising loss: this method has no time bins", ha="center", va="center",
               transform=b.transAxes, fontsize=9, color="0.4")
        b.set_yticks([])
    b.set_xlabel("optimiser step")
    b.set_ylabel("denoising loss (v-space MSE)")
    b.set_title("denoising loss per time bin")
    fig.tight_layout()
    return fig


def no_space(e: OSError, out: Path) -> ELFError:
    """The one-line error of a full disk while writing the run in `out`, naming its last good checkpoint."""
    good = list_checkpoints(out)
    last = f"step {int(good[-1].name[5:])}" if good else "none"
    return ELFError(f"no space left on device: {e.filename or out}; last good checkpoint: {last}; free some space, "
                    "then run again with --resume")

"""The names of the files and folders a run, a checkpoint and a model folder hold: the one place they are
spelled. What may be done with a run folder is elflow.lifecycle.claim's; how a checkpoint is written and read,
elflow.runs.checkpoint's.

    RUN/run.json                      the run's record (elflow.runs.record) and how it runs
    RUN/metrics.jsonl, loss.png, tb/  its log, the loss figure, TensorBoard's events
    RUN/checkpoints/step_NNNNNNN/     model.safetensors, ema.safetensors, space.safetensors, optimizer.pt,
                                      state.json and state.sha256
    RUN/report.json, samples.jsonl    what `elflow quickstart` writes of its run
    RUN/decoder/                      the first stage of a --decoder separate run
    RUN/.replaced-run/                a run that --overwrite set aside until the new run's first checkpoint
    RUN/.run-before-resume.json       run.json as it was before a resume rewrote it, kept (with the step the
                                      resume started from) until the resume's first checkpoint has landed
    OUT/distill.json                  a distillation's manifest, beside its rounds OUT/<N>-step
"""

from __future__ import annotations

import re
from pathlib import Path

from elflow.runs.tracking import ID_FILE
from elflow.util.files import resolved

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"
TENSORBOARD = "tb"
WANDB_FOLDER = "wandb"
CHECKPOINTS = "checkpoints"
REPORT_FILE = "report.json"
SAMPLES_FILE = "samples.jsonl"
DECODER_STAGE = "decoder"
REPLACED = ".replaced-run"
EARLIER_RUN = ".run-before-resume.json"
DISTILL_MANIFEST = "distill.json"

STATE_FILE = "state.json"
STATE_HASH = "state.sha256"
MODEL_WEIGHTS = "model.safetensors"
EMA_WEIGHTS = "ema.safetensors"
SPACE_WEIGHTS = "space.safetensors"
OPTIMIZER_STATE = "optimizer.pt"
MODEL_CONFIG = "config.json"  # a model folder's record and file list

STEP_DIR = re.compile(r"step_(\d+)")

# the names a run's own files and folders may have: what --overwrite may set aside (and nothing else); run.json
# lists those a run writes (`run_files`, and what a command adds to a run: `runs.record.own_files_added`)
RUN_FILES = (RUN_FILE, METRICS_FILE, LOSS_PLOT, CHECKPOINTS, TENSORBOARD, REPORT_FILE, SAMPLES_FILE, WANDB_FOLDER,
             ID_FILE, EARLIER_RUN)


def run_files(tensorboard: bool = False, wandb: bool = False) -> tuple[str, ...]:
    """The names a training run writes into its folder: its record, metrics, loss plot and checkpoints, and the
    TensorBoard and W&B files when it logs there."""
    return (RUN_FILE, METRICS_FILE, LOSS_PLOT, CHECKPOINTS, *((TENSORBOARD,) if tensorboard else ()),
            *((WANDB_FOLDER, ID_FILE) if wandb else ()))


def step_dir(step: int) -> str:
    """The name of the checkpoint folder of `step`."""
    return f"step_{step:07d}"


def step_of(folder: Path) -> int:
    """The step of a checkpoint folder (step_NNNNNNN)."""
    return int(STEP_DIR.fullmatch(Path(folder).name).group(1))


def checkpoint_dir(run: str | Path, step: int) -> Path:
    return Path(run) / CHECKPOINTS / step_dir(step)


def run_folders_holding(path) -> list[Path]:
    """The run folders (folders with a run.json) that `path` is or lies in, innermost first, resolved: a run
    folder, a checkpoint folder's run, a run nested in another's folder and that one too."""
    path = resolved(path)
    return [p for p in (path, *path.parents) if (p / RUN_FILE).is_file()]

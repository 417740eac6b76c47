"""The files that store a run, written here alone: run.json and the state.json of each checkpoint (the weights
beside it are elflow.runs.checkpoint's); reading a model of any format is elflow.runs.load's.

    RUN/run.json                  {"format", "record" (RunRecord), "train" (the training settings the record does
                                  not hold: TrainConfig.beside), "files" (the run's own files), "world_size",
                                  "stage_of" (a first stage's: the whole run's settings, TrainConfig.to_dict)}
    RUN/checkpoints/step_N/state.json
                                  {"format", "version", "step", "data_position", "data_store", "world_size",
                                   "model_sha256" (RunRecord.digest of the model its weights belong to), "files"
                                  (each file's sha256 and size)}: what changes from one checkpoint to the next; the
                                  model's description is its run's run.json (a checkpoint of an earlier elflow
                                  carried its own "record", which is read where it is)
    MODEL/config.json             a model folder's (elflow.runs.model_folder)

Every stored document goes through elflow.runs.migrate first (an earlier layout becomes today's), then
`RunRecord.from_dict`. The training settings are handed on as the stored dict (`run_file`'s "train"): the
trainer reads them with the record into an elflow.config.TrainConfig (TrainConfig.of_run), and nothing that
loads a model to sample imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

from elflow.runs.checkpoint import run_of
from elflow.runs.folder import MODEL_CONFIG, RUN_FILE, RUN_FILES
from elflow.runs.migrate import document
from elflow.runs.model_folder import is_model_folder
from elflow.runs.record import RECORD_VERSION, RunRecord
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_json, read_json

RUN_FORMAT = "elflow-run-2"  # run.json
CHECKPOINT_FORMAT = "elflow-checkpoint-3"  # a checkpoint's state.json


# ----------------------------------------------------------------------------------------------------------
# run.json
def write_run(folder: str | os.PathLike, record: RunRecord, train: dict, files=RUN_FILES, **extra) -> Path:
    """run.json of a run folder: the record, the training settings it does not hold (`train`:
    TrainConfig.beside(record)), the names of the files the run writes there (`files`: those of
    runs.folder.run_files, with the ones it wrote before on a resume), and `extra` (how the run runs:
    world_size, stage_of), written atomically."""
    path = Path(folder) / RUN_FILE
    listed = [n for n in RUN_FILES if n in files]
    atomic_write_json(path, {"format": RUN_FORMAT, "record": record.to_dict(), "train": train, "files": listed,
                             **extra})
    return path


def run_file(folder: str | os.PathLike) -> dict:
    """run.json of a run folder in today's layout: {"record": RunRecord, "train": its settings (a dict, or None
    for a model elflow did not train), "world_size", "stage_of" (a first stage's settings, a dict, or None),
    "files"}."""
    path = Path(folder) / RUN_FILE
    where = str(path)
    doc = document(read_json(path), where)
    record = RunRecord.from_dict(doc.get("record"), where)
    for key in ("train", "stage_of"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            raise ELFError(f"{where}: its field {key!r} must be a JSON object, got {type(doc[key]).__name__}")
    world = doc.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ELFError(f"{where}: its field 'world_size' must be an integer >= 1, got {world!r}")
    return {"record": record, "train": doc.get("train"), "world_size": world, "stage_of": doc.get("stage_of"),
            "files": own_files(doc, where)}


def training_settings(path: str | os.PathLike) -> dict:
    """The training settings of a model stored beside its record (TrainConfig.of_run reads them with it): those of
    the run a checkpoint folder (RUN/checkpoints/step_N) belongs to (its run.json's), or a model folder's (its
    config.json's); {} for a checkpoint read alone (a converted release, a copied checkpoint) or a model that
    elflow did not train."""
    path = Path(path)
    if is_model_folder(path):
        where = str(path / MODEL_CONFIG)
        settings = document(read_json(path / MODEL_CONFIG), where).get("train")
        if settings is not None and not isinstance(settings, dict):
            raise ELFError(f"{where}: its field 'train' must be a JSON object, got {type(settings).__name__}")
        return settings or {}
    run = run_of(path)
    if run is None:
        return {}
    return run_file(run)["train"] or {}  # a run.json that is no file elflow wrote is refused by its reader


def own_files_added(folder: str | os.PathLike, *names: str) -> None:
    """Before a command writes the files `names` (of runs.folder.RUN_FILES) into a run folder: run.json lists
    them as the run's own, so that --overwrite and --resume may replace them (and only them)."""
    path = Path(folder) / RUN_FILE
    doc = read_json(path)
    listed = own_files(doc, str(path))
    if all(n in listed for n in names):
        return
    atomic_write_json(path, {**doc, "files": [n for n in RUN_FILES if n in listed or n in names]})


def own_files(doc: dict, where: str) -> tuple[str, ...]:
    """The names a run folder's own files may have, as its run.json lists them (all of RUN_FILES for a run.json
    that lists none); a listed name elflow never writes is ignored, so no run.json can claim another file."""
    listed = doc.get("files", list(RUN_FILES))
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        raise ELFError(f"{where}: its field 'files' must be a list of file names, got {listed!r:.80}")
    return tuple(n for n in RUN_FILES if n in listed)


# ----------------------------------------------------------------------------------------------------------
# a checkpoint's state.json
def checkpoint_state(record: RunRecord, step: int, data_position=None, data_store=None,
                     world_size: int = 1) -> dict:
    """The state.json of a checkpoint of the model `record` describes, but for the files' hashes, which the
    checkpoint's writer adds as it writes them (elflow.runs.checkpoint.write_checkpoint): the one function
    that makes it. It names the model by its digest alone: the record is run.json's."""
    return {"format": CHECKPOINT_FORMAT, "version": RECORD_VERSION, "step": step, "data_position": data_position,
            "data_store": data_store, "world_size": world_size, "model_sha256": record.digest()}


__all__ = ["run_file", "write_run", "own_files", "training_settings", "own_files_added", "checkpoint_state",
           "RUN_FORMAT", "CHECKPOINT_FORMAT"]

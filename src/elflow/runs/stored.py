"""The files that store a model, read and written here alone.

    RUN/run.json                  {"format", "record" (RunRecord), "train" (TrainConfig's settings), "files" (the
                                  run's own files), "world_size", "stage_of" (a first stage's run settings)}
    RUN/checkpoints/step_N/state.json
                                  {"format", "step", "data_position", "data_store", "world_size", "record",
                                   "files" (each file's sha256 and size)}: what the checkpoint holds; the record
                                  travels with the weights, so that a checkpoint folder read alone (a converted
                                  release, a copied checkpoint) says what it is
    MODEL/config.json             a model folder's (elflow.runs.model_folder)

Every stored document goes through elflow.runs.migrate first (an earlier layout becomes today's), then
`RunRecord.from_dict`. The training settings are handed on as the stored dict (`run_file`'s "train"): the
trainer reads them into an elflow.config.TrainConfig, and nothing that loads a model to sample imports it.
Loading reads state.json once and each weight file it uses once (`read_model_parts`).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from elflow.runs.checkpoint import load_checkpoint, read_state
from elflow.runs.folder import CHECKPOINTS, MODEL_CONFIG, MODEL_WEIGHTS, RUN_FILE, RUN_FILES, STATE_FILE
from elflow.runs.locate import locate
from elflow.runs.migrate import document, released_record
from elflow.runs.model_folder import is_model_folder, load_listed, read_model_folder_files
from elflow.runs.record import RunRecord
from elflow.runs.released import (
    RELEASED_LENGTH,
    RELEASED_SPACE,
    infer_config,
    read_released_checkpoint,
    release_settings,
)
from elflow.space import learned
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_json, read_json

RUN_FORMAT = "elflow-run-2"  # run.json
CHECKPOINT_FORMAT = "elflow-checkpoint-2"  # a checkpoint's state.json


# ----------------------------------------------------------------------------------------------------------
# run.json
def write_run(folder: str | os.PathLike, record: RunRecord, train: dict, files=RUN_FILES, **extra) -> Path:
    """run.json of a run folder: the record, the training settings (`train`: TrainConfig.to_dict()), the names
    of the files the run writes there (`files`: those of runs.folder.run_files, with the ones it wrote before on
    a resume), and `extra` (how the run runs: world_size, stage_of), written atomically."""
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
    """The training settings of a model, as stored: those of the run a checkpoint folder (RUN/checkpoints/step_N)
    belongs to (its run.json's), or a model folder's (its config.json's); {} for a checkpoint read alone (a
    converted release, a copied checkpoint) or a model that elflow did not train."""
    path = Path(path)
    if is_model_folder(path):
        where = str(path / MODEL_CONFIG)
        settings = document(read_json(path / MODEL_CONFIG), where).get("train")
        if settings is not None and not isinstance(settings, dict):
            raise ELFError(f"{where}: its field 'train' must be a JSON object, got {type(settings).__name__}")
        return settings or {}
    run = path.parent.parent
    if path.parent.name != CHECKPOINTS or not os.path.lexists(run / RUN_FILE):
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
def checkpoint_state(record: RunRecord, step: int, data_position=None, data_store=None, world_size: int = 1,
                     **origin) -> dict:
    """The state.json of a checkpoint, but for the files' hashes, which the checkpoint's writer adds as it writes
    them (elflow.runs.checkpoint.write_checkpoint): the one function that makes it. `origin`: converted_from,
    for a converted release."""
    return {"format": CHECKPOINT_FORMAT, "step": step, "data_position": data_position, "data_store": data_store,
            "world_size": world_size, "record": record.to_dict(), **origin}


def record_of_state(state: dict, where: str) -> RunRecord:
    """The record of a checkpoint's state.json as `read_state` gives it (today's layout)."""
    return RunRecord.from_dict(state.get("record"), where)


# ----------------------------------------------------------------------------------------------------------
# a model of any format: its record and its weights
@dataclass(frozen=True)
class Origin:
    """Where a loaded model's weights came from: the checkpoint folder, model folder or released file, its
    format (locate.KINDS), its step (None where unknown) and whether the weights are the EMA's."""

    path: str
    format: str
    step: int | None = None
    ema: bool = True


@dataclass(frozen=True)
class StoredModel:
    """What `read_model_parts` read of a model: its record, its weights (elflow-named; None when not asked
    for; {} where no EMA weights were stored and the EMA was asked for), a learned space's parameters ({} for
    any other space) and where they came from."""

    record: RunRecord
    weights: dict | None
    space: dict
    origin: Origin


def read_record(path_or_hub_id) -> RunRecord:
    """The record of a run folder (its newest good checkpoint's), a checkpoint folder, a model folder made by
    `push`, or a released checkpoint (a checkpoint_<step> file or its folder), or a hub id of one."""
    return read_model_parts(path_or_hub_id, weights=False).record


def read_model(path_or_hub_id, use_ema: bool = True, weights: bool = True, tries: int = 5):
    """(record, weights (elflow-named; None unless `weights`), origin) of any model `locate` finds. Where no EMA
    weights were stored and `use_ema` asks for them, the weights are {}."""
    m = read_model_parts(path_or_hub_id, use_ema, weights, tries)
    return m.record, m.weights, m.origin


def read_model_parts(path_or_hub_id, use_ema: bool = True, weights: bool = True, tries: int = 5) -> StoredModel:
    """The record, weights and learned space parameters of any model `locate` finds, each file read once. A
    run's newest checkpoint that cannot be read (or vanishes while it is read: `--keep` of a training that runs)
    gives way to the next newest, with a warning for a damaged one."""
    for attempt in range(tries):
        found = locate(path_or_hub_id)
        try:
            return _read_located(found, use_ema, weights)
        except ELFError:
            if found.kind != "checkpoint" or found.path.exists() or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _read_located(found, use_ema: bool, weights: bool) -> StoredModel:
    if found.kind == "model-folder":
        if not use_ema:
            raise ELFError(f"{found.path} is a model folder: it holds the EMA weights only")
        config, files = read_model_folder_files(found.path)
        where = str(found.path / MODEL_CONFIG)
        record = RunRecord.from_dict(document(config, where)["record"], where)
        sd = load_listed(found.path, files, MODEL_WEIGHTS, where) if weights else None
        return StoredModel(record, sd, {}, Origin(str(found.path), found.kind, config.get("step"), True))
    if found.kind == "checkpoint":
        return _read_checkpoint(found, use_ema, weights)
    which = "ema_params1" if use_ema else "params"
    sd = read_released_checkpoint(found.path, which=which)
    settings = {"length": RELEASED_LENGTH, **release_settings(found.path.parent, found.given)}
    record = released_record(infer_config(sd, max_length=settings["length"]), settings, RELEASED_SPACE)
    m = re.fullmatch(r"checkpoint_(\d+)", found.path.name)
    return StoredModel(record, sd if weights else None, {},
                       Origin(str(found.path), found.kind, int(m.group(1)) if m else None, use_ema))


def _read_checkpoint(found, use_ema: bool, weights: bool) -> StoredModel:
    """The first of a run's checkpoints (newest first) that reads whole: its state.json once, then each weight
    file it needs once (the EMA's, or the trained weights; model.safetensors for a learned space's parameters
    too); never optimizer.pt."""
    bad = []
    for ckpt in found.candidates or (found.path,):
        try:
            state = read_state(ckpt)
            record = record_of_state(state, str(ckpt / STATE_FILE))
            origin = Origin(str(ckpt), found.kind, state.get("step"), use_ema)
            if not weights:
                return StoredModel(record, None, {}, origin)
            # a learned table's parameters: space.safetensors, or inside model.safetensors (the other layout)
            space_in_model = learned(record.space) and "space.safetensors" not in state["files"]
            parts = load_checkpoint(ckpt, with_optimizer=False, model=not use_ema or space_in_model, ema=use_ema,
                                    state=state)
        except ELFError as e:
            if len(found.candidates) < 2:
                raise
            if ckpt.exists():
                bad.append(str(e))
            continue
        for why in bad:
            print(f"warning: skipping a bad checkpoint: {why}", file=sys.stderr)
        return StoredModel(record, parts["ema" if use_ema else "model"], parts["space"], origin)
    raise ELFError(f"{found.given}: none of its checkpoints can be read ({'; '.join(bad) or 'all vanished'})")


__all__ = ["Origin", "StoredModel", "read_record", "read_model", "read_model_parts", "run_file", "write_run", "own_files",
           "training_settings",
           "own_files_added", "checkpoint_state", "record_of_state", "RUN_FORMAT", "CHECKPOINT_FORMAT"]

"""Where a model is (`locate`: a path or hub id -> its folder or file and its kind), and the files that store it,
read and written here alone.

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
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from elflow.data.store import is_store
from elflow.runs.checkpoint import (
    is_elflow_checkpoint,
    is_elflow_folder,
    load_checkpoint,
    newest_first,
    read_state,
    resolve_checkpoint,
)
from elflow.runs.folder import CHECKPOINTS, MODEL_CONFIG, MODEL_WEIGHTS, RUN_FILE, RUN_FILES, STATE_FILE
from elflow.runs.migrate import document, released_record
from elflow.runs.model_folder import is_model_folder, load_listed, read_model_folder_files
from elflow.runs.record import RunRecord
from elflow.runs.released import (
    RELEASED_LENGTH,
    RELEASED_SPACE,
    find_released_file,
    infer_config,
    read_released_checkpoint,
    release_settings,
)
from elflow.space import learned
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_json, read_json
from elflow.util.hub import hub_offline, hub_reachable, hub_unavailable_reason
from elflow.util.jsonio import open_regular

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
# where a model is: a path or hub id -> the folder or file that holds it, and its kind
#
#     checkpoint     an elflow checkpoint folder (a run folder resolves to its newest good checkpoint)
#     model-folder   a model folder, as `elflow push` uploads it
#     released       a released checkpoint_<step> file (a folder holding one resolves to the newest)
#
# A hub id (owner/name that is no local path) is downloaded first. Anything else is one line saying what the
# path is: missing, empty, a fifo or a device, a token store, a run without a checkpoint.
KINDS = ("checkpoint", "model-folder", "released")


@dataclass(frozen=True)
class Located:
    kind: str  # one of KINDS
    path: Path  # the checkpoint folder (a run's newest), the model folder or the released file
    given: str  # the path or hub id as given
    # a run folder's checkpoints, newest first, none read yet: the reader takes the first that reads whole
    candidates: tuple[Path, ...] = ()


def is_hub_id(s: str) -> bool:
    """owner/name, not an existing local path."""
    return (s.count("/") == 1 and not s.startswith((".", "/", "~")) and not s.endswith("/")
            and not os.path.lexists(s))


def download(repo_id: str) -> Path:
    """A hub model's files (a snapshot of its checkpoints, weights and JSON files)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ELFError(f"{repo_id!r} is no local path, and fetching it as a Hugging Face Hub id needs "
                       "huggingface_hub: pip install huggingface_hub") from None
    if not hub_offline() and not hub_reachable():
        raise ELFError(f"{repo_id}: no such local file or folder; read as a Hugging Face Hub id, it cannot be "
                       f"fetched: {hub_unavailable_reason()}. Check the path.")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["checkpoint_*", "*.safetensors", "*.json", "*.yml",
                                                               "*.yaml", "*.md"]))
    except Exception as e:  # the hub client's own error types, in one line
        first = " ".join(str(e).split())
        raise ELFError(f"{repo_id}: no such local file or folder; read as a Hugging Face Hub id, it could not be "
                       f"fetched ({type(e).__name__}: {first[:300]}). Check the path, or, without a hub, download "
                       "the checkpoint_<step> file elsewhere and pass its path.") from None


def describe_path(p: Path) -> str | None:
    """What a path that exists but holds no model is, in words (None for a regular file or a folder)."""
    try:
        mode = os.stat(p).st_mode
    except OSError as e:
        if os.path.islink(p):
            return "a symbolic link that leads nowhere (dangling or a loop)"
        return f"unreadable ({e.strerror or e})"
    for test, kind in ((stat.S_ISFIFO, "a fifo"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def locate(path_or_hub_id) -> Located:
    """The model at a path or hub id (module docstring); one ELFError for anything else."""
    s = str(path_or_hub_id)
    if s == "":
        raise ELFError("the model path is empty; pass a run or checkpoint folder, a model folder, a released "
                       "checkpoint_<step> file or a hub id")
    p = Path(s).expanduser()
    if not os.path.lexists(p):
        if not is_hub_id(s):
            raise ELFError(f"{s}: no such file or folder (nor a hub id of the form owner/name)")
        p = download(s)
    what = describe_path(p)
    if what is not None:
        raise ELFError(f"{p} is {what}, not a model; pass a run or checkpoint folder, a model folder or a released "
                       "checkpoint_<step> file")
    if p.is_file():
        with open_regular(p) as f:  # never a fifo or a device
            head = f.read(4)
        if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch.save's zip, or a pickle
            raise ELFError(f"{p}: not a checkpoint; pass an elflow run or checkpoint folder, or a released "
                           "checkpoint_<step> file")
        return Located("released", p, s)
    if p.is_dir() and (p / CHECKPOINTS).is_dir() and not is_elflow_checkpoint(p):  # a run folder
        candidates = tuple(newest_first(p))
        if not candidates:
            raise ELFError(f"{p}: this run has no checkpoint yet")
        return Located("checkpoint", candidates[0], s, candidates)
    if is_model_folder(p):
        return Located("model-folder", p, s)
    if is_elflow_checkpoint(p) or is_elflow_folder(p):
        ckpt = resolve_checkpoint(p)
        return Located("checkpoint", ckpt, s, (ckpt,))
    if is_store(p):
        raise ELFError(f"{p} is a token store (made by `elflow prepare`: training data, for --data), not a run, a "
                       "checkpoint or a model; pass a run or checkpoint folder")
    return Located("released", find_released_file(p), s)


# ----------------------------------------------------------------------------------------------------------
# a model of any format: its record and its weights
@dataclass(frozen=True)
class Origin:
    """Where a loaded model's weights came from: the checkpoint folder, model folder or released file, its
    format (KINDS), its step (None where unknown) and whether the weights are the EMA's."""

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


__all__ = ["KINDS", "Located", "locate", "Origin", "StoredModel", "read_record", "read_model", "read_model_parts",
           "run_file", "write_run", "own_files", "training_settings", "own_files_added", "checkpoint_state",
           "record_of_state", "RUN_FORMAT", "CHECKPOINT_FORMAT"]

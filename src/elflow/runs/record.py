"""The one description of a trained model: `RunRecord`, frozen and versioned, with typed parts.

    method        "elf", or a token baseline ("ar", "mdlm")
    network       the method's network config (ELF: elflow.model.ELFConfig; a baseline: TokenLMConfig)
    options       ELF's short-run options (elflow.model.ShortRunOptions; inactive for the released network)
    recipe        the flow recipe it was trained with (elflow.flow.Recipe): path, noise, training times
    space         the embedding space's spec and id (elflow.space.SpaceSpec)
    length        the sequence length it was trained at
    task          None, or a conditional model's layout (`Task`: source length, slot, task, fields)
    sampling      its sampling defaults (ELF: elflow.generate.SamplingSettings; a baseline: BaselineSampling)
    train         the training config (elflow.config.TrainConfig); None for a released model
    distillation  None, or how a student was distilled (`Distillation`)
    params        parameter counts

Training writes it once per run (`write`, into run.json) and into every checkpoint (`checkpoint_state`: the
record beside the step, data position, store and file hashes); every reader takes it from `RunRecord.read`
(a run, checkpoint or model folder, or a released checkpoint) or from the files it has already opened
(`record_of_state`). `upgrade` is the one reader of every earlier layout. A record that is malformed, from a
newer elflow, or whose parts disagree is one line naming the field.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from elflow.config import TrainConfig
from elflow.data.layout import SOURCE_SLOTS
from elflow.data.tasks import PAIR_TASKS
from elflow.flow import Recipe, recipe_for
from elflow.methods import get_method
from elflow.model import ShortRunOptions
from elflow.runs.checkpoint import load_checkpoint, read_state, upgrade_state, upgrade_train
from elflow.runs.folder import MODEL_WEIGHTS, RUN_FILE, RUN_FILES, STATE_FILE
from elflow.runs.locate import locate
from elflow.runs.migrate import RECORD_VERSION, current
from elflow.runs.model_folder import load_listed, read_model_folder_files
from elflow.runs.released import RELEASED_SPACE, infer_config, read_released_checkpoint, release_settings
from elflow.space import SpaceSpec, learned
from elflow.util.errors import ELFError, Record
from elflow.util.files import atomic_write_json, read_json

RUN_FORMAT = "elflow-run-2"  # run.json
CHECKPOINT_FORMAT = "elflow-checkpoint-2"  # a checkpoint's state.json
DISTILL_OBJECTIVES = ("pd", "flow-map")  # progressive distillation; one flow-map student for every step count


@dataclass(frozen=True)
class Task(Record):
    """A conditional model's layout: sources of up to `source_length` tokens, the target right after each
    (`source_slot` "packed") or at `source_length` ("fixed"); the named task and the pair fields it read."""

    source_length: int
    source_slot: str = "packed"
    name: str | None = None
    source_field: str = "input"
    target_field: str = "output"

    def __post_init__(self):
        if isinstance(self.source_length, bool) or not isinstance(self.source_length, int) or self.source_length < 1:
            raise ValueError(f"source_length must be an integer >= 1, got {self.source_length!r}")
        if self.source_slot not in SOURCE_SLOTS:
            raise ValueError(f"source_slot must be one of {', '.join(SOURCE_SLOTS)}, got {self.source_slot!r}")
        if self.name is not None and self.name not in PAIR_TASKS:
            raise ValueError(f"name must be one of {', '.join(PAIR_TASKS)} or null, got {self.name!r}")
        for f in ("source_field", "target_field"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise ValueError(f"{f} must be a field name, got {getattr(self, f)!r}")


@dataclass(frozen=True)
class Distillation(Record):
    """How a student was distilled from its teacher: `objective` "pd" (a progressive-distillation round whose
    student takes `student_steps` steps; None for a released student of unknown rounds) or "flow-map" (one
    student for every step count, `student_steps` its default), with the teacher's `teacher_steps`."""

    objective: str = "pd"
    student_steps: int | None = None
    teacher_steps: int | None = None

    def __post_init__(self):
        if self.objective not in DISTILL_OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(DISTILL_OBJECTIVES)}, got {self.objective!r}")
        for f in ("student_steps", "teacher_steps"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{f} must be an integer >= 1 or null, got {v!r}")


@dataclass(frozen=True)
class RunRecord:
    """The description of a trained model (module docstring)."""

    method: str
    network: object
    space: SpaceSpec
    length: int
    recipe: Recipe = field(default_factory=Recipe)
    options: ShortRunOptions = field(default_factory=ShortRunOptions)
    task: Task | None = None
    sampling: object = None
    train: TrainConfig | None = None
    distillation: Distillation | None = None
    params: dict | None = None
    version: int = RECORD_VERSION

    # -- what the record says -------------------------------------------------------------------------
    @property
    def conditional(self) -> bool:
        return self.task is not None

    @property
    def distilled(self) -> bool:
        return self.distillation is not None

    @property
    def source_length(self) -> int | None:
        return self.task.source_length if self.task else None

    @property
    def source_slot(self) -> str:
        return self.task.source_slot if self.task else "packed"

    def sampling_settings(self, **given):
        """The settings this model samples with: its stored defaults, the flags `given` on top (None: not
        given); a progressively distilled student's sampler settings follow the step count."""
        return get_method(self.method).sampling_settings(self, **given)

    def replace(self, **kw) -> "RunRecord":
        return replace(self, **kw)

    # -- stored form ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": self.version, "method": self.method, "network": self.network.to_dict(),
                **({"options": self.options.to_dict()} if self.options.active else {}),
                "recipe": self.recipe.to_dict(), "space": self.space.to_dict(), "length": self.length,
                "task": self.task.to_dict() if self.task else None, "sampling": self.sampling.to_dict(),
                "train": self.train.to_dict() if self.train else None,
                "distillation": self.distillation.to_dict() if self.distillation else None,
                "params": self.params}

    @classmethod
    def from_dict(cls, d, where: str = "the record") -> "RunRecord":
        """A stored record, checked part by part: one ELFError naming `where` and the field for anything that
        is malformed, from a newer elflow, or disagrees with another part."""
        if not isinstance(d, dict):
            raise ELFError(f"{where}: the record must be a JSON object, got {type(d).__name__}")
        d = current(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        version = d.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version > RECORD_VERSION:
            raise ELFError(f"{where}: a record of version {version}, written by a newer elflow (this one reads up "
                           f"to version {RECORD_VERSION}); upgrade elflow to read it")
        if version != RECORD_VERSION:
            raise ELFError(f"{where}: its record's field 'version' must be {RECORD_VERSION}, got {version!r}")
        if unknown:
            raise ELFError(f"{where}: its record has unknown fields {unknown}")
        missing = [k for k in ("method", "network", "space", "length", "sampling") if k not in d]
        if missing:
            raise ELFError(f"{where}: its record lacks the field {missing[0]!r}")

        def part(name, make):
            try:
                value = make(d.get(name))
                _complete(name, d.get(name), value)
                return value
            except ELFError as e:
                raise ELFError(f"{where}: its record's field {name!r}: {e}") from None
            except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
                raise ELFError(f"{where}: its record's field {name!r} cannot be read ({e})") from None

        method = part("method", get_method)
        length = part("length", _positive_int)
        record = cls(
            method=method.name,
            network=part("network", method.network_config),
            space=part("space", SpaceSpec.from_dict),
            length=length,
            recipe=part("recipe", lambda v: Recipe.from_dict(_obj(v or {}))),
            options=part("options", lambda v: ShortRunOptions.from_dict(_obj(v or {}))),
            task=part("task", lambda v: None if v is None else Task.from_dict(_obj(v))),
            sampling=part("sampling", lambda v: method.sampling_type.from_dict(_obj(v))),
            train=part("train", lambda v: None if v is None else TrainConfig.from_dict(_obj(v), strict=True)),
            distillation=part("distillation", lambda v: None if v is None else Distillation.from_dict(_obj(v))),
            params=part("params", lambda v: None if v is None else _obj(v)),
        )
        if record.train is not None:
            record.train.validate(stored=where)
        record.check(where)
        return record

    def check(self, where: str = "the record") -> None:
        """ELFError naming the first field that disagrees with another part of the record."""
        def bad(name, what):
            raise ELFError(f"{where}: its record's field {name!r} disagrees with the rest of the record: {what}")

        check_sampling = getattr(self.sampling, "check", None)
        if check_sampling is not None:
            try:
                check_sampling(self.recipe)
            except ELFError as e:
                raise ELFError(f"{where}: its record's field 'sampling': {e}") from None
        try:
            get_method(self.method).check_record(self)
        except ELFError as e:
            raise ELFError(f"{where}: its record's field 'network': {e}") from None
        if self.length > self.network.max_length:
            bad("length", f"{self.length} positions, more than the network's {self.network.max_length}")
        if self.task is not None and self.task.source_length >= self.length:
            bad("task", f"a source of {self.task.source_length} tokens leaves no target in {self.length} positions")
        if self.train is not None:
            if self.train.method != self.method:
                bad("train", f"its method is {self.train.method!r}, the record's {self.method!r}")
            if bool(self.train.source_length) != self.conditional:
                bad("task", "the training config and the task disagree on whether the model is conditional")
        if self.distillation is not None and "distill" not in get_method(self.method).features:
            bad("distillation", f"a model of --method {self.method} is never distilled")

    # -- files ----------------------------------------------------------------------------------------
    def write(self, folder: str | os.PathLike, files=RUN_FILES, **extra) -> Path:
        """run.json of a run folder: the record, the names of the files the run writes there (`files`: those
        of runs.folder.run_files, with the ones it wrote before on a resume), and `extra` (how the run runs:
        world_size, stage_of), written atomically."""
        path = Path(folder) / RUN_FILE
        listed = [n for n in RUN_FILES if n in files]
        atomic_write_json(path, {"format": RUN_FORMAT, "record": self.to_dict(), "files": listed, **extra})
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> "RunRecord":
        """The record of a run folder (its newest good checkpoint's), a checkpoint folder, a model folder made
        by `push`, or a released checkpoint (a checkpoint_<step> file or its folder), or a hub id of one."""
        return read_model(path, weights=False)[0]


def _complete(name: str, stored, value) -> None:
    """A stored part holds every field its type writes (`to_dict`): a missing one is an ELFError naming it (a
    record of an earlier version gains its new fields in elflow.runs.migrate, never from today's defaults)."""
    if value is None or not hasattr(value, "to_dict") or not isinstance(stored, dict):
        return
    missing = [k for k in value.to_dict() if k not in stored]
    if missing:
        raise ELFError(f"it lacks {', '.join(repr(f'{name}.{m}') for m in missing[:3])}; a record of this version "
                       "holds every field (restore the file as elflow wrote it)")


def _obj(v) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"expected a JSON object, got {type(v).__name__}")
    return v


def _positive_int(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"expected an integer >= 1, got {v!r}")
    return v


# ----------------------------------------------------------------------------------------------------------
# the files of a run and a checkpoint
def run_file(folder: str | os.PathLike) -> dict:
    """run.json of a run folder in today's layout: {"record": RunRecord, "world_size", "stage_of"
    (TrainConfig or None)}; an earlier run.json is upgraded."""
    path = Path(folder) / RUN_FILE
    doc = read_json(path)
    where = str(path)
    if doc.get("format") == RUN_FORMAT:
        record = RunRecord.from_dict(doc.get("record"), where)
    else:
        record = upgrade(doc, where)
    stage = doc.get("stage_of")
    stage_of = None
    if stage is not None:
        try:
            stage_of = TrainConfig.from_dict(upgrade_train(_obj(stage)))
        except (ValueError, TypeError) as e:
            raise ELFError(f"{where}: its field 'stage_of' cannot be read ({e})") from None
    world = doc.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ELFError(f"{where}: its field 'world_size' must be an integer >= 1, got {world!r}")
    return {"record": record, "world_size": world, "stage_of": stage_of, "files": own_files(doc, where)}


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


def checkpoint_state(record: RunRecord, step: int, data_position, data_store, world_size: int) -> dict:
    """The state.json of a checkpoint (the file hashes are added as it is written): the one function that
    writes it."""
    return {"format": CHECKPOINT_FORMAT, "step": step, "data_position": data_position, "data_store": data_store,
            "world_size": world_size, "record": record.to_dict()}


def record_of_state(state: dict, where: str) -> RunRecord:
    """The record of a checkpoint's state.json (either layout)."""
    if state.get("format") == CHECKPOINT_FORMAT:
        return RunRecord.from_dict(state.get("record"), where)
    return upgrade(state, where)


# ----------------------------------------------------------------------------------------------------------
# earlier layouts
def upgrade(state: dict, where: str) -> RunRecord:
    """The record of a state in any layout elflow wrote before the record (a checkpoint's state.json, run.json,
    a model folder's files merged into one state: elflow.runs.model_folder), through
    elflow.runs.checkpoint.upgrade_state, which reads the layouts before that."""
    if not isinstance(state, dict):
        raise ELFError(f"{where}: corrupted (a JSON object was expected, found {type(state).__name__})")
    for key in ("train", "model", "space", "settings", "short_run"):
        if key in state and state[key] is not None and not isinstance(state[key], dict):
            raise ELFError(f"{where}: corrupted (\"{key}\" must be a JSON object, got {type(state[key]).__name__})")
    if "model" not in state or "space" not in state:
        raise ELFError(f"{where}: corrupted (it describes no network: no \"model\" or \"space\")")
    state = upgrade_state(state)
    try:
        return _upgrade(state)
    except ELFError as e:
        raise ELFError(f"{where}: {e}") from None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        raise ELFError(f"{where}: its settings cannot be read ({type(e).__name__}: {e})") from None


def _upgrade(state: dict) -> RunRecord:
    method = get_method(state.get("method", "elf"))
    settings = _obj(state.get("settings") or {})
    raw_train = _obj(state.get("train") or {})
    released = "converted_from" in raw_train or not raw_train
    train = None if released else TrainConfig.from_dict(upgrade_train(raw_train))
    network = method.network_config(state["model"])
    options = ShortRunOptions.from_dict(_obj(state.get("short_run") or {}))
    length = settings.get("length") or network.max_length
    source_length = settings.get("source_length")
    task = None
    if source_length:
        task = Task(source_length, settings.get("source_slot", "packed"), settings.get("task"),
                    *((train.source_field, train.target_field) if train else ()))
    recipe = recipe_for(raw_train.get("recipe") or {}, conditional=bool(source_length))
    pd = (train.distillation if train else None) or {}
    distillation = None
    if pd.get("student_steps") or settings.get("distilled_steps") or settings.get("distilled"):
        distillation = Distillation("pd", pd.get("student_steps") or settings.get("distilled_steps"),
                                    pd.get("teacher_steps") or settings.get("teacher_steps"))
    space = SpaceSpec.from_dict(state["space"], state.get("space_id"))
    base = RunRecord(method.name, network, space, length, recipe, options, task, None, train, distillation,
                     state.get("params"))
    stored = _obj(settings.get("sampling") or {})
    sampling = method.default_sampling(base)
    if stored:
        sampling = sampling.replace(**{k: v for k, v in stored.items() if k in sampling.to_dict()})
    return base.replace(sampling=sampling)


def released_record(network, settings: dict, space: dict) -> RunRecord:
    """The record of a released checkpoint: its network (inferred from its weights), the layout and defaults
    of its release (`settings`: length, source_length, task, distilled) and its space."""
    source_length = settings.get("source_length")
    task = Task(source_length, "packed", settings.get("task")) if source_length else None
    distillation = Distillation("pd", None, None) if settings.get("distilled") else None
    base = RunRecord("elf", network, SpaceSpec.from_dict(space), settings.get("length", network.max_length),
                     recipe_for({}, conditional=task is not None), task=task, distillation=distillation)
    return base.replace(sampling=get_method("elf").default_sampling(base))


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
        state, files = read_model_folder_files(found.path)
        where = str(found.path / "config.json")
        record = RunRecord.from_dict(state["record"], where) if "record" in state else upgrade(state, where)
        sd = load_listed(found.path, files, MODEL_WEIGHTS, where) if weights else None
        return StoredModel(record, sd, {}, Origin(str(found.path), found.kind, state.get("step"), True))
    if found.kind == "checkpoint":
        return _read_checkpoint(found, use_ema, weights)
    which = "ema_params1" if use_ema else "params"
    sd = read_released_checkpoint(found.path, which=which)
    settings = {"length": 1024, **release_settings(found.path.parent, found.given)}
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


__all__ = ["RunRecord", "Task", "Distillation", "Origin", "StoredModel", "read_model_parts", "RECORD_VERSION", "DISTILL_OBJECTIVES",
           "checkpoint_state", "record_of_state", "run_file", "upgrade", "released_record", "read_model"]

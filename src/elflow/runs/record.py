"""The one description of a trained model: `RunRecord`, frozen and versioned, with typed parts, and nothing
about how it was trained (the training settings are elflow.config.TrainConfig, stored beside it in run.json).

    method        "elf", or a token baseline ("ar", "mdlm")
    network       the method's network config (ELF: elflow.model.ELFConfig; a baseline: TokenLMConfig); the
                  fields that follow from the other parts (the method's `derived`: ELF's self-conditioning,
                  path constants and target time) are set from them here, and not stored
    options       ELF's short-run options (elflow.model.ShortRunOptions; inactive for the released network)
    recipe        the flow recipe it was trained with (elflow.flow.Recipe): path, noise, training times
    space         the embedding space's spec and id (elflow.space.SpaceSpec)
    length        the sequence length it was trained at
    task          None, or a conditional model's layout (`Task`: source length, slot, task, fields)
    sampling      its generation defaults (ELF: elflow.sampler.GenerationDefaults; a baseline: BaselineSampling); the
                  seed, the batch size and the precision are the caller's
    distillation  None, or how a student was distilled (`Distillation`)
    params        None (a released model), or its parameter counts (`ParamCounts`)

This module holds the types alone. The files that store a record (run.json, a model folder's config.json; a
checkpoint's state.json names it by its digest, `RunRecord.digest`) are read by elflow.runs.load, after
elflow.runs.migrate has turned an earlier layout into today's; `RunRecord.from_dict` reads today's layout
only. A record that is malformed or whose parts disagree is one line naming the field.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace

from elflow.data.layout import PACKED, SOURCE_SLOTS
from elflow.data.tasks import PAIR_TASKS
from elflow.flow import SAMPLERS, SAMPLING_RANGES, Recipe
from elflow.methods import get_method
from elflow.methods.baseline import MATCHES, BaselineSampling
from elflow.methods.token_net import TokenLMConfig
from elflow.model import ELFConfig, ShortRunOptions
from elflow.sampler import GenerationDefaults
from elflow.space import SpaceSpec, drawn_table
from elflow.util.errors import AT_LEAST_0, AT_LEAST_1, ELFError, Record

RECORD_VERSION = 11  # the layout of today's stored documents; elflow.runs.migrate reads the earlier ones
DISTILL_OBJECTIVES = ("pd", "flow-map")  # progressive distillation; one flow-map student for every step count


@dataclass(frozen=True)
class Task(Record):
    """A conditional model's layout: sources of up to `source_length` tokens, the target right after each
    (`source_slot` "packed") or at `source_length` ("fixed"); the named task and the pair fields it read."""

    source_length: int
    source_slot: str = PACKED
    name: str | None = None
    source_field: str = "input"
    target_field: str = "output"

    DECLARED = {"source_length": (AT_LEAST_1, None), "source_slot": (None, SOURCE_SLOTS),
                "name": (None, tuple(PAIR_TASKS))}  # (source_field, target_field: a non-empty name each, below)

    def __post_init__(self):
        self.check_declared()
        for f in ("source_field", "target_field"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise ValueError(f"{f} must be a field name, got {getattr(self, f)!r}")


@dataclass(frozen=True)
class SamplingDefaults(Record):
    """The generation defaults a run gives its model (--sample-steps, --sample-sampler, --sample-omega), each
    None where not given: the record's `sampling` is then its kind's (its method's `default_sampling`)."""

    steps: int | None = None
    sampler: str | None = None
    omega: float | None = None

    DECLARED = {"steps": (SAMPLING_RANGES["steps"], None), "sampler": (None, SAMPLERS),
                "omega": (SAMPLING_RANGES["omega"], None)}

    def __post_init__(self):
        self.check_declared()

    def given(self) -> dict:
        """The defaults given, as the fields of a record's sampling they set."""
        return {k: v for k, v in self.to_dict().items() if v is not None}


@dataclass(frozen=True)
class Distillation(Record):
    """How a student was distilled from its teacher: `objective` "pd" (a progressive-distillation round whose
    student takes `student_steps` steps; None for a released student of unknown rounds) or "flow-map" (one
    student for every step count, `student_steps` its default), with the teacher's `teacher_steps`."""

    objective: str = "pd"
    student_steps: int | None = None
    teacher_steps: int | None = None

    DECLARED = {"objective": (None, DISTILL_OBJECTIVES), "student_steps": (AT_LEAST_1, None),
                "teacher_steps": (AT_LEAST_1, None)}

    def __post_init__(self):
        self.check_declared()


@dataclass(frozen=True)
class ParamCounts(Record):
    """A trained network's parameter counts: its own (`model`), the ELF network's it is sized against (its
    own for ELF; a baseline matches it) and how a baseline was matched (`match`, elflow.methods.baseline)."""

    model: int
    elf: int
    match: str = "total"

    DECLARED = {"model": (AT_LEAST_0, None), "elf": (AT_LEAST_0, None), "match": (None, MATCHES)}

    def __post_init__(self):
        self.check_declared()


def is_current(doc) -> bool:
    """Whether a stored document (run.json, a checkpoint's state.json, a model folder's config.json) is of
    today's layout, which its readers take as it is; any other goes through elflow.runs.migrate.document."""
    if not isinstance(doc, dict):
        return False
    if "record" in doc:  # run.json, a model folder, an earlier checkpoint: the record's version
        version = doc["record"].get("version") if isinstance(doc["record"], dict) else None
    else:  # today's state.json says its own
        version = doc.get("version")
    return type(version) is int and version == RECORD_VERSION


# what a resumed run may change of its record: the sampling defaults follow --sample-*, the parameter counts
# follow from the network, the version from the code that writes it
MAY_CHANGE = ("sampling", "params", "version")

# the fields every stored record holds (`options` only where one is on: absent, the paper's network)
STORED_FIELDS = ("method", "network", "space", "length", "recipe", "task", "sampling", "distillation", "params")


@dataclass(frozen=True)
class RunRecord:
    """The description of a trained model (module docstring)."""

    method: str
    network: ELFConfig | TokenLMConfig
    space: SpaceSpec
    length: int
    recipe: Recipe = field(default_factory=Recipe)
    options: ShortRunOptions = field(default_factory=ShortRunOptions)
    task: Task | None = None
    sampling: GenerationDefaults | BaselineSampling | None = None
    distillation: Distillation | None = None
    params: ParamCounts | None = None
    version: int = RECORD_VERSION

    def __post_init__(self):
        # the network's derived fields follow from the recipe and the distillation: consistent by construction
        derived = get_method(self.method).derive(self.recipe, self.distillation)
        if any(getattr(self.network, k) != v for k, v in derived.items()):
            object.__setattr__(self, "network", self.network.replace(**derived))

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
        return self.task.source_slot if self.task else PACKED

    def sampling_settings(self, **given):
        """The settings this model samples with: its stored defaults, the flags `given` on top (None: not
        given); a progressively distilled student's sampler settings follow the step count."""
        return get_method(self.method).sampling_settings(self, **given)

    def replace(self, **kw) -> "RunRecord":
        return replace(self, **kw)

    def identity(self) -> dict:
        """What fixes the meaning of the model's weights: the stored record but for the parts a resumed run may
        change (`MAY_CHANGE`), its space by its id (a spec may name its files by another path: a run moved
        elsewhere), or by nothing where it has none, and its network in full, derived fields included (as
        records stored it up to version 10: a checkpoint's digest is the same whichever version wrote it)."""
        d = {k: v for k, v in self.to_dict().items() if k not in MAY_CHANGE}
        d["space"] = self.space.id
        d["network"] = self.network.to_dict()
        return d

    def digest(self) -> str:
        """The sha256 of `identity`: what a checkpoint's state.json records of the model its weights belong to,
        so that a run.json edited or replaced after the save is refused rather than read."""
        text = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def with_default_sampling(self) -> "RunRecord":
        """The record with its method's generation defaults for a model of its kind."""
        return replace(self, sampling=get_method(self.method).default_sampling(self))

    # -- stored form ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        derived = get_method(self.method).derived
        network = {k: v for k, v in self.network.to_dict().items() if k not in derived}
        return {"version": self.version, "method": self.method, "network": network,
                **({"options": self.options.to_dict()} if self.options.active else {}),
                "recipe": self.recipe.to_dict(), "space": self.space.to_dict(), "length": self.length,
                "task": self.task.to_dict() if self.task else None, "sampling": self.sampling.to_dict(),
                "distillation": self.distillation.to_dict() if self.distillation else None,
                "params": self.params.to_dict() if self.params else None}

    @classmethod
    def from_dict(cls, d, where: str = "the record", stored_in: dict | None = None) -> "RunRecord":
        """A record of today's layout (elflow.runs.migrate turns an earlier one into it), checked part by
        part: one ELFError naming `where` and the field for anything that is malformed, missing or disagrees
        with another part; `stored_in` names the file a part came from where it is not `where` (a model folder
        of the first layout kept its sampling defaults in sampling.json)."""
        if not isinstance(d, dict):
            raise ELFError(f"{where}: the record must be a JSON object, got {type(d).__name__}")
        version = d.get("version")
        if version != RECORD_VERSION:
            raise ELFError(f"{where}: its record's field 'version' must be {RECORD_VERSION}, got {version!r}")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ELFError(f"{where}: its record has unknown fields {unknown}")
        missing = [k for k in STORED_FIELDS if k not in d]
        if missing:
            raise ELFError(f"{where}: its record lacks the field {missing[0]!r}")

        file = (stored_in or {}).get

        def part(name, make, typ=None, of="", derived=()):
            try:
                _required(name, d.get(name), typ, derived)
                value = make(d.get(name))
                _complete(name, d.get(name), value, derived)
                return value
            except ELFError as e:
                raise ELFError(f"{file(name, where)}: its record's field {name!r}{f' is not {of}' if of else ''}: "
                               f"{e}") from None
            except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
                raise ELFError(f"{file(name, where)}: its record's field {name!r} cannot be read"
                               f"{f' as {of}' if of else ''} ({e})") from None

        method = part("method", get_method)
        recipe = part("recipe", lambda v: Recipe.from_dict(_obj(v or {})), Recipe)
        distillation = part("distillation", lambda v: None if v is None else Distillation.from_dict(_obj(v)),
                            Distillation)

        def network(v):
            stored = [k for k in method.derived if k in _obj(v)]
            if stored:
                raise ELFError(f"it holds {stored[0]!r}, which follows from the recipe and the distillation (a record "
                               f"of version {RECORD_VERSION} does not store it); restore the file as elflow wrote it")
            return method.config_type.from_dict({**v, **method.derive(recipe, distillation)})

        record = cls(
            method=method.name,
            network=part("network", network, method.config_type, f"a network of its method {method.name!r}",
                         method.derived),
            space=part("space", SpaceSpec.from_dict),
            length=part("length", _positive_int),
            recipe=recipe,
            options=part("options", lambda v: ShortRunOptions.from_dict(_obj(v or {})), ShortRunOptions),
            task=part("task", lambda v: None if v is None else Task.from_dict(_obj(v)), Task),
            sampling=part("sampling", lambda v: method.sampling_type.from_dict(_obj(v)), method.sampling_type),
            distillation=distillation,
            params=part("params", lambda v: None if v is None else ParamCounts.from_dict(_obj(v)), ParamCounts),
        )
        record.check(where, stored_in)
        return record

    def check(self, where: str = "the record", stored_in: dict | None = None) -> None:
        """ELFError naming the first field that disagrees with another part of the record (and the file that
        holds it: `stored_in`, as in `from_dict`)."""
        file = (stored_in or {}).get

        def bad(name, what):
            raise ELFError(f"{file(name, where)}: its record's field {name!r} disagrees with the rest of the record: "
                           f"{what}")

        method = get_method(self.method)
        check_sampling = getattr(self.sampling, "check", None)
        try:
            if check_sampling is not None:
                check_sampling(self.recipe)
            if isinstance(self.sampling, BaselineSampling):  # a baseline's settings, read by its own sampler
                if self.sampling.method != method.name:
                    raise ELFError(f"sampling settings of {self.sampling.method!r}, not of {method.name!r}")
                method.sampler_settings(self.sampling)
        except ELFError as e:
            raise ELFError(f"{file('sampling', where)}: its record's field 'sampling': {e}") from None
        try:
            get_method(self.method).check_record(self)
        except ELFError as e:  # the network's, unless the method says which field is at fault
            name = getattr(e, "field", "network")
            raise ELFError(f"{file(name, where)}: its record's field {name!r}: {e}") from None
        if self.length > self.network.max_length:
            bad("length", f"{self.length} positions, more than the network's {self.network.max_length}")
        if self.task is not None and self.task.source_length >= self.length:
            bad("task", f"a source of {self.task.source_length} tokens leaves no target in {self.length} positions")
        if self.distillation is not None and "distill" not in get_method(self.method).features:
            bad("distillation", f"a model of --method {self.method} is never distilled")


# what a drawn table's stored spec holds besides its kind and base: it is rebuilt from them and checked by its id
DRAWN_TABLE_FIELDS = ("dim", "seed", "stream", "id")


def differences(a: dict, b: dict, skip=()) -> list[str]:
    """The fields in which two records (as `to_dict` gives them) differ, but those in `skip`, in name order, each
    as "field: a -> b" with both values cut at 60 characters: what a refused resume names."""
    return [f"{k}: {a.get(k)!r:.60} -> {b.get(k)!r:.60}" for k in sorted(set(a) | set(b))
            if k not in skip and a.get(k) != b.get(k)]


def _required(name: str, stored, typ, derived=()) -> None:
    """Before a stored part is read: the fields of its type that have no default of None (those its `to_dict`
    always writes), but those `derived` from the other parts, are all there; a missing one is an ELFError naming
    it, not a default filled in."""
    if typ is None or not isinstance(stored, dict):
        return
    _refuse_missing(name, [f.name for f in fields(typ)
                           if f.name not in stored and f.default is not None and f.name not in derived])


def _complete(name: str, stored, value, derived=()) -> None:
    """A stored part holds every field its type writes (`to_dict`, but the fields `derived` from the other parts;
    a drawn table's space, its DRAWN_TABLE_FIELDS too): a missing one is an ELFError naming it (a record of an
    earlier version gains its new fields in elflow.runs.migrate, never from today's defaults)."""
    if value is None or not hasattr(value, "to_dict") or not isinstance(stored, dict):
        return
    written = [k for k in value.to_dict() if k not in derived]
    if isinstance(value, SpaceSpec) and drawn_table(stored):
        written += [k for k in DRAWN_TABLE_FIELDS if k not in written]
    _refuse_missing(name, [k for k in written if k not in stored])


def _refuse_missing(name: str, missing: list[str]) -> None:
    """ELFError naming the first fields of the part `name` that a stored record lacks (none: nothing)."""
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


__all__ = ["RunRecord", "Task", "SamplingDefaults", "Distillation", "ParamCounts", "RECORD_VERSION",
           "DISTILL_OBJECTIVES"]

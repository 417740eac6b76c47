"""Every stored layout elflow reads, made today's by one linear chain of small steps, version N -> N + 1.

A stored document is a run's run.json, a checkpoint's state.json or a model folder's config.json (an earlier
model folder's JSON files merged into one: elflow.runs.model_folder). Today's layout (version 11) holds

    "record"   run.json and a model folder: the model's description (elflow.runs.record.RunRecord.to_dict)
    "train"    run.json and a model folder: the training settings the record does not hold
               (elflow.config.TrainConfig.beside); None for a model that was not trained by elflow (a converted
               release)
    "stage_of" the first stage of a --decoder separate run: the whole run's settings (TrainConfig.to_dict),
               which has no record yet
    "version"  a checkpoint's state.json, which holds no record: the version it was written in; it names its
               model by the record's digest ("model_sha256", RunRecord.digest), the record being run.json's

beside the document's own fields (a checkpoint's step, data position and store; run.json's files and ranks).
Earlier versions:

    1  before the record: the model's parts at the top level ("model", "space", "space_id", "method",
       "params", "short_run", "settings", "train")
    2  the record, with the training settings inside it ("record"."train")
    3  version 2 with the learning-rate schedule's warm-up start (train.lr_schedule)
    4  the training settings beside the record; their sample_steps / sample_sampler / sample_omega set the
       training previews alone, apart from the record's sampling defaults
    5  the training settings whole beside the record, restating what it holds (length, task, recipe, ...)
    6  every checkpoint's state.json carrying the model's record too, as the one in its run's run.json
    7  a first stage's whole settings ("stage_of") with the task and the sampling defaults as flat settings
       (source_length, source_slot, task, source_field, target_field; sample_steps, sample_sampler,
       sample_omega), not as the typed parts the record holds
    8  training settings that describe the network (a baseline's, sized against an ELF network; a first
       stage's) as flat settings (bottleneck, predict, conditioning, decoder) beside its other fields
       ("model"), which held self-conditioning, the path's constants and the target time too
    9  the space as five flat training settings (space, space_dim, space_seed, space_stream, latent_std), stored
       beside an ELF record that holds the space built from them
    10 an ELF record's network storing the fields that follow from its recipe and distillation (self_cond,
       target_time, noise_scale, t_eps), each checked against them when read

Each step fills in exactly what its version lacked, with the value that the code of that version used (never
today's default), so that an older run samples the same texts and resumes bit for bit. The authors' released
checkpoints carry no record: `released_record` is their one entry into today's. Nothing else upgrades.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from elflow.data.layout import PACKED
from elflow.flow import Recipe, recipe_for
from elflow.methods import get_method
from elflow.model import ELFConfig, ShortRunOptions
from elflow.runs.record import RECORD_VERSION, Distillation, ParamCounts, RunRecord, Task
from elflow.space import SpaceSpec, drawn_table, latent_std_of, parse_space
from elflow.util.errors import ELFError

PRE_RECORD = 1  # the version of a document that holds no "record"


def document(doc, where: str) -> dict:
    """`doc` (a stored document's JSON object, as read) in today's layout: the steps from its version on, in
    order. ELFError naming `where` for a document that is not an object, whose version is not an integer, or
    that a newer elflow wrote."""
    if not isinstance(doc, dict):
        raise ELFError(f"{where}: corrupted (a JSON object was expected, found {type(doc).__name__})")
    version = version_of(doc, where)
    if version > RECORD_VERSION:
        raise ELFError(f"{where}: a record of version {version}, written by a newer elflow (this one reads up to "
                       f"version {RECORD_VERSION}); upgrade elflow to read it")
    while version < RECORD_VERSION:
        doc = STEPS[version](doc, where)
        version += 1
    return doc


def version_of(doc: dict, where: str) -> int:
    if "record" not in doc:
        return _own_version(doc, where) if "version" in doc else PRE_RECORD
    record = doc["record"]
    if not isinstance(record, dict):
        raise ELFError(f"{where}: the record must be a JSON object, got {type(record).__name__}")
    version = record.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 2:
        raise ELFError(f"{where}: its record's field 'version' must be an integer from 2 to {RECORD_VERSION}, got "
                       f"{version!r}")
    return version


FIRST_OWN_VERSION = 7  # the first version whose state.json holds no record: it says its version itself


def _own_version(doc: dict, where: str) -> int:
    version = doc["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < FIRST_OWN_VERSION:
        raise ELFError(f"{where}: its field 'version' must be an integer from {FIRST_OWN_VERSION} to "
                       f"{RECORD_VERSION}, got {version!r}")
    return version


# ----------------------------------------------------------------------------------------------------------
# 1 -> 2: the record
# the update rule of a run stored with "muon_scale" (or without it: "fan")
LEGACY_MUON_SCALES = {"fan": "torch-fan", "released": "torch-head-transposed"}
SHORT_RUN_FIELDS = tuple(f.name for f in fields(ShortRunOptions))
ROUND_RECORD = ("distilled_steps", "teacher_steps", "sampling")
RUN_ONLY = ("grad_checkpoint",)  # a setting of the run that version 1 stored with the network ("model")


def train_1_to_2(train):
    """Version 1's training settings: the short-run options among the network settings ("model"), a
    distillation round's record among the recipe's constants, a drawn table's space without its stream (stream
    1, the draw from the seed), and the optimiser's update as "muon_scale" (torch's Muon and Adam, the decode
    head scaled by the fan rule, "fan", or as its transposes, "released"), or as nothing before that (the fan
    rule): the update rules "torch-fan" and "torch-head-transposed" (elflow.schedule.UPDATE_RULES)."""
    if not isinstance(train, dict):
        return train
    train = dict(train)
    model, recipe = dict(train.get("model") or {}), dict(train.get("recipe") or {})
    options = {k: model.pop(k) for k in SHORT_RUN_FIELDS if k in model}
    if options:
        train["model"], train["short_run"] = model, {**options, **(train.get("short_run") or {})}
    record = {k: recipe.pop(k) for k in ROUND_RECORD if k in recipe}
    if record:
        train["recipe"] = recipe
        if "distilled_steps" in record and not train.get("distillation"):
            train["distillation"] = {"student_steps": record["distilled_steps"],
                                     "teacher_steps": record.get("teacher_steps")}
    if "space_stream" not in train and isinstance(train.get("space"), str) and drawn_table(train["space"]):
        train["space_stream"] = 1
    if "update_rule" not in train:
        scale = train.pop("muon_scale", "fan")
        # AdamW runs stepped as AdamW does under every rule; they stored the rule's setting at its default
        train["update_rule"] = LEGACY_MUON_SCALES.get(scale, scale) if train.get("optimizer", "muon") == "muon" \
            else "released"
    return train


def space_1_to_2(space: dict) -> dict:
    """Version 1's space spec: a drawn table without its stream is stream 1, the draw from the seed itself."""
    if space.get("kind") and drawn_table(space) and "stream" not in space:
        return {**space, "stream": 1}
    return dict(space)


def _1_to_2(doc: dict, where: str) -> dict:
    """Version 1 -> 2: the record, built from the parts stored at the top level; the network's short-run
    options under "short_run" and without the run's activation checkpointing (`RUN_ONLY`), a drawn table's space with its stream (1), "data_store" None where it was not
    recorded (a resume then compares nothing)."""
    for key in ("train", "model", "space", "settings", "short_run"):
        if key in doc and doc[key] is not None and not isinstance(doc[key], dict):
            raise ELFError(f"{where}: corrupted (\"{key}\" must be a JSON object, got {type(doc[key]).__name__})")
    if "model" not in doc or "space" not in doc:
        raise ELFError(f"{where}: corrupted (it describes no network: no \"model\" or \"space\")")
    try:
        record, train, network = _record_1(doc)
    except ELFError as e:
        raise ELFError(f"{where}: {e}") from None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        raise ELFError(f"{where}: its settings cannot be read ({type(e).__name__}: {e})") from None
    rest = {k: v for k, v in doc.items() if k not in ("model", "space", "space_id", "method", "params", "short_run",
                                                      "settings", "train", "format")}
    if isinstance((doc.get("train") or {}).get("converted_from"), str):
        rest.setdefault("converted_from", doc["train"]["converted_from"])
    if "stage_of" in rest:
        rest["stage_of"] = train_1_to_2(rest["stage_of"])
    # (the network as version 1 stored it, derived fields included: step 10 -> 11 checks them against the rest)
    return {"data_store": None, **rest, "record": {**record.to_dict(), "network": network.to_dict(), "train": train,
                                                   "version": 2}}


def _record_1(doc: dict) -> tuple[RunRecord, dict | None, object]:
    method = get_method(doc.get("method", "elf"))
    model = {k: v for k, v in doc["model"].items() if k not in RUN_ONLY}
    options = {k: model.pop(k) for k in SHORT_RUN_FIELDS if k in model}
    options = {**options, **(doc.get("short_run") or {})}
    space = space_1_to_2(doc["space"])
    raw_train = dict(doc.get("train") or {})
    released = "converted_from" in raw_train or not raw_train
    train = None if released else train_1_to_2(raw_train)
    settings = doc.get("settings")
    if settings is None:  # run.json of version 1 stored the model's layout in its training settings alone
        settings = {k: (train or {}).get(k) for k in ("length", "source_length", "source_slot", "task")}
        settings = {k: v for k, v in settings.items() if v is not None}
    settings = dict(settings)
    network = method.config_type.from_dict(model)
    source_length = settings.get("source_length")
    task = None
    if source_length:
        fields_read = (train.get("source_field", "input"), train.get("target_field", "output")) if train else ()
        task = Task(source_length, settings.get("source_slot", PACKED), settings.get("task"), *fields_read)
    pd = (train or {}).get("distillation") or {}
    distillation = None
    if pd.get("student_steps") or settings.get("distilled_steps") or settings.get("distilled"):
        distillation = Distillation("pd", pd.get("student_steps") or settings.get("distilled_steps"),
                                    pd.get("teacher_steps") or settings.get("teacher_steps"))
    params = doc.get("params")
    record = RunRecord(method.name, network, SpaceSpec.from_dict(space, doc.get("space_id")),
                       settings.get("length") or network.max_length,
                       recipe_for(raw_train.get("recipe") or {}, conditional=bool(source_length)),
                       ShortRunOptions.from_dict(options), task, None, distillation,
                       ParamCounts.from_dict(params) if isinstance(params, dict) else None)
    sampling = method.default_sampling(record)
    stored = settings.get("sampling") or {}
    if stored:
        sampling = sampling.replace(**{k: v for k, v in stored.items() if k in sampling.to_dict()})
    return record.replace(sampling=sampling), train, network


# ----------------------------------------------------------------------------------------------------------
# 2 -> 3 -> 4 -> 5
def _new_setting(train: dict, name: str, version: int, where: str) -> dict:
    """`train` before a step adds its setting `name`, first stored in `version`: a file of an earlier version
    that holds it was not written by elflow, and its value is refused rather than kept."""
    if name in train:
        raise ELFError(f"{where}: its training settings hold {name!r}, which a run of version {version - 1} never "
                       f"stored (it was added in version {version}); restore the file as elflow wrote it")
    return train


def _2_to_3(doc: dict, where: str) -> dict:
    """Version 3 records the learning-rate schedule's warm-up start (train.lr_schedule). Version 2 runs stepped
    at lr (k + 1) / W: "one-ahead"."""
    def schedule(train):
        return {**_new_setting(train, "lr_schedule", 3, where), "lr_schedule": "one-ahead"} \
            if isinstance(train, dict) else train

    out = {**doc, "record": {**doc["record"], "train": schedule(doc["record"].get("train")), "version": 3}}
    if "stage_of" in doc:
        out["stage_of"] = schedule(doc["stage_of"])
    return out


# the network settings beside the preset's that versions 4 to 8 stored whole ("model")
MODEL_FIELDS_4 = ("depth", "hidden", "heads", "mlp_ratio", "time_tokens", "omega_tokens", "mode_tokens", "rope_theta",
                  "self_cond", "target_time", "noise_scale", "t_eps")


def train_3_to_4(train):
    """Version 4's training settings hold the record's typed parts whole: the recipe (version 3 stored the
    flags' overrides of the released recipe of the run's kind), the network settings beside the preset's, the
    short-run options (overrides of the paper's network) and the distillation (None where version 3 stored {};
    a progressive-distillation round's objective "pd")."""
    if not isinstance(train, dict):
        return train
    train = dict(train)
    conditional = bool(train.get("source_length"))
    if isinstance(train.get("recipe"), dict):
        train["recipe"] = recipe_for(train["recipe"], conditional=conditional).to_dict()
    if isinstance(train.get("model"), dict):
        unknown = sorted(set(train["model"]) - set(MODEL_FIELDS_4))
        if unknown:
            raise ValueError(f"model: unknown fields {unknown}")
        train["model"] = {k: train["model"].get(k) for k in MODEL_FIELDS_4}
    if isinstance(train.get("short_run"), dict):
        train["short_run"] = ShortRunOptions.from_dict(train["short_run"]).to_dict()
    if isinstance(train.get("distillation"), dict):
        d = train["distillation"]
        train["distillation"] = Distillation.from_dict(d).to_dict() if d else None
    return train


def _3_to_4(doc: dict, where: str) -> dict:
    """Version 4's record describes the model alone: the training settings move out of it, beside it, with
    their parts whole (`train_3_to_4`)."""
    record = dict(doc["record"])
    train = record.pop("train", None)
    try:
        out = {**doc, "record": {**record, "version": 4}, "train": train_3_to_4(train)}
        if "stage_of" in doc:
            out["stage_of"] = train_3_to_4(doc["stage_of"])
    except (ValueError, TypeError) as e:
        raise ELFError(f"{where}: its training settings cannot be read ({e})") from None
    return out


# the task and the sampling defaults as settings of their own, up to version 7: the setting -> the field of the
# typed part (elflow.runs.record.Task, SamplingDefaults) that holds it from version 8
FLAT_TASK = {"source_length": "source_length", "source_slot": "source_slot", "task": "name",
             "source_field": "source_field", "target_field": "target_field"}
FLAT_SAMPLING = {"sample_steps": "steps", "sample_sampler": "sampler", "sample_omega": "omega"}


def _4_to_5(doc: dict, where: str) -> dict:
    """From version 5 the --sample-* settings are the model's sampling defaults, written into its record's
    sampling, which its previews read. Version 4's set the previews alone, and its record holds the defaults
    its model samples with: they become "not given" (None), so that the record stays as it is."""
    def settings(train):
        return {**train, **{k: None for k in FLAT_SAMPLING if k in train}} if isinstance(train, dict) else train

    out = {**doc, "record": {**doc["record"], "version": 5}}
    for key in ("train", "stage_of"):
        if key in doc:
            out[key] = settings(doc[key])
    return out


# the training settings a record of version 6 holds (of every method; and an ELF network's besides)
HELD_IN_6 = ("method", "match", "length", "task", "recipe", "distillation", "sampling")
ELF_HELD_IN_6 = ("predict", "conditioning", "bottleneck", "decoder", "model", "short_run")


def _5_to_6(doc: dict, where: str) -> dict:
    """From version 6 the training settings beside the record hold only what the record does not: version 5's
    copies of the settings the record holds (HELD_IN_6: the length, the task, the recipe, an ELF network's
    settings, ...) go, and the record's values stand for them. Where the two said different things
    (a --decoder separate run's recipe, which the record holds as trained: decode_prob 0), the record's is the
    one the model was trained with. A first stage's settings of the whole run ("stage_of") stay whole."""
    out = {**doc, "record": {**doc["record"], "version": 6}}
    train, elf = doc.get("train"), _elf_record(doc)
    if isinstance(train, dict) and elf is not None:
        held = (*HELD_IN_6, *(ELF_HELD_IN_6 if elf else ()), *FLAT_TASK, *FLAT_SAMPLING)
        out["train"] = {k: v for k, v in train.items() if k not in held}
    return out


def _elf_record(doc: dict) -> bool | None:
    """Whether a document's record is of a method with an ELF network (whose record holds the network), or None
    for a method this elflow does not know (the record's reader names the field)."""
    try:
        return get_method(doc["record"].get("method")).config_type is ELFConfig
    except (ELFError, TypeError):
        return None


def _6_to_7(doc: dict, where: str) -> dict:
    """From version 7 a checkpoint's state.json names its model by the record's digest and the record is its
    run's run.json alone. A checkpoint of version 6 keeps the record it carries: the one description it has
    when it is read alone (a converted release, a checkpoint copied out of its run), the one its run.json is
    checked against where it is read in its run. Every other document changes its version alone."""
    return {**doc, "record": {**doc["record"], "version": 7}}


def train_7_to_8(train):
    """Version 8's whole training settings hold the task (None: plain text) and the sampling defaults as the
    typed parts the record holds, each field from the flat setting it was; a task's fields not stored take the
    values version 7 read pairs by (Task's defaults)."""
    if not isinstance(train, dict):
        return train
    train = dict(train)
    flat = {FLAT_TASK[k]: train.pop(k) for k in list(train) if k in FLAT_TASK}
    task = {f.name: flat.get(f.name, f.default) for f in fields(Task)}
    train["task"] = task if flat.get("source_length") else None
    train["sampling"] = {FLAT_SAMPLING[k]: train.pop(k) for k in list(train) if k in FLAT_SAMPLING}
    return train


def _7_to_8(doc: dict, where: str) -> dict:
    """From version 8 a run's whole settings hold its task and sampling defaults as typed parts (`train_7_to_8`);
    version 7 stored them flat in a first stage's "stage_of" alone (the settings beside a record hold neither:
    the record does). Every other document changes its version alone: today's state.json its own."""
    if "record" not in doc:
        return {**doc, "version": 8}
    out = {**doc, "record": {**doc["record"], "version": 8}}
    if "stage_of" in doc:
        out["stage_of"] = train_7_to_8(doc["stage_of"])
    return out


# the flat settings of the network up to version 8, and the fields of "model" that follow from the recipe and the
# distillation from version 9 (elflow.config.TrainConfig.network_fields)
FLAT_NETWORK = ("bottleneck", "predict", "conditioning", "decoder")
DERIVED_NETWORK = ("self_cond", "target_time", "noise_scale", "t_eps")


def train_8_to_9(train):
    """Version 9's training settings describe the network as one part ("network"): version 8's "model" without
    the fields that follow from the recipe and the distillation, with the flat network settings as its fields.
    Settings that hold none of them (an ELF run's, whose record holds its network) stay as they are."""
    if not isinstance(train, dict) or not any(k in train for k in ("model", *FLAT_NETWORK)):
        return train
    train = dict(train)
    model = train.pop("model", None) or {}
    network = {k: v for k, v in model.items() if k not in DERIVED_NETWORK} if isinstance(model, dict) else model
    if isinstance(network, dict):
        network.update({k: train.pop(k) for k in FLAT_NETWORK if k in train})
    train["network"] = network
    return train


# what a record's sampling held up to version 8 that is the caller's from version 9
CALLERS_SAMPLING = ("seed", "batch_size", "dtype")


def _8_to_9(doc: dict, where: str) -> dict:
    """From version 9 the training settings hold the network as one part (`train_8_to_9`): those beside a
    baseline's record and a first stage's whole settings; and a record's sampling holds the model's generation
    defaults alone, the seed, batch size and precision it held being the caller's (CALLERS_SAMPLING, which every
    version-8 record held at their defaults: 0, the method's batch, fp32). A state.json changes its version
    alone."""
    if "record" not in doc:
        return {**doc, "version": 9}
    record = doc["record"]
    sampling = record.get("sampling")
    if isinstance(sampling, dict):
        record = {**record, "sampling": {k: v for k, v in sampling.items() if k not in CALLERS_SAMPLING}}
    out = {**doc, "record": {**record, "version": 9}}
    for key in ("train", "stage_of"):
        if key in doc:
            out[key] = train_8_to_9(doc[key])
    return out


# version -> the step that makes a document of that version one version newer
# the space as flat training settings up to version 9
FLAT_SPACE = ("space", "space_dim", "space_seed", "space_stream", "latent_std")


def train_9_to_10(train):
    """Version 10's training settings hold the space as one part ("space", elflow.space.SpaceSpec's fields) where
    version 9 held it flat: the kind and encoder its --space value names; a drawn table's seed, stream and vector
    size; the latent std, a number where version 9 stored one as text."""
    if not isinstance(train, dict) or not any(k in train for k in FLAT_SPACE) or isinstance(train.get("space"), dict):
        return train
    train = dict(train)
    flat = {k: train.pop(k) for k in FLAT_SPACE if k in train}
    name, std = flat.get("space"), flat.get("latent_std")
    part = parse_space(name) if isinstance(name, str) else {}
    if not part or drawn_table(part):
        part.update(dim=flat.get("space_dim"), seed=flat.get("space_seed"), stream=flat.get("space_stream"))
    elif flat.get("space_dim") is not None:  # (refused by the run's checks, as version 9 refused it)
        part["dim"] = flat["space_dim"]
    part["latent_std"] = latent_std_of(std) if isinstance(std, str) else std  # (another word: refused by the checks)
    given = {k: v for k, v in part.items() if v is not None}
    if "kind" not in given:  # no space named: the preset's, with the fields given (as TrainConfig reads it)
        train["space"] = given or None
    else:  # as TrainConfig writes a space: every field
        train["space"] = asdict(SpaceSpec(**part))
    return train


def _9_to_10(doc: dict, where: str) -> dict:
    """From version 10 an ELF record's space is the one its run's settings name: the flat space settings beside it
    go (the record's space is the one built from them), and the whole settings of a first stage and those beside
    a baseline's record (which holds the tokenizer alone) hold the space as one part (`train_9_to_10`). A
    state.json changes its version alone."""
    if "record" not in doc:
        return {**doc, "version": 10}
    out = {**doc, "record": {**doc["record"], "version": 10}}
    if "stage_of" in doc:
        out["stage_of"] = train_9_to_10(doc["stage_of"])
    train, elf = doc.get("train"), _elf_record(doc)
    if isinstance(train, dict) and elf is not None:
        out["train"] = {k: v for k, v in train.items() if k not in FLAT_SPACE} if elf else train_9_to_10(train)
    return out


def _10_to_11(doc: dict, where: str) -> dict:
    """From version 11 an ELF record's network does not store the fields that follow from its recipe and
    distillation (the method's `derived`): the record sets them. Version 10 stored every one of them and refused
    a record whose values disagreed with the rest: such a record (or one that lacks one) is refused here, naming
    the field; one whose recipe or distillation is missing or cannot be read is left to the record's reader to
    name. A state.json changes its version alone (its model's digest is of the network in full:
    `RunRecord.identity`)."""
    if "record" not in doc:
        return {**doc, "version": 11}
    record = {**doc["record"], "version": 11}
    network = record.get("network")
    if _elf_record(doc) and isinstance(network, dict):
        elf = get_method("elf")
        try:
            recipe = Recipe.from_dict(record["recipe"])
            distillation = None if record["distillation"] is None else Distillation.from_dict(record["distillation"])
        except (KeyError, ELFError, ValueError, TypeError, AttributeError):
            recipe = None
        if recipe is not None:
            _check_derived(network, elf.derive(recipe, distillation), recipe, where)
        record["network"] = {k: v for k, v in network.items() if k not in elf.derived}
    return {**doc, "record": record}


def _check_derived(network: dict, derived: dict, recipe: Recipe, where: str) -> None:
    """ELFError for a version-10 network that lacks one of the derived fields or whose stored values disagree
    with its recipe and distillation (an x head's path constants excepted: it never read them)."""
    def refuse(what):
        raise ELFError(f"{where}: its record's field 'network': {what}")

    missing = [k for k in derived if k not in network]
    if missing:
        raise ELFError(f"{where}: its record's field 'network' is not a network of its method 'elf': it lacks "
                       f"'network.{missing[0]}'; a record of this version holds every field (restore the file as "
                       "elflow wrote it)")
    if network["self_cond"] is not derived["self_cond"]:  # (a bool, as version 10 read it: not 1 or "true")
        refuse(f"self_cond {network['self_cond']!r:.40} while the recipe's self_cond_prob is {recipe.self_cond_prob}")
    if network.get("predict", "x") != "x" and any(network[k] != derived[k] for k in ("noise_scale", "t_eps")):
        refuse(f"a {network.get('predict')!s:.20}-predicting head with noise_scale {network['noise_scale']!r:.40} and "
               f"t_eps {network['t_eps']!r:.40}, while the recipe's are {recipe.noise_scale} and {recipe.t_eps}")
    if network["target_time"] is not derived["target_time"]:
        refuse(f"target_time {network['target_time']!r:.40} while the model is "
               f"{'' if derived['target_time'] else 'not '}a flow-map student")


STEPS = {1: _1_to_2, 2: _2_to_3, 3: _3_to_4, 4: _4_to_5, 5: _5_to_6, 6: _6_to_7, 7: _7_to_8, 8: _8_to_9,
         9: _9_to_10, 10: _10_to_11}
assert sorted(STEPS) == list(range(PRE_RECORD, RECORD_VERSION)), "the chain must reach today's version"


# ----------------------------------------------------------------------------------------------------------
# the authors' checkpoints
def released_record(network, settings: dict, space: dict) -> RunRecord:
    """The record of a released checkpoint: its network (inferred from its weights), the layout and defaults
    of its release (`settings`: length, source_length, task, distilled) and its space."""
    source_length = settings.get("source_length")
    task = Task(source_length, PACKED, settings.get("task")) if source_length else None
    distillation = Distillation("pd", None, None) if settings.get("distilled") else None
    # (weights without the self-conditioning input were trained without it: the recipe the record derives it from)
    recipe = recipe_for({} if network.self_cond else {"self_cond_prob": 0.0}, conditional=task is not None)
    base = RunRecord("elf", network, SpaceSpec.from_dict(space), settings.get("length", network.max_length), recipe,
                     task=task, distillation=distillation)
    return base.with_default_sampling()

"""The training config (elflow.config.TrainConfig): its typed parts (recipe, model, short_run, distillation)
given whole or as dicts of their fields, a bad field one ELFError naming its flag; the settings a run.json
stores beside its record, each once (`TrainConfig.beside`, read back with the record by `TrainConfig.of_run`;
whole: `TrainConfig.stored`); the defaults filled in by `resolved`; the ranges and combinations `validate`
refuses; the named configs of --defaults; what a --resume may not change (`resume_conflicts`), what a
continued run keeps (`kept_from`) and the one-flag check of elflow distill (`check_setting`)."""

import json
from dataclasses import fields
from pathlib import Path

import pytest

from elflow.config import (
    NESTED_FLAGS,
    PART_TYPES,
    NetworkOverrides,
    TrainConfig,
    check_setting,
    held_settings,
    kept_from,
    record_settings,
    resume_conflicts,
)
from elflow.flow import Recipe
from elflow.model import ELFConfig, ShortRunOptions
from elflow.runs.migrate import document
from elflow.runs.record import Distillation, RunRecord, SamplingDefaults, Task
from elflow.space import TABLE_STREAM, SpaceSpec, latent_std_of, parse_space, space_name
from elflow.util.devices import resolve_dtype
from elflow.util.errors import ELFError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RUN_FILES = sorted(FIXTURES.glob("*/**/run.json"))  # the runs of earlier elflows: legacy/, record2/, ..., record10/
RELEASED_CONDITIONAL_DECODE_NOISE = 1.0  # the paper's decode corruption for (source, target) pairs


# ----------------------------------------------------------------------------------------------------------
# the typed parts


def test_the_parts_default_to_the_released_recipe_the_presets_network_and_no_options():
    cfg = TrainConfig()
    assert cfg.recipe is None and cfg.distillation is None
    assert cfg.network == NetworkOverrides() and cfg.network.given() == {}
    assert cfg.short_run == ShortRunOptions() and not cfg.short_run.active


def test_the_flow_recipe_is_the_released_one_of_the_runs_kind_unless_one_is_given():
    assert TrainConfig().flow_recipe() == Recipe()
    conditional = TrainConfig(task={"source_length": 8}).flow_recipe()
    assert conditional.decode_noise_scale == RELEASED_CONDITIONAL_DECODE_NOISE != Recipe().decode_noise_scale
    assert conditional.replace(decode_noise_scale=Recipe().decode_noise_scale) == Recipe()  # nothing else differs
    given = Recipe(t_std=0.5)
    assert TrainConfig(recipe=given, task={"source_length": 8}).flow_recipe() is given  # a recipe given whole is kept


def test_each_part_given_as_a_dict_of_its_fields_is_read_into_its_type():
    """A recipe's fields are overrides of the released recipe of the run's kind; the others are their types'
    fields, {} (or None) the type's defaults, and an empty distillation none."""
    assert TrainConfig(recipe={"t_std": 0.5}).recipe == Recipe(t_std=0.5)
    assert TrainConfig(recipe={"t_std": 0.5}, task={"source_length": 8}).recipe == \
        Recipe(t_std=0.5, decode_noise_scale=RELEASED_CONDITIONAL_DECODE_NOISE)
    assert TrainConfig(recipe={"decode_noise_scale": 2.0}, task={"source_length": 8}).recipe.decode_noise_scale == 2.0
    assert TrainConfig(network={"depth": 3, "heads": 2}).network == NetworkOverrides(depth=3, heads=2)
    assert TrainConfig(short_run={"skip": "gated"}).short_run == ShortRunOptions(skip="gated")
    assert TrainConfig(short_run=None).short_run == ShortRunOptions()
    assert TrainConfig(distillation={"student_steps": 4, "teacher_steps": 16}).distillation == \
        Distillation("pd", 4, 16)
    assert TrainConfig(distillation={}).distillation is None


def test_the_parts_are_stored_whole_and_read_back_equal():
    cfg = TrainConfig(preset="tiny", recipe={"t_std": 0.5}, network={"depth": 3}, short_run={"skip": "gated"},
                      distillation={"objective": "flow-map", "student_steps": 4})
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["recipe"] == {**Recipe().to_dict(), "t_std": 0.5}
    assert d["network"] == {**{k: None for k in NetworkOverrides().to_dict()}, "depth": 3}
    assert d["short_run"] == {"skip": "gated", "time_scale": 1.0, "head_modulation": False, "table_readout": 0.0}
    assert d["distillation"] == {"objective": "flow-map", "student_steps": 4, "teacher_steps": None}
    assert TrainConfig.from_dict(d) == cfg
    assert TrainConfig().to_dict()["recipe"] is None and TrainConfig().to_dict()["distillation"] is None


# (id, the part given, the error: a field of a flag names the flag)
BAD_PARTS = [
    ("time-scale-negative", dict(short_run={"time_scale": -1.0}), "--time-scale must be a number > 0, got -1.0"),
    ("time-scale-a-string", dict(short_run={"time_scale": "x"}), "--time-scale must be a number > 0, got 'x'"),
    ("table-readout-negative", dict(short_run={"table_readout": -1}), "--table-readout must be a number >= 0, got -1"),
    ("skip-unknown", dict(short_run={"skip": "residual"}), "--skip must be one of none, gaussian, gated, got 'residual'"),
    ("short-run-unknown-field", dict(short_run={"colour": 1}),
     "the short-run options do not fit together: ShortRunOptions: unknown fields ['colour']"),
    ("t-std-0", dict(recipe={"t_std": 0.0}), "--t-std must be a number in (0, 10], got 0.0"),
    ("t-std-a-string", dict(recipe={"t_std": "a"}), "--t-std must be a number in (0, 10], got 'a'"),
    ("decode-prob-above-1", dict(recipe={"decode_prob": 1.5}), "--decode-prob must be a number in [0, 1], got 1.5"),
    ("recipe-unknown-field", dict(recipe={"noise": 2.0}), "the run's recipe cannot be read: Recipe: unknown fields "
                                                          "['noise']"),
    ("omega-range-reversed", dict(recipe={"omega_low": 3.0, "omega_high": 1.0}),
     "the run's recipe cannot be read: the recipe's constants are out of range: omega range [3.0, 1.0]"),
    ("source-length-0", dict(task={"source_length": 0}), "--source-length must be an integer >= 1, got 0"),
    ("source-slot-unknown", dict(task={"source_length": 4, "source_slot": "middle"}),
     "--source-slot must be one of packed, fixed, got 'middle'"),
    ("task-unknown", dict(task={"source_length": 4, "name": "poetry"}),
     "--task must be one of wmt14-de-en, xsum, got 'poetry'"),
    ("source-field-a-number", dict(task={"source_length": 4, "source_field": 3}), "--source-field must be a string, got 3"),
    ("pair-flags-without-source-length", dict(task={"source_slot": "fixed", "name": "xsum"}),
     "--source-slot, --task lay out (source, target) pairs; give --source-length too"),
    ("task-unknown-field", dict(task={"source_length": 4, "slot": "fixed"}),
     "the run's task cannot be read: Task: unknown fields ['slot']"),
    ("sample-steps-0", dict(sampling={"steps": 0}), "--sample-steps must be an integer from 1 to 10,000"),
    ("sample-sampler-unknown", dict(sampling={"sampler": "euler"}),
     "--sample-sampler must be one of ode, sde, vc, map, got 'euler'"),
    ("sample-omega-nan", dict(sampling={"omega": float("nan")}), "--sample-omega must be a number from 0 to 100, got nan"),
    ("sampling-unknown-field", dict(sampling={"gamma": 1.0}),
     "the run's sampling defaults cannot be read: SamplingDefaults: unknown fields ['gamma']"),
    ("depth-0", dict(network={"depth": 0}), "--depth must be an integer from 1 to 1,099,511,627,776 (far past any network), got 0"),
    ("depth-a-fraction", dict(network={"depth": 2.5}), "--depth must be an integer from 1 to 1,099,511,627,776 (far past any network), got 2.5"),
    ("heads-true", dict(network={"heads": True}), "--heads must be an integer from 1 to 1,099,511,627,776 (far past any network), got True"),
    ("model-unknown-field", dict(network={"colour": 2}),
     "the run's network settings cannot be read: NetworkOverrides: unknown fields ['colour']"),
    ("distillation-objective", dict(distillation={"objective": "x"}),
     "the run's distillation cannot be read: objective must be one of pd, flow-map, got 'x'"),
    ("distillation-student-0", dict(distillation={"student_steps": 0}),
     "the run's distillation cannot be read: student_steps must be an integer >= 1 or null, got 0"),
]


@pytest.mark.parametrize("part, words", [c[1:] for c in BAD_PARTS], ids=[c[0] for c in BAD_PARTS])
def test_a_bad_field_of_a_part_is_one_error_naming_its_flag(part, words):
    with pytest.raises(ELFError) as e:
        TrainConfig(**part)
    assert str(e.value).startswith(words), str(e.value)


# ----------------------------------------------------------------------------------------------------------
# the settings a run.json stores


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: str(p.parent.relative_to(FIXTURES)))
def test_the_settings_of_every_earlier_run_read_with_its_record_and_write_back_as_stored(path):
    doc = document(json.loads(path.read_text()), str(path))
    record = RunRecord.from_dict(doc["record"], str(path))
    if doc["train"] is None:  # a converted release: not trained by elflow, it has no training settings
        assert doc["converted_from"] and record.params is None
        return
    cfg = TrainConfig.of_run(record, doc["train"], str(path))
    assert cfg.beside(record) == doc["train"]  # what run.json stores beside the record, as stored
    assert {k: v for k, v in cfg.to_dict().items() if k in held_settings(record.method)} == record_settings(record)
    assert isinstance(cfg.recipe, Recipe) and isinstance(cfg.short_run, ShortRunOptions)
    assert cfg.network.depth == 1  # every fixture's network has one block (--depth 1)


def test_run_json_stores_each_setting_once_the_record_the_model_and_beside_it_how_it_trained(
        trained, tiny_t5_dir, tiny_corpus_file):
    from helpers import tiny_config

    from elflow.runs.stored import run_file

    doc = json.loads((trained / "run.json").read_text())
    held = held_settings(doc["record"]["method"])
    assert not set(doc["train"]) & set(held)  # none restated
    assert set(doc["train"]) | set(held) == {f.name for f in fields(TrainConfig)}  # and none missing
    stored = run_file(trained)
    cfg = TrainConfig.of_run(stored["record"], stored["train"], "run.json")
    given = tiny_config(tiny_t5_dir, tiny_corpus_file).resolved()
    for k in ("length", "preset", "steps", "seed", "batch", "lr"):  # the run's own settings, from either place
        assert getattr(cfg, k) == getattr(given, k), k
    assert cfg.network.depth == stored["record"].network.depth and cfg.recipe == stored["record"].recipe


def test_settings_beside_the_record_that_restate_it_are_refused_naming_them(trained):
    from elflow.runs.stored import run_file

    stored = run_file(trained)
    record = stored["record"]
    with pytest.raises(ELFError, match=r"^run.json: its training settings hold 'length', which its record holds"):
        TrainConfig.of_run(record, {**stored["train"], "length": 64}, "run.json")
    with pytest.raises(ELFError, match="run.json: its training settings lack 'seed'"):
        TrainConfig.of_run(record, {k: v for k, v in stored["train"].items() if k != "seed"}, "run.json")
    with pytest.raises(ELFError, match=r"^run.json: its training settings must be a JSON object, got list$"):
        TrainConfig.of_run(record, [], "run.json")


def test_stored_training_settings_hold_every_setting_and_name_what_is_wrong(trained):
    from elflow.runs.stored import run_file

    stored = run_file(trained)
    settings = TrainConfig.of_run(stored["record"], stored["train"], "run.json").to_dict()
    assert TrainConfig.stored(settings, "run.json").to_dict() == settings
    with pytest.raises(ELFError, match="run.json: its training settings lack 'seed'"):
        TrainConfig.stored({k: v for k, v in settings.items() if k != "seed"}, "run.json")
    with pytest.raises(ELFError, match=r"unknown settings \['colour'\]"):
        TrainConfig.stored({**settings, "colour": 1}, "run.json")
    with pytest.raises(ELFError, match="run.json: --time-scale must be a number > 0"):
        TrainConfig.stored({**settings, "short_run": {**settings["short_run"], "time_scale": -1.0}}, "run.json")


def test_stored_settings_that_are_no_object_or_lack_several_name_the_first_three():
    settings = TrainConfig(preset="tiny").resolved().to_dict()
    with pytest.raises(ELFError, match=r"^run.json: its training settings must be a JSON object, got list$"):
        TrainConfig.stored([settings], "run.json")
    with pytest.raises(ELFError) as e:
        TrainConfig.stored({k: v for k, v in settings.items() if k not in ("seed", "batch", "lr", "keep")},
                           "run.json")
    assert str(e.value).startswith("run.json: its training settings lack 'batch', 'lr', 'seed'; a run.json of this "
                                   "version holds every setting")  # the first three in the order of the settings


@pytest.mark.parametrize("change, words", [
    (dict(batch=0), "run.json: its setting 'batch' must be an integer from 1 to 1,048,576"),
    (dict(optimizer="sgd"), "run.json: its setting 'optimizer' must be one of muon, adamw, got 'sgd'"),
    (dict(compile="yes"), "run.json: its setting 'compile' must be true or false, got 'yes'"),
    (dict(method="ar", network={"predict": "v"}), "run.json: --predict applies to ELF runs only, not to --method ar"),
    (dict(distillation={"objective": "x"}), "run.json: the run's distillation cannot be read"),
], ids=["batch", "optimizer", "compile", "method", "distillation"])
def test_a_stored_setting_out_of_range_names_the_file_and_the_setting(change, words):
    settings = TrainConfig(preset="tiny").resolved().to_dict()
    with pytest.raises(ELFError) as e:
        TrainConfig.stored({**settings, **change}, "run.json")
    assert str(e.value).startswith(words), str(e.value)


def test_from_dict_takes_defaults_for_what_is_missing_and_refuses_the_unknown_only_when_strict():
    assert TrainConfig.from_dict({"seed": 3}) == TrainConfig(seed=3)
    assert TrainConfig.from_dict({"seed": 3, "muon_scale": "fan"}) == TrainConfig(seed=3)  # a setting now gone
    with pytest.raises(ValueError, match=r"unknown settings \['muon_scale'\]"):
        TrainConfig.from_dict({"seed": 3, "muon_scale": "fan"}, strict=True)


# ----------------------------------------------------------------------------------------------------------
# resolved: the defaults that follow from the preset


def test_resolved_fills_in_each_presets_defaults():
    tiny = TrainConfig(preset="tiny").resolved()
    assert (tiny.space, tiny.ema_decay, tiny.length) == \
        (SpaceSpec("random-table", "minilm", dim=32, seed=0, stream=TABLE_STREAM), 0.995, 32)  # its draw recorded
    assert tiny.lr == pytest.approx(1e-3 * 32 / 256) and tiny.recipe == Recipe() and tiny.dtype == "auto"
    demo = TrainConfig(preset="demo").resolved()
    assert (demo.space, demo.ema_decay, demo.length) == (SpaceSpec("hf", "minilm"), 0.995, 64)
    paper = TrainConfig(preset="elf-b", batch=512).resolved()
    assert (space_name(paper.space), paper.ema_decay, paper.length) == ("t5-small", 0.9999, 1024)
    assert paper.lr == pytest.approx(2e-3)  # 1e-3 x 512 / 256
    assert TrainConfig(preset="tiny", optimizer="adamw").resolved().lr == pytest.approx(5e-5 * 32 / 256)
    assert TrainConfig(preset="tiny", task={"source_length": 4}).resolved().recipe.decode_noise_scale == \
        RELEASED_CONDITIONAL_DECODE_NOISE


def test_resolved_keeps_what_was_given_and_changes_nothing_twice():
    given = TrainConfig(preset="tiny", space={"kind": "learned-table", "name": "minilm", "dim": 16, "stream": 1},
                        ema_decay=0.9, length=20, lr=0.01, dtype="fp32", recipe={"t_std": 0.5})
    r = given.resolved("cpu")
    assert (r.space, r.ema_decay, r.length, r.lr, r.dtype) == \
        (SpaceSpec("learned-table", "minilm", dim=16, seed=0, stream=1), 0.9, 20, 0.01, "fp32")
    assert r.recipe == Recipe(t_std=0.5) and r.resolved("cpu") == r
    assert TrainConfig(preset="tiny", space="token-table:minilm").resolved().space.stream is None  # no draw
    # a space whose kind is not given is the size's own, with the fields given
    assert TrainConfig(preset="tiny", space={"seed": 3}).space == SpaceSpec("random-table", "minilm", dim=32, seed=3)


@pytest.mark.parametrize("text", ["minilm", "t5-small", "google-t5/t5-large", "t5:/models/mine", "hf:/models/enc",
                                  "/models/enc", "random-table:minilm", "token-table:t5-small", "learned-table",
                                  "hf:t5-small", "t5:minilm"])
def test_a_space_value_names_the_spec_it_parses_to(text):
    """space_name is parse_space's inverse: the value it writes parses to the same kind and encoder."""
    spec = parse_space(text)
    assert parse_space(space_name(spec)) == spec
    assert space_name(SpaceSpec.from_dict(spec)) == space_name(spec)


@pytest.mark.parametrize("text, hint", [("random-table:", "as in random-table:minilm, or leave the colon out"),
                                        ("t5:", "as in t5:t5-small")])
def test_a_space_value_that_names_no_encoder_after_its_colon_is_one_line(text, hint):
    with pytest.raises(ELFError) as e:
        TrainConfig(space=text)
    assert str(e.value) == f"--space {text!r} names no encoder after its colon; give its folder or hub id, {hint}"


def test_a_latent_std_is_read_and_checked_by_one_declaration():
    """The flag's text, a stored number and version 9's text alike: a positive number, 'auto' or 'table'."""
    assert [latent_std_of(t) for t in ("0.2", "auto", "table", "big")] == [0.2, "auto", "table", "big"]
    for bad in (0.0, -1, float("nan"), float("inf"), "big", True):
        with pytest.raises(ELFError, match="--latent-std must be a positive number, 'auto' or 'table'"):
            TrainConfig(space={"latent_std": bad})
        with pytest.raises(ValueError, match="latent_std must be a positive number"):
            SpaceSpec.from_dict({"kind": "hf", "name": "minilm", "latent_std": bad})
    assert TrainConfig(space={"latent_std": 0.5}).space.latent_std == 0.5


# the other fields a network needs around a probe of one (heads that divide the width into even heads, a
# path's constants for a v or eps head)
AROUND = {"hidden": {"heads": 1}, "heads": {"hidden": 2**34}, "predict": {"noise_scale": 1.0, "t_eps": 0.05}}


# how a stored part is read, for each typed part a flag sets a field of
STORED_PARTS = {
    "network": lambda field, v: ELFConfig(**{**AROUND.get(field, {}), field: v}),
    "space": lambda field, v: SpaceSpec.from_dict({"kind": "random-table", "name": "minilm", field: v}),
    "short_run": lambda field, v: ShortRunOptions(**{field: v}),
    "task": lambda field, v: Task(**{"source_length": 8, field: v}),
    "sampling": lambda field, v: SamplingDefaults(**{field: v}),
}


def _refused(check, *args) -> bool:
    try:
        check(*args)
    except (ELFError, ValueError):
        return True
    return False


@pytest.mark.parametrize("key", [k for k in NESTED_FLAGS if k[0] in PART_TYPES and k[1] in PART_TYPES[k[0]].DECLARED],
                         ids="{0[0]}.{0[1]}".format)
def test_a_part_field_is_declared_once_and_its_flag_and_its_stored_reader_agree(key):
    """A field's range and choices are its part type's declaration, which its flag reads: the flag and the stored
    part's reader refuse the same values (a seed past 2^32 was once refused by --space-seed and taken from a
    stored space)."""
    part, field = key
    flag = NESTED_FLAGS[key]
    check, choices = PART_TYPES[part].DECLARED[field]
    assert flag.check is check and (not choices or flag.type == tuple(choices))
    probes = [0, -1, 2.5, True, "4", "x", 2**33, 2**41, 10**100, float("nan"), -float("inf"), *(choices or ())]
    for v in probes:
        assert _refused(flag.check_value, v) == _refused(STORED_PARTS[part], field, v), (key, v)


def test_resolved_on_a_device_reads_dtype_auto_as_what_it_picks_there():
    picked = TrainConfig(preset="tiny").resolved("cpu").dtype
    assert picked in ("fp32", "bf16") and picked == resolve_dtype("auto", "cpu")


# ----------------------------------------------------------------------------------------------------------
# validate


# (id, settings, the error as a flag, the error for a stored run.json)
INVALID = [
    ("unknown-preset", dict(preset="huge"), "--preset: unknown preset 'huge'; choose one of tiny, demo",
     "run.json: its setting 'preset': unknown preset 'huge'"),
    ("bool-not-bool", dict(compile="yes"), "--compile must be true or false, got 'yes'",
     "run.json: its setting 'compile' must be true or false"),
    ("string-not-string", dict(data=3), "--data must be a string, got 3", "run.json: its setting 'data' must be a "
                                                                          "string"),
    ("flag-of-its-own", dict(text_field=3), "--field must be a string, got 3",
     "run.json: its setting 'text_field' must be a string"),
    ("not-a-choice", dict(optimizer="sgd"), "--optimizer must be one of muon, adamw, got 'sgd'",
     "run.json: its setting 'optimizer' must be one of"),
    ("batch-0", dict(batch=0), "--batch must be an integer from 1 to 1,048,576 (the paper's batch is 512), got 0",
     "run.json: its setting 'batch' must be an integer from 1"),
    ("lr-nan", dict(lr=float("nan")), "--lr must be a number > 0, got nan", "run.json: its setting 'lr' must be"),
    ("seed-negative", dict(seed=-1), "--seed must be an integer from 0 to 4294967295, got -1",
     "run.json: its setting 'seed' must be"),
    ("ema-decay-1", dict(ema_decay=1.0), "--ema-decay must be a number in [0, 1), got 1.0",
     "run.json: its setting 'ema_decay' must be"),
    ("elf-flag-on-a-baseline", dict(method="ar", network={"predict": "v"}), "--predict applies to ELF runs only, not to --method ar",
     "run.json: --predict applies to ELF runs only"),
    ("recipe-on-a-baseline", dict(method="ar", recipe={"t_std": 0.5}),
     "--t-std applies to ELF runs only, not to --method ar", "run.json: --t-std applies to ELF runs only"),
    ("muon-setting-with-adamw", dict(optimizer="adamw", adam_heads=True),
     "--adam-heads sets up Muon; it does not apply to --optimizer adamw",
     "run.json: its setting 'adam_heads' sets up Muon"),
    ("table-readout-without-token-vectors", dict(space="minilm", short_run={"table_readout": 1.0}),
     "--table-readout 1: the table readout needs a space with one vector per token",
     "run.json: its setting 'table_readout' 1: the table readout needs"),
    ("source-leaving-no-target", dict(task={"source_length": 16}, length=16),
     "--source-length 16 leaves no room for a target in --length 16",
     "run.json: its setting 'task.source_length' 16 leaves no room for a target"),
]


@pytest.mark.parametrize("settings, as_flag, as_stored", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_validate_names_the_first_setting_out_of_range_as_its_flag_or_its_stored_name(settings, as_flag, as_stored):
    cfg = TrainConfig(**settings)
    with pytest.raises(ELFError) as e:
        cfg.validate()
    assert str(e.value).startswith(as_flag), str(e.value)
    with pytest.raises(ELFError) as e:
        cfg.validate(stored="run.json")
    assert str(e.value).startswith(as_stored), str(e.value)


@pytest.mark.parametrize("settings", [
    dict(), dict(preset="tiny"), dict(space="token-table:minilm", short_run={"table_readout": 1.0}),
    dict(task={"source_length": 15, "source_slot": "fixed"}, length=16), dict(method="ar"), dict(optimizer="adamw"),
], ids=["defaults", "tiny", "table-readout-over-a-table", "fixed-slot-pairs", "baseline", "adamw"])
def test_validate_passes_settings_that_fit_together(settings):
    assert TrainConfig(**settings).validate() is None
    assert TrainConfig(**settings).resolved().validate() is None


# ----------------------------------------------------------------------------------------------------------
# named configs (--defaults)


def test_a_named_config_derives_its_cadence_from_its_length_unless_given():
    quick = TrainConfig.named("quickstart", steps=100)
    assert (quick.ckpt_every, quick.sample_every) == (25, 25)
    assert quick.short_run == ShortRunOptions(skip="gated", time_scale=1000.0, head_modulation=True,
                                              table_readout=1.0)
    assert TrainConfig.named("quickstart", steps=100, ckpt_every=7).ckpt_every == 7
    xsum = TrainConfig.named("xsum")
    assert (xsum.task.name, xsum.preset, space_name(xsum.space), xsum.layout) == ("xsum", "elf-b", "t5-small",
                                                                                   "document")
    assert xsum.task.source_length < xsum.length
    assert xsum.flow_recipe().decode_noise_scale == RELEASED_CONDITIONAL_DECODE_NOISE
    assert TrainConfig.named(None, seed=4) == TrainConfig(seed=4)
    with pytest.raises(ELFError, match="unknown --defaults 'nope'; choose one of quickstart, wmt14-de-en, xsum"):
        TrainConfig.named("nope")


def test_the_network_fields_are_the_overrides_and_variants_with_the_recipes_constants_a_head_reads():
    # (an x head's config drops the path constants: it reads none)
    released = {"self_cond": True, "target_time": False, "noise_scale": Recipe().noise_scale, "t_eps": Recipe().t_eps}
    cfg = TrainConfig(network={"depth": 3, "bottleneck": 8})
    assert cfg.network_fields(Recipe()) == {"depth": 3, "bottleneck": 8, **released}
    v = TrainConfig(network={"predict": "v"}).network_fields(Recipe(self_cond_prob=0.0, noise_scale=1.5))
    assert v == {"predict": "v", **released, "self_cond": False, "noise_scale": 1.5}
    student = TrainConfig(distillation=Distillation("flow-map", 4, None)).network_fields(Recipe())
    assert student == {**released, "target_time": True}  # a flow-map student's target time: its distillation's


# ----------------------------------------------------------------------------------------------------------
# what a resume may change, and what a continued run keeps


def test_resume_conflicts_name_each_setting_that_may_not_change():
    stored = TrainConfig(preset="tiny", lr=0.003, dtype="fp32")
    assert resume_conflicts(stored, stored) == []
    mutable = dict(steps=99, micro_batch=2, log_every=3, ckpt_every=4, keep=0, sample_every=5, sampling={"steps": 8},
                   dist_timeout=10.0, tensorboard=True, wandb="p", wandb_run="r")
    assert resume_conflicts(stored, stored.replace(**mutable)) == []
    assert resume_conflicts(stored, stored.replace(seed=3, lr=0.5)) == ["lr: 0.003 -> 0.5", "seed: 0 -> 3"]
    assert resume_conflicts(stored, stored.replace(short_run=ShortRunOptions(skip="gated"))) == [
        "short_run.skip: 'none' -> 'gated'"]
    assert resume_conflicts(stored, stored.replace(space={"dim": 16})) == ["space.dim: 32 -> 16"]
    assert resume_conflicts(stored, stored.replace(space={"kind": "hf", "name": "minilm"})) == [
        "space.kind: 'random-table' -> 'hf'"]


def test_on_resume_a_setting_the_record_holds_that_is_not_given_keeps_the_stored_one():
    """The settings the record holds are read back whole (a network setting as the network has it): a command
    that leaves one to the preset (None) keeps it; one given otherwise is a change."""
    stored = TrainConfig(preset="tiny", network=NetworkOverrides(depth=1, hidden=64, heads=2, bottleneck=16)).resolved()
    assert resume_conflicts(stored, stored.replace(network=NetworkOverrides(depth=1))) == []
    assert resume_conflicts(stored, stored.replace(network=NetworkOverrides(depth=2))) == ["network.depth: 1 -> 2"]
    assert resume_conflicts(stored, stored.replace(network=NetworkOverrides(bottleneck=8))) == [
        "network.bottleneck: 16 -> 8"]
    space = stored.space  # a space field not given is the stored one's; one given otherwise is a change
    assert resume_conflicts(stored, stored.replace(space=SpaceSpec(space.kind, space.name))) == []
    assert resume_conflicts(stored, stored.replace(space=SpaceSpec(space.kind, space.name, seed=4))) == [
        "space.seed: 0 -> 4"]
    assert resume_conflicts(stored, stored.replace(seed=None)) == ["seed: 0 -> None"]  # not held: as stored


def test_resume_conflicts_compare_the_resolved_settings():
    """A default that resolves to the stored value is no change; dtype auto is what it picks on the device."""
    stored = TrainConfig(preset="tiny", batch=32).resolved()
    assert resume_conflicts(stored, TrainConfig(preset="tiny", batch=32)) == []  # lr, space, length: the same
    fp32 = stored.replace(dtype="fp32")
    assert resume_conflicts(fp32, fp32.replace(dtype="auto")) == ["dtype: 'fp32' -> 'auto'"]
    picked = resolve_dtype("auto", "cpu")
    assert resume_conflicts(fp32, fp32.replace(dtype="auto"), "cpu") == \
        ([] if picked == "fp32" else [f"dtype: 'fp32' -> {picked!r}"])


def test_a_continued_run_keeps_the_stepping_of_the_run_it_continues():
    stored = TrainConfig(update_rule="torch-fan", lr_schedule="one-ahead", seed=7, lr=0.1)
    cfg = TrainConfig(seed=3, steps=9)
    kept = kept_from(stored, cfg)
    assert (kept.update_rule, kept.lr_schedule) == ("torch-fan", "one-ahead")
    assert kept.replace(update_rule=cfg.update_rule, lr_schedule=cfg.lr_schedule) == cfg  # the rest is cfg's


# ----------------------------------------------------------------------------------------------------------
# check_setting: one setting given as a flag by a command that builds the config itself


@pytest.mark.parametrize("name, value, words", [
    ("lr", -1.0, "--lr must be a number > 0, got -1.0"),
    ("lr", float("inf"), "--lr must be a number > 0, got inf"),
    ("batch", 0, "--batch must be an integer from 1 to 1,048,576 (the paper's batch is 512), got 0"),
    ("batch", True, "--batch must be an integer from 1 to 1,048,576 (the paper's batch is 512), got True"),
    ("ema_decay", 1.0, "--ema-decay must be a number in [0, 1), got 1.0"),
    ("seed", 2**32, "--seed must be an integer from 0 to 4294967295, got 4294967296"),
    ("warmup", "10", "--warmup must be an integer >= 0, got '10'"),
], ids=["lr-negative", "lr-inf", "batch-0", "batch-true", "ema-decay-1", "seed-too-large", "warmup-a-string"])
def test_check_setting_refuses_a_value_out_of_the_settings_range(name, value, words):
    with pytest.raises(ELFError) as e:
        check_setting(name, value)
    assert str(e.value) == words


def test_check_setting_passes_a_value_in_range_none_and_settings_without_a_range():
    for name, value in (("lr", 3e-3), ("batch", 1), ("ema_decay", 0.0), ("seed", 2**32 - 1), ("lr", None),
                        ("data", "anything"), ("optimizer", "adamw")):
        assert check_setting(name, value) is None


def test_the_training_settings_hold_no_dict():
    """Every part of TrainConfig is typed: the recipe, the short-run options, the network settings and the
    distillation are the record's own types, never a dict of overrides."""
    from dataclasses import fields

    assert not [f.name for f in fields(TrainConfig) if "dict" in str(f.type)]
    parts = {f.name: str(f.type) for f in fields(TrainConfig)}
    assert parts["recipe"] == "Recipe | None" and parts["short_run"] == "ShortRunOptions"
    assert parts["network"] == "NetworkOverrides" and parts["distillation"] == "Distillation | None"


def test_the_run_defaults_by_size_name_network_sizes_and_the_help_says_them():
    """SIZE_DEFAULTS holds the run settings of sizes elflow.model.PRESETS names (the shapes live there alone), and
    the help of a setting whose default follows the size says the values those tables hold."""
    from dataclasses import fields

    from elflow.config import SIZE_DEFAULTS, TrainConfig
    from elflow.model import PRESETS

    assert set(SIZE_DEFAULTS) <= set(PRESETS)
    from elflow.config import NESTED_FLAGS

    helps = {f.name: f.metadata["default_help"] for f in fields(TrainConfig)}
    assert f"{PRESETS['tiny'].bottleneck} for tiny" in NESTED_FLAGS["network", "bottleneck"].default_help
    assert f"{PRESETS['elf-b'].bottleneck} otherwise" in NESTED_FLAGS["network", "bottleneck"].default_help
    assert f"{SIZE_DEFAULTS['tiny']['space_dim']} for tiny's default space" in NESTED_FLAGS["space", "dim"].default_help
    assert f"{SIZE_DEFAULTS['tiny']['space']} for tiny" in NESTED_FLAGS["space", "kind"].default_help
    assert "the preset's" in helps["space"]


def test_a_baseline_of_version_8_resumes_with_its_network_left_to_the_preset():
    """Version 8 stored a baseline's network variants at their values (predict x, ...): a command that leaves
    them to the preset keeps them, as it keeps an ELF record's; another network is a change."""
    path = FIXTURES / "record8" / "ar-stopped" / "run.json"
    doc = document(json.loads(path.read_text()), str(path))
    stored = TrainConfig.of_run(RunRecord.from_dict(doc["record"], str(path)), doc["train"], str(path))
    assert stored.network.predict == "x"
    net = stored.network
    given = stored.replace(network=NetworkOverrides(depth=net.depth, hidden=net.hidden, heads=net.heads))
    assert resume_conflicts(stored, given) == []
    wider = NetworkOverrides(depth=net.depth, hidden=2 * net.hidden, heads=net.heads)
    assert resume_conflicts(stored, given.replace(network=wider)) == [f"network.hidden: {net.hidden} -> {2 * net.hidden}"]

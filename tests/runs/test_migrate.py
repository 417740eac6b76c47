"""The migration chain: every stored layout (run.json, state.json, a model folder's files) of an earlier version
reads as today's, gaining exactly what its version lacked, with the value the code of that version used."""

import json
from pathlib import Path

import pytest

from elflow.config import held_settings, record_settings
from elflow.runs import migrate
from elflow.runs.migrate import RECORD_VERSION, document
from elflow.runs.record import RunRecord
from elflow.util.errors import ELFError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RECORD2, LEGACY, RECORD5, RECORD8, RECORD9, RECORD10 = (FIXTURES / name for name in (
    "record2", "legacy", "record5", "record8", "record9", "record10"))


def stored(folder: Path, run: str) -> dict:
    return json.loads((folder / run / "run.json").read_text())


def without_callers(record: dict) -> dict:
    """A stored record as version 9 holds it: its sampling without the seed, batch size and precision, which
    are the caller's from version 9."""
    return {**record, "sampling": {k: v for k, v in record["sampling"].items()
                                   if k not in ("seed", "batch_size", "dtype")}}


DERIVED = ("self_cond", "target_time", "noise_scale", "t_eps")  # an ELF network's, from version 11 not stored


def without_derived(record: dict) -> dict:
    """A stored record as version 11 holds it: an ELF network without the fields that follow from the rest."""
    if record["method"] != "elf":
        return record
    return {**record, "network": {k: v for k, v in record["network"].items() if k not in DERIVED}}


def up_to(doc: dict, version: int) -> dict:
    """`doc` migrated to `version` (not further), one step at a time."""
    while migrate.version_of(doc, "x") < version:
        doc = migrate.STEPS[migrate.version_of(doc, "x")](doc, "x")
    return doc


def test_the_chain_reaches_todays_version_one_step_at_a_time():
    assert RECORD_VERSION == 11 and sorted(migrate.STEPS) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def held_by_7(method: str) -> tuple[str, ...]:
    """The settings a record of versions 6 and 7 held, as the training settings named them then: the task and
    the sampling defaults as the flat settings they were, an ELF network's as flat settings and "model"."""
    held = ("method", "match", "length", "task", "recipe", "distillation", "sampling", *migrate.FLAT_TASK,
            *migrate.FLAT_SAMPLING)
    return held + (("predict", "conditioning", "bottleneck", "decoder", "model", "short_run") if method == "elf" else ())


def test_a_version_2_run_file_gains_the_schedule_its_runs_used_and_its_settings_move_out_of_the_record():
    old = stored(RECORD2, "elf")
    assert old["record"]["version"] == 2 and "lr_schedule" not in old["record"]["train"]
    new = document(old, "run.json")
    assert new["record"]["version"] == RECORD_VERSION and "train" not in new["record"]
    held = held_by_7(new["record"]["method"])
    # beside the record: the settings it does not hold (5 -> 6), as they were, and the schedule (2 -> 3)
    # (and from version 10 an ELF record holds the space its flat settings named)
    assert new["train"] == {**{k: v for k, v in old["record"]["train"].items()
                               if k not in held and k not in migrate.FLAT_SPACE}, "lr_schedule": "one-ahead"}
    assert {k: v for k, v in new["record"].items() if k != "version"} == without_derived(
        without_callers({k: v for k, v in old["record"].items() if k not in ("train", "version")}))
    assert {k: v for k, v in new.items() if k not in ("record", "train")} == \
        {k: v for k, v in old.items() if k != "record"}
    RunRecord.from_dict(new["record"])


def test_a_setting_an_earlier_version_never_stored_is_refused_not_kept():
    """A version-2 run.json that holds train.lr_schedule (which version 3 added) was not written by elflow:
    keeping its value would resume the run on another schedule than it was trained with."""
    old = stored(RECORD2, "elf")
    edited = {**old, "record": {**old["record"], "train": {**old["record"]["train"], "lr_schedule": "released"}}}
    with pytest.raises(ELFError) as e:
        document(edited, "elf-stopped/run.json")
    assert str(e.value) == ("elf-stopped/run.json: its training settings hold 'lr_schedule', which a run of version "
                            "2 never stored (it was added in version 3); restore the file as elflow wrote it")


def test_each_step_changes_only_what_its_version_lacked():
    v2 = stored(RECORD2, "cond")
    v3 = migrate.STEPS[2](v2, "x")
    assert v3["record"]["version"] == 3 and v3["record"]["train"]["lr_schedule"] == "one-ahead"
    v4 = migrate.STEPS[3](v3, "x")
    assert v4["record"]["version"] == 4 and "train" not in v4["record"]
    assert v4["train"] == migrate.train_3_to_4(v3["record"]["train"])
    v5 = migrate.STEPS[4](v4, "x")
    assert v5["record"] == {**v4["record"], "version": 5}  # the record as it was: its model samples the same
    assert v5["train"] == {**v4["train"], **dict.fromkeys(migrate.FLAT_SAMPLING)}  # the previews' settings go
    v6 = migrate.STEPS[5](v5, "x")
    assert v6["record"] == {**v5["record"], "version": 6}
    assert v6["train"] == {k: v for k, v in v5["train"].items() if k not in held_by_7("elf")}
    v7 = migrate.STEPS[6](v6, "x")
    assert v7 == {**v6, "record": {**v6["record"], "version": 7}}  # its version alone: run.json keeps its record
    v8 = migrate.STEPS[7](v7, "x")
    assert v8 == {**v7, "record": {**v7["record"], "version": 8}}  # no first stage's settings: its version alone
    v9 = migrate.STEPS[8](v8, "x")  # an ELF run's settings hold no network setting: its record's sampling alone
    assert v9 == {**v8, "record": {**without_callers(v8["record"]), "version": 9}}
    v10 = migrate.STEPS[9](v9, "x")  # an ELF record holds the space: the flat space settings beside it go
    assert v10 == {**v9, "record": {**v9["record"], "version": 10},
                   "train": {k: v for k, v in v9["train"].items() if k not in migrate.FLAT_SPACE}}
    v11 = migrate.STEPS[10](v10, "x")  # an ELF network's derived fields go
    assert v11 == {**v10, "record": {**without_derived(v10["record"]), "version": 11}}
    assert document(v10, "x") == document(v9, "x") == v11 == document(v7, "x") == document(v8, "x") == document(v6, "x") == document(v5, "x") == document(v4, "x") == \
        document(v3, "x") == document(v2, "x")


@pytest.mark.parametrize("root", [LEGACY, RECORD2, RECORD5], ids=["legacy", "record2", "record5"])
def test_version_5_settings_that_restate_the_record_say_what_it_holds_or_leave_it_to_the_run(root):
    """What 5 -> 6 drops loses nothing: every version-5 copy of a setting the record holds is the record's value,
    or was not given (None: the kind's sampling default, the preset's network setting), which the record
    resolved; the record's settings and those beside it make one valid TrainConfig. record5's runs were written
    in version 5 by its own code; the others reach it through the chain."""
    from elflow.config import TrainConfig

    runs = sorted(f.parent for f in root.rglob("run.json") if "expected" not in f.parts)
    assert len(runs) >= 10
    for run in runs:
        v5 = up_to(json.loads((run / "run.json").read_text()), 5)
        record = RunRecord.from_dict({**without_derived(without_callers(v5["record"])), "version": RECORD_VERSION})
        held = record_settings(record)
        assert set(held) == set(held_settings(record.method))
        # the flat task, sampling and network settings as the parts they became
        copies = migrate.train_9_to_10(migrate.train_8_to_9(migrate.train_7_to_8(v5["train"])))
        for k in held:
            given = copies[k]  # (a field not given, None, is the record's)
            assert given is None or given == held[k] or isinstance(given, dict) and \
                all(v is None or v == held[k][f] for f, v in given.items()), (run, k)
        cfg = TrainConfig.of_run(record, document(v5, "x")["train"], "x")
        assert {k: v for k, v in cfg.to_dict().items() if k in held} == held  # each read from the record


def test_a_version_1_run_file_becomes_a_record_with_its_settings_beside_it():
    old = stored(LEGACY, "cond")
    assert "record" not in old and "muon_scale" in old["train"]
    new = document(old, "run.json")
    record = RunRecord.from_dict(new["record"])
    assert record.task is not None and record.task.source_length == old["train"]["source_length"]
    assert record.network.to_dict() == {**old["model"], **record.network.to_dict()}  # the network as stored
    assert new["train"]["update_rule"] == {"fan": "torch-fan", "released": "torch-head-transposed"}[
        old["train"]["muon_scale"]] and new["train"]["lr_schedule"] == "one-ahead"
    assert "muon_scale" not in new["train"] and new["world_size"] == old["world_size"]


def test_the_run_s_checkpointing_a_version_1_network_held_goes_in_the_chain_and_today_s_record_refuses_it():
    """Version 1 stored --grad-checkpoint (a setting of the run) among the network's fields: the step to version 2
    drops it there; a record of today's layout whose network holds it was not written by elflow."""
    old = stored(LEGACY, "elf")
    old["model"] = {**old["model"], "grad_checkpoint": True}
    record = RunRecord.from_dict(document(old, "run.json")["record"])
    plain = RunRecord.from_dict(document(stored(LEGACY, "elf"), "run.json")["record"])
    assert record.network.to_dict() == plain.network.to_dict()
    today = record.to_dict()
    today["network"]["grad_checkpoint"] = True
    with pytest.raises(ELFError, match="field 'network'.*grad_checkpoint"):
        RunRecord.from_dict(today, "run.json")


def test_a_version_1_model_folder_and_a_converted_checkpoint_read_as_records():
    from elflow.runs.model_folder import read_model_folder_files

    doc, _, _ = read_model_folder_files(LEGACY / "model-folder")
    assert "record" not in doc
    RunRecord.from_dict(document(doc, "config.json")["record"])
    state = json.loads((LEGACY / "converted" / "state.json").read_text())
    new = document(state, "state.json")
    assert new["train"] is None and new["converted_from"] == state["train"]["converted_from"]
    assert new["data_store"] is None  # not recorded then: a resume compares nothing


@pytest.mark.parametrize("name, edit, words", [
    ("sampling.json", lambda d: {**d, "sampling": {**d["sampling"], "steps": 0}},
     "sampling.json: its record's field 'sampling': steps must be an integer from 1 to"),
    ("sampling.json", lambda d: {**d, "sampling": {**d["sampling"], "omega": 500.0}},
     "sampling.json: its record's field 'sampling': omega must be a number from 0 to 100"),
    ("recipe.json", lambda d: {**d, "colour": "red"},
     "recipe.json: unknown fields ['colour'] (a model folder of this layout holds recipe, train there)"),
    ("space.json", lambda d: {**d, "extra": 1}, "space.json: unknown fields ['extra']"),
    ("recipe.json", lambda d: {**d, "recipe": {**d["recipe"], "colour": 1}},
     "recipe.json: its \"recipe\" differs from its train.recipe, which this layout holds the same"),
])
def test_a_first_layout_model_folder_s_bad_file_is_named_by_its_own_name(tmp_path, name, edit, words):
    """A first-layout model folder keeps its parts in four files: a bad value or an unknown field is one line
    naming the file that holds it (not config.json, which held neither)."""
    import shutil

    import elflow

    folder = tmp_path / "model-folder"
    shutil.copytree(LEGACY / "model-folder", folder)
    (folder / name).write_text(json.dumps(edit(json.loads((folder / name).read_text()))))
    with pytest.raises(ELFError) as e:
        elflow.load(str(folder))
    assert str(e.value).startswith(f"{folder / name.split(':')[0]}: ") and words in str(e.value), str(e.value)


def test_a_record_of_today_passes_unchanged_and_what_is_no_document_is_one_line():
    today = document(stored(RECORD2, "elf"), "x")
    assert document(today, "x") == today
    for odd, words in ((None, "JSON object"), ([1, 2], "JSON object"), ({"record": "x"}, "JSON object"),
                       ({"record": {"version": True}}, "'version' must be an integer"),
                       ({"record": {"version": 1}}, "'version' must be an integer"),
                       ({"model": {}}, "no \"model\" or \"space\"")):
        with pytest.raises(ELFError, match=words):
            document(odd, "x")


def test_a_checkpoint_of_today_names_its_model_by_digest_and_one_of_version_6_keeps_the_record_it_carries(trained):
    """Today's state.json holds no record: it says its version itself and names the model by the digest of
    run.json's record. A version-6 state.json (record5's, taken to 6 by the chain; it carries the record) reads
    with its record's version alone changed, the record as it was."""
    from elflow.runs.checkpoint import list_checkpoints
    from elflow.runs.stored import run_file

    state = json.loads((list_checkpoints(trained)[-1] / "state.json").read_text())
    assert "record" not in state and state["version"] == RECORD_VERSION
    assert state["model_sha256"] == run_file(trained)["record"].digest()
    assert document(state, "state.json") == state
    old = up_to(json.loads(sorted(RECORD5.rglob("state.json"))[0].read_text()), 6)
    assert old["record"]["version"] == 6
    new = document(old, "state.json")
    assert new == {**old, "record": {**without_callers(old["record"]), "version": RECORD_VERSION}}
    RunRecord.from_dict(new["record"])
    for bad in (True, 6, "7", None):
        with pytest.raises(ELFError, match="'version' must be an integer from 7"):
            document({**state, "version": bad}, "state.json")
    with pytest.raises(ELFError, match="newer elflow"):
        document({**state, "version": RECORD_VERSION + 1}, "state.json")


def test_a_new_run_records_todays_version_and_the_released_schedule(trained):
    from elflow.runs.stored import run_file

    stored_run = run_file(trained)
    assert stored_run["record"].version == RECORD_VERSION and stored_run["train"]["lr_schedule"] == "released"
    doc = json.loads((trained / "run.json").read_text())
    assert "train" not in doc["record"] and doc["train"]["lr_schedule"] == "released"


def test_a_record_from_a_newer_elflow_is_refused_in_one_line():
    new = document(stored(RECORD2, "elf"), "x")
    with pytest.raises(ELFError, match="newer elflow"):
        document({**new, "record": {**new["record"], "version": RECORD_VERSION + 1}}, "x")


def test_version_3_settings_gain_their_parts_whole_as_that_version_read_them():
    """A version-3 run stored the recipe flags' overrides (of the released recipe of its kind: decode noise 1.0
    for a conditional run), the short-run options' overrides, and {} for no distillation; version 4 stores the
    parts whole, equal to what version 3 resolved them to."""
    from elflow.flow import Recipe, recipe_for
    from elflow.model import ShortRunOptions

    cond = up_to(stored(RECORD2, "cond"), 4)
    old = stored(RECORD2, "cond")["record"]
    assert cond["train"]["recipe"] == recipe_for(old["train"]["recipe"], conditional=True).to_dict() == \
        RunRecord.from_dict(document(cond, "x")["record"]).recipe.to_dict()
    assert Recipe.from_dict(cond["train"]["recipe"]).decode_noise_scale == 1.0
    assert cond["train"]["distillation"] is None and old["train"]["distillation"] == {}
    assert cond["train"]["short_run"] == ShortRunOptions.from_dict(old["train"]["short_run"]).to_dict()
    fm = up_to(stored(RECORD2, "fm"), 4)["train"]["distillation"]
    assert fm == {"objective": "flow-map", "student_steps": 4, "teacher_steps": None}
    pd = up_to(stored(RECORD2 / "pd", "1-step"), 4)["train"]["distillation"]
    assert pd == {"objective": "pd", "student_steps": 1, "teacher_steps": 4}


def test_version_7_whole_settings_gain_the_task_and_sampling_parts_from_their_flat_settings():
    """A first stage's whole settings ("stage_of") of version 7 held the task and the sampling defaults as flat
    settings; 7 -> 8 makes them the typed parts today's TrainConfig holds, each field from the flat setting it
    was, so that the stored settings read back as the config that wrote them. Today's state.json of version 7
    changes its own version alone."""
    from elflow.config import TrainConfig

    for cfg in (TrainConfig(preset="tiny", sampling={"steps": 12, "omega": 2.0}),
                TrainConfig(preset="tiny", task={"source_length": 4, "source_slot": "fixed", "name": "xsum",
                                                 "target_field": "summary"}, length=16)):
        today = cfg.to_dict()
        flat = {k: v for k, v in today.items() if k not in ("task", "sampling")}  # as version 7 wrote it
        task = today["task"] or {"source_length": None, "source_slot": "packed", "name": None,
                                 "source_field": "input", "target_field": "output"}
        flat.update(source_length=task["source_length"], source_slot=task["source_slot"], task=task["name"],
                    source_field=task["source_field"], target_field=task["target_field"],
                    **{f"sample_{k}": v for k, v in today["sampling"].items()})
        v7 = {**up_to(stored(RECORD2, "elf"), 7), "stage_of": flat}
        new = document(v7, "run.json")
        assert new["stage_of"] == today
        assert new["record"] == without_derived({**without_callers(v7["record"]), "version": RECORD_VERSION})
        assert TrainConfig.stored(new["stage_of"], "run.json") == cfg
    state = {"format": "elflow-checkpoint-3", "version": 7, "step": 2, "model_sha256": "0" * 64, "files": {}}
    assert document(state, "state.json") == {**state, "version": RECORD_VERSION}


def test_version_8_network_settings_become_one_part_beside_a_baseline_s_record_and_in_a_first_stage():
    """Version 9 holds the network a run asks for as one part: a baseline's settings (sized against an ELF
    network) and a first stage's whole settings gain "network" from version 8's flat settings and "model", less
    the fields that follow from the recipe and the distillation; an ELF run's settings hold none of them."""
    from elflow.config import TrainConfig

    v8 = stored(RECORD8, "ar")  # written by version 8's own code
    assert migrate.version_of(v8, "x") == 8
    flat = {k: v8["train"][k] for k in ("bottleneck", "predict", "conditioning", "decoder")}
    v9 = migrate.STEPS[8](v8, "x")
    assert v9["record"] == {**without_callers(v8["record"]), "version": 9}
    assert v8["record"]["sampling"]["seed"] == 0 and v8["record"]["sampling"]["batch_size"] == 16  # the defaults
    assert not {"model", *flat} & set(v9["train"])
    derived = ("self_cond", "target_time", "noise_scale", "t_eps")
    assert v9["train"]["network"] == {**{k: v for k, v in v8["train"]["model"].items() if k not in derived}, **flat}
    today = document(v8, "x")
    cfg = TrainConfig.of_run(RunRecord.from_dict(today["record"]), today["train"], "x")
    assert cfg.network.depth == v8["train"]["model"]["depth"] and cfg.network.predict == flat["predict"]
    stage = {**v8["train"], "model": {"depth": 2, "self_cond": False, "noise_scale": 1.5}, "predict": "v"}
    assert migrate.train_8_to_9(stage)["network"] == {"depth": 2, **flat, "predict": "v"}
    for run in ("elf", "cond", "fm", "pd/1-step"):
        elf = stored(RECORD8, run)
        assert migrate.STEPS[8](elf, "x")["train"] == elf["train"]
    for path in RECORD8.rglob("run.json"):  # what 8 -> 9 drops of a record's sampling: every one at its default
        sampling = json.loads(path.read_text())["record"]["sampling"]
        elf = "method" not in sampling
        assert (sampling["seed"], sampling["batch_size"], sampling.get("dtype", "fp32")) == (0, 8 if elf else 16,
                                                                                           "fp32"), path
    for state in RECORD8.rglob("state.json"):  # a checkpoint's state.json: its version alone
        v8 = json.loads(state.read_text())
        assert migrate.STEPS[8](v8, "x") == {**v8, "version": 9}


def test_version_9_flat_space_settings_become_the_space_a_record_holds_or_one_part():
    """Version 10 holds the space a run asks for as one part (elflow.space.SpaceSpec's fields): an ELF record
    holds the space built from version 9's flat settings, which go; a baseline's settings (its record holds the
    tokenizer alone) and a first stage's whole settings hold the part, each field from the flat setting it was."""
    from elflow.config import TrainConfig
    from elflow.space import SpaceSpec

    for run in ("elf", "cond", "fm", "pd/1-step", "ar", "mdlm", "ar-stopped", "pd-stopped/2-step"):
        v9 = stored(RECORD9, run)  # written by version 9's own code
        assert migrate.version_of(v9, "x") == 9
        flat = {k: v9["train"][k] for k in migrate.FLAT_SPACE}
        v10 = migrate.STEPS[9](v9, "x")
        assert v10["record"] == {**v9["record"], "version": 10}
        assert not set(migrate.FLAT_SPACE) - {"space"} & set(v10["train"])
        cfg = TrainConfig.of_run(RunRecord.from_dict(migrate.STEPS[10](v10, "x")["record"]), v10["train"], "x")
        kind, _, name = flat["space"].partition(":")
        std = None if flat["latent_std"] is None else float(flat["latent_std"])
        asked = SpaceSpec(kind, name, std, dim=flat["space_dim"], seed=flat["space_seed"], stream=flat["space_stream"])
        if v9["record"]["method"] in ("ar", "mdlm"):  # beside a baseline's record: the space it asked for, as asked
            assert cfg.space == asked
        else:  # an ELF record's: the space built from it, the fields asked for among its own
            assert all(v is None or getattr(cfg.space, k) == v for k, v in asked.to_dict().items()), run
            assert "space" not in v10["train"]
    stage = {"preset": "tiny", "space": "t5:/enc", "space_dim": None, "space_seed": 0, "space_stream": None,
             "latent_std": "auto"}
    assert migrate.train_9_to_10(stage)["space"] == {**SpaceSpec("t5", "/enc", "auto").__dict__}
    unnamed = migrate.train_9_to_10({**stage, "space": None, "space_dim": 16, "latent_std": None})
    assert unnamed["space"] == {"dim": 16, "seed": 0}  # the preset's space, with what was given
    assert TrainConfig(preset="tiny", space=unnamed["space"]).resolved().space == \
        SpaceSpec("random-table", "minilm", dim=16, seed=0, stream=2)
    for state in RECORD9.rglob("state.json"):  # a checkpoint's state.json: its version alone
        v9 = json.loads(state.read_text())
        assert v9["version"] == 9 and migrate.STEPS[9](v9, "x") == {**v9, "version": 10}
    folder = json.loads((RECORD9 / "model-folder" / "config.json").read_text())  # a model folder's, as a run's
    assert "space" not in migrate.STEPS[9](folder, "x")["train"]


RUNS_10 = ("elf", "cond", "fm", "pd/1-step", "pd/2-step", "ar", "mdlm", "elf-stopped", "fm-stopped", "converted",
           "model-folder")


def stored_10(run: str) -> dict:
    return json.loads((RECORD10 / run / ("config.json" if run == "model-folder" else "run.json")).read_text())


@pytest.mark.parametrize("run", RUNS_10)
def test_version_10_networks_lose_the_fields_that_follow_from_the_recipe_and_the_distillation(run):
    """Version 11's ELF record does not store self_cond, target_time, noise_scale and t_eps: the record sets them
    from its recipe and distillation. Each run version 10's own code wrote reads back with the very values it
    stored, and names its model by the same digest as the state.json of its checkpoints, which that code wrote."""
    v10 = stored_10(run)
    assert migrate.version_of(v10, "x") == 10
    v11 = migrate.STEPS[10](v10, "x")
    assert v11 == {**v10, "record": {**without_derived(v10["record"]), "version": 11}}
    record = RunRecord.from_dict(v11["record"])
    assert record.network.to_dict() == v10["record"]["network"]  # derived as version 10 stored them
    assert record.to_dict() == v11["record"]
    for state in (RECORD10 / run).rglob("state.json"):
        v10_state = json.loads(state.read_text())
        assert migrate.STEPS[10](v10_state, "x") == {**v10_state, "version": 11}
        if "model_sha256" in v10_state and state.parent.parent.parent == RECORD10 / run:
            assert record.digest() == v10_state["model_sha256"], state


@pytest.mark.parametrize("run, key, value, words", [
    ("elf", "network.self_cond", False, "self_cond False while the recipe's self_cond_prob is 0.5"),
    ("elf", "recipe.self_cond_prob", 0.0, "self_cond True while the recipe's self_cond_prob is 0.0"),
    ("elf", "network.target_time", True, "target_time True while the model is not a flow-map student"),
    ("fm", "network.target_time", False, "target_time False while the model is a flow-map student"),
    ("elf", "network.predict", "v", "a v-predicting head with noise_scale None and t_eps None, while the recipe's "
                                    "are 2.0 and 0.05"),
    ("elf", "network.self_cond", 1, "self_cond 1 while the recipe's self_cond_prob is 0.5"),  # not a bool
])
def test_a_version_10_network_whose_stored_fields_disagree_with_the_rest_is_refused_naming_the_field(
        run, key, value, words):
    doc = stored_10(run)
    part, field = key.split(".")
    doc["record"][part][field] = value
    with pytest.raises(ELFError) as e:
        document(doc, "r.json")
    assert str(e.value) == f"r.json: its record's field 'network': {words}"


def test_a_version_10_network_that_lacks_a_derived_field_or_a_record_without_its_recipe_is_refused_naming_it():
    doc = stored_10("elf")
    del doc["record"]["network"]["target_time"]
    with pytest.raises(ELFError) as e:
        document(doc, "r.json")
    assert str(e.value) == ("r.json: its record's field 'network' is not a network of its method 'elf': it lacks "
                            "'network.target_time'; a record of this version holds every field (restore the file "
                            "as elflow wrote it)")
    doc = stored_10("elf")
    del doc["record"]["recipe"]
    with pytest.raises(ELFError) as e:
        RunRecord.from_dict(document(doc, "r.json")["record"], "r.json")
    assert str(e.value) == "r.json: its record lacks the field 'recipe'"

"""The run record (elflow.runs.record): a stored record reads into its typed parts and writes back as it was
stored; every way a stored record is malformed is one ELFError naming the file and the field; the checks
across its parts (`RunRecord.check`); the validation of its parts Task, Distillation and ParamCounts."""

import json
from pathlib import Path

import pytest

from elflow.model import ShortRunOptions
from elflow.runs.migrate import document
from elflow.runs.record import RECORD_VERSION, Distillation, ParamCounts, RunRecord, Task
from elflow.util.errors import ELFError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# the runs earlier elflows trained (legacy/, record2/, ..., record10/); a release converted by version 8
# has a run.json too, which core/test_config.py reads
RUN_FILES = sorted(p for p in FIXTURES.glob("*/**/run.json") if p.parent.name != "converted")

# what each fixture's make.sh trained (a run and its stopped copy alike): method, task, distillation and the
# network's own parameter count (None: not stated there); every network has 16 positions and trained at 16
MADE = {
    "elf": ("elf", None, None, 8286),
    "cond": ("elf", Task(8), None, 8286),
    "ar": ("ar", None, None, 8084),
    "mdlm": ("mdlm", None, None, 8084),
    "pd/2-step": ("elf", None, Distillation("pd", 2, 4), 8286),
    "pd/1-step": ("elf", None, Distillation("pd", 1, 4), 8286),
    "fm": ("elf", None, Distillation("flow-map", 4, None), None),
}


def made_as(path: Path) -> str:
    """The run of MADE that the fixture's run.json at `path` is (a stopped copy is its run)."""
    rel = path.parent.relative_to(FIXTURES)
    return "/".join((rel.parts[1].removesuffix("-stopped"), *rel.parts[2:]))


def stored(path: Path) -> dict:
    """The record of a fixture's run.json, in today's layout."""
    return document(json.loads(path.read_text()), str(path))["record"]


def fixture_record(run: str) -> dict:
    return stored(FIXTURES / "record2" / run / "run.json")


# ----------------------------------------------------------------------------------------------------------
# the stored form


def test_every_fixture_run_is_one_of_the_runs_its_make_sh_trained():
    assert RUN_FILES and {made_as(p) for p in RUN_FILES} == set(MADE)


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: str(p.parent.relative_to(FIXTURES)))
def test_a_stored_record_reads_into_its_parts_and_writes_back_as_stored(path):
    doc = stored(path)
    record = RunRecord.from_dict(doc, str(path))
    method, task, distillation, params = MADE[made_as(path)]
    assert (record.method, record.task, record.distillation) == (method, task, distillation)
    assert record.length == record.network.max_length == 16 and record.version == RECORD_VERSION
    assert record.conditional == (task is not None) and record.distilled == (distillation is not None)
    assert record.source_length == (task.source_length if task else None) and record.source_slot == "packed"
    assert type(record.sampling).__name__ == ("GenerationDefaults" if method == "elf" else "BaselineSampling")
    if params is not None:
        assert record.params == ParamCounts(params, record.params.elf, "total")
    assert record.to_dict() == doc  # every part written back as stored
    assert RunRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


def test_a_record_written_by_todays_training_reads_back_equal(trained):
    """The tiny run of helpers.tiny_config: ELF on plain text, 16 positions, neither distilled nor matched."""
    doc = json.loads((trained / "run.json").read_text())["record"]
    record = RunRecord.from_dict(doc, "run.json")
    assert (record.method, record.length, record.task, record.distillation) == ("elf", 16, None, None)
    assert record.params.model == record.params.elf and record.params.match == "total"
    assert record.to_dict() == doc and doc["version"] == RECORD_VERSION


def test_short_run_options_are_stored_only_when_they_change_the_network():
    plain = RunRecord.from_dict(fixture_record("elf"))
    assert not plain.options.active and "options" not in plain.to_dict()
    options = ShortRunOptions(skip="gaussian", time_scale=1000.0, head_modulation=True)
    changed = plain.replace(options=options)
    assert changed.to_dict()["options"] == {"skip": "gaussian", "time_scale": 1000.0, "head_modulation": True,
                                            "table_readout": 0.0}
    assert RunRecord.from_dict(changed.to_dict()) == changed and changed.options == options


# ----------------------------------------------------------------------------------------------------------
# a malformed record: one line naming the file and the field


def _without(d: dict, key: str) -> dict:
    """`d` without `key`, or, for "part.field", without that field of its part."""
    part, _, field = key.partition(".")
    if not field:
        return {k: v for k, v in d.items() if k != key}
    return {**d, part: {k: v for k, v in d[part].items() if k != field}}


def _with(d: dict, key: str, value) -> dict:
    """`d` with `key` (or "part.field") set to `value`."""
    part, _, field = key.partition(".")
    return {**d, key: value} if not field else {**d, part: {**d[part], field: value}}


# (id, base run, make(record) -> what is stored instead, the words of the error after "r.json: ")
REFUSED = [
    ("not-an-object", "elf", lambda d: [d], "the record must be a JSON object, got list"),
    ("null", "elf", lambda d: None, "the record must be a JSON object, got NoneType"),
    ("an-earlier-version", "elf", lambda d: _with(d, "version", 3),
     f"its record's field 'version' must be {RECORD_VERSION}, got 3"),
    ("a-newer-version", "elf", lambda d: _with(d, "version", RECORD_VERSION + 1),
     f"its record's field 'version' must be {RECORD_VERSION}, got {RECORD_VERSION + 1}"),
    ("version-true", "elf", lambda d: _with(d, "version", True),
     f"its record's field 'version' must be {RECORD_VERSION}, got True"),
    ("no-version", "elf", lambda d: _without(d, "version"), f"its record's field 'version' must be {RECORD_VERSION}, got None"),
    ("unknown-fields", "elf", lambda d: {**d, "colour": 1, "b": 2}, "its record has unknown fields ['b', 'colour']"),
    *[(f"no-{name}", "elf", lambda d, name=name: _without(d, name), f"its record lacks the field {name!r}")
      for name in ("method", "network", "space", "length", "recipe", "task", "sampling", "distillation", "params")],
    # a conditional record that lost its task would read as an unconditional model, and one that lost its recipe
    # would take the text recipe: refused like any other field
    ("cond-no-task", "cond", lambda d: _without(d, "task"), "its record lacks the field 'task'"),
    ("cond-no-recipe", "cond", lambda d: _without(d, "recipe"), "its record lacks the field 'recipe'"),
    # a part that lacks one of the fields its type writes
    *[(f"no-{key}", run, lambda d, key=key: _without(d, key),
       f"its record's field {key.split('.')[0]!r}"
       + (f" is not a network of its method {run!r}" if key.startswith("network.") else "")
       + f": it lacks {key!r}; a record of this version holds every field")
      for run, key in (("elf", "network.predict"), ("ar", "network.vocab_size"), ("elf", "recipe.t_std"),
                       ("elf", "sampling.steps"), ("ar", "sampling.temperature"), ("cond", "task.source_slot"),
                       ("pd/1-step", "distillation.teacher_steps"), ("elf", "params.match"))],
    ("options-in-part", "elf", lambda d: {**d, "options": {"time_scale": 1000.0}},
     "its record's field 'options': it lacks 'options.skip', 'options.head_modulation', 'options.table_readout'"),
    # a part that cannot be read
    ("unknown-method", "elf", lambda d: _with(d, "method", "gpt"),
     "its record's field 'method': unknown method 'gpt'; choose one of elf, ar, mdlm"),
    ("network-a-string", "elf", lambda d: _with(d, "network", "x"),
     "its record's field 'network' cannot be read as a network of its method 'elf' (expected a JSON object, got "
     "str)"),
    # a method that is not the network's: the network is read as the method's, and named so
    *[(f"{run}-record-of-method-{other}", run, lambda d, other=other: _with(d, "method", other),
       f"its record's field 'network' is not a network of its method {other!r}: it lacks 'network.")
      for run, other in (("elf", "ar"), ("elf", "mdlm"), ("ar", "elf"))],
    ("length-0", "elf", lambda d: _with(d, "length", 0),
     "its record's field 'length' cannot be read (expected an integer >= 1, got 0)"),
    ("length-true", "elf", lambda d: _with(d, "length", True),
     "its record's field 'length' cannot be read (expected an integer >= 1, got True)"),
    ("length-a-string", "elf", lambda d: _with(d, "length", "16"),
     "its record's field 'length' cannot be read (expected an integer >= 1, got '16')"),
    ("space-a-string", "elf", lambda d: _with(d, "space", "x"),
     "its record's field 'space' cannot be read (a space spec is a JSON object, got str)"),
    ("space-of-no-kind", "elf", lambda d: _with(d, "space", {}), "its record's field 'space' cannot be read (kind must be one of"),
    ("space-stream-true", "elf", lambda d: _with(d, "space.stream", True),
     "its record's field 'space' cannot be read (stream must be one of 1, 2 or null, got True)"),
    ("space-seed-past-2^32", "elf", lambda d: _with(d, "space.seed", 2**32),
     "its record's field 'space' cannot be read (seed must be an integer from 0 to 4294967295 or null, got "
     "4294967296)"),
    ("recipe-a-list", "elf", lambda d: _with(d, "recipe", [1]),
     "its record's field 'recipe' cannot be read (expected a JSON object, got list)"),
    ("recipe-out-of-range", "elf", lambda d: _with(d, "recipe.t_std", -1.0),
     "its record's field 'recipe' cannot be read (the recipe's constants are out of range: t_std -1.0"),
    ("task-a-string", "elf", lambda d: _with(d, "task", "x"),
     "its record's field 'task' cannot be read (expected a JSON object, got str)"),
    ("task-source-length-0", "cond", lambda d: _with(d, "task.source_length", 0),
     "its record's field 'task' cannot be read (source_length must be an integer >= 1, got 0)"),
    ("sampling-unknown-field", "elf", lambda d: _with(d, "sampling.colour", 1),
     "its record's field 'sampling' cannot be read (GenerationDefaults: unknown fields ['colour'])"),
    ("distillation-objective", "pd/1-step", lambda d: _with(d, "distillation.objective", "x"),
     "its record's field 'distillation' cannot be read (objective must be one of pd, flow-map, got 'x')"),
    ("params-negative", "elf", lambda d: _with(d, "params.model", -1),
     "its record's field 'params' cannot be read (model must be an integer >= 0, got -1)"),
    # parts that disagree (RunRecord.check, and the method's and sampler's own checks)
    ("length-beyond-the-network", "elf", lambda d: _with(d, "length", 17),
     "its record's field 'length' disagrees with the rest of the record: 17 positions, more than the network's 16"),
    ("source-leaving-no-target", "cond", lambda d: _with(d, "task.source_length", 16),
     "its record's field 'task' disagrees with the rest of the record: a source of 16 tokens leaves no target in "
     "16 positions"),
    ("a-distilled-baseline", "ar", lambda d: _with(d, "distillation", {"objective": "pd", "student_steps": 1,
                                                                        "teacher_steps": 2}),
     "its record's field 'distillation' disagrees with the rest of the record: a model of --method ar is never "
     "distilled"),
    ("a-conditional-baseline", "ar", lambda d: _with(d, "task", fixture_record("cond")["task"]),
     "its record's field 'network': a ar model has no conditional task and no short-run options"),
    ("sampling-of-another-baseline", "ar", lambda d: _with(d, "sampling.method", "mdlm"),
     "its record's field 'sampling': sampling settings of 'mdlm', not of 'ar'"),
    # a field that follows from the rest (a version-10 record that stored one disagreeing: test_migrate.py)
    ("a-network-storing-its-target-time", "elf", lambda d: _with(d, "network.target_time", True),
     "its record's field 'network' is not a network of its method 'elf': it holds 'target_time', which follows "
     "from the recipe and the distillation (a record of version 11 does not store it)"),
    ("a-network-storing-self-conditioning", "elf", lambda d: _with(d, "network.self_cond", False),
     "its record's field 'network' is not a network of its method 'elf': it holds 'self_cond', which follows"),
    ("network-depth-10^100", "elf", lambda d: _with(d, "network.depth", 10**100),
     "its record's field 'network' cannot be read as a network of its method 'elf' (ELFConfig.depth must be an "
     "integer from 1 to 1,099,511,627,776 (far past any network), got "
     "1000000000000000000000000000000000000...)"),
    ("sampling-steps-0", "elf", lambda d: _with(d, "sampling.steps", 0),
     "its record's field 'sampling': steps must be an integer from 1 to"),
]


@pytest.mark.parametrize("run, make, words", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_malformed_record_is_one_line_naming_the_file_and_the_field(run, make, words):
    with pytest.raises(ELFError) as e:
        RunRecord.from_dict(make(fixture_record(run)), "r.json")
    assert str(e.value).startswith(f"r.json: {words}"), str(e.value)
    assert "\n" not in str(e.value)


def test_an_error_names_the_record_itself_when_no_file_is_given():
    with pytest.raises(ELFError, match=r"^the record: its record's field 'length' cannot be read"):
        RunRecord.from_dict({**fixture_record("elf"), "length": 0})


def test_the_parts_that_default_when_absent_are_read_as_their_defaults():
    """A record may leave out its short-run options (written only when active): the paper's network."""
    record = RunRecord.from_dict(_without(fixture_record("elf"), "options"))
    assert record.options == ShortRunOptions()


# ----------------------------------------------------------------------------------------------------------
# check: the parts of a record built in code


def test_check_passes_a_consistent_record_and_names_the_first_part_that_disagrees():
    elf, cond, ar = (RunRecord.from_dict(fixture_record(run)) for run in ("elf", "cond", "ar"))
    for record in (elf, cond, ar):
        assert record.check("x") is None
    with pytest.raises(ELFError, match=r"^x: its record's field 'length' disagrees .*: 32 positions, more than "
                                       r"the network's 16$"):
        elf.replace(length=32).check("x")
    with pytest.raises(ELFError, match="a source of 15 tokens leaves no target in 15 positions"):
        cond.replace(task=Task(15), length=15).check("x")
    assert cond.replace(task=Task(15)).check("x") is None  # 15 of 16 positions: one target token
    with pytest.raises(ELFError, match="field 'distillation' disagrees .*--method ar is never distilled"):
        ar.replace(distillation=Distillation("flow-map")).check("x")
    assert elf.replace(network=elf.network.replace(target_time=True),
                       distillation=Distillation("flow-map", 4)).check("x") is None


def test_a_record_sets_the_network_fields_that_follow_from_its_recipe_and_distillation():
    """Self-conditioning follows from the recipe's self_cond_prob, a v- or eps-head's path constants from the
    recipe, a flow map's target time from the distillation: a record sets them whatever network it is given,
    stores none of them, and reads back equal; its digest is of the network in full."""
    elf = RunRecord.from_dict(fixture_record("elf"))
    assert elf.network.self_cond and not elf.network.target_time and elf.network.noise_scale is None
    plain = elf.replace(recipe=elf.recipe.replace(self_cond_prob=0.0))
    assert plain.network.self_cond is False
    fm = elf.replace(distillation=Distillation("flow-map", 4))
    assert fm.network.target_time is True
    assert fm.replace(network=fm.network.replace(target_time=False)).network.target_time is True
    v = elf.replace(network=elf.network.replace(predict="v", noise_scale=9.0, t_eps=0.5))
    assert (v.network.noise_scale, v.network.t_eps) == (elf.recipe.noise_scale, elf.recipe.t_eps)
    for record in (plain, fm, v):
        stored = record.to_dict()
        assert not {"self_cond", "target_time", "noise_scale", "t_eps"} & set(stored["network"])
        assert RunRecord.from_dict(json.loads(json.dumps(stored))) == record
        assert record.identity()["network"] == record.network.to_dict()
    assert len({r.digest() for r in (elf, plain, fm, v)}) == 4


def test_any_record_derives_its_network_as_the_method_says_and_reads_back_from_json_with_the_same_digest():
    """For any recipe (self-conditioned or not, any path constants), head and distillation: the record's network
    holds `derive`'s values whatever network it was given with, the stored form holds none of them, and it
    reads back from JSON equal, with the digest of its network in full."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from elflow.methods import get_method

    elf = RunRecord.from_dict(fixture_record("elf"))
    unit = st.floats(0.0, 1.0, allow_nan=False)

    @settings(max_examples=60, deadline=None)
    @given(self_cond_prob=unit, noise_scale=st.floats(0.01, 10.0), t_eps=st.floats(0.001, 0.5),
           predict=st.sampled_from(("x", "v", "eps")), given_self_cond=st.booleans(), given_target=st.booleans(),
           distillation=st.sampled_from((None, Distillation("pd", 2, 4), Distillation("flow-map", 4))))
    def check(self_cond_prob, noise_scale, t_eps, predict, given_self_cond, given_target, distillation):
        recipe = elf.recipe.replace(self_cond_prob=self_cond_prob, noise_scale=noise_scale, t_eps=t_eps)
        network = elf.network.replace(predict=predict, self_cond=given_self_cond, target_time=given_target,
                                      noise_scale=1.0, t_eps=0.1)
        record = elf.replace(recipe=recipe, network=network, distillation=distillation)
        net = record.network
        assert net.self_cond == (self_cond_prob > 0)
        assert net.target_time == (distillation is not None and distillation.objective == "flow-map")
        assert (net.noise_scale, net.t_eps) == ((None, None) if predict == "x" else (noise_scale, t_eps))
        stored = json.loads(json.dumps(record.to_dict()))
        assert not set(get_method("elf").derived) & set(stored["network"])
        back = RunRecord.from_dict(stored)
        assert back == record and back.digest() == record.digest()

    check()


# ----------------------------------------------------------------------------------------------------------
# the typed parts: Task, Distillation, ParamCounts


def test_a_task_holds_a_source_length_a_slot_a_named_task_and_its_fields():
    task = Task(8, "fixed", "xsum", "document", "summary")
    assert task.to_dict() == {"source_length": 8, "source_slot": "fixed", "name": "xsum",
                              "source_field": "document", "target_field": "summary"}
    assert Task.from_dict(task.to_dict()) == task
    assert Task(1) == Task.from_dict({"source_length": 1}) and Task(1).source_slot == "packed"
    with pytest.raises(ValueError, match="unknown fields"):
        Task.from_dict({"source_length": 8, "slot": "fixed"})


@pytest.mark.parametrize("kw, words", [
    (dict(source_length=0), "source_length must be an integer >= 1, got 0"),
    (dict(source_length=True), "source_length must be an integer >= 1, got True"),
    (dict(source_length=8.0), "source_length must be an integer >= 1, got 8.0"),
    (dict(source_length=8, source_slot="middle"), "source_slot must be one of packed, fixed, got 'middle'"),
    (dict(source_length=8, name="poetry"), "name must be one of wmt14-de-en, xsum or null, got 'poetry'"),
    (dict(source_length=8, source_field=""), "source_field must be a field name, got ''"),
    (dict(source_length=8, target_field=3), "target_field must be a field name, got 3"),
], ids=["length-0", "length-true", "length-float", "slot", "name", "empty-source-field", "target-field-number"])
def test_a_task_refuses_what_no_layout_has(kw, words):
    with pytest.raises(ValueError) as e:
        Task(**kw)
    assert str(e.value) == words


def test_a_distillation_is_progressive_or_a_flow_map_with_its_step_counts():
    assert Distillation() == Distillation("pd", None, None)  # a released student of unknown rounds
    assert Distillation.from_dict({"objective": "flow-map", "student_steps": 4}) == Distillation("flow-map", 4)
    assert Distillation("pd", 1, 4).to_dict() == {"objective": "pd", "student_steps": 1, "teacher_steps": 4}


@pytest.mark.parametrize("kw, words", [
    (dict(objective="consistency"), "objective must be one of pd, flow-map, got 'consistency'"),
    (dict(student_steps=0), "student_steps must be an integer >= 1 or null, got 0"),
    (dict(student_steps=2.0), "student_steps must be an integer >= 1 or null, got 2.0"),
    (dict(teacher_steps=True), "teacher_steps must be an integer >= 1 or null, got True"),
    (dict(teacher_steps=-4), "teacher_steps must be an integer >= 1 or null, got -4"),
], ids=["objective", "student-0", "student-float", "teacher-true", "teacher-negative"])
def test_a_distillation_refuses_an_objective_or_a_step_count_it_cannot_have(kw, words):
    with pytest.raises(ValueError) as e:
        Distillation(**kw)
    assert str(e.value) == words


def test_parameter_counts_are_counts_with_how_a_baseline_was_matched():
    assert ParamCounts(0, 0) == ParamCounts(0, 0, "total")
    assert ParamCounts.from_dict({"model": 8084, "elf": 8478, "match": "trunk"}).match == "trunk"


@pytest.mark.parametrize("kw, words", [
    (dict(model=-1, elf=1), "model must be an integer >= 0, got -1"),
    (dict(model=1, elf=True), "elf must be an integer >= 0, got True"),
    (dict(model=1.5, elf=1), "model must be an integer >= 0, got 1.5"),
    (dict(model=1, elf=1, match="all"), "match must be one of total, trunk, got 'all'"),
], ids=["model-negative", "elf-true", "model-float", "match"])
def test_parameter_counts_refuse_what_is_no_count(kw, words):
    with pytest.raises(ValueError) as e:
        ParamCounts(**kw)
    assert str(e.value) == words


def test_a_baseline_record_holds_no_seed_or_batch_size():
    """A model's generation defaults hold no seed or batch size, a baseline's as an ELF model's (the caller's)."""
    record = fixture_record("ar")
    assert not {"seed", "batch_size"} & set(record["sampling"])
    for key, value in (("seed", 5), ("batch_size", 4)):
        with pytest.raises(ELFError, match=f"generation defaults hold no {key} .the caller's., got {value}"):
            RunRecord.from_dict({**record, "sampling": {**record["sampling"], key: value}}, "r.json")


def test_a_huge_stored_value_is_cut_in_its_one_error_line():
    """A field's value of a million characters (or digits) is shown by its first ones, whatever the check that
    refuses it (a choice, a type, a range); a range check takes an integer too long for a float."""
    cases = [("network.predict", "x" * 10**6, "ELFConfig.predict must be one of x, v, eps, got 'xxx"),
             ("network.conditioning", "y" * 10**6, "ELFConfig.conditioning must be one of tokens, adaln, got 'yyy"),
             ("space.dim", -10**60, "dim must be an integer >= 1 or null, got -1000"),
             ("space.dim", -10**10**5, "dim must be an integer >= 1 or null, got an integer of about 100,001 digits"),
             ("network.rope_theta", 10**400, "ELFConfig.rope_theta must be a number in (1, 1e30], got 1000"),
             ("recipe.t_mean", 10**400, "t_mean 1000000000000000000000000000000000000... (must be from -10 to 10)")]
    for key, value, words in cases:
        with pytest.raises(ELFError) as e:
            RunRecord.from_dict(_with(fixture_record("elf"), key, value))
        assert words in str(e.value) and len(str(e.value)) < 400, str(e.value)[:500]

"""The run settings as one description: `train --print-config` resolves a preset's defaults, the quickstart's
settings are one named preset that a single flag changes one key of, and a stored config of an earlier layout
reads as the same run."""
import json

import pytest
from helpers import cli

from elflow.config import TrainConfig
from elflow.space import SpaceSpec, space_name

# ----------------------------------------------------------------------------------------------------------
# the run settings: one description


def test_print_config_resolves_the_preset_defaults(capsys):
    code, out, err = cli(capsys, ["train", "--preset", "tiny", "--print-config"])
    assert code == 0, err
    cfg = json.loads(out)
    assert SpaceSpec.from_dict(cfg["space"]) == SpaceSpec("random-table", "minilm", dim=32, seed=0, stream=2)
    assert cfg["ema_decay"] == 0.995 and cfg["length"] == 32 and cfg["lr"] == pytest.approx(1e-3 * 32 / 256)
    code, out, _ = cli(capsys, ["train", "--preset", "elf-b", "--batch", "512", "--print-config"])
    cfg = json.loads(out)
    assert space_name(cfg["space"]) == "t5-small" and cfg["ema_decay"] == 0.9999 and cfg["lr"] == pytest.approx(2e-3)


def test_quickstart_settings_are_one_named_preset(capsys):
    from types import SimpleNamespace

    from elflow.experiments.quickstart import demo_config
    from elflow.model import ShortRunOptions
    from elflow.runs.record import SamplingDefaults

    args = SimpleNamespace(length=64, batch=32, steps=250, lr=None, space=None, seed=0, sample_steps=64, sampler="vc",
                           omega=3.0)
    cfg = demo_config(args)
    expected = dict(preset="demo", data="builtin", space=SpaceSpec("random-table", "minilm"), length=64, batch=32, steps=250,
                    lr=3e-3, warmup=50, ema_decay=0.95, adam_heads=True, dtype="auto", seed=0, log_every=10,
                    ckpt_every=62, keep=2, sample_every=62,
                    sampling=SamplingDefaults(steps=64, sampler="vc", omega=3.0),
                    short_run=ShortRunOptions(skip="gated", time_scale=1000.0, head_modulation=True,
                                              table_readout=1.0),
                    recipe=None)
    assert {k: getattr(cfg, k) for k in expected} == expected
    # the same settings from `elflow train --defaults quickstart`, but for the demo model's sampling defaults,
    # which the quickstart command gives (a conditional model trained with these settings samples as its kind)
    code, out, _ = cli(capsys, ["train", "--defaults", "quickstart", "--print-config"])
    from dataclasses import replace

    from elflow.cli.train import run_device

    plain = replace(cfg, sampling=SamplingDefaults())
    assert json.loads(out) == plain.resolved(run_device(None)).to_dict()  # dtype auto: what it picks here
    # --lr and --space replace the preset's and nothing else (a space without fixed token vectors also drops
    # the table readout); the preset itself is not changed
    mine = demo_config(SimpleNamespace(**{**vars(args), "lr": 1e-3, "space": "token-table:minilm"}))
    assert (mine.lr, space_name(mine.space)) == (1e-3, "token-table:minilm")
    assert {k: v for k, v in mine.to_dict().items() if k not in ("lr", "space")} == \
        {k: v for k, v in cfg.to_dict().items() if k not in ("lr", "space")}
    mine = demo_config(SimpleNamespace(**{**vars(args), "space": "minilm"}))
    assert mine.short_run == cfg.short_run.replace(table_readout=0.0) and space_name(mine.space) == "minilm"
    assert {k: v for k, v in mine.to_dict().items() if k not in ("short_run", "space")} == \
        {k: v for k, v in cfg.to_dict().items() if k not in ("short_run", "space")}
    assert demo_config(args).short_run.skip == "gated"  # the options are a frozen part: the preset's stay


def test_one_short_run_flag_over_the_quickstart_keeps_its_other_options(capsys):
    """A nested flag sets one field of the preset's part: `--skip none` over `--defaults quickstart` changes
    the skip alone (the time scale, head modulation and table readout stay the quickstart's); without
    --defaults the other options are the plain defaults (off)."""
    from elflow.config import RUN_DEFAULTS
    from elflow.model import ShortRunOptions

    preset = RUN_DEFAULTS["quickstart"][0]["short_run"]
    code, out, err = cli(capsys, ["train", "--defaults", "quickstart", "--skip", "none", "--time-scale", "10",
                                  "--print-config"])
    assert code == 0, err
    assert json.loads(out)["short_run"] == {**preset, "skip": "none", "time_scale": 10.0}
    assert preset["time_scale"] == 1000.0 and preset["skip"] != "none"  # the preset itself is not changed
    code, out, err = cli(capsys, ["train", "--preset", "tiny", "--skip", "gaussian", "--print-config"])
    assert code == 0, err
    assert json.loads(out)["short_run"] == ShortRunOptions(skip="gaussian").to_dict()


def test_the_pair_and_sampling_flags_set_the_fields_of_the_task_and_sampling_parts(capsys):
    """--source-length, --source-slot, --task, --source-field, --target-field set the fields of the run's task
    (elflow.runs.record.Task, the record's own part) and --sample-* those of its sampling defaults; a flag over
    --defaults xsum changes its field alone; no pair flag: no task."""
    code, out, err = cli(capsys, ["train", "--preset", "tiny", "--length", "16", "--source-length", "6",
                                  "--source-slot", "fixed", "--target-field", "summary", "--sample-steps", "9",
                                  "--sample-omega", "2", "--print-config"])
    assert code == 0, err
    printed = json.loads(out)
    assert printed["task"] == {"source_length": 6, "source_slot": "fixed", "name": None, "source_field": "input",
                               "target_field": "summary"}
    assert printed["sampling"] == {"steps": 9, "sampler": None, "omega": 2.0}
    assert not {"source_length", "source_slot", "sample_steps", "sample_omega"} & set(printed)  # each once
    code, out, err = cli(capsys, ["train", "--defaults", "xsum", "--source-slot", "fixed", "--print-config"])
    assert code == 0, err
    assert json.loads(out)["task"] == {"source_length": 1024, "source_slot": "fixed", "name": "xsum",
                                       "source_field": "input", "target_field": "output"}
    code, out, err = cli(capsys, ["train", "--preset", "tiny", "--print-config"])
    assert code == 0 and json.loads(out)["task"] is None, err


def test_a_config_with_options_and_round_records_among_other_settings_reads_as_the_same_run():
    """Short-run options stored among the network settings and a distillation round's record among the
    recipe's constants are read into their own settings (elflow.runs.migrate.train_1_to_2, the chain's step
    from version 1, and train_8_to_9, which makes the network settings one part); the recipe refuses keys it does not know."""
    from elflow.flow import Recipe
    from elflow.runs.migrate import train_1_to_2, train_8_to_9

    stored = TrainConfig(preset="tiny").to_dict()
    stored.update(model={"depth": 3, "skip": "gaussian", "table_readout": 1.0}, short_run={}, distillation={},
                  recipe={"decode_noise_scale": 1.0, "distilled_steps": 4, "teacher_steps": 16,
                          "sampling": {"steps": 4, "sampler": "sde", "gamma": 1.5, "omega": 2.5}})
    from elflow.config import NetworkOverrides
    from elflow.model import ShortRunOptions
    from elflow.runs.record import Distillation

    del stored["network"]  # (version 1's network settings: "model", the part it became from version 9)
    cfg = TrainConfig.from_dict(train_8_to_9(train_1_to_2(json.loads(json.dumps(stored)))))
    assert cfg.network == NetworkOverrides(depth=3)
    assert cfg.short_run == ShortRunOptions(skip="gaussian", table_readout=1.0)
    assert cfg.recipe == Recipe(decode_noise_scale=1.0) and cfg.distillation == Distillation("pd", 4, 16)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown fields"):
        Recipe.from_dict({"noise": 2.0})


def test_the_map_sampler_as_a_plain_model_s_default_names_the_flag_and_the_sampling(capsys, tmp_path, tiny_t5_dir,
                                                                                    tiny_corpus_file):
    """--sample-sampler map on a model that is no flow-map student: one line naming the flag and the sampling
    defaults at fault (not the network), before the run folder is made."""
    from helpers import assert_one_error, new_run_args

    out = tmp_path / "run"
    code, _, err = cli(capsys, [*new_run_args(tiny_t5_dir, tiny_corpus_file, tmp_path / "cache", out),
                                "--sample-sampler", "map"])
    line = assert_one_error(code, err, "train", "--sample-sampler map: its record's field 'sampling': its sampling "
                                                "defaults jump with the map sampler, which needs a flow-map student")
    assert "'network'" not in line and not out.exists()

"""Every command against bad input and faults: one clear line on stderr (exit 2), no traceback, no NaN
result, and no file that existed before is changed."""

import errno
import json
import math
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_one_error, checkpoint_weights, fill, readout_without_specials, small_tmpfs, tiny_config
from safetensors.torch import load_file

from elflow.cli import main
from elflow.config import TrainConfig
from elflow.runs import checkpoint as ckpt_mod
from elflow.runs.checkpoint import list_checkpoints, write_state
from elflow.train import train
from elflow.util import devices, files, hub
from elflow.util.errors import ELFError

# ----------------------------------------------------------------------------------------------------------
# helpers


def cli(capsys, args):
    """(exit code, stdout, stderr) of `elflow ARGS` run in this process."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(root: Path) -> dict:
    """Every file under `root` (or `root` itself) with its bytes."""
    root = Path(root)
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def tiny_flags(t5_dir, corpus, cache, **kw):
    """CLI flags of the run that `cfg_for` describes (test_train's tiny run)."""
    flags = {"preset": "tiny", "data": corpus, "space": f"t5:{t5_dir}", "length": 16, "batch": 4, "steps": 6,
             "warmup": 2, "ema-decay": 0.9, "log-every": 1, "ckpt-every": 3, "keep": 5, "dtype": "fp32", "seed": 1,
             "cache-dir": cache}
    flags.update(kw)
    return [x for k, v in flags.items() for x in (f"--{k}", v)] + ["--quiet"]


cfg_for = tiny_config


weights = checkpoint_weights


def assert_bit_identical(run_a: Path, run_b: Path, step: int):
    for a, b in zip(weights(run_a, step), weights(run_b, step)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_t5_dir, tiny_corpus_file, cache):
    """An uninterrupted 6-step run with checkpoints at steps 3 and 6."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train(cfg_for(tiny_t5_dir, tiny_corpus_file), run, cache_dir=cache, quiet=True)
    return run


@pytest.fixture
def run_copy(trained, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(trained, dst)
    return dst


@pytest.fixture
def read_only(monkeypatch):
    """Make every write probe fail as on a read-only file system."""
    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(files, "probe_writable", refuse)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ----------------------------------------------------------------------------------------------------------
# argument checks (no work done): table-driven


CASES = [
    # (id, command line, words the error must contain)
    ("train-lr-negative", ["train", "--lr", "-1", "--print-config"], ["--lr must be a number > 0", "-1"]),
    ("quickstart-task-alone", ["quickstart", "--task", "shuffle"], ["--task belongs to the conditional", "--conditional"]),
    ("quickstart-steps-0", ["quickstart", "--conditional", "--steps", "0"], ["--steps must be an integer from 1 to 100,000,000"]),
    ("train-lr-nan", ["train", "--lr", "nan", "--print-config"], ["--lr must be a number > 0", "nan"]),
    ("train-ema-above-1", ["train", "--ema-decay", "1.5", "--print-config"], ["--ema-decay", "[0, 1)"]),
    ("train-length-0", ["train", "--length", "0", "--print-config"], ["--length must be a number from 1 to 1,048,576"]),
    ("train-val-fraction-1", ["train", "--val-fraction", "1", "--print-config"], ["--val-fraction"]),
    ("train-depth-0", ["train", "--depth", "0", "--print-config"], ["--depth must be a number >= 1"]),
    ("train-decode-clean-1", ["train", "--decode-clean-prob", "1", "--print-config"], ["--decode-clean-prob", "[0, 1)"]),
    ("train-table-readout-neg", ["train", "--table-readout", "-1", "--print-config"], ["--table-readout", ">= 0"]),
    ("toy-gamma-negative", ["toy", "--gamma", "-1", "--sampler", "sde"], ["--gamma", "from 0 to 100"]),
    ("toy-gamma-nan", ["toy", "--gamma", "nan", "--sampler", "sde"], ["--gamma", "nan"]),
    ("schedules-samples-0", ["schedules", "--samples", "0"], ["--samples must be at least 2"]),
    ("judge-context-1", ["train-judge", "--context", "1"], ["--context must be at least 2"]),
]


@pytest.mark.parametrize("args,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_arguments_are_one_line(capsys, tmp_path, monkeypatch, args, needles):
    monkeypatch.chdir(tmp_path)  # any output would land here
    code, _, err = cli(capsys, args)
    assert_one_error(code, err, args[0], *needles)
    assert list(tmp_path.iterdir()) == []  # nothing written


DEVICE_CASES = [
    ["train", "--device", "cuda", "--preset", "tiny"],
    ["sample", "RUN", "--device", "cuda"],
    ["eval", "SAMPLES", "--device", "cuda"],
    ["bench", "forward", "--preset", "tiny", "--device", "cuda"],
]


@pytest.mark.parametrize("args", DEVICE_CASES, ids=[a[0] for a in DEVICE_CASES])
def test_cuda_without_cuda(capsys, tmp_path, no_cuda, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"text": "a b c"}\n')
    args = [str(samples) if a == "SAMPLES" else str(tmp_path / "nothing") if a == "RUN" else a for a in args]
    code, _, err = cli(capsys, args)
    assert_one_error(code, err, args[0], "CUDA is not available")


OUT_CASES = [  # commands whose --out is a file: (args before --out)
    ["toy", "--steps", "1", "--num", "2"],
    ["schedules", "--samples", "1000"],
]


@pytest.mark.parametrize("args", OUT_CASES, ids=[a[0] for a in OUT_CASES])
def test_existing_output_is_kept(capsys, tmp_path, args):
    out = tmp_path / "figure.png"
    out.write_bytes(b"precious")
    code, _, err = cli(capsys, args + ["--out", out])
    assert_one_error(code, err, args[0], "already exists", "--overwrite")
    assert out.read_bytes() == b"precious"
    code, _, err = cli(capsys, args + ["--out", out, "--overwrite"])
    assert code == 0, err
    assert out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("args", OUT_CASES, ids=[a[0] for a in OUT_CASES])
def test_read_only_output(capsys, tmp_path, read_only, args):
    code, _, err = cli(capsys, args + ["--out", tmp_path / "x.png"])
    assert_one_error(code, err, args[0], "cannot write", "Read-only file system")
    assert list(tmp_path.iterdir()) == []


def test_train_out_is_a_file_under_a_file_or_read_only(capsys, tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("keep me")
    code, _, err = cli(capsys, ["train", "--preset", "tiny", "--out", f])
    assert_one_error(code, err, "train", "is a file, not a folder")
    code, _, err = cli(capsys, ["train", "--preset", "tiny", "--out", f / "run"])
    assert_one_error(code, err, "train", "lies under", "which is a file")
    assert f.read_text() == "keep me"

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(files, "probe_writable", refuse)
    code, _, err = cli(capsys, ["train", "--preset", "tiny", "--out", tmp_path / "ro" / "run"])
    assert_one_error(code, err, "train", "cannot write", "Read-only file system")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_unknown_flag_is_one_line_naming_the_subcommands_help(capsys):
    code, _, err = cli(capsys, ["toy", "--no-such-flag"])
    assert_one_error(code, err, "toy", "unrecognized arguments: --no-such-flag", "`elflow toy --help`")


# ----------------------------------------------------------------------------------------------------------
# the run settings: one description


def test_every_train_flag_has_help_and_one_default():
    from elflow.cli import build_parser

    p = build_parser(only="train").subcommands["train"]
    text = p.format_help()
    assert "(default: None)" not in text and "==SUPPRESS==" not in text
    for action in p._actions:
        assert action.help, action.option_strings
        assert action.help.count("(default:") <= 1, action.option_strings


def test_print_config_resolves_the_preset_defaults(capsys):
    code, out, err = cli(capsys, ["train", "--preset", "tiny", "--print-config"])
    assert code == 0, err
    cfg = json.loads(out)
    assert cfg["space"] == "random-table:minilm" and cfg["space_dim"] == 32
    assert cfg["ema_decay"] == 0.995 and cfg["length"] == 32 and cfg["lr"] == pytest.approx(1e-3 * 32 / 256)
    code, out, _ = cli(capsys, ["train", "--preset", "elf-b", "--batch", "512", "--print-config"])
    cfg = json.loads(out)
    assert cfg["space"] == "t5-small" and cfg["ema_decay"] == 0.9999 and cfg["lr"] == pytest.approx(2e-3)


def test_quickstart_settings_are_one_named_preset(capsys):
    from types import SimpleNamespace

    from elflow.experiments.quickstart import demo_config

    args = SimpleNamespace(length=64, batch=32, steps=250, lr=None, space=None, seed=0, sample_steps=64, sampler="vc",
                           omega=3.0)
    cfg = demo_config(args)
    expected = dict(preset="demo", data="builtin", space="random-table:minilm", length=64, batch=32, steps=250,
                    lr=3e-3, warmup=50, ema_decay=0.95, adam_heads=True, dtype="auto", seed=0, log_every=10,
                    ckpt_every=62, keep=2, sample_every=62, sample_steps=64, sample_sampler="vc", sample_omega=3.0,
                    short_run={"skip": "gated", "time_scale": 1000.0, "head_modulation": True, "table_readout": 1.0},
                    recipe={})
    assert {k: getattr(cfg, k) for k in expected} == expected
    # the same settings from `elflow train --defaults quickstart`
    code, out, _ = cli(capsys, ["train", "--defaults", "quickstart", "--print-config"])
    from elflow.cli.train import run_device

    assert json.loads(out) == cfg.resolved(run_device(None)).to_dict()  # dtype auto: what it picks here
    # --lr and --space replace the preset's and nothing else (a space without fixed token vectors also drops
    # the table readout); the preset itself is not changed
    mine = demo_config(SimpleNamespace(**{**vars(args), "lr": 1e-3, "space": "token-table:minilm"}))
    assert (mine.lr, mine.space) == (1e-3, "token-table:minilm")
    assert {k: v for k, v in mine.to_dict().items() if k not in ("lr", "space")} == \
        {k: v for k, v in cfg.to_dict().items() if k not in ("lr", "space")}
    mine = demo_config(SimpleNamespace(**{**vars(args), "space": "minilm"}))
    assert mine.short_run == {**cfg.short_run, "table_readout": 0.0} and mine.space == "minilm"
    assert {k: v for k, v in mine.to_dict().items() if k not in ("short_run", "space")} == \
        {k: v for k, v in cfg.to_dict().items() if k not in ("short_run", "space")}
    mine.short_run["skip"] = "none"
    assert demo_config(args).short_run["skip"] == "gated"


def test_one_short_run_flag_over_the_quickstart_keeps_its_other_options(capsys):
    """A nested flag sets one key of the preset's dict: `--skip none` over `--defaults quickstart` changes the
    skip alone (the time scale, head modulation and table readout stay the quickstart's); without --defaults
    the other options are the plain defaults (off)."""
    from elflow.config import RUN_DEFAULTS

    preset = RUN_DEFAULTS["quickstart"][0]["short_run"]
    code, out, err = cli(capsys, ["train", "--defaults", "quickstart", "--skip", "none", "--time-scale", "10",
                                  "--print-config"])
    assert code == 0, err
    assert json.loads(out)["short_run"] == {**preset, "skip": "none", "time_scale": 10.0}
    assert preset["time_scale"] == 1000.0 and preset["skip"] != "none"  # the preset itself is not changed
    code, out, err = cli(capsys, ["train", "--preset", "tiny", "--skip", "gaussian", "--print-config"])
    assert code == 0, err
    assert json.loads(out)["short_run"] == {"skip": "gaussian"}


def test_a_config_with_options_and_round_records_among_other_settings_reads_as_the_same_run():
    """Short-run options stored among the network settings and a distillation round's record among the
    recipe's constants are read into their own settings (elflow.runs.checkpoint.upgrade_train, the one reader of
    earlier layouts); the recipe refuses keys it does not know."""
    from elflow.flow import Recipe
    from elflow.runs.checkpoint import upgrade_train

    stored = TrainConfig(preset="tiny").to_dict()
    stored.update(model={"depth": 3, "skip": "gaussian", "table_readout": 1.0}, short_run={}, distillation={},
                  recipe={"decode_noise_scale": 1.0, "distilled_steps": 4, "teacher_steps": 16,
                          "sampling": {"steps": 4, "sampler": "sde", "gamma": 1.5, "omega": 2.5}})
    cfg = TrainConfig.from_dict(upgrade_train(json.loads(json.dumps(stored))))
    assert cfg.model == {"depth": 3} and cfg.short_run == {"skip": "gaussian", "table_readout": 1.0}
    assert cfg.recipe == {"decode_noise_scale": 1.0} and cfg.distillation == {"student_steps": 4, "teacher_steps": 16}
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown fields"):
        Recipe.from_dict({"noise": 2.0})
    with pytest.raises(ELFError, match="recipe"):
        TrainConfig(recipe={"noise": 2.0}).resolved().validate()


# ----------------------------------------------------------------------------------------------------------
# train: data loss


@pytest.mark.parametrize("bad", [["--data", "typo.txt"], ["--lr", "-1"], ["--space", "t5:/no/such/encoder"]],
                         ids=["data", "lr", "space"])
def test_overwrite_with_bad_settings_keeps_the_old_run(capsys, run_copy, tiny_t5_dir, tiny_corpus_file, cache, bad):
    before = snapshot(run_copy)
    flags = tiny_flags(tiny_t5_dir, tiny_corpus_file, cache, **{bad[0][2:]: bad[1]})
    code, _, err = cli(capsys, ["train", *flags, "--out", run_copy, "--overwrite"])
    assert_one_error(code, err, "train")
    assert snapshot(run_copy) == before


@pytest.mark.slow
def test_overwrite_failing_before_its_first_checkpoint_restores_the_old_run(
        capsys, run_copy, tiny_t5_dir, tiny_corpus_file, cache, monkeypatch):
    (run_copy / "notes.txt").write_text("mine")  # a file the run did not write: --overwrite takes nothing
    before = snapshot(run_copy)
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, cache, seed=7), "--out", run_copy,
                                "--overwrite"])
    assert_one_error(code, err, "train", "holds notes.txt, which the run did not write")
    assert snapshot(run_copy) == before
    (run_copy / "notes.txt").unlink()
    before = snapshot(run_copy)
    real = ckpt_mod.save_file

    def full_disk(sd, path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(ckpt_mod, "save_file", full_disk)
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, cache, seed=7), "--out", run_copy,
                                "--overwrite"])
    assert_one_error(code, err, "train", "no space left on device", "last good checkpoint: none")
    assert snapshot(run_copy) == before

    # once the new run has written a checkpoint the old one is gone
    monkeypatch.setattr(ckpt_mod, "save_file", real)
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, cache, seed=7, steps=3),
                                "--out", run_copy, "--overwrite"])
    assert code == 0, err
    assert [p.name for p in list_checkpoints(run_copy)] == ["step_0000003"]
    assert json.loads((run_copy / "run.json").read_text())["record"]["train"]["seed"] == 7
    assert not (run_copy / ".replaced-run").exists() and not (run_copy / ".lock").exists()


@pytest.mark.slow
def test_enospc_during_a_save_keeps_the_last_checkpoint_and_resume_is_exact(
        capsys, trained, tmp_path, tiny_t5_dir, tiny_corpus_file, cache, monkeypatch):
    run = tmp_path / "run"
    real = ckpt_mod.save_file

    def full_disk_at_step_6(sd, path, *a, **k):
        if "step_0000006" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(sd, path, *a, **k)
    monkeypatch.setattr(ckpt_mod, "save_file", full_disk_at_step_6)
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, cache), "--out", run])
    line = assert_one_error(code, err, "train", "no space left on device: ", "; last good checkpoint: step 3")
    assert "step_0000006" in line
    assert [p.name for p in list_checkpoints(run)] == ["step_0000003"]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    ckpt_mod.load_checkpoint(run / "checkpoints" / "step_0000003")  # intact: every file matches its hash
    assert_bit_identical(run, trained, 3)

    monkeypatch.setattr(ckpt_mod, "save_file", real)
    code, _, err = cli(capsys, ["train", "--resume", "--out", run, "--cache-dir", cache, "--quiet"])
    assert code == 0, err
    assert_bit_identical(run, trained, 6)


def test_lock_held_by_a_live_process_is_refused(capsys, run_copy, tiny_t5_dir, tiny_corpus_file, cache):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (run_copy / ".lock").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(),
                                                     "command": "elflow train --out x"}))
        before = snapshot(run_copy)
        code, _, err = cli(capsys, ["train", "--resume", "--out", run_copy, "--cache-dir", cache, "--quiet",
                                    "--steps", "8"])
        assert_one_error(code, err, "train", "in use by another elflow command", f"pid {holder.pid}",
                         "elflow train --out x")
        assert snapshot(run_copy) == before
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_stale_lock_and_temporaries_are_cleared_and_keep_0_keeps_all(capsys, run_copy, cache):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_copy / ".lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "command": "x"}))
    tmp = run_copy / "checkpoints" / ".tmp-step_0000009-abcd"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half")
    # --resume takes the stored settings; only what may change is given
    code, _, err = cli(capsys, ["train", "--resume", "--out", run_copy, "--cache-dir", cache, "--quiet",
                                "--steps", "14", "--ckpt-every", "2", "--keep", "0"])
    assert code == 0, err
    assert not tmp.exists() and not (run_copy / ".lock").exists()
    assert [int(p.name[5:]) for p in list_checkpoints(run_copy)] == [3, 6, 8, 10, 12, 14]
    stored = json.loads((run_copy / "run.json").read_text())["record"]["train"]
    assert stored["batch"] == 4 and stored["seed"] == 1 and stored["steps"] == 14


def test_resume_refuses_changes_that_may_not_change(capsys, run_copy, cache, tmp_path):
    before = snapshot(run_copy)
    code, _, err = cli(capsys, ["train", "--resume", "--out", run_copy, "--batch", "8", "--seed", "3", "--quiet"])
    assert_one_error(code, err, "train", "batch: 4 -> 8", "seed: 1 -> 3", "--steps")
    assert snapshot(run_copy) == before
    code, _, err = cli(capsys, ["train", "--resume", "--out", tmp_path / "typo", "--quiet"])
    assert_one_error(code, err, "train", "holds no run to resume")
    assert not (tmp_path / "typo").exists()


def test_interrupted_overwrite_is_undone_at_the_next_start(capsys, run_copy, trained, cache):
    aside = run_copy / ".replaced-run"
    aside.mkdir()
    for name in ("run.json", "metrics.jsonl", "loss.png", "checkpoints"):
        (run_copy / name).rename(aside / name)
    (run_copy / "run.json").write_text(json.dumps({"train": {"preset": "tiny", "seed": 99}}))
    (run_copy / "metrics.jsonl").write_text("{}\n")
    code, _, err = cli(capsys, ["train", "--resume", "--out", run_copy, "--cache-dir", cache, "--quiet",
                                "--steps", "7"])
    assert code == 0, err
    assert not aside.exists()
    assert [int(p.name[5:]) for p in list_checkpoints(run_copy)] == [3, 6, 7]
    assert snapshot(run_copy / "checkpoints" / "step_0000006") == snapshot(trained / "checkpoints" / "step_0000006")


def test_steps_below_warmup_warns(capsys, tmp_path, tiny_t5_dir, tiny_corpus_file, cache):
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, cache, steps=1, warmup=4),
                                "--out", tmp_path / "r"])
    assert code == 0
    assert "warning: --steps 1 is shorter than --warmup 4" in err


def test_no_network_fails_at_once_with_advice(capsys, tmp_path, tiny_corpus_file, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    code, _, err = cli(capsys, ["train", "--preset", "tiny", "--data", tiny_corpus_file, "--space",
                                "hf:nobody-xyz/no-such-encoder", "--out", tmp_path / "r", "--quiet"])
    assert_one_error(code, err, "train", "no network", "HF_HUB_OFFLINE=1")
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------------------------------------
# sample and eval


def test_sample_refuses_an_existing_or_unwritable_out_before_sampling(capsys, trained, tmp_path, monkeypatch):
    out = tmp_path / "samples.jsonl"
    out.write_text("old\n")
    args = ["sample", trained, "--steps", "2", "--num", "1", "--quiet"]
    code, _, err = cli(capsys, args + ["--out", out])
    assert_one_error(code, err, "sample", "already exists", "--overwrite")
    assert out.read_text() == "old\n"

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(files, "probe_writable", refuse)
    code, _, err = cli(capsys, args + ["--out", tmp_path / "new.jsonl"])
    assert_one_error(code, err, "sample", "Read-only file system")


def test_sample_needs_no_optimizer_and_warns_beyond_the_trained_length(capsys, run_copy, tmp_path, tiny_t5_dir):
    readout_without_specials(run_copy, tiny_t5_dir)  # a tiny model may end every sample at once
    for ck in list_checkpoints(run_copy):
        (ck / "optimizer.pt").unlink()
    bad = run_copy / "checkpoints" / "step_0000006" / "ema.safetensors"
    bad.write_bytes(bad.read_bytes()[:50])
    out = tmp_path / "s.jsonl"
    code, stdout, err = cli(capsys, ["sample", run_copy, "--steps", "2", "--num", "1", "--length", "24", "--quiet",
                                     "--out", out])
    assert code == 0, err
    assert "skipping a bad checkpoint" in err and "skipping" not in stdout
    assert "warning: --length 24 is longer than the 16 positions the model was trained on" in err
    rec = json.loads(out.read_text())
    assert isinstance(rec["text"], str) and rec["length"] == 24


def test_sample_paths_that_are_not_checkpoints(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    code, _, err = cli(capsys, ["sample", notes, "--out", tmp_path / "s.jsonl"])
    assert_one_error(code, err, "sample", "not a checkpoint")
    code, _, err = cli(capsys, ["sample", "runs/typo", "--out", tmp_path / "s.jsonl"])
    assert_one_error(code, err, "sample", "runs/typo: no such local file or folder", "Hub id")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("content", ["", "\n", '{"text": ""}\n{"text": "   "}\n'], ids=["empty", "blank", "all-empty"])
def test_eval_of_nothing_fails_without_a_report(capsys, tmp_path, content):
    samples = tmp_path / "s.jsonl"
    samples.write_text(content)
    code, stdout, err = cli(capsys, ["eval", samples, "--judge", tmp_path / "no-judge"])
    assert_one_error(code, err, "eval", "nothing to evaluate")
    assert "nan" not in stdout.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]


def test_eval_checks_the_checkpoint_before_the_judge(capsys, tmp_path, monkeypatch):
    import elflow.cli.eval as ev

    def no_judge(*a, **k):
        raise AssertionError("the judge was loaded")
    monkeypatch.setattr(ev, "load_judge", no_judge)
    code, _, err = cli(capsys, ["eval", "--checkpoint", tmp_path / "runs" / "typo", "--out", tmp_path / "o"])
    assert_one_error(code, err, "eval", "no such file or folder")


def test_eval_report_is_not_replaced(capsys, tmp_path):
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"text": "a b"}\n')
    report = tmp_path / "s.eval.json"
    report.write_text("{}")
    code, _, err = cli(capsys, ["eval", samples, "--judge", tmp_path / "no-judge"])
    assert_one_error(code, err, "eval", "already exists", "--overwrite")
    assert report.read_text() == "{}"


def test_no_nan_in_train_config_checks():
    for bad in (dict(lr=math.nan), dict(grad_clip=math.inf), dict(sample_omega=math.nan)):
        with pytest.raises(ELFError):
            TrainConfig(**bad).resolved().validate()


def test_judge_and_sweep_outputs_are_not_replaced(capsys, tmp_path):
    judge_out = tmp_path / "judge"
    judge_out.mkdir()
    (judge_out / "config.json").write_text("{}")
    code, _, err = cli(capsys, ["train-judge", "--out", judge_out, "--steps", "1"])
    assert_one_error(code, err, "train-judge", "is not empty", "--overwrite")
    assert snapshot(judge_out) == {"config.json": b"{}"}

    sweep_out = tmp_path / "sweep"
    sweep_out.mkdir()
    (sweep_out / "sweep.json").write_text(json.dumps({"checkpoint": "runs/a", "judge": "j", "protocol": "elf"}))
    before = snapshot(sweep_out)
    code, _, err = cli(capsys, ["sweep", "runs/b", "--out", sweep_out, "--judge", "j"])
    assert_one_error(code, err, "sweep", "another checkpoint 'runs/a' (now 'runs/b')", "--overwrite")
    assert snapshot(sweep_out) == before


def test_learned_table_resumes_from_both_checkpoint_layouts(tmp_path, tiny_t5_dir, tiny_corpus_file, cache):
    """The space's trained table is saved through its own trainable_state_dict (space.safetensors); a checkpoint
    of the older layout ("space."-prefixed keys in model.safetensors) resumes to the same weights."""
    from safetensors.torch import save_file

    from elflow.util.files import sha256_file

    cfg = cfg_for(tiny_t5_dir, tiny_corpus_file, space=f"learned-table:{tiny_t5_dir}")
    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg, full, cache_dir=cache, quiet=True)
    train(cfg, part, cache_dir=cache, quiet=True, stop_after=3)
    ck = part / "checkpoints" / "step_0000003"
    table = load_file(ck / "space.safetensors")
    assert list(table) == ["table"] and table["table"].shape[1] == 32
    # rewrite step 3 in the older layout
    model = load_file(ck / "model.safetensors")
    assert not any(k.startswith("space.") for k in model)
    save_file({**model, "space.table": table["table"]}, ck / "model.safetensors")
    (ck / "space.safetensors").unlink()
    state = json.loads((ck / "state.json").read_text())
    del state["files"]["space.safetensors"]
    state["files"]["model.safetensors"] = sha256_file(ck / "model.safetensors")
    write_state(ck, state)

    train(cfg, part, resume=True, cache_dir=cache, quiet=True)
    assert_bit_identical(part, full, 6)
    a, b = (load_file(r / "checkpoints" / "step_0000006" / "space.safetensors") for r in (part, full))
    assert torch.equal(a["table"], b["table"])
    assert not torch.equal(a["table"], table["table"])  # the table did train


def test_cpu_flags_are_read_once(monkeypatch):
    devices.cpu_flags.cache_clear()
    import builtins

    opened = []
    real_open = builtins.open

    def counting_open(path, *a, **k):
        if str(path) == "/proc/cpuinfo":
            opened.append(path)
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", counting_open)
    answers = {devices.resolve_dtype("auto", "cpu") for _ in range(5)}
    assert len(answers) == 1 and answers <= {"bf16", "fp32"}
    assert len(opened) == (1 if Path("/proc/cpuinfo").exists() else 0)  # five answers, one read
    assert devices.resolve_dtype("fp32", "cpu") == "fp32" and devices.resolve_dtype("auto", "cuda") == "bf16"


# ----------------------------------------------------------------------------------------------------------
# outputs that must never lose data: table-driven. Each case builds what stands at an output (a teacher, files of
# the user's own, a device node, a fifo, links), runs one command and checks: exit 2, one line, no traceback, and
# every pre-existing entry under the test folder unchanged (bytes, link targets, device numbers).


def tree_state(root: Path) -> dict:
    """Every entry under `root`, links and special files not followed: a regular file's bytes, a link's target,
    a device's or fifo's type and numbers."""
    import os
    import stat as st

    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            s = os.lstat(p)
            rel = str(p.relative_to(root))
            if st.S_ISLNK(s.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif st.S_ISREG(s.st_mode):
                out[rel] = ("file", p.read_bytes())
            elif st.S_ISDIR(s.st_mode):
                out[rel] = ("dir",)
            else:
                out[rel] = ("special", st.S_IFMT(s.st_mode), s.st_rdev)
    return out


def _distill_args(teacher, out, cache, *extra):
    return ["distill", teacher, "--out", out, "--cache-dir", cache, "--quiet", "--dtype", "fp32", "--batch", "4",
            "--student-steps", "1", "--teacher-steps", "2", "--steps-per-round", "1", "--ckpt-every", "1", *extra]


def _sample_args(run, out, *extra):
    return ["sample", run, "--num", "1", "--steps", "1", "--quiet", "--out", out, *extra]


def _char_device(path: Path) -> None:
    import os

    try:
        os.mknod(path, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))  # as /dev/null
    except PermissionError:
        pytest.skip("making a device node needs root")


def _fifo(path: Path) -> None:
    import os

    os.mkfifo(path)


def _live_lock(folder: Path, holder) -> None:
    (folder / ".lock").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(),
                                              "command": "elflow distill --out x"}))


# (id, command, setup(tmp, run, cache, holder) -> argv, words of the error)
LOSS_CASES = [
    ("distill-out-is-the-teacher", "distill",
     lambda t, run, c, h: _distill_args(run, run, c, "--overwrite"), ["is the folder of a run", "choose another"]),
    ("distill-out-above-the-teacher", "distill",
     lambda t, run, c, h: _distill_args(run, t, c, "--overwrite"), ["holds the teacher"]),
    ("distill-out-is-the-run-of-a-teacher-checkpoint", "distill",
     lambda t, run, c, h: _distill_args(run / "checkpoints" / "step_0000006", run, c, "--overwrite"),
     ["is the folder of a run", "choose another"]),
    ("distill-out-of-own-files-without-overwrite", "distill",
     lambda t, run, c, h: ((t / "mine").mkdir(), (t / "mine" / "notes.txt").write_text("keep"),
                           _distill_args(run, t / "mine", c))[-1],
     ["holds notes.txt, which a distillation did not write", "folder of its own"]),
    ("distill-overwrite-while-another-runs", "distill",
     lambda t, run, c, h: ((t / "d").mkdir(), (t / "d" / "distill.json").write_text("{}"), _live_lock(t / "d", h),
                           _distill_args(run, t / "d", c, "--overwrite"))[-1],
     ["in use by another elflow command", "elflow distill --out x"]),
    ("sample-out-char-device-overwrite", "sample",
     lambda t, run, c, h: (_char_device(t / "mynull"), _sample_args(run, t / "mynull", "--overwrite"))[-1],
     ["is a character device", "not a regular file"]),
    ("sample-out-fifo-overwrite", "sample",
     lambda t, run, c, h: (_fifo(t / "pipe"), _sample_args(run, t / "pipe", "--overwrite"))[-1],
     ["is a fifo", "not a regular file"]),
    ("sample-out-link-overwrite", "sample",
     lambda t, run, c, h: ((t / "keep").mkdir(), (t / "keep" / "target.jsonl").write_text("mine\n"),
                           (t / "link.jsonl").symlink_to("keep/target.jsonl"),
                           _sample_args(run, t / "link.jsonl", "--overwrite"))[-1],
     ["is a symbolic link", "keep/target.jsonl", "does not write through links"]),
    ("sample-out-dangling-link", "sample",
     lambda t, run, c, h: ((t / "dangling.jsonl").symlink_to("nowhere.jsonl"),
                           _sample_args(run, t / "dangling.jsonl"))[-1], ["is a symbolic link", "nowhere.jsonl"]),
    ("sample-out-link-loop", "sample",
     lambda t, run, c, h: ((t / "loop.jsonl").symlink_to("loop.jsonl"), _sample_args(run, t / "loop.jsonl"))[-1],
     ["is a symbolic link"]),
    ("sample-trajectory-out-fifo", "sample",
     lambda t, run, c, h: (_fifo(t / "s.trajectory.json"), _sample_args(run, t / "s.jsonl", "--trajectory",
                                                                          "--overwrite"))[-1], ["is a fifo"]),
    ("toy-out-fifo", "toy",
     lambda t, run, c, h: (_fifo(t / "toy.png"), ["toy", "--steps", "1", "--num", "2", "--out", t / "toy.png",
                                                  "--overwrite"])[-1], ["is a fifo"]),
    ("schedules-out-char-device", "schedules",
     lambda t, run, c, h: (_char_device(t / "dev.png"), ["schedules", "--samples", "1000", "--out", t / "dev.png",
                                                         "--overwrite"])[-1], ["is a character device"]),
    ("eval-report-link", "eval",
     lambda t, run, c, h: ((t / "s.jsonl").write_text('{"text": "a b"}\n'), (t / "r.json").write_text("{}"),
                           (t / "report.json").symlink_to("r.json"),
                           ["eval", t / "s.jsonl", "--report", t / "report.json", "--overwrite", "--judge",
                            t / "no-judge"])[-1], ["--report", "is a symbolic link"]),
    ("train-out-dangling-link", "train",
     lambda t, run, c, h: ((t / "r").symlink_to("nowhere"), ["train", "--preset", "tiny", "--out", t / "r"])[-1],
     ["is a symbolic link to nowhere", "not a folder"]),
    ("train-out-link-loop", "train",
     lambda t, run, c, h: ((t / "r").symlink_to("r"), ["train", "--preset", "tiny", "--out", t / "r"])[-1],
     ["is a symbolic link", "not a folder"]),
    ("train-out-fifo", "train",
     lambda t, run, c, h: (_fifo(t / "r"), ["train", "--preset", "tiny", "--out", t / "r", "--overwrite"])[-1],
     ["is a fifo"]),
]


@pytest.fixture
def live_process():
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield holder
    holder.kill()
    holder.wait()


@pytest.mark.parametrize("command,setup,needles", [c[1:] for c in LOSS_CASES], ids=[c[0] for c in LOSS_CASES])
def test_outputs_never_replace_what_stands_there(capsys, tmp_path, trained, cache, live_process, command, setup,
                                                 needles):
    run = tmp_path / "t"
    shutil.copytree(trained, run)
    argv = setup(tmp_path, run, cache, live_process)
    before = tree_state(tmp_path)
    code, _, err = cli(capsys, argv)
    assert_one_error(code, err, command, *needles)
    assert tree_state(tmp_path) == before


def test_distill_overwrite_replaces_only_its_own_files_and_restores_them_on_failure(
        capsys, tmp_path, trained, cache, monkeypatch):
    out = tmp_path / "stuff"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for name in ("9-step", "round-8"):  # names a distillation writes (and wrote before): set aside, then back
        (out / name).mkdir()
        (out / name / "x").write_text("old")
    (out / "distill.json").write_text(json.dumps({"teacher": "old"}))
    before, teacher = tree_state(tmp_path), tree_state(trained)
    code, _, err = cli(capsys, _distill_args(trained, out, cache, "--overwrite"))  # a file it did not write
    assert_one_error(code, err, "distill", "holds notes.txt, which the distillation did not write")
    assert tree_state(tmp_path) == before
    (out / "notes.txt").unlink()
    before = tree_state(tmp_path)
    real = ckpt_mod.save_file

    def full_disk(sd, path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(ckpt_mod, "save_file", full_disk)
    code, _, err = cli(capsys, _distill_args(trained, out, cache, "--overwrite"))
    assert_one_error(code, err, "distill", "no space left on device")
    assert tree_state(tmp_path) == before  # the old distillation is back

    monkeypatch.setattr(ckpt_mod, "save_file", real)
    code, _, err = cli(capsys, _distill_args(trained, out, cache, "--overwrite"))
    assert code == 0, err
    assert not (out / "9-step").exists() and not (out / "round-8").exists()
    assert not (out / ".replaced-run").exists() and not (out / ".lock").exists()
    assert json.loads((out / "distill.json").read_text())["student_steps"] == [1]
    assert list_checkpoints(out / "1-step")
    assert tree_state(trained) == teacher


def test_an_output_that_appears_while_sampling_is_kept(capsys, tmp_path, trained, monkeypatch):
    from elflow.methods.elf import ELFMethod

    out = tmp_path / "s.jsonl"
    real = ELFMethod.generate

    def another_writer(self, *a, **k):
        records = real(self, *a, **k)
        out.write_text("the other command's samples\n")  # a second `elflow sample --out s.jsonl` finished first
        return records
    monkeypatch.setattr(ELFMethod, "generate", another_writer)
    code, _, err = cli(capsys, _sample_args(trained, out))
    assert_one_error(code, err, "sample", str(out), "appeared while this command ran", "--overwrite")
    assert out.read_text() == "the other command's samples\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]  # no temporary left behind

    code, _, err = cli(capsys, _sample_args(trained, out, "--overwrite"))  # with --overwrite it is replaced
    assert code == 0, err
    assert json.loads(out.read_text().splitlines()[0])["index"] == 0


def _edit_state(ckpt: Path, change, rehash: bool = True) -> None:
    state = json.loads((ckpt / "state.json").read_text())
    change(state)
    if rehash:  # as someone who knows the format would: state.sha256 matches the edited file
        write_state(ckpt, state)
    else:
        (ckpt / "state.json").write_text(json.dumps(state, indent=2) + "\n")


SECURITY_CASES = [
    ("files-name-escapes-to-a-device", lambda s: s["files"].update({"../../../../../../../../dev/zero": "0" * 64}),
     True, ["not a plain file name", "../../../../../../../../dev/zero", "nothing outside it is read"]),
    ("files-name-escapes-to-a-file", lambda s: s["files"].update({"../../secret.txt": "0" * 64}), True,
     ["not a plain file name", "../../secret.txt"]),
    ("files-name-is-absolute", lambda s: s["files"].update({"/etc/passwd": "0" * 64}), True,
     ["not a plain file name", "/etc/passwd"]),
    ("state-edited-without-its-hash", lambda s: s.update(step=7), False, ["corrupted or edited", "state.sha256"]),
    ("files-is-not-a-map", lambda s: s.update(files=["model.safetensors"]), True,
     ["\"files\" must map file names"]),
]


@pytest.mark.parametrize("change,rehash,needles", [c[1:] for c in SECURITY_CASES], ids=[c[0] for c in SECURITY_CASES])
def test_state_json_reads_nothing_outside_its_checkpoint(capsys, tmp_path, trained, change, rehash, needles,
                                                          monkeypatch):
    import builtins

    run = tmp_path / "t"
    shutil.copytree(trained, run)
    (tmp_path / "secret.txt").write_text("secret")
    for ck in list_checkpoints(run):
        _edit_state(ck, change, rehash)
    opened = []
    real_open = builtins.open

    def watch(path, *a, **k):
        opened.append(str(path))
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", watch)
    code, _, err = cli(capsys, _sample_args(run / "checkpoints" / "step_0000006", tmp_path / "s.jsonl"))
    monkeypatch.setattr(builtins, "open", real_open)
    assert_one_error(code, err, "sample", *needles)
    assert not any("secret" in p or "/dev/zero" in p for p in opened)
    assert not (tmp_path / "s.jsonl").exists()


def test_a_checkpoint_file_that_is_a_link_is_refused(capsys, tmp_path, trained):
    run = tmp_path / "t"
    shutil.copytree(trained, run)
    ck = run / "checkpoints" / "step_0000006"
    (tmp_path / "elsewhere.safetensors").write_bytes((ck / "ema.safetensors").read_bytes())
    (ck / "ema.safetensors").unlink()
    (ck / "ema.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    code, _, err = cli(capsys, _sample_args(ck, tmp_path / "s.jsonl"))
    assert_one_error(code, err, "sample", "ema.safetensors", "not a regular file")


# ----------------------------------------------------------------------------------------------------------
# a real full disk: a small tmpfs (mounting needs root; skipped with the reason where it is not allowed)


@pytest.fixture
def small_fs(tmp_path):
    with small_tmpfs(tmp_path / "fs") as fs:
        yield fs


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])
def test_a_real_full_disk_during_a_save_then_an_exact_resume(capsys, small_fs, trained, tiny_t5_dir,
                                                             tiny_corpus_file, cache, writer):
    run = small_fs / "run"
    train(cfg_for(tiny_t5_dir, tiny_corpus_file), run, cache_dir=cache, quiet=True, stop_after=3)
    ck = run / "checkpoints" / "step_0000003"
    sizes = {p.name: p.stat().st_size for p in ck.iterdir()}
    # the save at step 6 meets the full disk in the first weights file, or in optimizer.pt (torch.save)
    leave = sizes["model.safetensors"] // 2 if writer == "safetensors" else \
        sizes["model.safetensors"] + sizes["ema.safetensors"] + sizes["optimizer.pt"] // 2
    filler = fill(small_fs, leave)
    code, _, err = cli(capsys, ["train", "--resume", "--out", run, "--cache-dir", cache, "--quiet"])
    assert_one_error(code, err, "train", "no space left on device", "step_0000006", "last good checkpoint: step 3",
                     "--resume")
    assert [p.name for p in list_checkpoints(run)] == ["step_0000003"]
    assert not list((run / "checkpoints").glob(".tmp-*")) and not (run / ".lock").exists()
    ckpt_mod.load_checkpoint(ck)  # intact: every file matches its hash

    filler.unlink()
    code, _, err = cli(capsys, ["train", "--resume", "--out", run, "--cache-dir", cache, "--quiet"])
    assert code == 0, err
    assert_bit_identical(run, trained, 6)
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r.get("kind", "train") == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 6  # each step logged once


def test_a_real_full_disk_for_a_samples_file_an_eval_report_and_the_figures(capsys, small_fs, trained, tmp_path):
    samples, refs = tmp_path / "hyp.jsonl", tmp_path / "refs.txt"
    samples.write_text('{"text": "the cat sat"}\n')
    refs.write_text("the cat sat down\n")
    filler = fill(small_fs)
    commands = [("sample", _sample_args(trained, small_fs / "s.jsonl"), small_fs / "s.jsonl"),
                ("eval", ["eval", samples, "--task", "translation", "--references", refs, "--report",
                          small_fs / "r.json"], small_fs / "r.json"),
                ("toy", ["toy", "--num", "8", "--steps", "1", "2", "--out", small_fs / "toy.png"], small_fs / "toy.png"),
                ("schedules", ["schedules", "--samples", "2000", "--out", small_fs / "s.png"], small_fs / "s.png")]
    for command, argv, out in commands:
        code, _, err = cli(capsys, argv)
        assert_one_error(code, err, command, "no space left on device while writing", str(out), "free some space")
        assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]  # nothing half-written, no temporary
    filler.unlink()
    for command, argv, out in commands:
        code, _, err = cli(capsys, argv)
        assert code == 0, err
        if out.suffix == ".png":
            assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            assert json.loads(out.read_text() if command == "eval" else out.read_text().splitlines()[0])


# ----------------------------------------------------------------------------------------------------------
# bad run state, seeds, sizes, encodings: table-driven. Each is one line (exit 2, no traceback) and changes
# nothing under the test folder (no half-made run folder either).


def _rewrite_state(run: Path, change) -> Path:
    """Every checkpoint of `run` with its state.json changed by `change` (state.sha256 written to match)."""
    for ck in list_checkpoints(run):
        state = json.loads((ck / "state.json").read_text())
        write_state(ck, change(state))
    return run


def _set(d: dict, keys: str, value) -> dict:
    *path, last = keys.split(".")
    inner = d
    for k in path:
        inner = inner[k]
    inner[last] = value
    return d


def _edit_json(path: Path, keys: str, value) -> None:
    path.write_text(json.dumps(_set(json.loads(path.read_text()), keys, value)))


def _rehash_files(ck: Path) -> None:
    from elflow.util.files import sha256_file

    state = json.loads((ck / "state.json").read_text())
    state["files"] = {name: {"sha256": sha256_file(ck / name), "bytes": (ck / name).stat().st_size}
                      for name in state["files"]}
    write_state(ck, state)


def _reshaped(run: Path) -> Path:
    """The newest checkpoint's weights replaced by those of another shape (one matrix cut in half)."""
    from safetensors.torch import save_file

    ck = list_checkpoints(run)[-1]
    for name in ("model.safetensors", "ema.safetensors"):
        sd = load_file(ck / name)
        key = next(k for k, v in sd.items() if v.dim() == 2)
        sd[key] = sd[key][: sd[key].shape[0] // 2].contiguous()
        save_file(sd, ck / name)
    for old in list_checkpoints(run)[:-1]:
        shutil.rmtree(old)
    _rehash_files(ck)
    return run


class Payload:
    """A pickle that, if it were ever unpickled, would write `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def _pickled_optimizer(run: Path) -> Path:
    for ck in list_checkpoints(run):
        torch.save({"optimizer": Payload(run.parent / "PWNED")}, ck / "optimizer.pt")
        _rehash_files(ck)
    return run


def _pickled_judge(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2,
                                                    "n_positions": 16}))
    torch.save({"transformer.wte.weight": Payload(folder.parent / "PWNED")}, folder / "pytorch_model.bin")
    return folder


def _resume(run, cache, *extra):
    return ["train", "--resume", "--out", run, "--cache-dir", cache, "--quiet", *extra]


def _new_run(t5, corpus, cache, out, **kw):
    return ["train", *tiny_flags(t5, corpus, cache, **kw), "--out", out]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# (id, command, setup(tmp, run, t5, corpus, cache) -> argv, words of the error)
STATE_CASES = [
    ("train-seed-beyond-int64", "train", lambda t, r, t5, c, k: ["train", "--seed", "5000000000", "--print-config"],
     ["--seed must be an integer from 0 to 4294967295", "5000000000"]),
    ("sample-seed-beyond-the-generator", "sample",
     lambda t, r, t5, c, k: _sample_args(r, t / "s.jsonl", "--seed", "200000000000000"), ["--seed must be an integer"]),
    ("sample-seed-2-to-the-70", "sample", lambda t, r, t5, c, k: _sample_args(r, t / "s.jsonl", "--seed", 2**70),
     ["--seed must be an integer"]),
    ("train-space-seed-negative", "train",
     lambda t, r, t5, c, k: ["train", "--space-seed", "-1", "--print-config"], ["--space-seed must be an integer"]),
    ("train-depth-a-billion", "train", lambda t, r, t5, c, k: _new_run(t5, c, k, t / "new", depth=10**9),
     ["depth 1000000000", "needs", "more than the", "of memory"]),
    ("train-hidden-a-million", "train", lambda t, r, t5, c, k: _new_run(t5, c, k, t / "new", hidden=10**6),
     ["hidden 1000000", "more than the"]),
    ("train-space-dim-huge", "train",
     lambda t, r, t5, c, k: _new_run(t5, c, k, t / "new", space=f"random-table:{t5}", **{"space-dim": 10**8}),
     ["x 100000000 vectors", "more than the", "--space-dim"]),
    ("sample-state-depth-huge", "sample",
     lambda t, r, t5, c, k: _sample_args(_rewrite_state(r, lambda s: _set(s, "record.network.depth", 10**9)), t / "s.jsonl"),
     ["depth 1000000000", "more than the"]),
    ("sample-state-depth-negative", "sample",
     lambda t, r, t5, c, k: _sample_args(_rewrite_state(r, lambda s: _set(s, "record.network.depth", -5)), t / "s.jsonl"),
     ["depth must be an integer >= 1", "-5"]),
    ("sample-state-depth-text", "sample",
     lambda t, r, t5, c, k: _sample_args(_rewrite_state(r, lambda s: _set(s, "record.network.depth", "abc")), t / "s.jsonl"),
     ["state.json", "cannot be read"]),
    ("sample-state-a-list", "sample",
     lambda t, r, t5, c, k: _sample_args(_rewrite_state(r, lambda s: [1, 2]), t / "s.jsonl"),
     ["none of its checkpoints can be read", "a JSON object was expected, found array"]),
    ("eval-checkpoint-state-a-list", "eval",
     lambda t, r, t5, c, k: ["eval", "--checkpoint", _rewrite_state(r, lambda s: [1, 2]), "--out", t / "ev",
                             "--judge", t / "no-judge", "--num", "1"], ["a JSON object was expected"]),
    ("distill-state-a-list", "distill",
     lambda t, r, t5, c, k: _distill_args(_rewrite_state(r, lambda s: [1, 2]), t / "d", k),
     ["a JSON object was expected"]),
    ("init-from-state-a-list", "train",
     lambda t, r, t5, c, k: _new_run(t5, c, k, t / "new", **{"init-from": _rewrite_state(r, lambda s: [1, 2])}),
     ["a JSON object was expected"]),
    ("sweep-state-a-list", "sweep",
     lambda t, r, t5, c, k: ["sweep", _rewrite_state(r, lambda s: [1, 2]), "--out", t / "sw", "--judge",
                             t / "no-judge", "--num", "1", "--steps", "1"], ["a JSON object was expected"]),
    ("resume-run-json-train-a-list", "train",
     lambda t, r, t5, c, k: ((r / "run.json").write_text('{"train": []}'), _resume(r, k))[-1],
     ["run.json", "\"train\" must be a JSON object"]),
    ("resume-run-json-batch-text", "train",
     lambda t, r, t5, c, k: (_edit_json(r / "run.json", "record.train.batch", "four"), _resume(r, k))[-1],
     ["run.json: its setting 'batch' must be a number from 1 to", "'four'"]),
    ("quickstart-report-only-run-json-garbage", "quickstart",
     lambda t, r, t5, c, k: ((r / "run.json").write_text("garbage"), ["quickstart", "--report-only", "--out", r])[-1],
     ["run.json: corrupted or truncated"]),
    ("quickstart-report-only-run-json-empty", "quickstart",
     lambda t, r, t5, c, k: ((r / "run.json").write_text(""), ["quickstart", "--report-only", "--out", r])[-1],
     ["run.json: corrupted or truncated"]),
    ("resume-a-checkpoint-of-another-shape", "train", lambda t, r, t5, c, k: _resume(_reshaped(r), k, "--steps", "8"),
     ["does not fit this run", "size mismatch"]),
    ("resume-a-pickled-optimizer", "train",
     lambda t, r, t5, c, k: _resume(_pickled_optimizer(r), k, "--steps", "8"),
     ["optimizer.pt: cannot be read with weights_only=True", "never unpickles"]),
    ("resume-every-checkpoint-unusable", "train",
     lambda t, r, t5, c, k: ([(ck / "optimizer.pt").unlink() for ck in list_checkpoints(r)],
                             _resume(r, k, "--steps", "8"))[-1],
     ["no checkpoint can be resumed", "step_0000006/optimizer.pt: missing", "step_0000003/optimizer.pt: missing",
      "nothing was changed"]),
    ("resume-steps-already-passed", "train", lambda t, r, t5, c, k: _resume(r, k, "--steps", "5"),
     ["already at step 6, past --steps 5", "nothing was changed"]),
    ("resume-run-json-data-edited", "train",
     lambda t, r, t5, c, k: (_edit_json(r / "run.json", "record.train.data", "/etc/passwd"), _resume(r, k, "--steps", "8"))[-1],
     ["describes another run than its checkpoint", "/etc/passwd"]),
    ("sample-checkpoint-without-state-json", "sample",
     lambda t, r, t5, c, k: ((r / "checkpoints" / "step_0000006" / "state.json").unlink(),
                             _sample_args(r / "checkpoints" / "step_0000006", t / "s.jsonl"))[-1],
     ["incomplete elflow checkpoint folder (no state.json)"]),
    ("eval-samples-latin-1", "eval",
     lambda t, r, t5, c, k: ["eval", _write(t / "l.jsonl", b'{"text": "caf\xe9"}\n'), "--judge", t / "no-judge"],
     ["l.jsonl line 1: not UTF-8 text", "0xe9"]),
    ("eval-samples-binary", "eval",
     lambda t, r, t5, c, k: ["eval", _write(t / "b.jsonl", bytes(range(256))), "--judge", t / "no-judge"],
     ["b.jsonl line 1: not valid JSON (a NUL character at offset 0: binary data?)"]),
    ("eval-judge-with-pickled-weights", "eval",
     lambda t, r, t5, c, k: ["eval", _write(t / "s.jsonl", b'{"text": "a b"}\n'), "--judge", _pickled_judge(t / "pj")],
     ["does not hold a loadable causal LM", "pickled weights are never loaded"]),
    ("train-out-empty", "train", lambda t, r, t5, c, k: _new_run(t5, c, k, ""), ["argument --out: an empty value"]),
    ("sample-out-empty", "sample", lambda t, r, t5, c, k: _sample_args(r, ""), ["argument --out: an empty value"]),
    ("train-out-through-a-missing-folder", "train",
     lambda t, r, t5, c, k: _new_run(t5, c, k, f"{t}/nonexist/../x"), ["goes through", "nonexist", "does not exist"]),
    ("sample-omega-negative", "sample", lambda t, r, t5, c, k: _sample_args(r, t / "s.jsonl", "--omega", "-1"),
     ["omega must be a number from 0 to 100"]),
    ("sample-length-beyond-memory", "sample",
     lambda t, r, t5, c, k: _sample_args(r, t / "s.jsonl", "--length", "10000000"),
     ["--length 10000000", "needs", "more than the", "choose a smaller --length or --batch"]),
]


SLOW_STATE_CASES = {"sample-length-beyond-memory"}  # (it sizes a 10-million-position sampling)


@pytest.mark.parametrize("command,setup,needles", [
    pytest.param(*c[1:], id=c[0], marks=pytest.mark.slow if c[0] in SLOW_STATE_CASES else ()) for c in STATE_CASES])
def test_bad_run_state_seeds_sizes_and_encodings_are_one_line(capsys, tmp_path, trained, tiny_t5_dir,
                                                               tiny_corpus_file, cache, monkeypatch, command, setup,
                                                               needles):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "t"
    shutil.copytree(trained, run)
    argv = setup(tmp_path, run, tiny_t5_dir, tiny_corpus_file, cache)
    before, cached = tree_state(tmp_path), sorted(p.name for p in Path(cache).rglob("*"))
    code, _, err = cli(capsys, argv)
    assert_one_error(code, err, command, *needles)
    assert tree_state(tmp_path) == before
    assert sorted(p.name for p in Path(cache).rglob("*")) == cached  # nothing read into the cache either
    assert not (tmp_path / "PWNED").exists()  # no pickle ever ran


# ----------------------------------------------------------------------------------------------------------
# state that is repaired, not refused


@pytest.mark.slow
def test_a_half_written_metrics_line_is_dropped_on_resume(capsys, run_copy, cache):
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 2')  # a kill in the middle of a line
    code, _, err = cli(capsys, _resume(run_copy, cache, "--steps", "8"))
    assert code == 0, err
    recs = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if r.get("kind", "train") == "train"]
    assert steps == list(range(1, 9))
    assert (run_copy / "loss.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_sigterm_during_overwrite_puts_the_old_run_back_at_once(tmp_path, trained, tiny_t5_dir, tiny_corpus_file,
                                                               cache):
    import os
    import signal
    import time

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = tree_state(run)
    cmd = [sys.executable, "-m", "elflow.cli", *map(str, _new_run(tiny_t5_dir, tiny_corpus_file, cache, run,
                                                                   steps=100000, **{"ckpt-every": 50000})),
           "--overwrite"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not (
                (run / ".replaced-run").is_dir() and (run / "metrics.jsonl").exists()):  # the new run trains
            time.sleep(0.05)
        assert (run / ".replaced-run").is_dir(), "the new run never started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "stopped by SIGTERM" in err
    assert tree_state(run) == before  # the old run is back, byte for byte; no lock, nothing set aside


def test_readers_bring_back_a_run_an_interrupted_overwrite_set_aside(capsys, run_copy, tmp_path):
    before = tree_state(run_copy)
    aside = run_copy / ".replaced-run"  # as SIGKILL during --overwrite leaves it, before the new run's checkpoint
    aside.mkdir()
    for name in ("run.json", "metrics.jsonl", "loss.png", "checkpoints"):
        (run_copy / name).rename(aside / name)
    (run_copy / "run.json").write_text("{}")
    code, _, err = cli(capsys, _sample_args(run_copy, tmp_path / "s.jsonl"))
    assert code == 0, err
    assert "restored the run" in err
    assert tree_state(run_copy) == before


def test_new_files_get_the_umask_mode(trained):
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    for p in [trained / "run.json", trained / "loss.png", trained / "metrics.jsonl",
              *(trained / "checkpoints" / "step_0000006").iterdir()]:
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask, p


@pytest.mark.slow
def test_locks_of_a_reused_pid_are_taken_over_and_of_another_host_explained(capsys, run_copy, cache, live_process):
    (run_copy / ".lock").write_text(json.dumps({"pid": live_process.pid, "host": socket.gethostname(),
                                                "start": "another-boot:1", "command": "elflow train"}))
    code, _, err = cli(capsys, _resume(run_copy, cache, "--steps", "7"))
    assert code == 0, err  # that pid runs, but it is another process than the one that took the lock
    assert not (run_copy / ".lock").exists()

    (run_copy / ".lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "command": "elflow train"}))
    before = tree_state(run_copy)
    code, _, err = cli(capsys, _resume(run_copy, cache, "--steps", "8"))
    assert_one_error(code, err, "train", "on elsewhere", "another host", "cannot be checked from here",
                     f"delete {run_copy / '.lock'}")
    assert tree_state(run_copy) == before


def test_a_long_output_name_that_the_file_system_allows_is_written(capsys, trained, tmp_path):
    out = tmp_path / ("s" * 245 + ".jsonl")  # 251 bytes: the temporary name must still fit in 255
    code, _, err = cli(capsys, _sample_args(trained, out))
    assert code == 0, err
    assert json.loads(out.read_text())["index"] == 0
    code, _, err = cli(capsys, _sample_args(trained, tmp_path / ("s" * 256)))
    assert_one_error(code, err, "sample", "256 bytes long", "choose a shorter name")


@pytest.mark.slow
def test_init_from_the_run_being_overwritten(capsys, run_copy, tiny_t5_dir, tiny_corpus_file, cache):
    code, _, err = cli(capsys, [*_new_run(tiny_t5_dir, tiny_corpus_file, cache, run_copy, steps=3, seed=2,
                                          **{"init-from": run_copy}), "--overwrite"])
    assert code == 0, err
    assert [p.name for p in list_checkpoints(run_copy)] == ["step_0000003"]
    assert json.loads((run_copy / "run.json").read_text())["record"]["train"]["seed"] == 2


def test_a_warning_is_one_line_once(capsys, trained, tmp_path):
    code, _, err = cli(capsys, _sample_args(trained, tmp_path / "s.jsonl", "--omega", "10"))
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("warning")] == [
        "warning: omega 10.0 lies outside the range the model was trained on [0.5, 5.0]; results may be poor"]


def test_temporaries_of_a_killed_writer_are_removed(capsys, trained, tmp_path):
    import os

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "s.jsonl"
    left = tmp_path / f".s.jsonl.{dead.pid}.abcd1234.tmp"  # what SIGKILL during a write leaves
    left.write_text("half")
    os.utime(left, (0, 0))
    running = tmp_path / f".s.jsonl.{os.getpid()}.efgh5678.tmp"  # a live writer's: kept
    running.write_text("busy")
    os.utime(running, (0, 0))
    code, _, err = cli(capsys, _sample_args(trained, out))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, running.name])


def test_a_checkpoint_removed_while_it_is_read_gives_way_to_the_next(capsys, run_copy, tmp_path, monkeypatch,
                                                                       tiny_t5_dir):
    import elflow.runs.record as loader

    readout_without_specials(run_copy, tiny_t5_dir)  # a tiny model may end every sample at once

    real = loader.load_checkpoint
    removed = []

    def keep_1_of_a_running_training(ckpt, *a, **k):  # --keep deletes the newest-but-one just now
        if not removed:
            removed.append(Path(ckpt).name)
            shutil.rmtree(ckpt)
        return real(ckpt, *a, **k)
    monkeypatch.setattr(loader, "load_checkpoint", keep_1_of_a_running_training)
    code, _, err = cli(capsys, _sample_args(run_copy, tmp_path / "s.jsonl"))
    assert code == 0, err
    assert removed == ["step_0000006"]
    assert json.loads((tmp_path / "s.jsonl").read_text())["checkpoint"] == str(run_copy)


def test_an_unwritable_checkpoints_folder_is_found_before_training(capsys, run_copy, cache):
    ck = run_copy / "checkpoints"
    r = subprocess.run(["chattr", "+i", str(ck)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr +i is not available here ({(r.stderr or r.stdout).strip()})")
    try:
        before = tree_state(run_copy)
        code, _, err = cli(capsys, _resume(run_copy, cache, "--steps", "8"))
        assert_one_error(code, err, "train", f"{ck}: cannot write in it", "nothing was trained")
        assert tree_state(run_copy) == before
    finally:
        subprocess.run(["chattr", "-i", str(ck)], check=False)


def test_sources_that_are_not_utf8_are_one_line(tmp_path):
    from elflow.data.corpus import read_sources

    src = tmp_path / "src.jsonl"
    src.write_bytes('{"input": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ELFError, match=r"src.jsonl line 1: not UTF-8 text \(byte 0xe9 .*iconv"):
        read_sources(str(src))


def test_a_real_full_disk_during_eval_of_a_checkpoint_leaves_no_folder(capsys, small_fs, trained, tmp_path):
    from elflow.eval.gpt2_tokenizer import tokenizer_from_ranks
    from elflow.eval.judge import CausalJudge, JudgeConfig, save_judge

    torch.manual_seed(0)
    tok = tokenizer_from_ranks({bytes([i]): i for i in range(256)}, model_max_length=32)
    judge = save_judge(CausalJudge(JudgeConfig(vocab_size=257, hidden=32, depth=1, heads=2, context=32,
                                               eos_id=256)), tok, tmp_path / "judge")
    capsys.readouterr()
    out = small_fs / "ev"
    argv = ["eval", "--checkpoint", trained, "--out", out, "--judge", judge, "--num", "2", "--steps", "1", "--json"]
    filler = fill(small_fs)
    code, _, err = cli(capsys, argv)
    assert_one_error(code, err, "eval", "no space left on device while writing", str(out))
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]  # no empty folder left behind
    filler.unlink()
    code, stdout, err = cli(capsys, argv)
    assert code == 0, err
    assert json.loads(stdout)["gen_ppl"] > 1 and (out / "report.json").exists()

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
from safetensors.torch import load_file

from elflow import checkpoint as ckpt_mod
from elflow import utils
from elflow.checkpoint import list_checkpoints
from elflow.cli import main
from elflow.train import TrainConfig, train

from helpers import checkpoint_weights, tiny_config


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


def assert_one_error(code, err, command, *needles):
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"elflow {command}: error: "), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


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
    monkeypatch.setattr(utils, "_probe_writable", refuse)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ----------------------------------------------------------------------------------------------------------
# argument checks (no work done): table-driven


CASES = [
    # (id, command line, words the error must contain)
    ("train-lr-negative", ["train", "--lr", "-1", "--print-config"], ["--lr must be a number > 0", "-1"]),
    ("train-lr-nan", ["train", "--lr", "nan", "--print-config"], ["--lr must be a number > 0", "nan"]),
    ("train-ema-above-1", ["train", "--ema-decay", "1.5", "--print-config"], ["--ema-decay", "[0, 1)"]),
    ("train-length-0", ["train", "--length", "0", "--print-config"], ["--length must be a number >= 1"]),
    ("train-val-fraction-1", ["train", "--val-fraction", "1", "--print-config"], ["--val-fraction"]),
    ("train-depth-0", ["train", "--depth", "0", "--print-config"], ["--depth must be a number >= 1"]),
    ("train-decode-clean-1", ["train", "--decode-clean-prob", "1", "--print-config"], ["--decode-clean-prob", "[0, 1)"]),
    ("train-table-readout-neg", ["train", "--table-readout", "-1", "--print-config"], ["--table-readout", ">= 0"]),
    ("toy-gamma-negative", ["toy", "--gamma", "-1", "--sampler", "sde"], ["--gamma", ">= 0"]),
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
    monkeypatch.setattr(utils, "_probe_writable", refuse)
    code, _, err = cli(capsys, ["train", "--preset", "tiny", "--out", tmp_path / "ro" / "run"])
    assert_one_error(code, err, "train", "cannot write", "Read-only file system")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_unknown_flag_shows_the_subcommands_usage(capsys):
    code, _, err = cli(capsys, ["toy", "--no-such-flag"])
    assert code == 2 and "Traceback" not in err
    assert "usage: elflow toy" in err and "elflow toy: error: unrecognized arguments: --no-such-flag" in err


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

    from elflow.quickstart import demo_config

    args = SimpleNamespace(length=64, batch=32, steps=250, lr=None, space=None, seed=0, sample_steps=64, sampler="vc",
                           omega=3.0)
    cfg = demo_config(args)
    expected = dict(preset="demo", data="builtin", space="random-table:minilm", length=64, batch=32, steps=250,
                    lr=3e-3, warmup=50, ema_decay=0.95, adam_heads=True, dtype="auto", seed=0, log_every=10,
                    ckpt_every=62, keep=2, sample_every=62, sample_steps=64, sample_sampler="vc", sample_omega=3.0,
                    short_run={"skip": "gaussian", "time_scale": 1000.0, "head_modulation": True, "table_readout": 1.0},
                    recipe={})
    assert {k: getattr(cfg, k) for k in expected} == expected
    # the same settings from `elflow train --defaults quickstart`
    code, out, _ = cli(capsys, ["train", "--defaults", "quickstart", "--print-config"])
    from elflow.train import run_device

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
    assert demo_config(args).short_run["skip"] == "gaussian"


def test_a_config_with_options_and_round_records_among_other_settings_reads_as_the_same_run():
    """Short-run options stored among the network settings and a distillation round's record among the
    recipe's constants are read into their own settings; the recipe refuses keys it does not know."""
    from elflow.flow import Recipe

    stored = TrainConfig(preset="tiny").to_dict()
    stored.update(model={"depth": 3, "skip": "gaussian", "table_readout": 1.0}, short_run={}, distillation={},
                  recipe={"decode_noise_scale": 1.0, "distilled_steps": 4, "teacher_steps": 16,
                          "sampling": {"steps": 4, "sampler": "sde", "gamma": 1.5, "omega": 2.5}})
    cfg = TrainConfig.from_dict(json.loads(json.dumps(stored)))
    assert cfg.model == {"depth": 3} and cfg.short_run == {"skip": "gaussian", "table_readout": 1.0}
    assert cfg.recipe == {"decode_noise_scale": 1.0} and cfg.distillation == {"student_steps": 4, "teacher_steps": 16}
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown fields"):
        Recipe.from_dict({"noise": 2.0})
    with pytest.raises(utils.ELFError, match="recipe"):
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


def test_overwrite_failing_before_its_first_checkpoint_restores_the_old_run(
        capsys, run_copy, tiny_t5_dir, tiny_corpus_file, cache, monkeypatch):
    (run_copy / "notes.txt").write_text("mine")
    before = snapshot(run_copy)
    real = ckpt_mod.save_file

    def full_disk(sd, path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(ckpt_mod, "save_file", full_disk)
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, cache, seed=7), "--out", run_copy,
                                "--overwrite"])
    assert_one_error(code, err, "train", "no space left on device", "last good checkpoint: none")
    assert snapshot(run_copy) == before

    # once the new run has written a checkpoint the old one is gone, and files it did not write stay
    monkeypatch.setattr(ckpt_mod, "save_file", real)
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, cache, seed=7, steps=3),
                                "--out", run_copy, "--overwrite"])
    assert code == 0, err
    assert (run_copy / "notes.txt").read_text() == "mine"
    assert [p.name for p in list_checkpoints(run_copy)] == ["step_0000003"]
    assert json.loads((run_copy / "run.json").read_text())["train"]["seed"] == 7
    assert not (run_copy / ".replaced-run").exists() and not (run_copy / ".lock").exists()


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
    stored = json.loads((run_copy / "run.json").read_text())["train"]
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
    monkeypatch.setattr(utils, "hub_reachable", lambda timeout=3.0: False)
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
    monkeypatch.setattr(utils, "_probe_writable", refuse)
    code, _, err = cli(capsys, args + ["--out", tmp_path / "new.jsonl"])
    assert_one_error(code, err, "sample", "Read-only file system")


def test_sample_needs_no_optimizer_and_warns_beyond_the_trained_length(capsys, run_copy, tmp_path):
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
    import elflow.evaluate as ev

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
        with pytest.raises(utils.ELFError):
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

    from elflow.utils import sha256_file

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
    (ck / "state.json").write_text(json.dumps(state))

    train(cfg, part, resume=True, cache_dir=cache, quiet=True)
    assert_bit_identical(part, full, 6)
    a, b = (load_file(r / "checkpoints" / "step_0000006" / "space.safetensors") for r in (part, full))
    assert torch.equal(a["table"], b["table"])
    assert not torch.equal(a["table"], table["table"])  # the table did train


def test_cpu_flags_are_read_once(monkeypatch):
    utils.cpu_flags.cache_clear()
    import builtins

    opened = []
    real_open = builtins.open

    def counting_open(path, *a, **k):
        if str(path) == "/proc/cpuinfo":
            opened.append(path)
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", counting_open)
    answers = {utils.resolve_dtype("auto", "cpu") for _ in range(5)}
    assert len(answers) == 1 and answers <= {"bf16", "fp32"}
    assert len(opened) == (1 if Path("/proc/cpuinfo").exists() else 0)  # five answers, one read
    assert utils.resolve_dtype("fp32", "cpu") == "fp32" and utils.resolve_dtype("auto", "cuda") == "bf16"

"""`elflow sample` and `elflow eval` against bad input: outputs refused before sampling, paths that are not
checkpoints, evaluations of nothing, no NaN among the checks; a learned table resumed from both checkpoint
layouts; CPU flags read once."""
import errno
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_bit_identical,
    assert_one_error,
    cli,
    edit_record,
    readout_without_specials,
    snapshot,
    tiny_config,
)
from safetensors.torch import load_file

from elflow.config import TrainConfig
from elflow.runs.checkpoint import list_checkpoints, write_state
from elflow.train import train
from elflow.util import budget, devices, files
from elflow.util.errors import ELFError

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


def test_sample_warns_when_the_default_length_is_beyond_the_trained_one(capsys, run_copy, tmp_path):
    edit_record(run_copy, lambda r: r.update(length=8))  # a network of 16 positions whose record says it trained on 8
    out = tmp_path / "s.jsonl"
    code, _, err = cli(capsys, ["sample", run_copy, "--steps", "2", "--num", "1", "--quiet", "--out", out])
    assert code == 0, err
    assert "warning: the default --length, the network's 16 positions, is longer than the 8 positions the model " \
           "was trained on" in err
    assert json.loads(out.read_text())["length"] == 16


def test_the_size_check_names_the_stored_counts_no_flag_gave(capsys, run_copy, tmp_path, monkeypatch):
    """A count no flag gave is named by where it comes from: the record's field and its file, or the batch size's
    default (the caller's, never stored)."""
    monkeypatch.setattr(budget, "available_memory", lambda device=None: (700 * 2**10, "available on this machine"))
    state_file = run_copy / "run.json"  # the file that holds the record
    out = tmp_path / "s.jsonl"
    code, _, err = cli(capsys, ["sample", run_copy, "--num", "20000", "--quiet", "--out", out])
    steps = json.loads(state_file.read_text())["record"]["sampling"]["steps"]
    line = assert_one_error(code, err, "sample", f"sampling at record.sampling.steps of {state_file} = {steps}, the "
                            f"default --batch = 8, --num 20000, record.network.max_length of {state_file} = 16 needs "
                            "about")
    assert "--batch 8" not in line and not out.exists()


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


def test_a_sweep_or_an_eval_whose_samples_in_all_are_past_the_bound_is_refused_before_any_work(capsys, trained,
                                                                                            tmp_path):
    """Each list value and --num within its own range, their product is not: 2,000 omegas x 2,000 step counts x 2
    samplers x --num 10,000, and 30,000 --seeds x --num 10,000,000, are one line each, before the run or the
    judge is read (the judge named here does not exist)."""
    omegas = [f"{1 + i / 1000:.3f}" for i in range(2000)]
    steps = [str(i) for i in range(1, 2001)]
    code, _, err = cli(capsys, ["sweep", trained, "--judge", tmp_path / "no-judge", "--omega", *omegas, "--steps",
                                *steps, "--num", "10000", "--out", tmp_path / "sw"])
    assert_one_error(code, err, "sweep", "2 --sampler values x 2,000 --steps values x 2,000 --omega values x --num "
                     "10,000 make 80,000,000,000 samples, more than 10,000,000", "choose a smaller --num")
    code, _, err = cli(capsys, ["eval", "--checkpoint", trained, "--num", "10000000", "--steps", "1", "--judge",
                                tmp_path / "no-judge", "--no-heldout", "--seeds", *map(str, range(30000)), "--out",
                                tmp_path / "ev"])
    assert_one_error(code, err, "eval", "30,000 --seeds x --num 10,000,000 make 300,000,000,000 samples",
                     "pass fewer --seeds")
    assert not (tmp_path / "sw").exists() and not (tmp_path / "ev").exists()


def test_no_nan_in_train_config_checks():
    for bad in (dict(lr=math.nan), dict(grad_clip=math.inf), dict(sampling={"omega": math.nan})):
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

    cfg = tiny_config(tiny_t5_dir, tiny_corpus_file, space=f"learned-table:{tiny_t5_dir}")
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

"""The paths a run records (--data, the encoder folder of --space, --init-from) name the same files from any working
folder: a run stores them absolute when it is made, so that it resumes and teaches from anywhere. A run of an
earlier elflow that holds a relative path is read from the folder it was trained in; from another folder it is
one line saying the path is relative and what to do (run from there, or pass --data), never a hub lookup of the
path's name."""

import json
import shutil
from pathlib import Path

import pytest
from helpers import cli, one_error, tree_state

from elflow.runs.checkpoint import list_checkpoints, read_state, write_state


@pytest.fixture(scope="module")
def made_here(tmp_path_factory, tiny_t5_dir, tiny_corpus_file):
    """A folder `home` holding a token store `st`, an encoder folder `t5` and the run `runs/base`, trained from
    `home` with relative paths (--data st --space t5:t5); beside it an empty folder `away`."""
    import os

    from elflow.cli import main

    root = tmp_path_factory.mktemp("paths")
    home, away = root / "home", root / "away"
    home.mkdir()
    away.mkdir()
    shutil.copytree(tiny_t5_dir, home / "t5")
    shutil.copy(tiny_corpus_file, home / "corpus.txt")
    was = os.getcwd()
    os.chdir(home)
    try:
        assert main(["prepare", "corpus.txt", "--space", "t5:t5", "--out", "st", "--quiet"]) == 0
        assert main(["train", "--preset", "tiny", "--data", "st", "--space", "t5:t5", "--length", "16", "--batch", "4",
                     "--steps", "2", "--warmup", "1", "--ckpt-every", "2", "--dtype", "fp32", "--quiet", "--out",
                     "runs/base", "--cache-dir", str(root / "cache")]) == 0
    finally:
        os.chdir(was)
    return root


def recorded_relative(run: Path) -> Path:
    """`run` as an earlier elflow wrote it: --data recorded as the relative path 'st' in run.json, and the
    store's folder so in every checkpoint, each checkpoint resealed."""
    doc = json.loads((run / "run.json").read_text())
    doc["train"]["data"] = "st"
    (run / "run.json").write_text(json.dumps(doc, indent=2))
    for ck in list_checkpoints(run):
        state = read_state(ck)
        state["data_store"]["folder"] = "st"
        write_state(ck, state)
    return run


def test_a_run_records_its_paths_absolute(made_here):
    home = made_here / "home"
    doc = json.loads((home / "runs" / "base" / "run.json").read_text())
    assert doc["train"]["data"] == str(home / "st")
    assert "space" not in doc["train"] and doc["record"]["space"]["name"] == str(home / "t5")
    state = read_state(list_checkpoints(home / "runs" / "base")[-1])
    assert state["data_store"]["folder"] == str(home / "st")


def test_a_run_resumes_samples_and_teaches_from_another_folder(made_here, tmp_path, monkeypatch, capsys):
    """The documented few-step commands (docs/few_step.md) from a folder other than the teacher's: a copy of the
    run under runs/demo there, both distillations, a resume and a sample."""
    monkeypatch.chdir(made_here / "away")
    demo = made_here / "away" / "runs" / "demo"
    shutil.copytree(made_here / "home" / "runs" / "base", demo)
    cache = ["--cache-dir", made_here / "cache"]
    code, _, err = cli(capsys, ["distill", "runs/demo", "--objective", "pd", "--student-steps", "2,1", "--teacher-steps",
                                "4", "--steps-per-round", "1", "--batch", "4", "--micro-batch", "4", "--ema-decay",
                                "0.5", "--out", tmp_path / "pd", "--quiet", *cache])
    assert code == 0, err
    code, _, err = cli(capsys, ["distill", "runs/demo", "--objective", "flow-map", "--steps", "1", "--batch", "4",
                                "--out", tmp_path / "fm", "--quiet", *cache])
    assert code == 0, err
    student = json.loads((tmp_path / "fm" / "run.json").read_text())["train"]
    assert student["init_from"] == str(demo / "checkpoints" / "step_0000002")
    assert student["data"] == str(made_here / "home" / "st")
    code, _, err = cli(capsys, ["train", "--resume", "--out", demo, "--steps", "3", "--quiet", *cache])
    assert code == 0, err
    assert [c.name for c in list_checkpoints(demo)][-1] == "step_0000003"


def test_an_earlier_run_with_a_relative_data_path_says_so_from_another_folder(made_here, tmp_path, monkeypatch,
                                                                              capsys):
    """An earlier run's relative --data 'st', read from another folder: train --resume and both distillations
    give one line (not 'the store is missing', not a hub lookup of 'st') and write nothing; --data from here,
    or the folder it was trained in, makes them work."""
    home = made_here / "home"
    old = recorded_relative(Path(shutil.copytree(home / "runs" / "base", home / "runs" / "old")))
    monkeypatch.chdir(made_here / "away")
    cache = ["--cache-dir", made_here / "cache"]
    before = tree_state(made_here)
    code, _, err = cli(capsys, ["train", "--resume", "--out", old, "--steps", "3", "--quiet", *cache])
    one_error(code, err, "train", "records --data 'st', a path relative to the folder the run was trained in",
              "run from that folder, or pass --data with its path from here")
    for objective in (["--objective", "flow-map", "--steps", "1"], ["--student-steps", "1", "--teacher-steps", "2",
                                                                     "--steps-per-round", "1"]):
        code, _, err = cli(capsys, ["distill", old, *objective, "--batch", "4", "--out", tmp_path / "d", "--quiet",
                                    *cache])
        one_error(code, err, "distill", "records --data 'st', a path relative", "pass --data")
    assert tree_state(made_here) == before and not (tmp_path / "d").exists()

    code, _, err = cli(capsys, ["distill", old, "--objective", "flow-map", "--steps", "1", "--batch", "4", "--data",
                                "../home/st", "--out", tmp_path / "d", "--quiet", *cache])
    assert code == 0, err
    code, _, err = cli(capsys, ["train", "--resume", "--out", old, "--steps", "3", "--data", "../home/st", "--quiet",
                                *cache])
    assert code == 0, err
    assert json.loads((old / "run.json").read_text())["train"]["data"] == str(home / "st")

    older = recorded_relative(Path(shutil.copytree(home / "runs" / "base", home / "runs" / "older")))
    monkeypatch.chdir(home)
    code, _, err = cli(capsys, ["train", "--resume", "--out", "runs/older", "--steps", "3", "--quiet", *cache])
    assert code == 0, err
    assert [c.name for c in list_checkpoints(older)][-1] == "step_0000003"

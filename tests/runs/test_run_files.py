"""A run's own files go through the one reader and writer: metrics.jsonl, the lock, loss.png, report.json,
samples.jsonl, wandb-run.json or tb/ as a link (to a file outside the run, to /dev/zero) or a fifo is one line
on --resume, never followed, read without bound or waited on; an evaluation's report that is a link out of the
run is refused before any work."""

import os
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_error, cli, dev_zero_link, make_fifo, resume_args

# what stands in place of a file of the run: make(path, tmp) -> the file outside the run it leads to, or None


def _nothing_outside(make):
    """make(path, tmp) of the tables from a maker of what leads nowhere outside the run (a fifo, a link to
    /dev/zero)."""
    return lambda path, tmp: make(path) and None


def _metrics_outside(path: Path, tmp: Path) -> Path:
    outside = tmp / "outside.jsonl"
    outside.write_text('{"kind": "train", "step": 1}\n')
    path.symlink_to(outside)
    return outside


@pytest.mark.parametrize("make, needle", [(_metrics_outside, "symbolic link"),
                                          (_nothing_outside(dev_zero_link), "symbolic link"),
                                          (_nothing_outside(make_fifo), "fifo")],
                         ids=["link-outside", "link-dev-zero", "fifo"])
def test_a_resume_refuses_a_metrics_file_that_is_not_its_own(capsys, tmp_path, trained, cache, make, needle):
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    shutil.rmtree(run / "checkpoints" / "step_0000006")  # so that the resume has steps to train
    (run / "metrics.jsonl").unlink()
    outside = make(run / "metrics.jsonl", tmp_path)
    before = outside.read_text() if outside else None
    code, _, err = cli(capsys, resume_args(run, cache))
    assert_one_error(code, err, "train", "metrics.jsonl", needle, "refused")
    if outside:
        assert outside.read_text() == before  # nothing was written through the link


def _outside_file(path: Path, tmp: Path) -> Path:
    outside = tmp / f"outside-{path.name}"
    outside.write_text("mine")
    if os.path.lexists(path):
        path.unlink()
    path.symlink_to(outside)
    return outside


def _outside_folder(path: Path, tmp: Path) -> Path:
    outside = tmp / f"outside-{path.name}"
    outside.mkdir()
    (outside / "mine").write_text("mine")
    path.symlink_to(outside)
    return outside / "mine"


@pytest.mark.parametrize("name, make, needle", [
    (".lock", _nothing_outside(make_fifo), "a fifo"),
    (".lock", _nothing_outside(dev_zero_link), "symbolic link (to /dev/zero)"),
    ("loss.png", _outside_file, "symbolic link"),
    ("report.json", _outside_file, "symbolic link"),
    ("samples.jsonl", _nothing_outside(make_fifo), "a fifo"),
    ("wandb-run.json", _nothing_outside(dev_zero_link), "symbolic link (to /dev/zero)"),
    ("tb", _outside_folder, "symbolic link"),
], ids=["lock-fifo", "lock-dev-zero", "loss-plot-link-outside", "report-link-outside", "samples-fifo",
        "wandb-id-dev-zero", "tensorboard-link-outside"])
def test_a_resume_refuses_any_own_file_that_is_not_a_regular_file_of_the_run(capsys, tmp_path, trained, cache,
                                                                              name, make, needle):
    """Refused before any step, in one line naming the file and what to do; what is there stays as it was."""
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    shutil.rmtree(run / "checkpoints" / "step_0000006")  # so that the resume has steps to train
    outside = make(run / name, tmp_path)
    before = os.lstat(run / name)
    code, _, err = cli(capsys, resume_args(run, cache, "--steps", "8"))
    assert_one_error(code, err, "train", str(run / name), needle, "refused", "move it away")
    assert os.lstat(run / name).st_ino == before.st_ino
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000003"]
    if outside:
        assert outside.read_text() == "mine"


def test_an_evaluation_report_that_leads_out_of_the_run_is_refused_before_any_work(capsys, tmp_path, trained):
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    (run / "eval" / "mine").mkdir(parents=True)
    outside = _outside_file(run / "eval" / "mine" / "report.json", tmp_path)
    code, _, err = cli(capsys, ["eval", "--checkpoint", run, "--num", "2", "--steps", "2", "--judge",
                                tmp_path / "no-judge", "--out", run / "eval" / "mine", "--overwrite"])
    assert_one_error(code, err, "eval", "report.json", "symbolic link", "does not write through links")
    assert outside.read_text() == "mine"


def test_metrics_are_appended_as_a_regular_file_of_the_run(tmp_path):
    from elflow.util.errors import ELFError
    from elflow.util.files import append_own

    path = tmp_path / "m.jsonl"
    append_own(path, "a\n")
    append_own(path, "b\n")
    assert path.read_text() == "a\nb\n"
    target = tmp_path / "target"
    target.write_text("")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    with pytest.raises(ELFError, match="symbolic link"):
        append_own(link, "c\n")
    assert target.read_text() == ""


def test_a_folder_of_the_set_aside_name_that_elflow_did_not_make_is_kept(capsys, tmp_path, trained, cache):
    """A user's own RUN/.replaced-run (no run.json in it): --resume refuses in one line and removes nothing."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    mine = run / ".replaced-run"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, _, err = cli(capsys, resume_args(run, cache))
    assert_one_error(code, err, "train", ".replaced-run", "did not set aside", "move it out")
    assert (mine / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name, folder", [("samples.jsonl", False), ("report.json", False), ("tb", True),
                                          ("wandb-run.json", False)])
def test_overwrite_keeps_a_users_file_of_a_name_the_run_never_wrote(capsys, tmp_path, trained, tiny_t5_dir,
                                                                    tiny_corpus_file, cache, name, folder):
    """run.json lists what the run wrote (no samples, report, TensorBoard or W&B files for a plain run): a
    user's file of such a name is refused by --overwrite, in one line naming it, and stays."""
    import json

    from helpers import new_run_args, tree_state

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    assert json.loads((run / "run.json").read_text())["files"] == ["run.json", "metrics.jsonl", "loss.png",
                                                                   "checkpoints"]
    mine = run / name
    if folder:
        mine.mkdir()
        (mine / "events").write_text("mine")
    else:
        mine.write_text("mine")
    before = tree_state(tmp_path)
    code, _, err = cli(capsys, [*new_run_args(tiny_t5_dir, tiny_corpus_file, cache, run), "--overwrite"])
    assert_one_error(code, err, "train", name, "did not write")
    assert tree_state(tmp_path) == before


def test_a_run_that_logs_to_tensorboard_lists_its_folder_and_keeps_it_listed(tmp_path, tiny_t5_dir,
                                                                            tiny_corpus_file, cache):
    import json

    from helpers import tiny_config

    from elflow.train import train

    run = tmp_path / "run"
    train(tiny_config(tiny_t5_dir, tiny_corpus_file, steps=2, ckpt_every=1, tensorboard=True), run,
          cache_dir=cache, quiet=True, stop_after=1)
    assert "tb" in json.loads((run / "run.json").read_text())["files"]
    train(tiny_config(tiny_t5_dir, tiny_corpus_file, steps=2, ckpt_every=1, tensorboard=False), run, resume=True,
          cache_dir=cache, quiet=True)
    assert "tb" in json.loads((run / "run.json").read_text())["files"]  # written before: still the run's

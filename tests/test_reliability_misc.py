"""Careless and hostile input outside the token store, one table of one-line errors and a test per behaviour:
`view` of any bytes, a device or non-finite numbers; `sample --html` with an .html --out; an empty --wandb; a
source cut at sampling; outputs inside another run's folder or through a link; train-encoder's advice; an
error under an open progress bar; a rank killed under torchrun; a resume's metrics log and the weights of a
resume on another number of ranks (Gloo on CPU)."""

import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import checkpoint_weights, tiny_config

from elflow.cli import main
from elflow.runs.checkpoint import list_checkpoints, load_checkpoint
from elflow.train import train

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMING = ("tokens_per_s", "elapsed")  # the fields of a metrics record that measure time


def cli(capsys, args):
    """(exit code, stdout, stderr) of `elflow ARGS` in this process."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def visible(err: str) -> list[str]:
    """The lines a terminal shows of `err`: of each line, what follows its last carriage return (a progress
    bar's redraws)."""
    return [line.split("\r")[-1] for line in err.split("\n")]


def one_error(code, err: str, command: str, *needles) -> str:
    """The command failed with exit 2 and one error line of its own, which starts a line of the terminal (not
    beside a progress bar) and holds every needle."""
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in visible(err) if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"elflow {command}: error: "), err
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def tree(root: Path) -> dict:
    """Every entry under `root`, links not followed: a file's bytes, a link's target, a folder."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            s = os.lstat(p)
            key = str(p.relative_to(root))
            if stat.S_ISLNK(s.st_mode):
                out[key] = ("link", os.readlink(p))
            elif stat.S_ISREG(s.st_mode):
                out[key] = p.read_bytes()
            else:
                out[key] = stat.S_IFMT(s.st_mode)
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_t5_dir, tiny_corpus_file, cache):
    """A 6-step run of the tiny preset (checkpoints at 3 and 6) and its recorded trajectory."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train(tiny_config(tiny_t5_dir, tiny_corpus_file), run, cache_dir=cache, quiet=True)
    traj = run.parent / "s.jsonl"
    assert main(["sample", str(run), "--num", "2", "--steps", "3", "--trajectory", "--quiet", "--out", str(traj)]) == 0
    return run


@pytest.fixture(scope="module")
def fixed_slot(tmp_path_factory, tiny_t5_dir, cache):
    """A conditional run in the fixed source slot, sources of up to 4 tokens, rows of 16."""
    folder = tmp_path_factory.mktemp("fixed")
    rng = random.Random(0)
    words = "the king of love and sweet night lord good heart".split()
    pairs = folder / "pairs.jsonl"
    with open(pairs, "w") as f:
        for _ in range(64):
            s = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
            f.write(json.dumps({"input": s, "output": s}) + "\n")
    run = folder / "run"
    cfg = tiny_config(tiny_t5_dir, pairs, source_length=4, source_slot="fixed", steps=2, ckpt_every=2)
    train(cfg, run, cache_dir=cache, quiet=True)
    return run


def _traj(run: Path) -> Path:
    return run.parent / "s.trajectory.json"


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
     lambda t, run, e: ((t / "x.json").write_text(json.dumps({**json.loads(_traj(run).read_text()),
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


@pytest.mark.parametrize("command,setup,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_line_and_nothing_written(capsys, tmp_path, trained, tiny_t5_dir, tiny_corpus_file, cache, command,
                                      setup, needles):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    shutil.copy(_traj(trained), _traj(run))
    argv = setup(tmp_path, run, (tiny_t5_dir, tiny_corpus_file, cache))
    before = tree(tmp_path)
    code, _, err = cli(capsys, argv)
    one_error(code, err, command, *[n.format(t=tmp_path) for n in needles])
    assert tree(tmp_path) == before
    assert not Path("/dev/zero.html").exists()


# ----------------------------------------------------------------------------------------------------------
# behaviour
def _page_data(page: Path):
    """The trajectory embedded in a page, read as strict JSON (NaN or Infinity would fail, as in JSON.parse)."""
    m = re.search(r'<script type="application/json" id="trajectory-data">(.*?)</script>', page.read_text(), re.S)

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(m.group(1), parse_constant=refuse)


def test_a_trajectory_with_non_finite_numbers_makes_a_page_whose_data_parses(capsys, tmp_path, trained):
    doc = json.loads(_traj(trained).read_text())
    doc["steps"][0]["t"], doc["steps"][1]["t"] = float("nan"), float("inf")
    doc["settings"]["omega"] = float("-inf")
    src = tmp_path / "nan.trajectory.json"
    src.write_text(json.dumps(doc))  # Python writes NaN / Infinity, as a hand-edited or foreign file may hold
    assert "NaN" in src.read_text() and "Infinity" in src.read_text()
    code, _, err = cli(capsys, ["view", src])
    assert code == 0, err
    data = _page_data(tmp_path / "nan.trajectory.html")
    assert data["steps"][0]["t"] is None and data["steps"][1]["t"] is None and data["settings"]["omega"] is None
    assert data["steps"][2]["t"] == doc["steps"][2]["t"]  # finite numbers as they were
    assert '"n/a"' in (tmp_path / "nan.trajectory.html").read_text()  # what the page shows for a null t
    node = shutil.which("node")
    if node:  # the browser's parser itself, where one is at hand
        script = ("const fs = require('fs'); const s = fs.readFileSync(process.argv[1], 'utf8');"
                  "const m = /id=\"trajectory-data\">([\\s\\S]*?)<\\/script>/.exec(s);"
                  "const d = JSON.parse(m[1]); process.stdout.write(String(d.steps[0].t));")
        r = subprocess.run([node, "-e", script, str(tmp_path / "nan.trajectory.html")], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == "null", r.stderr
        from elflow.experiments.viewer import _SCRIPT  # and what the page's script shows for a t

        [fmt] = [line for line in _SCRIPT.splitlines() if line.strip().startswith("const fmt = ")]
        r = subprocess.run([node, "-e", fmt + "\nprocess.stdout.write([null, 0.25, 1].map(fmt).join(' '))"],
                           capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == "n/a 0.250 1.000", r.stderr


def test_a_sampled_page_still_parses_strictly(trained, tmp_path):
    """The page `sample --html` writes holds strict JSON too (finite numbers only)."""
    page = tmp_path / "p.jsonl"
    assert main(["sample", str(trained), "--num", "1", "--steps", "2", "--html", "--quiet", "--out", str(page)]) == 0
    assert _page_data(page.with_suffix(".trajectory.html"))["samples"][0]["text"] == \
        json.loads(page.read_text())["text"]


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


@pytest.fixture
def every_warning():
    """Python's own once-per-location filter off: what is shown once is the CLI's doing (one text once per
    command), in a process that runs many commands."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        yield


def test_a_source_cut_at_sampling_is_warned_once_with_the_count(capsys, tmp_path, fixed_slot, every_warning):
    long = "the king of love and the lord of night and good sweet heart"  # 12 words
    code, _, err = cli(capsys, ["sample", fixed_slot, "--source", long, "--steps", "1", "--quiet", "--out",
                                tmp_path / "one.jsonl"])
    assert code == 0, err
    [w] = _warnings(err)
    assert re.fullmatch(r"warning: 1 of 1 source is longer than the 4 source tokens this model was trained with and "
                        r"was cut to 4 \((\d+) of (\d+) tokens dropped\)", w), w
    dropped, total = map(int, re.search(r"\((\d+) of (\d+)", w).groups())
    assert total >= 12 and dropped == total - 4
    # several batches and several seeds: still one warning
    src = tmp_path / "src.jsonl"
    rows = [{"input": long if i % 2 else "the king", "output": "x"} for i in range(5)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = cli(capsys, ["sample", fixed_slot, "--source", src, "--batch", "2", "--steps", "1", "--quiet",
                                "--out", tmp_path / "five.jsonl"])
    assert code == 0, err
    [w] = _warnings(err)
    assert w.startswith("warning: 2 of 5 sources are longer than the 4 source tokens") and "were cut to 4" in w
    code, _, err = cli(capsys, ["eval", "--task", src, "--checkpoint", fixed_slot, "--steps", "1", "--batch", "2",
                                "--seeds", "0", "1", "--out", tmp_path / "ev", "--json"])
    assert code == 0, err
    [w] = _warnings(err)
    assert w.startswith("warning: 2 of 5 sources are longer")
    # sources that fit: no warning
    code, _, err = cli(capsys, ["sample", fixed_slot, "--source", "the king", "--steps", "1", "--quiet", "--out",
                                tmp_path / "short.jsonl"])
    assert code == 0 and not _warnings(err), err


def test_an_empty_wandb_on_resume_turns_logging_off_and_says_so(capsys, tmp_path, trained):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    code, _, err = cli(capsys, ["train", "--out", run, "--resume", "--steps", "7", "--wandb", ""])
    assert code == 0, err
    assert "note: --wandb '': W&B logging is off for this run from here on" in err
    assert json.loads((run / "run.json").read_text())["record"]["train"]["wandb"] == ""


def test_train_encoder_skips_a_latin_1_file_with_on_bad_skip(capsys, tmp_path, tiny_corpus_file):
    data = tmp_path / "mixed"
    data.mkdir()
    shutil.copy(tiny_corpus_file, data / "a.txt")
    (data / "b.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    code, _, err = cli(capsys, ["train-encoder", "--data", data, "--on-bad", "skip", "--vocab", "100", "--steps", "1",
                                "--hidden", "32", "--quiet", "--out", tmp_path / "enc"])
    assert code == 0, err
    assert "b.txt is not valid UTF-8" in err and (tmp_path / "enc" / "config.json").exists()


def test_an_error_under_an_open_progress_bar_starts_its_own_line(capsys, monkeypatch):
    """Any command: the bar is ended before the one line (and a warning is written above the bar)."""
    import types
    import warnings

    import elflow.cli as cli_module
    from elflow.util.errors import ELFError

    def run(args):
        from tqdm.auto import tqdm

        bar = tqdm(total=10, desc="work", file=sys.stderr)
        bar.update(3)
        warnings.warn("half way")
        raise ELFError("it broke")

    monkeypatch.setattr(cli_module, "_load", lambda name: types.SimpleNamespace(run=run, add_arguments=lambda p: None))
    code = main(["toy"])
    err = capsys.readouterr().err
    lines = visible(err)
    assert code == 2 and "elflow toy: error: it broke" in lines, err
    assert [line for line in lines if "warning: half way" in line] == ["warning: half way"], err
    assert err.endswith("elflow toy: error: it broke\n")  # the bar is not drawn again after the error


@pytest.mark.slow
def test_a_resumed_runs_metrics_equal_the_uninterrupted_ones_but_timing(tmp_path, tiny_t5_dir, tiny_corpus_file,
                                                                        cache):
    """Logging every 2 steps, a checkpoint every 3: step 3 is logged (a checkpoint's step is a logging step), so
    a run stopped there and resumed logs the same intervals and numbers as one that ran through."""
    cfg = tiny_config(tiny_t5_dir, tiny_corpus_file, log_every=2, ckpt_every=3)
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(cfg, full, cache_dir=cache, quiet=True)
    train(cfg, cut, cache_dir=cache, quiet=True, stop_after=3)
    with open(cut / "metrics.jsonl", "a") as f:  # what a killed run may leave: a line past its checkpoint
        f.write(json.dumps({"kind": "train", "step": 4, "loss": 9.0}) + "\n{\"kind\": \"tr")
    train(cfg, cut, resume=True, cache_dir=cache, quiet=True)
    a, b = (_untimed(r / "metrics.jsonl") for r in (full, cut))
    assert [r["step"] for r in a] == [2, 3, 4, 6]
    assert a == b


def _untimed(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------------------------------------
# two ranks under torchrun (Gloo)
STEPS = 16


def _args(t5, corpus, cache, out, *extra):
    """A tiny run of 4 micro-batches of 2 rows a step (two on each of two ranks), logged every 2 steps, saved
    every 4."""
    return ["train", "--preset", "tiny", "--data", str(corpus), "--space", f"t5:{t5}", "--length", "16", "--batch",
            "8", "--micro-batch", "2", "--warmup", "2", "--ema-decay", "0.9", "--log-every", "2", "--ckpt-every", "4",
            "--dtype", "fp32", "--seed", "1", "--cache-dir", str(cache), "--out", str(out), *extra]


def _ranks_of(parent: int) -> dict[int, int]:
    """{rank: pid} of torchrun's workers (the children of `parent` with RANK in their environment)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0") if ppid == parent else []
        except (OSError, IndexError, ValueError):
            continue
        for item in env:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(d.name)
    return found


@pytest.fixture(scope="module")
def killed(tmp_path_factory, tiny_t5_dir, tiny_corpus_file, cache):
    """(an uninterrupted 2-rank run of STEPS steps, a 2-rank run whose rank 1 got SIGKILL once step 4 was saved,
    rank 0's stderr). torchrun's agent looks at its workers every 15 s (it stops the survivors when it sees a
    dead one), so rank 0 meets the dead peer first even on a loaded machine."""
    folder = tmp_path_factory.mktemp("ranks")
    full, cut = folder / "full", folder / "cut"
    r = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "elflow.cli",
                        *_args(tiny_t5_dir, tiny_corpus_file, cache, full, "--steps", str(STEPS), "--quiet")],
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    p = subprocess.Popen([*TORCHRUN, "--standalone", "--monitor-interval", "15", "--nproc-per-node", "2", "-m",
                          "elflow.cli", *_args(tiny_t5_dir, tiny_corpus_file, cache, cut, "--steps", "100000")],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while not (cut / "checkpoints" / "step_0000004").exists():
            assert p.poll() is None and time.time() - t0 < 300, "the run ended before its step-4 checkpoint"
            time.sleep(0.01)
        os.kill(_ranks_of(p.pid)[1], signal.SIGKILL)
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    return full, cut, err


@pytest.mark.slow
def test_a_killed_rank_is_one_line_on_the_others_and_the_run_resumes(killed, tmp_path):
    full, cut, err = killed
    assert "[rank0]" not in err and "Connection closed by peer" not in err.replace("(Connection closed by peer", "")
    [line] = [x for x in err.splitlines() if x.startswith("elflow train: error:")] or [err[-3000:]]
    assert line.startswith("elflow train: error: rank 0: another rank of this torchrun group died ("), err
    assert f"elflow train --out {cut} --resume" in line
    saved = [int(c.name.split("_")[1]) for c in list_checkpoints(cut)]
    assert 4 in saved and max(saved) < STEPS and not (cut / ".lock").exists()
    for c in list_checkpoints(cut):
        load_checkpoint(c)  # every checkpoint left is whole
    # resumed on two ranks: bit-identical weights, and the log of the uninterrupted run but its timing
    two = tmp_path / "two"
    shutil.copytree(cut, two)
    r = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "elflow.cli", "train", "--out",
                        str(two), "--resume", "--steps", str(STEPS), "--quiet"], env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for a, b in zip(checkpoint_weights(full, STEPS), checkpoint_weights(two, STEPS)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _untimed(two / "metrics.jsonl") == _untimed(full / "metrics.jsonl")


@pytest.mark.slow
def test_a_resume_on_another_number_of_ranks_differs_by_summation_order_only(killed, tmp_path):
    """Resumed on one process: the same data and noise, but the gradients of the four micro-batches of a step
    are summed in another order (one process adds them in turn, two ranks add two each and Gloo adds the
    ranks' sums): a difference in the last bits at the first step, which the steps after it carry and can
    grow. The weights agree to atol 2e-5 / rtol 1e-4 (measured: a few 1e-6 after 8 to 12 steps), not bit
    for bit."""
    full, cut, _ = killed
    one = tmp_path / "one"
    shutil.copytree(cut, one)
    assert main(["train", "--out", str(one), "--resume", "--steps", str(STEPS), "--quiet"]) == 0
    worst, scale = 0.0, 0.0
    for a, b in zip(checkpoint_weights(full, STEPS), checkpoint_weights(one, STEPS)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4), (k, (a[k] - b[k]).abs().max())
            worst = max(worst, float((a[k].double() - b[k].double()).abs().max()))
            scale = max(scale, float(a[k].abs().max()))
    print(f"2 ranks -> 1 against 2 ranks throughout, step {STEPS}: largest weight difference {worst:.3g} "
          f"(largest weight {scale:.3g})")
    steps = [json.loads(x)["step"] for x in (one / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(2, STEPS + 1, 2))  # every interval logged once

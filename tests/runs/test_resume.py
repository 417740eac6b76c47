"""Resume against the uninterrupted run: a resumed run's metrics equal the uninterrupted ones but timing;
under torchrun (Gloo on CPU) a killed rank is one line on the others and the run resumes, and a resume on
another number of ranks differs by summation order only."""
import json
import os
import shutil
import signal
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

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMING = ("tokens_per_s", "elapsed")  # the fields of a metrics record that measure time


import os
import sys
from pathlib import Path

from helpers import untimed

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMING = ("tokens_per_s", "elapsed")  # the fields of a metrics record that measure time


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
    a, b = (untimed(r / "metrics.jsonl") for r in (full, cut))
    assert [r["step"] for r in a] == [2, 3, 4, 6]
    assert a == b


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
    assert untimed(two / "metrics.jsonl") == untimed(full / "metrics.jsonl")


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

"""Runs over several ranks and nodes (Gloo on CPU): world-size changes on resume, two "nodes" on localhost, a run
folder that is not shared."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import checkpoint_weights, free_port, tiny_config

from elflow.cli import main
from elflow.lifecycle.claim import micro_batch_for
from elflow.util.errors import ELFError

pytestmark = pytest.mark.slow  # multi-process / learning runs: `python -m pytest -m slow`

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def run_args(t5_dir, corpus, cache) -> list[str]:
    """`elflow train` flags of a tiny run: batch 4, a checkpoint and a log line every 4 steps."""
    return ["train", "--preset", "tiny", "--data", str(corpus), "--space", f"t5:{t5_dir}", "--length", "16",
            "--batch", "4", "--warmup", "2", "--ema-decay", "0.9", "--log-every", "4", "--ckpt-every", "4",
            "--dtype", "fp32", "--seed", "1", "--cache-dir", str(cache), "--quiet"]


def assert_same_weights(run_a: Path, run_b: Path, step: int) -> None:
    """The weights and the EMA of two runs at `step` agree (to the sum order of two ranks against one)."""
    for a, b in zip(checkpoint_weights(run_a, step), checkpoint_weights(run_b, step)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4), (k, (a[k] - b[k]).abs().max())


def two_nodes(args: list[str], cwds: tuple[Path, Path]) -> list[subprocess.CompletedProcess]:
    """`elflow ARGS` as two torchrun "nodes" of one rank each on localhost (static rendezvous, --node-rank),
    node i in the folder cwds[i]."""
    port = free_port()
    procs = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "1",
                               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "elflow.cli", *args],
                              cwd=cwds[i], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_t5_dir, tiny_corpus_file):
    """(the run's flags, an uninterrupted 8-step run of one process in micro-batches of 2)."""
    cache = tmp_path_factory.mktemp("cache")
    args = run_args(tiny_t5_dir, tiny_corpus_file, cache)
    full = tmp_path_factory.mktemp("full") / "run"
    assert main([*args, "--micro-batch", "2", "--steps", "8", "--out", str(full)]) == 0
    return args, full


def test_a_run_of_two_ranks_resumes_on_one_rank_exactly(setup, tmp_path):
    """Two ranks resolve the micro-batch to batch / 2 and store it; resumed on one rank, the run keeps it (two
    accumulation steps instead of one) and ends where an uninterrupted run of one process in that micro-batch
    ends."""
    args, full = setup
    run = tmp_path / "run"
    r = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "elflow.cli", *args,
                        "--steps", "4", "--out", str(run)], env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((run / "run.json").read_text())
    assert meta["train"]["micro_batch"] == 2 and meta["world_size"] == 2
    assert main(["train", "--out", str(run), "--resume", "--steps", "8", "--quiet"]) == 0
    assert json.loads((run / "run.json").read_text())["world_size"] == 1
    assert_same_weights(run, full, 8)


def test_a_run_of_one_rank_resumes_on_two_nodes_exactly(setup, tmp_path):
    """The multi-node path (torchrun --nnodes 2 --node-rank, one rank per "node"): rank 0 reads the stored run
    and chooses the checkpoint, every rank checks that it sees the same folder, --dist-timeout is stored; a run
    of one process resumed there ends where the uninterrupted run ends."""
    args, full = setup
    run = tmp_path / "run"
    assert main([*args, "--micro-batch", "2", "--steps", "4", "--out", str(run)]) == 0
    nodes = two_nodes(["train", "--out", str(run), "--resume", "--steps", "8", "--dist-timeout", "7", "--quiet"],
                      (tmp_path, tmp_path))
    for r in nodes:
        assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((run / "run.json").read_text())
    train = meta["train"]
    assert meta["world_size"] == 2 and train["dist_timeout"] == 7 and train["micro_batch"] == 2
    assert_same_weights(run, full, 8)


def test_a_run_folder_that_the_nodes_do_not_share_is_refused(setup, tmp_path):
    """A relative --out on two "nodes" in different working folders is two folders: every rank stops with one
    line that names the folder and says what a run on several nodes needs; nothing is left in rank 0's."""
    args, _ = setup
    here, there = tmp_path / "node0", tmp_path / "node1"
    here.mkdir(), there.mkdir()
    nodes = two_nodes([*args, "--steps", "4", "--out", "runs/x"], (here, there))
    for r in nodes:  # each rank's one line (torchrun's agent adds its own report of the failed worker)
        assert r.returncode != 0, r.stderr[-3000:]
        [line] = [x for x in r.stderr.splitlines() if x.startswith("elflow train: error:")]
        assert line.startswith("elflow train: error: rank 1 (host ") and "--out runs/x is not shared between the " \
            f"nodes: this node does not see the lock that rank 0 (host {socket.gethostname()})" in line
        assert str(there / "runs" / "x" / ".lock") in line and "every node mounts at the same path" in line
    assert not (here / "runs").exists() and not (there / "runs").exists()


def test_a_micro_batch_that_does_not_split_over_the_ranks_is_refused_with_the_flag_to_give(tiny_t5_dir,
                                                                                           tiny_corpus_file):
    cfg = tiny_config(tiny_t5_dir, tiny_corpus_file, batch=8)
    def run_file_of(micro, world):  # what runs.stored.run_file gives: the stored settings, the ranks it started on
        return {"train": cfg.replace(micro_batch=micro).to_dict(), "world_size": world}

    stored = run_file_of(4, 2)
    assert micro_batch_for(cfg, 1, stored) == 4  # the stored micro-batch, two accumulation steps
    assert micro_batch_for(cfg, 2, run_file_of(None, 4)) == 2  # its first start's
    assert micro_batch_for(cfg, 4) == 2  # a fresh run: batch / ranks
    with pytest.raises(ELFError, match=r"does not split over 4 ranks: resume it on 1 or 2 ranks to continue "
                                       r"exactly, or give --micro-batch 2"):
        micro_batch_for(cfg, 4, stored)


def alone_and_on_two_ranks(args: list[str], one: list[str], two: list[str]) -> None:
    """`elflow ARGS ONE` in this process and `elflow ARGS TWO` under torchrun with two Gloo ranks."""
    assert main([*args, *one]) == 0
    r = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "elflow.cli", *args, *two],
                       env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_sampling_on_two_ranks_writes_the_file_of_one_process(setup, tmp_path):
    """7 samples in batches of 2: rank 0 draws batches 0 and 2, rank 1 batches 1 and 3 (one row); rank 0 writes
    them all, in order, as one process does with the same seed."""
    _, full = setup
    args = ["sample", str(full), "--num-samples", "7", "--batch", "2", "--steps", "4", "--seed", "3", "--device", "cpu",
            "--quiet", "--out"]
    alone_and_on_two_ranks(args, [str(tmp_path / "one.jsonl")], [str(tmp_path / "two.jsonl")])
    one, two = ((tmp_path / f"{n}.jsonl").read_text().splitlines() for n in ("one", "two"))
    assert len(one) == 7 and [json.loads(x)["index"] for x in two] == list(range(7))
    assert one == two
    assert len({json.loads(x)["text"] for x in one}) > 1  # the batches drew different noise


def test_evaluation_on_two_ranks_samples_and_judges_as_one_process(setup, tiny_t5_judge_dir, tmp_path):
    """`eval --checkpoint` under torchrun: sharded sampling (the same samples file) and a sharded judge (the same
    per-seed numbers: each sample's NLL comes from one rank). The NLLs agree to float32 rounding, not bit for bit:
    a rank judges its samples in batches of other neighbours, with other padding, and on some processors the
    batched kernels round a row differently beside other rows (measured on an AVX2-only AMD EPYC: 1e-9 of the
    sum)."""
    _, full = setup
    args = ["eval", "--checkpoint", str(full), "--judge", str(tiny_t5_judge_dir), "--num-samples", "7",
            "--batch", "2", "--batch-size", "2", "--steps", "4", "--seeds", "0", "1", "--device", "cpu", "--json", "--out"]
    alone_and_on_two_ranks(args, [str(tmp_path / "one")], [str(tmp_path / "two")])
    for seed in (0, 1):
        name = f"samples_seed{seed}.jsonl"
        assert (tmp_path / "one" / name).read_text() == (tmp_path / "two" / name).read_text()
    one, two = (json.loads((tmp_path / n / "report.json").read_text()) for n in ("one", "two"))
    for a, b in zip(one["per_seed"], two["per_seed"]):
        assert a["num_samples"] == b["num_samples"] == 7 and a["num_tokens"] == b["num_tokens"] > 0
        assert a["nll_sum"] == pytest.approx(b["nll_sum"], rel=1e-6) and a["gen_ppl"] == pytest.approx(b["gen_ppl"])

"""A training step's memory (weights, gradients, optimiser state, EMA, the passes at the micro-batch, the frozen
encoder's and a teacher's) is checked against what the process may still take, before its network is built, and
its previews are bounded: a run that does not fit is one line that writes nothing; a distillation is checked as
soon as its teacher's weights are read."""

import pytest
from helpers import assert_one_error, cli, cli_under_memory_limit, distill_args, tiny_flags

from elflow.util import budget

MiB = 2**20


@pytest.fixture
def small_machine(monkeypatch):
    """A process that may still take 64 MiB."""
    monkeypatch.setattr(budget, "available_memory", lambda device=None: (64 * MiB, "available on this machine"))


def test_a_network_whose_training_state_is_past_the_process_limit_is_one_line(tmp_path, tiny_t5_dir,
                                                                             tiny_corpus_file):
    """train --preset elf-l under a 6 GB address-space limit: its weights, gradients, optimiser state and EMA
    alone take 12 GiB. Refused before the network is built (not an allocator's traceback at 5 GB), and no run
    folder is left."""
    out = tmp_path / "b01b"
    code, err = cli_under_memory_limit(["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, tmp_path / "cache",
                                                              preset="elf-l", steps=1, warmup=1, **{"latent-std": 1}),
                                        "--out", out])
    assert_one_error(code, err, "train", "training at --preset elf-l (depth 32, hidden 1280) --batch 4 --length 16 "
                     "needs about", "left under this process's memory limit (ulimit)",
                     "optimiser state and EMA alone take", "choose a smaller --preset")
    assert not out.exists()


def test_a_batch_and_length_each_in_range_whose_step_does_not_fit_is_one_line(tmp_path, tiny_t5_dir,
                                                                             tiny_corpus_file, small_machine,
                                                                             capsys):
    out = tmp_path / "b02b"
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, tmp_path / "cache", batch=128,
                                                     length=32, steps=1, warmup=1), "--out", out])
    assert_one_error(code, err, "train", "training at --preset tiny (depth 2, hidden 64) --batch 128 --length 32 "
                     "needs about", "activations", "more than the 64.0 MiB of memory available on this machine",
                     "choose a smaller --micro-batch (the batch is then accumulated)")
    assert not out.exists()
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, tmp_path / "cache", steps=1,
                                                     warmup=1), "--out", tmp_path / "fits"])
    assert code == 0, err


def test_previews_past_their_bound_are_one_line(tmp_path, tiny_t5_dir, tiny_corpus_file, capsys):
    """--steps 10000 --sample-every 1 --sample-steps 10000: each flag in range, 2 x 10^8 network passes of
    previews in all."""
    out = tmp_path / "b09"
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, tmp_path / "cache", steps=10000,
                                                     **{"sample-every": 1, "sample-steps": 10000}), "--out", out])
    assert_one_error(code, err, "train", "10,000 previews (--steps 10,000 / --sample-every 1) x --sample-steps "
                     "10,000 x 2 samples make 200,000,000 network passes of one row, more than 2,000,000",
                     "choose a larger --sample-every")
    assert not out.exists()


def test_a_distillation_is_checked_once_its_teacher_is_read(trained, cache, tmp_path, monkeypatch, capsys):
    """The teacher's network and passes and a student's training step, refused before either network is built
    (on a process that may take 1 MiB more)."""
    monkeypatch.setattr(budget, "available_memory", lambda device=None: (MiB, "available on this machine"))
    pd = distill_args(trained, tmp_path / "d", cache)
    flow_map = [*pd[:pd.index("--student-steps")], "--objective", "flow-map", "--steps", "1"]
    for args in (pd, flow_map):
        code, _, err = cli(capsys, args)
        assert_one_error(code, err, "distill", f"distilling {trained / 'checkpoints' / 'step_0000006'} at --batch 4 "
                         "--length 16 needs about", "teacher", "more than the 1.0 MiB of memory available")
        assert not (tmp_path / "d").exists()

"""A run folder through faults of training: an overwrite with bad settings or failing before its first
checkpoint keeps the old run, a full disk during a save keeps the last checkpoint (and resume is exact), locks
held, stale or left behind, resumes that change what may not change, an interrupted overwrite undone, no
network."""
import json
import socket
import subprocess
import sys

import pytest
from helpers import (
    assert_bit_identical,
    assert_one_error,
    cli,
    full_disk,
    snapshot,
    tiny_flags,
)

from elflow.runs import checkpoint as ckpt_mod
from elflow.runs.checkpoint import list_checkpoints
from elflow.util import hub

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


@pytest.mark.slow
def test_overwrite_failing_before_its_first_checkpoint_restores_the_old_run(
        capsys, run_copy, tiny_t5_dir, tiny_corpus_file, cache, monkeypatch):
    (run_copy / "notes.txt").write_text("mine")  # a file the run did not write: --overwrite takes nothing
    before = snapshot(run_copy)
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, cache, seed=7), "--out", run_copy,
                                "--overwrite"])
    assert_one_error(code, err, "train", "holds notes.txt, which the run did not write")
    assert snapshot(run_copy) == before
    (run_copy / "notes.txt").unlink()
    before = snapshot(run_copy)
    real = ckpt_mod.save_file

    monkeypatch.setattr(ckpt_mod, "save_file", full_disk)
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, cache, seed=7), "--out", run_copy,
                                "--overwrite"])
    assert_one_error(code, err, "train", "no space left on device", "no checkpoint was written, so there is nothing "
                     "to resume: free some space, then run the same command again (without --resume)")
    assert snapshot(run_copy) == before

    # once the new run has written a checkpoint the old one is gone
    monkeypatch.setattr(ckpt_mod, "save_file", real)
    code, _, err = cli(capsys, ["train", *tiny_flags(tiny_t5_dir, tiny_corpus_file, cache, seed=7, steps=3),
                                "--out", run_copy, "--overwrite"])
    assert code == 0, err
    assert [p.name for p in list_checkpoints(run_copy)] == ["step_0000003"]
    assert json.loads((run_copy / "run.json").read_text())["train"]["seed"] == 7
    assert not (run_copy / ".replaced-run").exists() and not (run_copy / ".lock").exists()


@pytest.mark.slow
def test_enospc_during_a_save_keeps_the_last_checkpoint_and_resume_is_exact(
        capsys, trained, tmp_path, tiny_t5_dir, tiny_corpus_file, cache, monkeypatch):
    run = tmp_path / "run"
    real = ckpt_mod.save_file

    def full_disk_at_step_6(sd, path, *a, **k):
        return (full_disk if "step_0000006" in str(path) else real)(sd, path, *a, **k)
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


@pytest.mark.slow
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


def test_a_resumed_run_that_turns_non_finite_names_the_checkpoint_it_resumed_from(capsys, run_copy, cache,
                                                                                  monkeypatch):
    """A non-finite step before the resumed run's first checkpoint: the line names the checkpoint the run resumed
    from (not "no checkpoint was saved yet"), and nothing after it is written."""
    import elflow.train as train_module

    real = train_module.finish_step

    def poisoned(*a, **k):
        out = real(*a, **k)
        out["nonfinite"] = out["nonfinite"] + 1
        return out

    monkeypatch.setattr(train_module, "finish_step", poisoned)
    code, _, err = cli(capsys, ["train", "--resume", "--out", run_copy, "--steps", "8", "--cache-dir", cache,
                                "--quiet"])
    assert_one_error(code, err, "train", "non-finite loss or gradient at step 7",
                     f"The last good checkpoint is {run_copy / 'checkpoints' / 'step_0000006'} (the one this run "
                     "resumed from)")
    assert [p.name for p in list_checkpoints(run_copy)] == ["step_0000003", "step_0000006"]


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
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    code, _, err = cli(capsys, ["train", "--preset", "tiny", "--data", tiny_corpus_file, "--space",
                                "hf:nobody-xyz/no-such-encoder", "--out", tmp_path / "r", "--quiet"])
    assert_one_error(code, err, "train", "no network", "HF_HUB_OFFLINE=1")
    assert not (tmp_path / "r").exists()

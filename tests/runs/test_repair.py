"""Run state that is repaired, not refused: a half-written metrics line, an overwrite stopped by SIGTERM or
set aside, locks of a reused pid, temporaries of a killed writer, a checkpoint removed while read; new files
get the umask's mode."""
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    assert_one_error,
    cli,
    new_run_args,
    readout_without_specials,
    resume_args,
    sample_args,
    tree_state,
)

from elflow.runs.checkpoint import list_checkpoints
from elflow.util.errors import ELFError

# ----------------------------------------------------------------------------------------------------------
# state that is repaired, not refused


@pytest.mark.slow
def test_a_half_written_metrics_line_is_dropped_on_resume(capsys, run_copy, cache):
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 2')  # a kill in the middle of a line
    code, _, err = cli(capsys, resume_args(run_copy, cache, "--steps", "8"))
    assert code == 0, err
    recs = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if r.get("kind", "train") == "train"]
    assert steps == list(range(1, 9))
    assert (run_copy / "loss.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_sigterm_during_overwrite_puts_the_old_run_back_at_once(tmp_path, trained, tiny_t5_dir, tiny_corpus_file,
                                                               cache):
    import os
    import signal
    import time

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = tree_state(run)
    cmd = [sys.executable, "-m", "elflow.cli", *map(str, new_run_args(tiny_t5_dir, tiny_corpus_file, cache, run,
                                                                   steps=100000, **{"ckpt-every": 50000})),
           "--overwrite"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not (
                (run / ".replaced-run").is_dir() and (run / "metrics.jsonl").exists()):  # the new run trains
            time.sleep(0.05)
        assert (run / ".replaced-run").is_dir(), "the new run never started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "stopped by SIGTERM" in err
    assert tree_state(run) == before  # the old run is back, byte for byte; no lock, nothing set aside


def test_readers_bring_back_a_run_an_interrupted_overwrite_set_aside(capsys, run_copy, tmp_path):
    before = tree_state(run_copy)
    aside = run_copy / ".replaced-run"  # as SIGKILL during --overwrite leaves it, before the new run's checkpoint
    aside.mkdir()
    for name in ("run.json", "metrics.jsonl", "loss.png", "checkpoints"):
        (run_copy / name).rename(aside / name)
    (run_copy / "run.json").write_text("{}")
    code, _, err = cli(capsys, sample_args(run_copy, tmp_path / "s.jsonl"))
    assert code == 0, err
    assert "restored the run" in err
    assert tree_state(run_copy) == before


def test_new_files_get_the_umask_mode(trained):
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    for p in [trained / "run.json", trained / "loss.png", trained / "metrics.jsonl",
              *(trained / "checkpoints" / "step_0000006").iterdir()]:
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask, p


@pytest.mark.slow
def test_locks_of_a_reused_pid_are_taken_over_and_of_another_host_explained(capsys, run_copy, cache, live_process):
    (run_copy / ".lock").write_text(json.dumps({"pid": live_process.pid, "host": socket.gethostname(),
                                                "start": "another-boot:1", "command": "elflow train"}))
    code, _, err = cli(capsys, resume_args(run_copy, cache, "--steps", "7"))
    assert code == 0, err  # that pid runs, but it is another process than the one that took the lock
    assert not (run_copy / ".lock").exists()

    (run_copy / ".lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "command": "elflow train"}))
    before = tree_state(run_copy)
    code, _, err = cli(capsys, resume_args(run_copy, cache, "--steps", "8"))
    assert_one_error(code, err, "train", "on elsewhere", "another host", "cannot be checked from here",
                     f"delete {run_copy / '.lock'}")
    assert tree_state(run_copy) == before


def test_a_long_output_name_that_the_file_system_allows_is_written(capsys, trained, tmp_path):
    out = tmp_path / ("s" * 245 + ".jsonl")  # 251 bytes: the temporary name must still fit in 255
    code, _, err = cli(capsys, sample_args(trained, out))
    assert code == 0, err
    assert json.loads(out.read_text())["index"] == 0
    code, _, err = cli(capsys, sample_args(trained, tmp_path / ("s" * 256)))
    assert_one_error(code, err, "sample", "256 bytes long", "choose a shorter name")


@pytest.mark.slow
def test_init_from_the_run_being_overwritten(capsys, run_copy, tiny_t5_dir, tiny_corpus_file, cache):
    code, _, err = cli(capsys, [*new_run_args(tiny_t5_dir, tiny_corpus_file, cache, run_copy, steps=3, seed=2,
                                          **{"init-from": run_copy}), "--overwrite"])
    assert code == 0, err
    assert [p.name for p in list_checkpoints(run_copy)] == ["step_0000003"]
    assert json.loads((run_copy / "run.json").read_text())["train"]["seed"] == 2


def test_a_warning_is_one_line_once(capsys, trained, tmp_path):
    code, _, err = cli(capsys, sample_args(trained, tmp_path / "s.jsonl", "--omega", "10"))
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("warning")] == [
        "warning: omega 10.0 lies outside the range the model was trained on [0.5, 5.0]; results may be poor"]


def test_temporaries_of_a_killed_writer_are_removed(capsys, trained, tmp_path):
    import os

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "s.jsonl"
    left = tmp_path / f".s.jsonl.{dead.pid}.abcd1234.tmp"  # what SIGKILL during a write leaves
    left.write_text("half")
    os.utime(left, (0, 0))
    running = tmp_path / f".s.jsonl.{os.getpid()}.efgh5678.tmp"  # a live writer's: kept
    running.write_text("busy")
    os.utime(running, (0, 0))
    code, _, err = cli(capsys, sample_args(trained, out))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, running.name])


def test_a_checkpoint_removed_while_it_is_read_gives_way_to_the_next(capsys, run_copy, tmp_path, monkeypatch,
                                                                       tiny_t5_dir):
    import elflow.runs.load as loader

    readout_without_specials(run_copy, tiny_t5_dir)  # a tiny model may end every sample at once

    real = loader.load_checkpoint
    removed = []

    def keep_1_of_a_running_training(ckpt, *a, **k):  # --keep deletes the newest-but-one just now
        if not removed:
            removed.append(Path(ckpt).name)
            shutil.rmtree(ckpt)
        return real(ckpt, *a, **k)
    monkeypatch.setattr(loader, "load_checkpoint", keep_1_of_a_running_training)
    code, _, err = cli(capsys, sample_args(run_copy, tmp_path / "s.jsonl"))
    assert code == 0, err
    assert removed == ["step_0000006"]
    assert json.loads((tmp_path / "s.jsonl").read_text())["checkpoint"] == str(run_copy)


def test_an_unwritable_checkpoints_folder_is_found_before_training(capsys, run_copy, cache):
    ck = run_copy / "checkpoints"
    r = subprocess.run(["chattr", "+i", str(ck)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr +i is not available here ({(r.stderr or r.stdout).strip()})")
    try:
        before = tree_state(run_copy)
        code, _, err = cli(capsys, resume_args(run_copy, cache, "--steps", "8"))
        assert_one_error(code, err, "train", f"{ck}: cannot write in it", "nothing was trained")
        assert tree_state(run_copy) == before
    finally:
        subprocess.run(["chattr", "-i", str(ck)], check=False)


def test_run_json_kept_before_a_resume_comes_back_only_when_no_later_checkpoint_landed(tmp_path):
    """What a resume leaves when killed: before its first checkpoint the earlier run.json comes back; once a
    checkpoint past the one it resumed from has landed, the resume's own run.json stands."""
    from elflow.lifecycle.claim import keep_earlier_run, recover_earlier_run

    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000002").mkdir(parents=True)
    (run / "run.json").write_text('{"earlier": true}')
    keep_earlier_run(run, 2)
    (run / "run.json").write_text('{"rewritten": true}')
    assert recover_earlier_run(run) is True
    assert (run / "run.json").read_text() == '{"earlier": true}' and not (run / ".run-before-resume.json").exists()
    keep_earlier_run(run, 2)
    (run / "run.json").write_text('{"rewritten": true}')
    (run / "checkpoints" / "step_0000004").mkdir()
    assert recover_earlier_run(run) is False
    assert (run / "run.json").read_text() == '{"rewritten": true}' and not (run / ".run-before-resume.json").exists()
    assert recover_earlier_run(run) is False  # nothing kept: nothing to do
    (run / ".run-before-resume.json").write_text('{"step": "two"}')
    with pytest.raises(ELFError, match="corrupted"):
        recover_earlier_run(run)


def test_a_signal_during_a_held_writer_comes_once_it_is_done():
    """A SIGTERM that arrives while torch.save writes a checkpoint's optimizer.pt used to interrupt its zip
    writer mid-record, whose clean-up then failed with a raw RuntimeError ("unexpected pos") in place of the
    stop: the signal is held until the write is done, then delivered."""
    import io
    import os
    import signal

    import torch

    from elflow.util.files import signals_held

    got = []
    previous = signal.signal(signal.SIGTERM, lambda *_: got.append("SIGTERM"))
    try:
        buffer = io.BytesIO()
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            torch.save({"m": torch.zeros(1000)}, buffer)
            assert got == []  # held
        assert got == ["SIGTERM"]  # delivered once the block ended
        buffer.seek(0)
        assert torch.load(buffer, weights_only=True)["m"].shape == (1000,)  # the write is whole
    finally:
        signal.signal(signal.SIGTERM, previous)

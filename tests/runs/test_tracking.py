"""Weights & Biases in offline mode: a training run logs the records of metrics.jsonl, its settings and the
samples shown during training; a resumed run continues the same W&B run; without wandb, one line."""

import json
import sys

import pytest
from helpers import tiny_config, wandb_offline_runs

from elflow.train import train

pytest.importorskip("wandb", reason="the W&B tests need wandb (pip install -e '.[test]' installs it)")


@pytest.mark.slow
def test_a_run_logs_its_records_settings_and_samples_and_resume_continues_it(tmp_path, tiny_t5_dir,
                                                                             tiny_corpus_file, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run, cache = tmp_path / "run", tmp_path / "cache"
    cfg = tiny_config(tiny_t5_dir, tiny_corpus_file, wandb="elflow-test", sample_every=3, sampling={"steps": 4})
    train(cfg, run, cache_dir=cache, quiet=True, stop_after=3)
    train(cfg, run, resume=True, cache_dir=cache, quiet=True)

    first, second = wandb_offline_runs(run)
    assert first["id"] == second["id"] == json.loads((run / "wandb-run.json").read_text())["id"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["kind"] == "train"]
    logged = first["history"] + second["history"]
    assert [h["_step"] for h in logged] == [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for rec, got in zip(records, logged):
        numbers = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}
        assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= numbers.keys()
        assert any(k.startswith("loss_t") for k in numbers)  # the losses per time bin
        assert {k: got[k] for k in numbers} == pytest.approx(numbers)
    assert first["config"]["preset"] == "tiny" and first["config"]["steps"] == 6
    assert first["config"]["params"]["model"] > 0 and first["config"]["dtype"] == "fp32"
    # the samples shown at steps 3 and 6 (one in each invocation), two per step, as rows of one table
    rows = []
    for table in sorted((run / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json")):
        doc = json.loads(table.read_text())
        assert doc["columns"] == ["step", "index", "text"]
        rows += doc["data"]
    assert sorted((step, i) for step, i, _ in rows) == [(3, 0), (3, 1), (6, 0), (6, 1)]
    assert all(isinstance(text, str) for *_, text in rows)


def test_without_wandb_installed_the_flag_is_one_line(tmp_path, tiny_t5_dir, tiny_corpus_file, monkeypatch, capsys):
    from elflow.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--space", f"t5:{tiny_t5_dir}",
                 "--steps", "1", "--wandb", "elflow-test", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elflow train: error:") and 'pip install "elflow[wandb]"' in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_wandb_dir_decides_where_wandbs_files_go_and_resume_still_continues_the_run(tmp_path, tiny_t5_dir,
                                                                                     tiny_corpus_file, monkeypatch):
    """W&B's own convention: WANDB_DIR, where set, holds its files (scratch on a cluster); the run folder keeps
    the W&B run's id, so a resumed run continues the same W&B run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("WANDB_DIR", str(scratch))
    run, cache = tmp_path / "run", tmp_path / "cache"
    cfg = tiny_config(tiny_t5_dir, tiny_corpus_file, wandb="elflow-test")
    train(cfg, run, cache_dir=cache, quiet=True, stop_after=3)
    train(cfg, run, resume=True, cache_dir=cache, quiet=True)

    assert not (run / "wandb").exists()
    first, second = wandb_offline_runs(scratch)
    assert first["id"] == second["id"] == json.loads((run / "wandb-run.json").read_text())["id"]
    assert [h["_step"] for h in first["history"] + second["history"]] == [1, 2, 3, 4, 5, 6]


def _file(tmp_path):
    (tmp_path / "a-file").write_text("mine")
    return tmp_path / "a-file"


@pytest.mark.parametrize("where, said", [
    (lambda t: "/dev/null", "WANDB_DIR=/dev/null: /dev/null is not a folder"),
    (lambda t: _file(t), "a-file is not a folder"),
    (lambda t: _file(t) / "wandb", "a-file is not a folder, so"),
], ids=["a-device", "a-file", "under-a-file"])
@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_wandb_dir_that_cannot_hold_wandbs_files_is_one_line(capsys, tmp_path, tiny_t5_dir, tiny_corpus_file,
                                                               tiny_t5_judge_dir, monkeypatch, command, where, said):
    """WANDB_DIR a device, a file or a path under a file, with --wandb: one line naming the variable, exit 2,
    before anything is written (W&B would stop on it after the run folder was made)."""
    from helpers import assert_one_error, cli, new_run_args, tree_state

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(where(tmp_path)))
    samples = tmp_path / "s.jsonl"
    samples.write_text(json.dumps({"text": "a line of text"}) + "\n")
    argv = {"train": new_run_args(tiny_t5_dir, tiny_corpus_file, tmp_path / "cache", tmp_path / "run"),
            "eval": ["eval", samples, "--judge", tiny_t5_judge_dir, "--device", "cpu", "--no-heldout", "--report",
                     tmp_path / "report.json"]}[command]
    before = tree_state(tmp_path)
    code, _, err = cli(capsys, [*argv, "--wandb", "elflow-test"])
    assert_one_error(code, err, command, said, "Set WANDB_DIR to a folder you can write")
    assert tree_state(tmp_path) == before

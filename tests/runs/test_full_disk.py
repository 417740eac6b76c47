"""A real full disk (a small tmpfs; mounting needs root, skipped with the reason where it is not allowed):
during a save then an exact resume, for a samples file, an eval report and the figures, and for an eval of a
checkpoint."""
import json

import pytest
import torch
from helpers import assert_bit_identical, assert_one_error, cli, fill, sample_args, tiny_config

from elflow.runs import checkpoint as ckpt_mod
from elflow.runs.checkpoint import list_checkpoints
from elflow.train import train

# ----------------------------------------------------------------------------------------------------------
# a real full disk: a small tmpfs (mounting needs root; skipped with the reason where it is not allowed)


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])
def test_a_real_full_disk_during_a_save_then_an_exact_resume(capsys, small_fs, trained, tiny_t5_dir,
                                                             tiny_corpus_file, cache, writer):
    run = small_fs / "run"
    train(tiny_config(tiny_t5_dir, tiny_corpus_file), run, cache_dir=cache, quiet=True, stop_after=3)
    ck = run / "checkpoints" / "step_0000003"
    sizes = {p.name: p.stat().st_size for p in ck.iterdir()}
    # the save at step 6 meets the full disk in the first weights file, or in optimizer.pt (torch.save)
    leave = sizes["model.safetensors"] // 2 if writer == "safetensors" else \
        sizes["model.safetensors"] + sizes["ema.safetensors"] + sizes["optimizer.pt"] // 2
    filler = fill(small_fs, leave)
    code, _, err = cli(capsys, ["train", "--resume", "--out", run, "--cache-dir", cache, "--quiet"])
    assert_one_error(code, err, "train", "no space left on device", "step_0000006", "last good checkpoint: step 3",
                     "--resume")
    assert [p.name for p in list_checkpoints(run)] == ["step_0000003"]
    assert not list((run / "checkpoints").glob(".tmp-*")) and not (run / ".lock").exists()
    ckpt_mod.load_checkpoint(ck)  # intact: every file matches its hash

    filler.unlink()
    code, _, err = cli(capsys, ["train", "--resume", "--out", run, "--cache-dir", cache, "--quiet"])
    assert code == 0, err
    assert_bit_identical(run, trained, 6)
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r.get("kind", "train") == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 6  # each step logged once


def test_a_real_full_disk_for_a_samples_file_an_eval_report_and_the_figures(capsys, small_fs, trained, tmp_path):
    samples, refs = tmp_path / "hyp.jsonl", tmp_path / "refs.txt"
    samples.write_text('{"text": "the cat sat"}\n')
    refs.write_text("the cat sat down\n")
    filler = fill(small_fs)
    commands = [("sample", sample_args(trained, small_fs / "s.jsonl"), small_fs / "s.jsonl"),
                ("eval", ["eval", samples, "--task", "translation", "--references", refs, "--report",
                          small_fs / "r.json"], small_fs / "r.json"),
                ("toy", ["toy", "--num", "8", "--steps", "1", "2", "--out", small_fs / "toy.png"], small_fs / "toy.png"),
                ("schedules", ["schedules", "--samples", "2000", "--out", small_fs / "s.png"], small_fs / "s.png")]
    for command, argv, out in commands:
        code, _, err = cli(capsys, argv)
        assert_one_error(code, err, command, "no space left on device while writing", str(out), "free some space")
        assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]  # nothing half-written, no temporary
    filler.unlink()
    for command, argv, out in commands:
        code, _, err = cli(capsys, argv)
        assert code == 0, err
        if out.suffix == ".png":
            assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            assert json.loads(out.read_text() if command == "eval" else out.read_text().splitlines()[0])


def test_a_real_full_disk_during_eval_of_a_checkpoint_leaves_no_folder(capsys, small_fs, trained, tmp_path):
    from elflow.eval.gpt2_tokenizer import tokenizer_from_ranks
    from elflow.eval.judge import CausalJudge, JudgeConfig, save_judge

    torch.manual_seed(0)
    tok = tokenizer_from_ranks({bytes([i]): i for i in range(256)}, model_max_length=32)
    judge = save_judge(CausalJudge(JudgeConfig(vocab_size=257, hidden=32, depth=1, heads=2, context=32,
                                               eos_id=256)), tok, tmp_path / "judge")
    capsys.readouterr()
    out = small_fs / "ev"
    argv = ["eval", "--checkpoint", trained, "--out", out, "--judge", judge, "--num", "2", "--steps", "1", "--json"]
    filler = fill(small_fs)
    code, _, err = cli(capsys, argv)
    assert_one_error(code, err, "eval", "no space left on device while writing", str(out))
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]  # no empty folder left behind
    filler.unlink()
    code, stdout, err = cli(capsys, argv)
    assert code == 0, err
    assert json.loads(stdout)["gen_ppl"] > 1 and (out / "report.json").exists()

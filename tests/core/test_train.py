"""Training end to end on CPU: resume exactness (also after SIGKILL), DDP equivalence, checkpoints, sampling."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    as_layout_1,
    assert_same,
    checkpoint_weights,
    readout_without_specials,
    run_alone_and_on_two_ranks,
    tiny_config,
)
from safetensors.torch import load_file

from elflow.runs.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from elflow.runs.stored import run_file
from elflow.train import train
from elflow.util.errors import ELFError

ROOT = Path(__file__).resolve().parents[2]


cfg_for = tiny_config


final_weights = checkpoint_weights


def assert_same_runs(run_a: Path, run_b: Path, step: int, exact=True):
    """The two runs' checkpoints at `step` hold the same weights and the same EMA (to float rounding where not
    `exact`)."""
    for name, a, b in zip(("weights", "EMA"), *(final_weights(run, step) for run in (run_a, run_b))):
        assert_same(a, b, f"{run_a.name} {name}", exact, rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_t5_dir, tiny_corpus_file):
    run = tmp_path_factory.mktemp("full") / "run"
    cache = tmp_path_factory.mktemp("cache")
    summary = train(cfg_for(tiny_t5_dir, tiny_corpus_file), run, cache_dir=cache, quiet=True)
    return run, cache, summary


def test_run_folder_contents_and_metrics(uninterrupted):
    run, _, summary = uninterrupted
    assert [p.name for p in list_checkpoints(run)] == ["step_0000003", "step_0000006"]
    ck = load_checkpoint(latest_checkpoint(run))
    st, record = ck["state"], run_file(run)["record"]  # the record is run.json's; state.json names it by digest
    assert st["step"] == 6 and "record" not in st and st["model_sha256"] == record.digest()
    assert record.network.dim == 32 and record.space.id.startswith("t5:")
    assert st["data_position"] and (run / "loss.png").exists()
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
        assert all(key in r for r in recs)
    lr = 1e-3 * 4 / 256
    assert [r["lr"] for r in recs[:3]] == pytest.approx([0.0, lr / 2, lr])  # a warm-up of 2 steps, from rate 0
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)


def test_the_sample_settings_given_are_the_models_sampling_defaults(uninterrupted, tmp_path, tiny_t5_dir,
                                                                    tiny_corpus_file):
    """--sample-steps / --sample-sampler / --sample-omega are written into the record's sampling (what previews,
    `elflow sample` and `elflow eval` use), on top of the defaults of the model's kind; none given, the record
    holds its kind's defaults; a setting the method's sampler has not is refused before anything is written."""
    from elflow.generate import default_sampling
    from elflow.runs.load import read_record

    run, cache, _ = uninterrupted
    assert read_record(run).sampling == default_sampling()  # a text model's
    given = tmp_path / "given"
    train(cfg_for(tiny_t5_dir, tiny_corpus_file, steps=1, ckpt_every=1,
                  sampling={"steps": 5, "sampler": "ode", "omega": 2.0}), given, cache_dir=cache, quiet=True)
    assert read_record(given).sampling == default_sampling().replace(steps=5, sampler="ode", omega=2.0)
    with pytest.raises(ELFError, match="--sample-omega does not apply to a model of --method ar"):
        train(cfg_for(tiny_t5_dir, tiny_corpus_file, method="ar", steps=1, sampling={"omega": 2.0}), tmp_path / "ar",
              cache_dir=cache, quiet=True)
    assert not (tmp_path / "ar").exists()


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["record"]["recipe"].update(noise_scale=3.0), "describes another model than its checkpoint "
                                                              "step_0000006 holds (not the model it was saved"),
    (lambda d: d["train"].update(length=8), "its training settings hold 'length', which its record holds"),
    (lambda d: d["record"]["space"].update(latent_std=2.5), "make another model than its checkpoint "
                                                             "step_0000006 holds (space: "),
    (lambda d: d["train"].update(space={"kind": "hf", "name": "minilm"}), "its training settings hold 'space', which "
                                                                          "its record holds"),
    (lambda d: d["train"].update(update_rule="torch-fan"), "If run.json's optimiser settings were edited"),
], ids=["recipe", "restated", "space-scale", "space-restated", "update-rule"])
def test_a_resume_from_edited_training_settings_names_run_json(uninterrupted, tmp_path, capsys, edit, words):
    """run.json's training settings edited so that they make another model than the checkpoint holds (another
    recipe, another space) or another optimiser: the resume is one line that says run.json was edited, before
    anything is changed, never a run that continues with the edited value or a message blaming the checkpoint."""
    import shutil

    from elflow.cli import main

    run = tmp_path / "run"
    shutil.copytree(uninterrupted[0], run)
    doc = json.loads((run / "run.json").read_text())
    edit(doc)
    (run / "run.json").write_text(json.dumps(doc))
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file())
    assert main(["train", "--out", str(run), "--resume", "--steps", "8", "--quiet",
                 "--cache-dir", str(uninterrupted[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "run.json" in err[0], err
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()) == before


def test_a_resume_refused_for_an_edited_run_json_warns_of_nothing_it_read_there(uninterrupted, tmp_path, capsys):
    """run.json's stored sampling omega edited outside the trained range, and its recipe edited: the resume is
    refused in one line, with no warning about the edited omega of a run that does not go on."""
    import shutil

    from elflow.cli import main

    run = tmp_path / "run"
    shutil.copytree(uninterrupted[0], run)
    doc = json.loads((run / "run.json").read_text())
    doc["record"]["sampling"]["omega"] = 7.0
    doc["record"]["recipe"]["noise_scale"] = 3.0
    (run / "run.json").write_text(json.dumps(doc))
    assert main(["train", "--out", str(run), "--resume", "--steps", "8", "--quiet",
                 "--cache-dir", str(uninterrupted[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "describes another model than its checkpoint step_0000006" in err[0], err
    assert "omega" not in err[0] and "restore it" in err[0]


@pytest.mark.slow
def test_resume_continues_exactly(uninterrupted, tmp_path, tiny_t5_dir, tiny_corpus_file):
    full, cache, _ = uninterrupted
    run = tmp_path / "run"
    cfg = cfg_for(tiny_t5_dir, tiny_corpus_file)
    train(cfg, run, cache_dir=cache, quiet=True, stop_after=3)  # stops after the step-3 checkpoint
    assert [p.name for p in list_checkpoints(run)] == ["step_0000003"]
    summary = train(cfg, run, resume=True, cache_dir=cache, quiet=True)
    assert summary["start_step"] == 3
    assert_same_runs(run, full, 6)


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_is_exact(uninterrupted, tmp_path, tiny_t5_dir, tiny_corpus_file):
    full, cache, _ = uninterrupted
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "elflow.cli", "train", "--preset", "tiny", "--data", str(tiny_corpus_file),
           "--space", f"t5:{tiny_t5_dir}", "--length", "16", "--batch", "4", "--steps", "600", "--warmup", "2",
           "--ema-decay", "0.9", "--log-every", "1", "--ckpt-every", "3", "--keep", "5", "--dtype", "fp32",
           "--seed", "1", "--out", str(run), "--cache-dir", str(cache)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (run / "checkpoints" / "step_0000003").exists():
            time.sleep(0.05)
        assert (run / "checkpoints" / "step_0000003").exists(), "no checkpoint appeared"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the kill may land in the middle of a later save: whatever is left must be skipped or complete
    cfg = cfg_for(tiny_t5_dir, tiny_corpus_file, steps=600)
    start = latest_checkpoint(run)
    assert start is not None
    summary = train(cfg, run, resume=True, cache_dir=cache, quiet=True, stop_after=6 - int(start.name[5:]))
    assert summary["end_step"] == 6
    # same schedule (steps=600 only changes nothing in the first 6 steps: warm-up 2, constant lr)
    assert_same_runs(run, full, 6)


@pytest.mark.slow
def test_corrupted_checkpoint_is_refused_and_resume_falls_back(uninterrupted, tmp_path, tiny_t5_dir,
                                                               tiny_corpus_file):
    import shutil

    full, cache, _ = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(full, run)
    bad = run / "checkpoints" / "step_0000006" / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(ELFError, match="model.safetensors: corrupted or truncated"):
        load_checkpoint(run / "checkpoints" / "step_0000006")
    warnings = []
    assert latest_checkpoint(run, warn=warnings.append).name == "step_0000003"
    assert "step_0000006" in warnings[0]
    summary = train(cfg_for(tiny_t5_dir, tiny_corpus_file), run, resume=True, cache_dir=cache, quiet=True)
    assert summary["start_step"] == 3
    assert_same_runs(run, full, 6)


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_with_the_same_global_batch(uninterrupted, tmp_path, tiny_t5_dir,
                                                                     tiny_corpus_file):
    _, cache, _ = uninterrupted
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--preset", "tiny", "--data", str(tiny_corpus_file), "--space", f"t5:{tiny_t5_dir}", "--length", "16",
              "--batch", "4", "--micro-batch", "2", "--steps", "3", "--warmup", "1", "--log-every", "1",
              "--ckpt-every", "3", "--dtype", "fp32", "--seed", "2", "--cache-dir", str(cache)]
    run_alone_and_on_two_ranks(["train", *common], one, two)
    assert_same_runs(one, two, 3, exact=False)
    m1 = [json.loads(x)["loss"] for x in (one / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x)["loss"] for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert m1 == pytest.approx(m2, rel=1e-4)  # losses averaged across ranks before logging


@pytest.mark.slow
def test_two_gloo_ranks_train_a_learned_table_as_one_process(uninterrupted, tmp_path, tiny_t5_dir,
                                                            tiny_corpus_file):
    """The space's encode runs inside the DDP-wrapped pass: a learned table's gradients are averaged across ranks
    like the network's, so the table of two ranks equals one process's."""
    _, cache, _ = uninterrupted
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--preset", "tiny", "--data", str(tiny_corpus_file), "--space", f"learned-table:{tiny_t5_dir}",
              "--space-dim", "16", "--length", "16", "--batch", "4", "--micro-batch", "2", "--steps", "3",
              "--warmup", "1", "--log-every", "1", "--ckpt-every", "3", "--dtype", "fp32", "--seed", "2",
              "--cache-dir", str(cache)]
    run_alone_and_on_two_ranks(["train", *common], one, two)
    assert_same_runs(one, two, 3, exact=False)
    from elflow.space import build_space

    start = build_space({"kind": "learned-table", "name": str(tiny_t5_dir), "dim": 16, "seed": 0}).table.detach()
    a, b = (load_file(r / "checkpoints" / "step_0000003" / "space.safetensors")["table"] - start for r in (one, two))
    assert a.abs().max() > 0  # the table trained, by a few learning rates (1.6e-5) per entry
    assert torch.allclose(a, b, atol=1e-7, rtol=1e-3)  # the same updates (a rank's own gradients differ by ~lr)


def test_a_compiled_pass_takes_the_same_step(tiny_t5_dir):
    """torch.compile wraps the one trained pass (encode, self-conditioning pass, trained pass): the same
    step, the same weights as the plain pass."""
    from elflow.flow import Recipe
    from elflow.methods import get_method
    from elflow.methods.base import TrainedPass
    from elflow.model import ELF, get_config
    from elflow.optim import EMA, ELFOptimizer
    from elflow.space import build_space
    from elflow.train import train_step

    space = build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": 0.2})
    shards = [{"tokens": torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(0)),
               "mask": torch.ones(4, 16, dtype=torch.bool)}]
    weights = []
    for compiled in (False, True):
        torch.manual_seed(0)
        net = ELF(get_config("tiny", dim=space.dim, vocab_size=space.vocab_size, max_length=16))
        opt = ELFOptimizer(net.named_parameters(), lr=1e-2)
        model = TrainedPass(get_method("elf"), net, space, Recipe())
        model = torch.compile(model, backend="eager") if compiled else model
        for step in range(2):
            m = train_step(model, shards, opt, EMA(net, 0.9), step, 0, 0, "fp32")
            assert m["nonfinite"] == 0 and m["decode_rows"] + m["denoise_rows"] == 4
        weights.append(net.state_dict())
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-6) for k in weights[0])


def test_bad_input_is_refused_without_touching_the_run(uninterrupted, tmp_path, tiny_t5_dir, tiny_corpus_file):
    full, cache, _ = uninterrupted
    before = sorted(p.name for p in list_checkpoints(full))
    with pytest.raises(ELFError, match="already holds a run"):
        train(cfg_for(tiny_t5_dir, tiny_corpus_file), full, cache_dir=cache, quiet=True)
    with pytest.raises(ELFError, match="holds a different run"):
        train(cfg_for(tiny_t5_dir, tiny_corpus_file, batch=8), full, resume=True, cache_dir=cache, quiet=True)
    assert sorted(p.name for p in list_checkpoints(full)) == before
    with pytest.raises(ELFError, match="unknown preset"):
        train(cfg_for(tiny_t5_dir, tiny_corpus_file, preset="huge"), tmp_path / "a", cache_dir=cache, quiet=True)
    with pytest.raises(ELFError, match="not divisible"):
        train(cfg_for(tiny_t5_dir, tiny_corpus_file, micro_batch=3), tmp_path / "b", cache_dir=cache, quiet=True)


def test_a_nonfinite_step_is_flagged_on_the_device(tiny_t5_dir):
    """train_step reads nothing on the host: a step whose gradient is not finite says so in its sums."""
    from elflow.flow import Recipe
    from elflow.methods import get_method
    from elflow.methods.base import TrainedPass
    from elflow.model import ELF, get_config
    from elflow.optim import EMA, ELFOptimizer
    from elflow.space import build_space
    from elflow.train import train_step

    space = build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": 0.2})
    net = ELF(get_config("tiny", dim=space.dim, vocab_size=space.vocab_size, max_length=16))
    opt = ELFOptimizer(net.named_parameters(), lr=1e-2)
    shards = [{"tokens": torch.randint(3, 200, (4, 16)), "mask": torch.ones(4, 16, dtype=torch.bool)}]
    model = TrainedPass(get_method("elf"), net, space, Recipe(decode_prob=0.0))
    assert train_step(model, shards, opt, EMA(net, 0.9), 0, 0, 0, "fp32")["nonfinite"] == 0
    with torch.no_grad():
        net.x_head.weight.fill_(float("nan"))
    assert train_step(model, shards, opt, EMA(net, 0.9), 1, 0, 0, "fp32")["nonfinite"] == 1


@pytest.mark.slow
def test_a_nonfinite_step_stops_the_run_before_anything_of_it_is_saved(uninterrupted, tmp_path, tiny_t5_dir,
                                                                       tiny_corpus_file, monkeypatch):
    """The loop reads the non-finite flag with the log and before every checkpoint: a step that is not finite
    stops the run with the last good checkpoint named, and nothing after it is written."""
    import elflow.train as train_module

    _, cache, _ = uninterrupted
    real = train_module.finish_step

    def poisoned(model, net, totals, *a, **k):  # step 5 (0-based 4) has a non-finite gradient
        out = real(model, net, totals, *a, **k)
        if len(calls) == 4:
            out["nonfinite"] = torch.ones(())
        calls.append(1)
        return out

    calls = []
    monkeypatch.setattr(train_module, "finish_step", poisoned)
    run = tmp_path / "run"
    with pytest.raises(ELFError, match=r"non-finite loss or gradient in steps 4\.\.6.*step_0000003"):
        train(cfg_for(tiny_t5_dir, tiny_corpus_file, log_every=3), run, cache_dir=cache, quiet=True)
    assert [p.name for p in list_checkpoints(run)] == ["step_0000003"]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [3]


def test_sample_cli_is_reproducible_and_writes_jsonl(uninterrupted, tmp_path):
    from elflow.cli import main

    run, _, _ = uninterrupted
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = ["sample", str(run), "--steps", "4", "--num", "3", "--batch", "2", "--seed", "5", "--quiet"]
    assert main(args + ["--out", str(a)]) == 0
    assert main(args + ["--out", str(b), "--trajectory"]) == 0
    ra = [json.loads(x) for x in a.read_text().splitlines()]
    rb = [json.loads(x) for x in b.read_text().splitlines()]
    assert len(ra) == 3 and all("text" in r and r["steps"] == 4 and r["sampler"] == "sde" for r in ra)
    assert [r["text"] for r in ra] == [r["text"] for r in rb]
    assert main(["sample", str(run), "--steps", "0", "--out", str(a)]) == 2  # a clear error, not a traceback


def test_quickstart_report_on_a_trained_run(uninterrupted):
    from elflow.experiments.quickstart import report

    run, cache, _ = uninterrupted
    lines = []
    out = report(run, sampler="vc", steps=2, num=2, cache_dir=cache, printer=lines.append)
    v = out["validation"]
    assert v["bins"] and all(b["model"] > 0 and b["baseline"] > 0 for b in v["bins"])
    assert set(v["decode_accuracy"]) == {"p=1.0", "p=0.9", "p=0.7"}
    assert 0 <= out["real_text"]["corpus_word_share"] <= 1 and out["samples"]["texts"] <= 2
    assert any("baseline" in line for line in lines)
    assert (run / "report.json").exists() and len((run / "samples.jsonl").read_text().splitlines()) == 2


def test_quickstart_total_time_counts_training_and_report():
    from elflow.experiments.quickstart import total_time

    assert total_time("training", 240.0, 30.0) == "total time 4.5 min (training 4.0 min, report 0.5 min)"
    assert total_time("training", 0.0, 240.0).startswith("total time 4.0 min")  # --report-only


@pytest.mark.slow
def test_print_config_and_the_first_line_name_the_resolved_precision(tmp_path, tiny_t5_dir, tiny_corpus_file,
                                                                     capsys):
    from elflow.cli import main
    from elflow.util.devices import fast_bf16

    picked = "bf16" if fast_bf16(torch.device("cpu")) else "fp32"
    assert main(["train", "--preset", "tiny", "--device", "cpu", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == picked
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--space", f"t5:{tiny_t5_dir}",
                 "--length", "16", "--batch", "2", "--steps", "1", "--warmup", "1", "--device", "cpu",
                 "--cache-dir", str(tmp_path / "c"), "--out", str(run)]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("training an ELF model") and "on cpu (" in first and f"precision {picked}" in first
    assert json.loads((run / "run.json").read_text())["train"]["dtype"] == picked


def test_word_stats_by_hand():
    import math

    from elflow.eval.diagnostics import word_stats

    s = word_stats(["a a b", "c"], vocab={"a", "c"})
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert s["word_entropy"] == pytest.approx((h + 0.0) / 2)
    assert s["corpus_word_share"] == pytest.approx(3 / 4)


def test_a_random_table_run_stored_without_a_stream_keeps_its_table(tmp_path, tiny_t5_dir, tiny_corpus_file):
    """A run whose stored settings name no table stream (as elflow wrote them before streams) rebuilds its
    table from the seed itself, loads with the readout table it was trained with, and resumes; a new run
    with the same settings draws stream 2, another table."""
    from elflow.cli import main
    from elflow.runs.load import load_for_sampling

    base = ["--preset", "tiny", "--data", str(tiny_corpus_file), "--length", "16", "--batch", "4", "--warmup",
            "1", "--ckpt-every", "2", "--dtype", "fp32", "--quiet", "--cache-dir", str(tmp_path / "cache"),
            "--space", f"random-table:{tiny_t5_dir}", "--table-readout", "1"]
    cfg = tiny_config(tiny_t5_dir, tiny_corpus_file, steps=2, ckpt_every=2, short_run={"table_readout": 1.0},
                      data=str(tiny_corpus_file), space={"kind": "random-table", "name": str(tiny_t5_dir), "stream": 1})
    old = tmp_path / "old"
    train(cfg, old, quiet=True, cache_dir=tmp_path / "cache")
    settings, record = (json.loads((old / "run.json").read_text())[k] for k in ("train", "record"))
    for f in [old / "run.json", *old.glob("checkpoints/*/state.json")]:  # what an elflow without streams wrote
        d = as_layout_1(json.loads(f.read_text()), settings, record)
        d["train"].pop("space_stream", None)  # (a baseline's; an ELF run's space is its record's)
        if "space" in d:
            d["space"].pop("stream")
            assert d["space_id"].endswith(":seed0")
        f.write_text(json.dumps(d))
        (f.parent / "state.sha256").unlink(missing_ok=True)  # nor the hash of state.json beside it
    net, space = load_for_sampling(old)
    first_draws = torch.randn(space.table.shape, generator=torch.Generator().manual_seed(0))
    assert space.stream == 1 and torch.equal(space.table, first_draws)
    assert torch.equal(net.readout_table, space.table[:net.config.vocab_size])
    assert main(["train", "--out", str(old), "--resume", "--steps", "4", "--quiet"]) == 0
    assert json.loads((old / "run.json").read_text())["record"]["space"]["stream"] == 1
    assert main(["train", *base, "--steps", "2", "--out", str(tmp_path / "new")]) == 0
    _, fresh = load_for_sampling(tmp_path / "new")
    assert fresh.stream == 2 and not torch.allclose(fresh.table, space.table)


def test_table_readout_run_carries_the_token_vectors(tmp_path, tiny_t5_dir, tiny_corpus_file, capsys):
    """`--table-readout 1` in a random-table space: the stored readout table is each token's own vector,
    frozen and carried by the EMA; training is the same as without the option (the same weights); the run
    samples; a contextual space is refused."""
    from elflow.cli import main
    from elflow.runs.load import load_for_sampling

    cache = tmp_path / "cache"
    args = ["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--length", "16", "--batch", "4",
            "--warmup", "1", "--ckpt-every", "2", "--dtype", "fp32", "--quiet", "--cache-dir", str(cache),
            "--steps", "4", "--space", f"random-table:{tiny_t5_dir}"]
    assert main(args + ["--table-readout", "1", "--out", str(tmp_path / "tied")]) == 0
    assert main(args + ["--out", str(tmp_path / "plain")]) == 0
    net, space = load_for_sampling(tmp_path / "tied")
    V = net.config.vocab_size
    assert net.options.table_readout == 1.0
    assert torch.equal(net.readout_table, space.table[:V])  # random-table: the rows themselves (scale 1)
    w2, e2 = checkpoint_weights(tmp_path / "tied", 2)
    w4, e4 = checkpoint_weights(tmp_path / "tied", 4)
    assert torch.equal(w2["readout_table"], w4["readout_table"]) and torch.equal(e4["readout_table"], w4["readout_table"])
    p4, q4 = checkpoint_weights(tmp_path / "plain", 4)
    assert set(w4) == set(p4) | {"readout_table"}
    assert all(torch.equal(w4[k], p4[k]) and torch.equal(e4[k], q4[k]) for k in p4)  # training unchanged
    assert main(["sample", str(tmp_path / "tied"), "--steps", "4", "--num", "2", "--quiet",
                 "--out", str(tmp_path / "s.jsonl")]) == 0
    capsys.readouterr()
    code = main(args[:-1] + [f"t5:{tiny_t5_dir}", "--table-readout", "1", "--out", str(tmp_path / "refused")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "table readout needs a space with one vector per token" in err[0]
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_gaussian_skip_run_carries_the_training_moments(tmp_path, tiny_t5_dir, tiny_corpus_file):
    """`--skip gaussian` from the CLI, with the cosine decay: the stored moments are the training split's
    own (computed here directly over every scored position), stay frozen, and the run samples and resumes
    exactly."""
    from elflow.cli import main
    from elflow.data.datasets import build_dataset
    from elflow.runs.load import load_for_sampling

    run, cache = tmp_path / "skip", tmp_path / "cache"
    args = ["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--space", f"t5:{tiny_t5_dir}",
            "--length", "16", "--batch", "4", "--warmup", "2", "--ema-decay", "0.9", "--ckpt-every", "3",
            "--dtype", "fp32", "--seed", "1", "--skip", "gaussian", "--lr-decay", "cosine", "--log-every", "1", "--quiet",
            "--cache-dir", str(cache)]
    assert main(args + ["--steps", "6", "--out", str(run)]) == 0
    net, space = load_for_sampling(run)
    train_set, _ = build_dataset(str(tiny_corpus_file), space, 16, val_fraction=0.02, seed=1, cache_dir=cache)
    assert len(train_set) <= 512  # the moments then cover every row
    x = space.encode(train_set.tokens, attention_mask=train_set.attention_mask).double()[train_set.mask]
    assert net.options.skip == "gaussian"
    assert torch.allclose(net.skip_mean.double(), x.mean(0), atol=1e-5)
    assert torch.allclose(net.skip_var.double(), x.var(0, unbiased=False), rtol=1e-4)
    assert net.skip_noise.item() == 2.0  # the recipe's noise scale
    w3, e3 = checkpoint_weights(run, 3)
    w6, e6 = checkpoint_weights(run, 6)
    for k in ("skip_mean", "skip_var", "skip_noise"):
        assert torch.equal(w3[k], w6[k]) and torch.equal(e6[k], w6[k])  # frozen, and carried by the EMA
    assert not torch.equal(w3["x_head.weight"], w6["x_head.weight"])
    lrs = [json.loads(x)["lr"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    # the released cosine: the peak at the warm-up's end (step 2 of 6), down to 0 at step 6, one past the last
    assert lrs[2] == max(lrs) and all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    assert lrs[-1] == pytest.approx(lrs[2] * (1 + math.cos(math.pi * 3 / 4)) / 2)
    # stopped after step 3 and resumed: the same weights as the uninterrupted run
    from elflow.lifecycle.claim import stored_config

    cfg = stored_config(run)  # the run's settings: its record's and those beside it
    part = tmp_path / "part"
    train(cfg, part, cache_dir=cache, quiet=True, stop_after=3)
    train(cfg, part, resume=True, cache_dir=cache, quiet=True)
    assert_same_runs(run, part, 6)
    readout_without_specials(run, tiny_t5_dir)  # six steps may end every sample at once, which sample refuses
    assert main(["sample", str(run), "--steps", "4", "--num", "2", "--quiet", "--out", str(tmp_path / "s.jsonl")]) == 0


@pytest.mark.parametrize("method,options", [
    ("elf", {"skip": "gaussian", "time_scale": 1000.0, "head_modulation": True}), ("ar", {}), ("mdlm", {})])
@pytest.mark.slow
def test_samples_printed_during_training_come_from_the_ema_weights(method, options, tmp_path, tiny_t5_dir,
                                                                    tiny_corpus_file, capsys):
    """--sample-every prints samples of the EMA weights with the method's own sampler (an ELF network of the
    run's own kind, short-run options included): for ELF, the texts the saved EMA weights give through the
    loader and sampler.generate_tokens with the run's sample settings and seed."""
    from elflow.runs.load import load_for_sampling
    from elflow.sampler import generate_tokens

    run = tmp_path / "run"
    steps = {} if method == "ar" else {"sampling": {"steps": 3}}  # an autoregressive sampler takes no steps
    cfg = cfg_for(tiny_t5_dir, tiny_corpus_file, method=method, short_run=options, steps=2, ckpt_every=2,
                  sample_every=2, **steps)
    train(cfg, run, cache_dir=tmp_path / "cache", quiet=False)
    out = capsys.readouterr()
    printed = [line.split(": ", 1)[1] for line in (out.out + out.err).splitlines() if "[step 2] sample" in line]
    assert len(printed) == 2
    if method == "elf":
        net, space = load_for_sampling(run, device="cpu")
        assert net.record.sampling.steps == 3  # the previews sample as the model does
        ids, _ = generate_tokens(net, 2, 16, 3, "sde", omega=3.0, generator=torch.Generator().manual_seed(1))
        assert printed == [t[:300] for t in space.decode(ids)]


def test_the_loss_plot_labels_its_axes_names_its_lines_and_draws_the_gaussian_baseline(tmp_path):
    """Losses in 1.1-1.6 get ticks inside that range; with a held-out report the baseline is drawn; a run with a
    non-positive value gets a linear axis instead of an empty log panel."""
    import matplotlib.pyplot as plt

    from elflow.runs.log import loss_figure, plot_losses

    recs = [{"kind": "train", "step": s, "loss": 1.6 - 0.02 * s, "loss_denoise": 1.5 - 0.02 * s,
             "loss_decode": 0.1, "loss_t0.0-0.1": 1.1 + 0.001 * s, "loss_t0.3-0.5": 1.6 - 0.01 * s}
            for s in range(1, 21)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "report.json").write_text(json.dumps({"validation": {
        "baseline_loss": 1.65, "bins": [{"t": "t0.0-0.1", "baseline": 1.14}, {"t": "t0.3-0.5", "baseline": 2.37}]}}))
    fig = loss_figure(tmp_path)
    a, b = fig.axes
    assert a.get_ylabel() and b.get_ylabel() and a.get_xlabel() == b.get_xlabel() == "optimiser step"
    names = [t.get_text() for t in a.get_legend().get_texts()]
    assert names == ["total", "denoising (v-space MSE)", "denoising: Gaussian baseline (held-out)",
                     "decoding (cross-entropy)"]
    assert a.get_legend().get_texts()[0].get_fontsize() >= 9
    assert any("Gaussian baseline" in t.get_text() for t in b.get_legend().get_texts())
    assert sorted(round(line.get_ydata()[0], 2) for line in b.lines if line.get_linestyle() == "--"
                  and len(line.get_ydata())) == [1.14, 2.37]
    ticks = [t for t in b.get_yticks() if 1.1 <= t <= 1.6]
    assert b.get_yscale() == "log" and len(ticks) >= 2  # labelled ticks inside the range of the curves
    plt.close(fig)
    recs[3]["loss_decode"] = 0.0  # a value a log axis cannot show
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fig = loss_figure(tmp_path)
    assert fig.axes[0].get_yscale() == "linear" and fig.axes[1].get_yscale() == "log"
    plt.close(fig)
    plot_losses(tmp_path)
    assert (tmp_path / "loss.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_confident_readout_gradient_holds_denormals_that_training_flushes(tmp_path, tiny_t5_dir, tiny_corpus_file,
                                                                            monkeypatch):
    """The log-softmax gradient of a token at probability e^-95 (5.5e-42, below fp32's normal range) is a
    denormal; inside training it reads as zero, and the process's setting comes back afterwards."""
    import torch.nn.functional as F

    import elflow.train as T
    from elflow.util.devices import flushed_denormals

    def gradient_of_the_improbable_token():
        logits = torch.tensor([[0.0, -95.0]], requires_grad=True)
        (-F.log_softmax(logits, dim=-1)[0, 0]).backward()
        return logits.grad[0, 1].item()

    kept = gradient_of_the_improbable_token()
    exact = torch.exp(torch.tensor(-95.0, dtype=torch.float64)).item()
    assert 0 < kept < torch.finfo(torch.float32).tiny and kept == pytest.approx(exact, rel=1e-3)
    with flushed_denormals():
        assert gradient_of_the_improbable_token() == 0.0
    assert gradient_of_the_improbable_token() == kept
    seen = []
    real_loop = T.train_loop

    def probing_loop(*args, **kwargs):
        seen.append(gradient_of_the_improbable_token())
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(T, "train_loop", probing_loop)
    T.train(cfg_for(tiny_t5_dir, tiny_corpus_file), tmp_path / "run", cache_dir=tmp_path / "c", quiet=True,
            stop_after=1)
    assert seen == [0.0] and gradient_of_the_improbable_token() == kept


def test_a_new_run_that_fails_before_its_first_checkpoint_leaves_no_run(tmp_path, tiny_t5_dir, tiny_corpus_file,
                                                                       monkeypatch):
    """A fresh run refused after it wrote run.json (a bad id met in the first batch, say) takes what it wrote
    with it, so the same command can be run again; a folder holding files of other programs is refused, with
    or without --overwrite, and left as it is."""
    import elflow.train as trainer
    from elflow.util.errors import ELFError

    def refused(*a, **k):
        raise ELFError("the first batch holds an id outside the vocabulary")

    cfg = cfg_for(tiny_t5_dir, tiny_corpus_file)
    run, cache = tmp_path / "run", tmp_path / "cache"
    monkeypatch.setattr(trainer, "train_loop", refused)
    with pytest.raises(ELFError, match="outside the vocabulary"):
        train(cfg, run, cache_dir=cache, quiet=True)
    assert not run.exists()  # it made the folder, and took it with it
    monkeypatch.undo()
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ELFError, match="holds notes.txt, which a run did not write"):
            train(cfg, run, cache_dir=cache, quiet=True, overwrite=overwrite)
        assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    (run / "notes.txt").unlink()
    assert train(cfg, run, cache_dir=cache, quiet=True, stop_after=1)["end_step"] == 1
    (run / "eval").mkdir()  # what eval writes by default into a run's folder
    (run / "eval" / "report.json").write_text("{}")
    with pytest.raises(ELFError, match="holds eval, which the run did not write; --overwrite replaces only"):
        train(cfg, run, cache_dir=cache, quiet=True, overwrite=True, stop_after=1)
    assert (run / "eval" / "report.json").read_text() == "{}" and (run / "run.json").is_file()


# ---------------------------------------------------------------------------------------------------------
# the learning-rate schedule and the logged branch losses, as the authors' code has them


@pytest.mark.parametrize("kw, warmup", [(dict(warmup=3), 3),  # the other two: the slow suite's
                                        pytest.param(dict(warmup=1), 1, marks=pytest.mark.slow),
                                        pytest.param(dict(warmup_frac=0.5, lr_decay="cosine"), 3,
                                                     marks=pytest.mark.slow)])
def test_each_optimiser_step_runs_at_the_released_rate(kw, warmup, tmp_path, tiny_t5_dir, tiny_corpus_file):
    """Under accumulation (2 micro-batches a step) and across a resume, step k (from 0) runs at lr k / W in the
    warm-up (W = ceil(0.5 x 5) = 3 for the fraction), then lr or the cosine to 0 at the last step; the first step
    at rate 0 leaves the weights where they started, so the EMA equals them."""
    import math

    lr, steps = 3e-3, 5
    cfg = cfg_for(tiny_t5_dir, tiny_corpus_file, steps=steps, lr=lr, batch=4, micro_batch=2, ckpt_every=1, **kw)
    run, cache = tmp_path / "run", tmp_path / "cache"
    train(cfg, run, cache_dir=cache, quiet=True, stop_after=2)
    train(cfg, run, resume=True, cache_dir=cache, quiet=True)

    def want(k):
        if k < warmup:
            return lr * k / warmup
        if cfg.lr_decay == "constant":
            return lr
        return lr * (1 + math.cos(math.pi * min(1.0, (k - warmup) / (steps - warmup)))) / 2

    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert [r["lr"] for r in recs if r["kind"] == "train"] == pytest.approx([want(k) for k in range(steps)], abs=1e-15)
    weights, ema = final_weights(run, 1)
    assert_same(weights, ema, "step 1")  # nothing moved at step 0's rate of 0
    assert not all(torch.equal(a, b) for a, b in zip(*(w.values() for w in final_weights(run, 2))))


def test_a_run_of_the_earlier_schedule_keeps_it(tmp_path, tiny_t5_dir, tiny_corpus_file):
    """A run recorded with the one-ahead warm-up steps at lr (k + 1) / W, its first step moving the weights."""
    cfg = cfg_for(tiny_t5_dir, tiny_corpus_file, steps=3, lr=3e-3, warmup=2, ckpt_every=1,
                  lr_schedule="one-ahead")
    run = tmp_path / "run"
    train(cfg, run, cache_dir=tmp_path / "cache", quiet=True)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in recs if r["kind"] == "train"] == pytest.approx([1.5e-3, 3e-3, 3e-3], abs=1e-15)
    weights, ema = final_weights(run, 1)
    assert any(not torch.equal(weights[k], ema[k]) for k in weights)


def test_the_branch_losses_are_token_means_over_the_step():
    """loss_denoise / loss_decode: one token mean over the scored positions of the branch's rows (the authors'
    l2_loss and ce_loss), on rows of unequal lengths over two shards; the mean of the rows' means apart."""
    from types import SimpleNamespace

    from elflow.flow import token_mean_loss
    from elflow.methods.elf import ELFMethod, step_sums

    torch.manual_seed(0)
    B, L, V = 5, 6, 7
    lengths = [6, 2, 4, 3, 5]  # scored positions per row
    w = torch.tensor([[1.0] * n + [0.0] * (L - n) for n in lengths])
    err = torch.rand(B, L)
    tokens = torch.randint(V, (B, L))
    is_dec = torch.tensor([False, True, False, True, False])
    dec = is_dec.nonzero().squeeze(1)
    logits = torch.randn(len(dec), L, V)
    draw = SimpleNamespace(decode=is_dec, t=torch.tensor([0.05, 1.0, 0.4, 1.0, 0.7]))
    totals = {}
    for rows in (slice(0, 3), slice(3, 5)):  # two micro-batches of one step
        sub = is_dec[rows]
        sub_dec = sub.nonzero().squeeze(1)
        loss, parts = token_mean_loss(err[rows], logits[(dec >= rows.start) & (dec < rows.stop)], tokens[rows], sub,
                                      sub_dec, w[rows])
        sums = step_sums(loss, parts, SimpleNamespace(decode=sub, t=draw.t[rows]))
        totals = {k: totals[k] + v if k in totals else v for k, v in sums.items()}
    rec = ELFMethod().summarize({k: v.item() if v.numel() == 1 else v.tolist() for k, v in totals.items()})

    # by hand: the denoise rows 0, 2, 4 score 6 + 4 + 5 positions, the decode rows 1 and 3 score 2 + 3
    den_sum = sum(float(err[r, :lengths[r]].sum()) for r in (0, 2, 4))
    assert rec["loss_denoise"] == pytest.approx(den_sum / 15, rel=1e-6)
    assert rec["loss_denoise_rows"] == pytest.approx(
        sum(float(err[r, :lengths[r]].mean()) for r in (0, 2, 4)) / 3, rel=1e-6)
    ce = [-torch.log_softmax(logits[i], -1)[torch.arange(L), tokens[r]] for i, r in enumerate((1, 3))]
    ce_sums = [float(ce[0][:2].sum()), float(ce[1][:3].sum())]
    assert rec["loss_decode"] == pytest.approx(sum(ce_sums) / 5, rel=1e-6)
    assert rec["loss_decode_rows"] == pytest.approx((ce_sums[0] / 2 + ce_sums[1] / 3) / 2, rel=1e-6)
    assert rec["loss_denoise"] != pytest.approx(rec["loss_denoise_rows"], rel=1e-3)  # unequal lengths tell them apart

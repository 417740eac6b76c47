"""The AR and MDLM baselines in ELF's harness: `elflow train --method`, exact resume, torchrun, the loader,
`elflow sample` / `eval` / `sweep` on their runs, the one-line refusals, and `elflow compare` end to end."""

import json
from pathlib import Path

import pytest
import torch
from helpers import checkpoint_weights, run_alone_and_on_two_ranks, tiny_config
from safetensors.torch import load_file

from elflow.cli import main
from elflow.config import TrainConfig
from elflow.methods import ar, mdlm
from elflow.methods.token_net import TokenLMConfig
from elflow.model import ELF, get_config, num_params
from elflow.runs.checkpoint import list_checkpoints
from elflow.runs.load import load_for_sampling, load_init_weights
from elflow.runs.record import RunRecord
from elflow.train import train
from elflow.util.errors import ELFError

MODULES = {"ar": ar, "mdlm": mdlm}


def cfg_for(t5_dir, corpus, **kw):
    return tiny_config(t5_dir, corpus, **{"steps": 4, "ckpt_every": 2, **kw})


weights = checkpoint_weights


@pytest.fixture(scope="module")
def baseline_runs(tmp_path_factory, tiny_t5_dir, tiny_corpus_file, cache):
    """An uninterrupted 4-step run of each baseline."""
    out = {}
    for method in ("ar", "mdlm"):
        out[method] = tmp_path_factory.mktemp(method) / "run"
        train(cfg_for(tiny_t5_dir, tiny_corpus_file, method=method), out[method], cache_dir=cache, quiet=True)
    return out


@pytest.fixture(scope="module")
def judge_dir(tiny_t5_judge_dir):
    return tiny_t5_judge_dir


# ----------------------------------------------------------------------------------------------------------
# training


@pytest.mark.parametrize("method", ["ar", "mdlm"])
def test_a_baseline_run_records_its_method_shape_and_matched_size(baseline_runs, method, tiny_t5_dir):
    run = baseline_runs[method]
    meta, settings = (json.loads((run / "run.json").read_text())[k] for k in ("record", "train"))
    state = json.loads((run / "checkpoints" / "step_0000004" / "state.json").read_text())
    assert meta["method"] == method and "method" not in settings  # stored once: the record's
    assert "record" not in state and state["model_sha256"] == RunRecord.from_dict(meta).digest()
    shape = TokenLMConfig(**meta["network"])
    net = MODULES[method].build(shape, type("V", (), {"vocab_size": 300})())
    elf = get_config("tiny", dim=32, vocab_size=300, max_length=16)  # the tiny T5's width and vocabulary
    with torch.device("meta"):
        target = ELF(elf).num_params()
    assert meta["params"] == {"model": num_params(net), "elf": target, "match": "total"}
    assert abs(num_params(net) - target) / target <= 0.05
    assert meta["space"]["kind"] == "tokens" and meta["space"]["of"]["name"] == str(tiny_t5_dir)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and all(r["loss_per_token"] > 0 for r in recs)


@pytest.mark.parametrize("method", ["ar", "mdlm"])
def test_an_interrupted_then_resumed_baseline_run_equals_an_uninterrupted_one(baseline_runs, method, tmp_path,
                                                                              tiny_t5_dir, tiny_corpus_file, cache):
    run = tmp_path / "run"
    cfg = cfg_for(tiny_t5_dir, tiny_corpus_file, method=method)
    train(cfg, run, cache_dir=cache, quiet=True, stop_after=2)
    assert [p.name for p in list_checkpoints(run)] == ["step_0000002"]
    assert train(cfg, run, resume=True, cache_dir=cache, quiet=True)["start_step"] == 2
    for a, b in zip(weights(run, 4), weights(baseline_runs[method], 4)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    before = weights(baseline_runs[method], 2)[0]  # and the run did move
    assert any(not torch.equal(before[k], weights(run, 4)[0][k]) for k in before)


def test_a_time_limit_ends_the_run_with_a_checkpoint(tmp_path, tiny_t5_dir, tiny_corpus_file, cache):
    run = tmp_path / "run"
    summary = train(cfg_for(tiny_t5_dir, tiny_corpus_file, method="ar", steps=500, ckpt_every=100), run,
                    cache_dir=cache, quiet=True, time_limit=1e-9)
    assert summary["end_step"] == 1 and [p.name for p in list_checkpoints(run)] == ["step_0000001"]


@pytest.mark.slow
def test_two_gloo_ranks_train_a_baseline_as_one_process(tmp_path, tiny_t5_dir, tiny_corpus_file, cache):
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--method", "mdlm", "--preset", "tiny", "--data", str(tiny_corpus_file), "--space", f"t5:{tiny_t5_dir}",
              "--length", "16", "--batch", "4", "--micro-batch", "2", "--steps", "2", "--warmup", "1",
              "--log-every", "1", "--ckpt-every", "2", "--dtype", "fp32", "--seed", "2", "--cache-dir", str(cache)]
    run_alone_and_on_two_ranks(["train", *common], one, two)
    for a, b in zip(weights(one, 2), weights(two, 2)):
        assert all(torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4) for k in a)


def test_the_optimiser_takes_adam_parameters_by_name():
    from elflow.optim import ELFOptimizer

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = ELFOptimizer(net.named_parameters(), lr=1e-3, adam=["1.weight"])
    assert opt.muon_names == ["0.weight"]
    assert sorted(opt.adam_names) == ["0.bias", "1.bias", "1.weight"]


# ----------------------------------------------------------------------------------------------------------
# loading and sampling


def test_the_loader_builds_the_baseline_from_its_ema_weights(baseline_runs):
    net, space = load_for_sampling(baseline_runs["ar"], device="cpu")
    assert net.record.method == "ar" and isinstance(net, torch.nn.Module) and space.vocab_size == 300
    ema = load_file(baseline_runs["ar"] / "checkpoints" / "step_0000004" / "ema.safetensors")
    assert all(torch.equal(v, ema[k]) for k, v in net.state_dict().items() if k in ema)
    assert set(ema) == {k for k, _ in net.named_parameters()}


@pytest.mark.parametrize("method,flags", [("ar", ["--temperature", "0.8", "--top-p", "0.9"]),
                                          ("mdlm", ["--steps", "4"])])
def test_sample_cli_draws_with_the_baselines_own_sampler(baseline_runs, method, flags, tmp_path, tiny_t5_dir):
    from transformers import AutoTokenizer

    out = tmp_path / "s.jsonl"
    assert main(["sample", str(baseline_runs[method]), *flags, "--num", "3", "--seed", "5", "--quiet", "--out",
                 str(out)]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2] and all(r["method"] == method and r["seed"] == 5 for r in recs)
    # the same draws by hand: the EMA weights, the module's sampler, the generator of batch 0 of seed 5 (seeded
    # 5 x 100,003 + 0, as every sampler seeds its batches: generate.generation_batches), the tokenizer
    stored = json.loads((baseline_runs[method] / "run.json").read_text())
    module = MODULES[method]
    net = module.build(TokenLMConfig(**stored["record"]["network"]), type("V", (), {"vocab_size": 300})())
    net.load_state_dict(load_file(baseline_runs[method] / "checkpoints" / "step_0000004" / "ema.safetensors"))
    settings = (ar.ARSampling(temperature=0.8, top_p=0.9) if method == "ar" else mdlm.MDLMSampling(steps=4))
    ids = module.generate_tokens(net.eval(), 3, 16, settings, torch.Generator().manual_seed(5 * 100_003)).tolist()
    tok = AutoTokenizer.from_pretrained(tiny_t5_dir)
    texts = tok.batch_decode([row[: row.index(1)] if 1 in row else row for row in ids], skip_special_tokens=True)
    assert [r["text"] for r in recs] == texts


def one_line_error(capsys, argv, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "error" in err and all(w in err for w in words), err


def test_elf_only_uses_of_a_baseline_are_one_line_errors(baseline_runs, capsys, tmp_path, tiny_t5_dir, tiny_corpus_file,
                                                         cache):
    a, m = str(baseline_runs["ar"]), str(baseline_runs["mdlm"])
    out = str(tmp_path / "x.jsonl")
    one_line_error(capsys, ["sample", a, "--prompt", "the king", "--out", out], "--prompt", "ELF model")
    one_line_error(capsys, ["sample", m, "--suffix", "the end", "--out", out], "--suffix", "ELF model")
    one_line_error(capsys, ["sample", a, "--omega", "2", "--out", out], "--omega", "--temperature")
    one_line_error(capsys, ["sample", a, "--steps", "4", "--out", out], "--steps")
    one_line_error(capsys, ["sample", m, "--top-p", "0.5", "--out", out], "--top-p")
    one_line_error(capsys, ["distill", a, "--out", str(tmp_path / "d"), "--steps-per-round", "1"], "AR", "ELF model")
    one_line_error(capsys, ["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--space",
                            f"t5:{tiny_t5_dir}", "--length", "16", "--batch", "4", "--steps", "1", "--warmup", "1", "--init-from", a,
                            "--out", str(tmp_path / "i"), "--cache-dir", str(cache), "--quiet"], "ELF model")
    one_line_error(capsys, ["train", "--method", "ar", "--source-length", "4", "--out", str(tmp_path / "j")],
                   "--source-length", "ELF")
    assert not list(tmp_path.glob("x.jsonl"))
    with pytest.raises(ELFError, match="AR baseline"):
        load_init_weights(a)


def test_an_unknown_method_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--method", "gpt"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(name in err for name in ("elf", "ar", "mdlm"))
    with pytest.raises(ELFError) as e:
        TrainConfig(method="gpt").validate()
    assert "\n" not in str(e.value) and all(name in str(e.value) for name in ("elf", "ar", "mdlm"))


def test_eval_judges_a_baselines_samples(baseline_runs, judge_dir, tmp_path):
    from elflow.eval.judge import load_judge
    from elflow.eval.metrics import generative_perplexity, read_texts

    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(baseline_runs["mdlm"]), "--steps", "4", "--num", "3", "--judge",
                 str(judge_dir), "--out", str(out), "--device", "cpu", "--json"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "mdlm" and report["steps"] == 4
    texts = read_texts(out / "samples_seed0.jsonl")
    assert len(texts) == 3
    expected = generative_perplexity(texts, *load_judge(judge_dir, device="cpu"))
    assert report["gen_ppl"] == pytest.approx(expected["gen_ppl"]) and report["entropy"] == pytest.approx(
        expected["entropy"])


def test_sweep_runs_an_ar_models_temperatures(baseline_runs, judge_dir, tmp_path, capsys):
    from elflow.experiments.sweep import read_csv

    out = tmp_path / "sweep"
    assert main(["sweep", str(baseline_runs["ar"]), "--temperature", "0.8", "1", "--num", "2", "--judge",
                 str(judge_dir), "--device", "cpu", "--out", str(out)]) == 0
    rows = read_csv(out / "sweep.csv")
    assert [(r["method"], r["temperature"], r["top_p"]) for r in rows] == [("ar", 0.8, 1.0), ("ar", 1.0, 1.0)]
    assert (out / "tradeoff.png").exists()
    # a cell's samples are `elflow sample`'s at the same settings and seed
    assert main(["sample", str(baseline_runs["ar"]), "--temperature", "1", "--num", "2", "--quiet",
                 "--out", str(tmp_path / "s.jsonl")]) == 0
    cell = [json.loads(x)["text"] for x in (out / "samples" / "ar_temperature1_topp1_seed0.jsonl").read_text().splitlines()]
    assert cell == [json.loads(x)["text"] for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    capsys.readouterr()
    one_line_error(capsys, ["sweep", str(baseline_runs["ar"]), "--omega", "1", "--judge", str(judge_dir), "--out",
                            str(tmp_path / "w")], "--omega", "--temperature")


# ----------------------------------------------------------------------------------------------------------
# elflow compare


@pytest.mark.slow
def test_compare_cli_end_to_end(tmp_path, tiny_t5_dir, tiny_corpus_file, judge_dir, cache, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--preset", "tiny", "--space", f"t5:{tiny_t5_dir}", "--data", str(tiny_corpus_file),
            "--length", "16", "--batch", "4", "--steps", "2", "--num", "2", "--elf-steps", "2", "--omega", "1",
            "--temperature", "1", "--mdlm-steps", "2", "--judge", str(judge_dir), "--out", str(out),
            "--cache-dir", str(cache), "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "compare.json").read_text())
    assert res["budget"] == {"steps": 2}
    assert [r["method"] for r in res["rows"]] == ["elf", "ar", "mdlm", "held-out text"]
    for name in ("elf", "ar", "mdlm"):
        m = res["methods"][name]
        assert m["steps"] == 2 and m["tokens"] == 2 * 4 * 16
        assert abs(m["params"] - m["elf_params"]) / m["elf_params"] <= 0.05
        assert json.loads((out / name / "run.json").read_text())["record"]["method"] == name
    assert res["methods"]["elf"]["params"] == res["methods"]["elf"]["elf_params"]
    assert "judge ppl" in printed and "held-out text" in printed and (out / "compare.png").exists()
    one_line_error(capsys, argv, "already holds a comparison")  # never silently overwritten


def test_the_default_judge_is_trained_once_and_kept(tmp_path, monkeypatch):
    import elflow.experiments.compare as compare_module
    from elflow.experiments.compare import cached_judge

    calls = []

    def fake_train(out, cfg, documents=None, **kw):
        calls.append(list(documents))
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")

    monkeypatch.setattr(compare_module, "train_judge", fake_train)
    a = cached_judge(["one text", "two"], tmp_path, printer=lambda m: None, steps=3)
    assert cached_judge(["one text", "two"], tmp_path, printer=lambda m: None, steps=3) == a
    assert calls == [["one text", "two"]] and (a / "config.json").exists()
    b = cached_judge(["another text"], tmp_path, printer=lambda m: None, steps=3)
    c = cached_judge(["one text", "two"], tmp_path, printer=lambda m: None, steps=4)
    assert len({a, b, c}) == 3 and len(calls) == 3
    assert not list((tmp_path / "judges").glob(".tmp-*"))

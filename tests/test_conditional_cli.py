"""Conditional sampling and scoring from the command line, and prompt continuation / infilling, on tiny models:
a local authors'-format conditional checkpoint read with a local tiny T5 (as the released ELF-B-de-en-torch
would be read with t5-small), and a tiny elflow run."""

import json

import pytest
import torch

from elflow.checkpoint import load, load_for_sampling
from elflow.cli import main
from elflow.model import ELF, get_config
from elflow.official import elflow_to_official

SOURCES = ["the king of love", "sweet night and the lord", "good heart"]


@pytest.fixture(scope="module")
def cond_release(tmp_path_factory):
    """A random tiny network saved as the authors save a conditional model: their keys, a checkpoint_<step>
    dict with params and ema_params1, and a config.json with the layout (L 16, source 8)."""
    folder = tmp_path_factory.mktemp("hub") / "ELF-B-de-en-torch"
    folder.mkdir()
    torch.manual_seed(0)
    net = ELF(get_config("tiny", dim=32, vocab_size=300, max_length=16))
    torch.nn.init.normal_(net.x_head.weight, std=0.2)
    theirs = elflow_to_official(net.state_dict())
    torch.save({"params": theirs, "ema_params1": theirs, "step": 3}, folder / "checkpoint_3")
    (folder / "config.json").write_text(json.dumps({"max_length": 16, "max_input_length": 8}))
    return folder


def test_a_released_conditional_model_knows_its_layout_and_defaults(cond_release, tiny_t5_dir):
    loaded = load(cond_release)
    assert loaded.conditional and loaded.settings["source_length"] == 8 and loaded.settings["length"] == 16
    assert loaded.settings["sampling"] == {"sampler": "ode", "steps": 64, "guidance": 2.0, "omega": 1.0,
                                           "gamma": 0.0}
    _, space = load_for_sampling(cond_release, space=str(tiny_t5_dir))
    assert space.dim == 32 and space.scale == pytest.approx(0.2)


def test_sample_source_writes_source_text_and_reference(cond_release, tiny_t5_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"input": s, "output": s.upper()}) + "\n" for s in SOURCES))
    out = tmp_path / "out.jsonl"
    args = ["sample", str(cond_release), "--encoder", str(tiny_t5_dir), "--source", str(pairs), "--steps", "3",
            "--quiet", "--out", str(out)]
    assert main(args) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["source"] for r in recs] == SOURCES and [r["reference"] for r in recs] == [s.upper() for s in SOURCES]
    assert all(isinstance(r["text"], str) and r["sampler"] == "ode" and r["guidance"] == 2.0 for r in recs)
    assert main(args) == 2  # an existing output is refused
    assert main(args + ["--overwrite", "--guidance", "1", "--omega", "3"]) == 0
    assert json.loads(out.read_text().splitlines()[0])["guidance"] == 1.0
    # one source text instead of a file
    assert main(["sample", str(cond_release), "--encoder", str(tiny_t5_dir), "--source", "the king", "--steps",
                 "2", "--quiet", "--out", str(tmp_path / "one.jsonl")]) == 0
    assert len((tmp_path / "one.jsonl").read_text().splitlines()) == 1


def test_eval_task_file_scores_bleu_and_rouge(cond_release, tiny_t5_dir, tmp_path):
    pairs = tmp_path / "val.jsonl"
    pairs.write_text("".join(json.dumps({"input": s, "output": s}) + "\n" for s in SOURCES))
    report = tmp_path / "r.json"
    base = ["eval", "--task", str(pairs), "--checkpoint", str(cond_release), "--encoder", str(tiny_t5_dir),
            "--steps", "2", "--out", str(tmp_path / "ev"), "--json"]
    assert main(base + ["--report", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["metric"] == "bleu" and r["num_examples"] == 3 and 0.0 <= r["bleu"] <= 100.0
    assert r["guidance"] == 2.0 and r["sampler"] == "ode" and r["steps"] == 2
    samples = [json.loads(x) for x in (tmp_path / "ev" / "val.samples.jsonl").read_text().splitlines()]
    from elflow.evaluate import bleu
    assert r["bleu"] == pytest.approx(bleu([s["text"] for s in samples], SOURCES))  # the score of what was written
    assert main(base + ["--report", str(tmp_path / "r2.json"), "--metric", "rouge", "--overwrite"]) == 0
    r2 = json.loads((tmp_path / "r2.json").read_text())
    assert {"rouge1", "rouge2", "rougeL"} <= set(r2)


def test_conditional_bad_input_is_one_line(cond_release, tiny_t5_dir, tmp_path, capsys):
    enc = ["--encoder", str(tiny_t5_dir)]
    cases = [
        (["sample", str(cond_release), *enc, "--prompt", "the king", "--out", str(tmp_path / "a.jsonl")],
         "pass --source"),
        (["sample", str(cond_release), *enc, "--source", "x", "--guidance", "-1", "--out", str(tmp_path / "b.jsonl")],
         "guidance must be"),
        (["sample", str(cond_release), *enc, "--source", "x", "--guidance", "nan", "--out",
          str(tmp_path / "c.jsonl")], "guidance must be"),
        (["eval", "--task", "nope", "--checkpoint", str(cond_release)], "unknown --task"),
    ]
    for args, message in cases:
        capsys.readouterr()
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def uncond_run(tmp_path_factory, tiny_t5_dir, tiny_corpus_file):
    from elflow.train import TrainConfig, train

    run = tmp_path_factory.mktemp("uncond") / "run"
    cfg = TrainConfig(preset="tiny", data=str(tiny_corpus_file), space=f"t5:{tiny_t5_dir}", length=16, batch=4,
                      steps=2, warmup=1, ema_decay=0.9, log_every=1, ckpt_every=2, dtype="fp32", seed=1)
    train(cfg, run, cache_dir=tmp_path_factory.mktemp("cache"), quiet=True)
    return run


def test_prompt_and_suffix_come_back_unchanged_and_the_rest_varies(uncond_run, tmp_path):
    from elflow.generate import SamplingSettings, generate

    loaded, space = load_for_sampling(uncond_run, device="cpu")
    prompt, suffix = "the king of", "sweet night"
    head = space.tokenizer.decode(space.tokenize([prompt], eos=False)[0])
    tail = space.tokenizer.decode(space.tokenize([suffix], eos=False)[0])
    texts = {}
    for seed in (0, 1):
        recs = generate(loaded.net, space, 4, SamplingSettings(steps=3, seed=seed), prompt=prompt, suffix=suffix,
                        progress=False)
        texts[seed] = [r["text"] for r in recs]
        assert all(t.startswith(head) and t.endswith(tail) for t in texts[seed]), texts[seed]
    assert texts[0] != texts[1]
    # the same through the CLI, and the errors
    out = tmp_path / "p.jsonl"
    assert main(["sample", str(uncond_run), "--prompt", prompt, "--steps", "2", "--num", "2", "--quiet",
                 "--out", str(out)]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(r["text"].startswith(head) and r["prompt"] == prompt for r in recs)
    assert main(["sample", str(uncond_run), "--source", "x", "--out", str(tmp_path / "s.jsonl")]) == 2
    assert main(["sample", str(uncond_run), "--prompt", "the king " * 20, "--out", str(tmp_path / "l.jsonl")]) == 2


def test_known_positions_are_encoded_from_known_tokens_only(uncond_run):
    """Known tokens attend only to known tokens: what fills the other positions cannot change them."""
    from elflow.generate import conditioning

    _, space = load_for_sampling(uncond_run, device="cpu")
    ids, mask, known = conditioning(space, 16, 2, prompt="the king of love")
    n = int(mask[0].sum())
    alone = space.encode(ids[:1, :n])[0]
    torch.testing.assert_close(known[0, :n], alone, atol=1e-5, rtol=1e-5)
    assert torch.all(known[:, n:] == 0)

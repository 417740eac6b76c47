"""Conditional sampling and scoring from the command line, and prompt continuation / infilling, on tiny models:
a local authors'-format conditional checkpoint read with a local tiny T5 (as the released ELF-B-de-en-torch
would be read with t5-small), and a tiny elflow run."""

import json

import pytest
import torch
from helpers import elflow_to_official

from elflow.cli import main
from elflow.model import ELF, get_config
from elflow.runs.load import load, load_for_sampling
from elflow.util.errors import ELFError

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
    record = load(cond_release).record
    assert record.conditional and record.task.source_length == 8 and record.length == 16
    s = record.sampling
    assert (s.sampler, s.steps, s.guidance, s.omega, s.gamma) == ("ode", 64, 2.0, 1.0, 0.0)
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
    from elflow.eval.metrics import bleu
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
    from elflow.config import TrainConfig
    from elflow.train import train

    run = tmp_path_factory.mktemp("uncond") / "run"
    cfg = TrainConfig(preset="tiny", data=str(tiny_corpus_file), space=f"t5:{tiny_t5_dir}", length=16, batch=4,
                      steps=2, warmup=0, ema_decay=0.9, log_every=1, ckpt_every=2, dtype="fp32", seed=1)
    train(cfg, run, cache_dir=tmp_path_factory.mktemp("cache"), quiet=True)  # no warm-up: both steps at full rate
    return run


def test_prompt_and_suffix_come_back_unchanged_and_the_rest_varies(uncond_run, tmp_path):
    from elflow.generate import SamplingSettings, generate

    net, space = load_for_sampling(uncond_run, device="cpu")
    prompt, suffix = "the king of", "sweet night"
    head = space.tokenizer.decode(space.tokenize([prompt], eos=False)[0])
    tail = space.tokenizer.decode(space.tokenize([suffix], eos=False)[0])
    texts = {}
    for seed in (0, 1):
        recs = generate(net, space, 4, SamplingSettings(steps=3, seed=seed), prompt=prompt, suffix=suffix,
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


@pytest.fixture(scope="module")
def cond_run(tmp_path_factory, tiny_t5_dir):
    """A tiny conditional model trained from the command line on a .jsonl of {input, output} pairs."""
    root = tmp_path_factory.mktemp("cond")
    pairs = root / "pairs.jsonl"
    rows = [{"input": f"{a} {b}", "output": f"{b} {a}"} for a in ("king", "love", "night", "lord", "heart")
            for b in ("sweet", "good", "old", "great", "little", "long")]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = root / "run"
    assert main(["train", "--preset", "tiny", "--space", f"t5:{tiny_t5_dir}", "--data", str(pairs),
                 "--source-length", "6", "--length", "16", "--batch", "4", "--steps", "3", "--warmup", "1",
                 "--dtype", "fp32", "--ckpt-every", "3", "--out", str(run), "--cache-dir", str(root / "cache"),
                 "--quiet"]) == 0
    return run, pairs


def test_a_model_trained_on_pairs_is_conditional_and_samples_from_sources(cond_run, tmp_path):
    run, pairs = cond_run
    record = load(run).record
    assert record.conditional and record.task.source_length == 6 and record.length == 16
    assert record.sampling.guidance == 2.0
    stored = json.loads((run / "run.json").read_text())["record"]
    assert stored["task"]["source_length"] == 6 and stored["task"]["source_field"] == "input"
    out = tmp_path / "s.jsonl"
    assert main(["sample", str(run), "--source", str(pairs), "--steps", "2", "--quiet", "--out", str(out)]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 30 and recs[0]["source"] == "king sweet" and recs[0]["reference"] == "sweet king"
    report = tmp_path / "bleu.json"
    assert main(["eval", "--task", str(pairs), "--checkpoint", str(run), "--steps", "2", "--num", "5",
                 "--out", str(tmp_path / "ev"), "--report", str(report), "--json"]) == 0
    assert json.loads(report.read_text())["num_examples"] == 5


def test_a_dropped_rows_target_encodings_ignore_its_source(tiny_t5_dir):
    from elflow.data.layout import encoder_mask, pair_layout
    from elflow.space import build_space

    space = build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": 0.5})
    tgt = space.tokenize(["sweet night"], eos=False)
    srcs = [space.tokenize([s], eos=False)[0] for s in ("the king of love", "good heart")]
    lays = [pair_layout([s], tgt, 16, 8, space.pad_id) for s in srcs]
    drop = torch.tensor([True])
    xs = [space.encode(l["ids"], encoder_mask(l["source_mask"], l["valid"], drop))[0] for l in lays]
    kept = [space.encode(l["ids"], l["encoder_mask"])[0] for l in lays]
    n0, n1 = (int(l["source_mask"].sum()) for l in lays)
    t = len(tgt[0])
    # dropped: the target's encodings are the same whatever the source says
    torch.testing.assert_close(xs[0][n0:n0 + t], xs[1][n1:n1 + t], atol=1e-5, rtol=1e-5)
    # kept: they depend on it
    assert not torch.allclose(kept[0][n0:n0 + t], kept[1][n1:n1 + t], atol=1e-4)


def test_shuffled_line_pairs_keep_the_words_and_hold_out_every_nth_line():
    from elflow.data.tasks import shuffled_line_pairs

    docs = ["one two three four\nshort\n" + "\n".join(f"w{i} a b c d" for i in range(9))]
    train, held = shuffled_line_pairs(docs, min_words=4, max_words=6, every=5, seed=3)
    assert len(train) + len(held) == 10 and len(held) == 2  # "short" is left out
    for src, tgt in train + held:
        assert sorted(src.split()) == sorted(tgt.split())
    assert held[0][1] == "w3 a b c d"  # the 5th kept line
    assert shuffled_line_pairs(docs, 4, 6, 5, seed=3) == (train, held)
    assert any(s != t for s, t in train)


def test_conditional_report_scores_copy_dropped_and_guided(cond_run):
    from elflow.eval.metrics import bleu
    from elflow.experiments.quickstart import conditional_report

    run, pairs = cond_run
    held = [(r["input"], r["output"]) for r in map(json.loads, pairs.read_text().splitlines())][:4]
    lines = []
    out = conditional_report(run, held, num=4, steps=2, printer=lines.append)
    names = [r["model"] for r in out["rows"]]
    assert names == ["copy the source", "source dropped (guidance 0)", "guidance 1", "guidance 2"]
    assert out["rows"][0]["bleu"] == pytest.approx(bleu([s for s, _ in held], [t for _, t in held]))
    assert [r["guidance"] for r in out["rows"][1:]] == [0.0, 1.0, 2.0]
    g2 = [json.loads(x) for x in (run / "samples_guidance2.jsonl").read_text().splitlines()]
    assert out["rows"][3]["bleu"] == pytest.approx(bleu([r["text"] for r in g2], [t for _, t in held]))
    assert any("guidance 2" in line for line in lines)


@pytest.mark.slow
def test_a_released_distilled_model_samples_with_the_few_step_defaults(tmp_path, tiny_t5_dir):
    folder = tmp_path / "ELF-B-PD-owt-torch"
    folder.mkdir()
    torch.manual_seed(0)
    net = ELF(get_config("tiny", dim=32, vocab_size=300, max_length=16))
    theirs = elflow_to_official(net.state_dict())
    torch.save({"params": theirs, "ema_params1": theirs, "step": 1}, folder / "checkpoint_1")
    (folder / "config.json").write_text(json.dumps({"max_length": 16}))
    for steps, (gamma, omega) in ((None, (1.5, 2.5)), (1, (1.5, 2.5)), (4, (1.5, 2.5)), (16, (2.0, 2.0)),
                                  (32, (2.0, 2.0))):
        out = tmp_path / f"s{steps}.jsonl"
        extra = [] if steps is None else ["--steps", str(steps)]
        assert main(["sample", str(folder), "--encoder", str(tiny_t5_dir), "--num", "1", "--quiet",
                     "--out", str(out), *extra]) == 0
        rec = json.loads(out.read_text())
        assert (rec["sampler"], rec["gamma"], rec["omega"]) == ("sde", gamma, omega)
        assert rec["steps"] == (steps or 8)


def test_sampling_starts_from_the_noise_scale_the_model_was_trained_with(uncond_run):
    """A model trained with another noise scale samples from z0 = noise_scale N(0, 1) with its own scale: the
    recipe of its record."""
    import elflow.sampler as sampler

    net, space = load_for_sampling(uncond_run, device="cpu")
    assert net.record.recipe.noise_scale == 2.0
    net.record = net.record.replace(recipe=net.record.recipe.replace(noise_scale=1.0))
    s = net.record.sampling_settings(steps=2)
    seen = {}
    real = sampler.integrate

    def spy(net, z0, grid, **kw):
        seen["std"], seen["scale"] = z0.std().item(), kw["recipe"].noise_scale
        return real(net, z0, grid, **kw)

    sampler.integrate, saved = spy, sampler.integrate
    try:
        from elflow.generate import generate

        generate(net, space, 8, s, progress=False)
    finally:
        sampler.integrate = saved
    assert seen["scale"] == 1.0 and 0.8 < seen["std"] < 1.2


@pytest.mark.slow
def test_a_conditional_teacher_distils_into_conditional_students(cond_run, tmp_path):
    from elflow import distill

    run, pairs = cond_run
    rounds = distill.distill(run, tmp_path / "pd", student_steps=[2, 1], teacher_steps=2, steps_per_round=2,
                             ckpt_every=2, dtype="fp32", seed=1, quiet=True)
    student = load(rounds[1]).record
    assert student.conditional and student.task.source_length == 6
    assert student.distillation.student_steps == 1
    out = tmp_path / "s.jsonl"
    assert main(["sample", str(rounds[1]), "--source", str(pairs), "--quiet", "--out", str(out)]) == 0
    rec = json.loads(out.read_text().splitlines()[0])
    assert rec["source"] == "king sweet" and rec["steps"] == 1 and rec["gamma"] == 1.5 and rec["omega"] == 2.5


@pytest.mark.slow
def test_quickstart_conditional_trains_in_stages_and_draws_its_bleu_curve(tmp_path):
    """The conditional demonstration on the built-in corpus, a few steps: a BLEU point after each quarter of
    the run (the last one equal to the report's guidance-2 BLEU on the same lines, measured by another path),
    the copy task's copying baseline exact, the fixed source slot and the released network (no short-run
    option) stored with the model, and bleu.png."""
    from helpers import MISSING_DATA

    from elflow.data.corpus import read_documents
    from elflow.model import ShortRunOptions

    try:
        read_documents("builtin")
    except ELFError as e:
        pytest.skip(f"{MISSING_DATA}: the built-in corpus ({e})")
    out = tmp_path / "cond"
    assert main(["quickstart", "--conditional", "--steps", "4", "--batch", "2", "--num", "3", "--curve-num", "3",
                 "--sample-steps", "2", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["task"] == "copy" and [c["step"] for c in report["curve"]] == [1, 2, 3, 4]
    rows = {r["model"]: r["bleu"] for r in report["rows"]}
    assert rows["copy the source"] == pytest.approx(100.0)
    assert report["curve"][-1]["bleu"] == pytest.approx(rows["guidance 2"])
    stored = json.loads((out / "run.json").read_text())["record"]
    assert stored["task"]["source_slot"] == "fixed" and not ShortRunOptions.from_dict(stored.get("options", {})).active
    assert (out / "bleu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # run again with --resume: the run is finished, so nothing is trained or measured again
    curve = (out / "curve.json").read_text()
    assert main(["quickstart", "--conditional", "--steps", "4", "--batch", "2", "--num", "3", "--curve-num", "3",
                 "--sample-steps", "2", "--out", str(out), "--resume"]) == 0
    assert (out / "curve.json").read_text() == curve

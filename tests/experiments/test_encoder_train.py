"""`elflow train-encoder`: span corruption as T5 defines it, and a trained encoder that is a space."""

import json

import numpy as np
import pytest
import torch

from elflow.experiments.encoder_train import corrupt_spans, span_noise_mask


@pytest.mark.parametrize("length,density,span", [(64, 0.15, 3.0), (20, 0.3, 2.0), (9, 0.15, 3.0)])
def test_span_corruption_hides_the_share_asked_and_its_pair_gives_the_window_back(length, density, span):
    """The mask has round(L x density) noise tokens in round(noise / span) spans, starting with kept tokens;
    the window is rebuilt exactly from (input, target) by putting each sentinel's tokens back in its place."""
    rng = np.random.default_rng(0)
    sentinels = list(range(1000, 900, -1))
    for _ in range(20):
        ids = rng.integers(3, 500, length)
        mask = span_noise_mask(length, density, span, rng)
        noise = max(round(length * density), 1)
        assert mask.sum() == noise and not mask[0]
        starts = int((mask & ~np.concatenate([[False], mask[:-1]])).sum())
        assert starts == min(max(round(noise / span), 1), noise, length - noise)
        inputs, target = corrupt_spans(ids, mask, sentinels, eos=1)
        assert target[-1] == 1 and len(inputs) == length - noise + starts
        pieces, current = {}, None
        for t in target[:-1]:
            if t in sentinels:
                current = t
                pieces[t] = []
            else:
                pieces[current].append(t)
        rebuilt = [x for t in inputs for x in (pieces[t] if t in pieces else [t])]
        assert rebuilt == ids.tolist()


@pytest.mark.slow
def test_a_trained_encoder_beats_its_baselines_and_is_a_space(tmp_path, tiny_corpus_file, capsys):
    """A few steps on the tiny corpus: the held-out span-corruption loss falls below both baselines that
    learn nothing (the network at its initialisation, the targets' unigram entropy); the folder is a T5
    space (`--space t5:FOLDER`) that ELF trains in and samples from; bad input is one line."""
    from elflow.cli import main
    from elflow.data.corpus import calibration_for
    from elflow.space import build_space

    out = tmp_path / "enc"
    assert main(["train-encoder", "--data", str(tiny_corpus_file), "--vocab", "200", "--length", "32",
                 "--hidden", "32", "--heads", "2", "--depth", "1", "--steps", "40", "--batch", "16", "--lr", "1e-2",
                 "--quiet", "--out", str(out)]) == 0
    info = json.loads((out / "elflow_encoder.json").read_text())
    assert info["heldout_loss"] < info["heldout_unigram_entropy"] < info["heldout_loss_at_init"], info
    space = build_space(f"t5:{out}", calibration=calibration_for({}))  # its scale measured on the built-in corpus
    ids = torch.tensor([space.tokenizer("the king and the lord")["input_ids"]])
    assert space.dim == 32 and space.encode(ids).shape == (1, ids.shape[1], 32)
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", str(tiny_corpus_file), "--space", f"t5:{out}", "--length",
                 "16", "--batch", "4", "--steps", "2", "--warmup", "1", "--dtype", "fp32", "--quiet",
                 "--cache-dir", str(tmp_path / "cache"), "--out", str(run)]) == 0
    assert main(["sample", str(run), "--steps", "2", "--num", "2", "--quiet", "--out", str(tmp_path / "s.jsonl")]) == 0
    capsys.readouterr()
    assert main(["train-encoder", "--hidden", "30", "--heads", "4", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not split into --heads" in err[0]


# ----------------------------------------------------------------------------------------------------------
# the size check of `elflow train-encoder`
BIG = str(10**12)


@pytest.mark.parametrize("flag,value,needle", [
    *[(f, v, f"{f} must be at least 1") for f in ("--vocab", "--length", "--hidden", "--depth", "--heads", "--steps",
                                                   "--batch") for v in ("0", "-4")],
    ("--steps", BIG, "--steps must be an integer from 1 to 100,000,000"),
    ("--hidden", "1000000", "training the encoder at --vocab 2000 --length 64 --hidden 1000000"),  # 10^12 weights
    ("--length", "100000000", "training the encoder at --vocab 2000 --length 100000000"),  # 10^8 positions
    *[(f, BIG, "needs about") for f in ("--vocab", "--length", "--hidden", "--depth", "--batch")],
    ("--heads", BIG, "does not split into --heads"),
])
def test_train_encoder_refuses_a_bad_size_in_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch, flag,
                                                                                 value, needle):
    """train-encoder --hidden 10^6, --length 10^8 and the rest: one line, exit 2, before the corpus is read, and
    --out is not made (so no tokenizer file is left in it)."""
    from helpers import assert_one_error

    import elflow.experiments.encoder_train as e
    from elflow.cli import main
    from elflow.util import budget

    monkeypatch.setattr(budget, "available_memory", lambda device=None: (8 * 2**30, "available on this machine"))
    monkeypatch.setattr(e, "read_documents", None)  # reading the corpus would fail
    out = tmp_path / "enc"
    code = main(["train-encoder", flag, value, "--out", str(out)])
    assert_one_error(code, capsys.readouterr().err, "train-encoder", needle)
    assert not out.exists()


@pytest.mark.slow
def test_a_window_longer_than_the_corpus_leaves_no_tokenizer_behind(tmp_path, tiny_corpus_file, capsys):
    """--length past what the corpus holds is found after the tokenizer is trained: the tokenizer lives in a
    temporary folder until the encoder is saved, so the refused --out is left as it was (not made), and the same
    command with a good --length then runs into it."""
    from helpers import assert_one_error

    from elflow.cli import main

    out = tmp_path / "enc"
    args = ["train-encoder", "--data", str(tiny_corpus_file), "--vocab", "200", "--hidden", "32", "--heads", "2",
            "--depth", "1", "--steps", "1", "--batch", "4", "--quiet", "--out", str(out)]
    code = main([*args, "--length", "1000"])
    assert_one_error(code, capsys.readouterr().err, "train-encoder", "fewer than two windows of --length 1000")
    assert not out.exists()
    assert main([*args, "--length", "16"]) == 0
    assert {"tokenizer_config.json", "config.json", "elflow_encoder.json"} <= {p.name for p in out.iterdir()}

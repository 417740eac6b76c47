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

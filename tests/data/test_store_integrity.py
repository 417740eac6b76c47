"""A token store is verified, not believed: a damaged store (manifest, offsets, ids) is one line and no run;
a store written before fingerprints still opens; the open check reads a bounded sample; resume on a changed
store is refused naming it."""
import json
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_one_error

from elflow.cli import main
from elflow.data.store import TokenStore

ROOT = Path(__file__).resolve().parents[2]


from pathlib import Path

from helpers import cli, snapshot_with_folders, train_args, words

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------------
# a store is verified, not believed


def _manifest(folder, **changes):
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    for key, value in changes.items():
        if key in ("vocab_size", "eos_id"):
            m["tokenizer"][key] = value
        elif value is None:
            m.pop(key)
        else:
            m[key] = value
    path.write_text(json.dumps(m))
    return m


def _offsets(folder, edit):
    o = np.fromfile(folder / "offsets.bin", "<i8")
    edit(o)
    o.tofile(folder / "offsets.bin")


def _ids(folder, edit, fingerprint=True):
    m = json.loads((folder / "manifest.json").read_text())
    dtype = np.dtype(m["dtype"]).newbyteorder("<")
    ids = np.fromfile(folder / "ids.bin", dtype)
    edit(ids)
    ids.tofile(folder / "ids.bin")
    if not fingerprint:
        _manifest(folder, fingerprint=None)  # a store written before stores had a fingerprint


def _offset(i, value):
    def damage(folder):
        _offsets(folder, lambda o: o.__setitem__(i, value))
    return damage


def _reversed_at(i):
    def swap(o):
        o[i], o[i + 1] = o[i + 1], o[i]
    return lambda folder: _offsets(folder, swap)


def _uint8(folder):
    m = json.loads((folder / "manifest.json").read_text())
    _manifest(folder, dtype="uint8", tokens=2 * m["tokens"])


DAMAGE = [
    # (id, which store, damage, words of the one line)
    ("dtype-object", "text", lambda f: _manifest(f, dtype="object"), ["its dtype 'object' is not a token store's"]),
    ("dtype-uint8-tokens-doubled", "text", _uint8, ["its dtype 'uint8' is not a token store's (uint16 or uint32)"]),
    ("vocab-size-10", "text", lambda f: _manifest(f, vocab_size=10), ["outside the vocabulary of 10 ids"]),
    ("tokens-negative", "text", lambda f: _manifest(f, tokens=-5), ["tokens is -5, not a whole number from 1"]),
    ("eos-outside-the-vocabulary", "text", lambda f: _manifest(f, eos_id=10**6),
     ["tokenizer.eos_id is 1000000, not a whole number from 0 to 299"]),
    ("offset-1e9", "text", _offset(3, 10**9), ["offsets.bin holds 1,000,000,000 at entry 3, outside 0.."]),
    ("offset-negative", "text", _offset(3, -1), ["offsets.bin holds -1 at entry 3"]),
    ("offsets-reversed", "text", _reversed_at(4), ["offsets.bin decreases at entry 5"]),
    ("offsets-not-from-0", "text", _offset(0, 1), ["offsets.bin starts at 1, not 0"]),
    ("pair-offset-1e9", "pairs", _offset(5, 10**9), ["offsets.bin holds 1,000,000,000 at entry 5"]),
    ("pair-offset-minus-7", "pairs", _offset(5, -7), ["offsets.bin holds -7 at entry 5"]),
    ("pair-offsets-reversed", "pairs", _reversed_at(6), ["offsets.bin decreases at entry 7"]),
    ("ids-beyond-the-vocabulary", "text", lambda f: _ids(f, lambda ids: ids.fill(65000)),
     ["ids.bin holds id 65,000 at position 0, outside the vocabulary of 300 ids"]),
    ("ids-beyond-the-vocabulary-no-fingerprint", "text", lambda f: _ids(f, lambda ids: ids.fill(65000), False),
     ["ids.bin holds id 65,000 at position 0"]),
    ("ids-edited-in-place", "text", lambda f: _ids(f, lambda ids: ids.__setitem__(slice(None), ids[::-1].copy())),
     ["its arrays are not those its manifest describes"]),
]


@pytest.mark.parametrize("which,damage,needles", [c[1:] for c in DAMAGE], ids=[c[0] for c in DAMAGE])
def test_train_on_a_damaged_store_is_one_line_and_writes_no_run(capsys, tmp_path, space_flag, store, pair_store,
                                                               which, damage, needles):
    folder = store if which == "text" else pair_store
    damage(folder)
    before = snapshot_with_folders(folder)
    extra = ["--source-length", "4"] if which == "pairs" else []
    code, _, err = cli(capsys, train_args(folder, tmp_path / "r_s02", space_flag, tmp_path / "cache", *extra))
    line = assert_one_error(code, err, "train", str(folder), *needles)
    assert "--overwrite" in line
    assert not (tmp_path / "r_s02").exists()  # nothing written, not even run.json
    assert snapshot_with_folders(folder) == before


def test_a_store_written_before_fingerprints_still_opens(store):
    good = TokenStore(store)
    _manifest(store, fingerprint=None)
    again = TokenStore(store)
    assert again.fingerprint == good.fingerprint and again.manifest["fingerprint"] is None


def test_the_open_check_reads_a_bounded_sample(tmp_path):
    """A store of 24 M ids (48 MB) opens with its arrays checked in 64 blocks each: a few MB read."""
    from elflow.data import integrity
    from elflow.data.store import StoreWriter

    writer = StoreWriter(tmp_path / "big", "text", 30522)
    rng = np.random.default_rng(0)
    for _ in range(24):
        writer.add_documents([rng.integers(0, 30000, 1 << 20)])
    writer.finish({"layout": "packed", "tokenizer": {"id": "x", "vocab_size": 30522, "eos_id": 1, "pad_id": 1}})
    spans = integrity.block_spans(48 << 20, 2)
    assert len(spans) == integrity.BLOCKS and sum(b - a for a, b in spans) == integrity.BLOCKS * integrity.BLOCK_BYTES
    t = time.perf_counter()
    TokenStore(tmp_path / "big")
    assert time.perf_counter() - t < 2.0


# ----------------------------------------------------------------------------------------------------------
# resume on the store the run started on


@pytest.fixture
def run_on_store(tmp_path, space_flag, store, capsys):
    run, cache = tmp_path / "run", tmp_path / "cache"
    code, _, err = cli(capsys, train_args(store, run, space_flag, cache, "--steps", "1"))
    assert code == 0, err
    state = json.loads((run / "checkpoints" / "step_0000001" / "state.json").read_text())
    assert state["data_store"]["fingerprint"] == TokenStore(store).fingerprint.to_dict()
    return run


def _resume(run, cache):
    return ["train", "--resume", "--out", run, "--steps", "2", "--cache-dir", cache, "--quiet"]


@pytest.mark.parametrize("change,needles", [
    ("edited-in-place", ["its arrays are not those its manifest describes"]),
    ("edited-in-place-no-fingerprint", ["is not the token store this run was trained on",
                                        "it holds as many tokens, but other ids"]),
    ("prepared-again-from-other-text", ["is not the token store this run was trained on", "tokens in 20 records, not"]),
])
def test_resume_on_a_changed_store_is_refused_naming_it(capsys, tmp_path, space_flag, store, run_on_store, change,
                                                        needles):
    if change.startswith("edited-in-place"):
        _ids(store, lambda ids: ids.__setitem__(slice(None), ids[::-1].copy()), fingerprint="no" not in change)
    else:
        src = tmp_path / "other.jsonl"
        src.write_text("".join(json.dumps({"text": words(40, 50 + i)}) + "\n" for i in range(20)))
        assert main(["prepare", str(src), "--space", space_flag, "--out", str(store), "--overwrite", "--quiet"]) == 0
    before = snapshot_with_folders(run_on_store)
    code, _, err = cli(capsys, _resume(run_on_store, tmp_path / "cache"))
    assert_one_error(code, err, "train", str(store), *needles)
    assert snapshot_with_folders(run_on_store) == before


def test_a_checkpoint_saved_before_stores_were_recorded_resumes(capsys, tmp_path, run_on_store):
    import hashlib

    ck = run_on_store / "checkpoints" / "step_0000001"
    state = json.loads((ck / "state.json").read_text())
    del state["data_store"]
    text = json.dumps(state, indent=2) + "\n"
    (ck / "state.json").write_text(text)
    (ck / "state.sha256").write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")
    code, _, err = cli(capsys, _resume(run_on_store, tmp_path / "cache"))
    assert code == 0, err
    assert (run_on_store / "checkpoints" / "step_0000002").is_dir()


def test_init_from_a_store_says_it_is_a_store(capsys, tmp_path, space_flag, store):
    code, _, err = cli(capsys, train_args(store, tmp_path / "run", space_flag, tmp_path / "cache", "--init-from", store))
    assert_one_error(code, err, "train", f"{store} is a token store", "not a run")
    assert not (tmp_path / "run").exists()

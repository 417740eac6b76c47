"""A store's records checked field by field: its fingerprint, its manifest and a checkpoint's record of its
store; the source a store was prepared from is compared on resume by its sha256."""
import hashlib
import itertools
import json
import os

import numpy as np
import pytest
from helpers import CharSpace, assert_one_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elflow.data import integrity
from elflow.data.datasets import check_recorded_store, check_same_store, store_record
from elflow.data.ingest import prepare_store
from elflow.data.integrity import Fingerprint, block_spans
from elflow.data.store import TokenStore, check_manifest
from elflow.util.errors import ELFError

NEST = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
BIGINT = '{"text": 1' + "0" * 5000 + "}\n"
BAD_LINES = [("nested-100000-deep", NEST, "nested too deeply"),
             ("an-integer-of-5001-digits", BIGINT, "an integer of 5001 digits")]




from helpers import cli, snapshot_with_folders, train_args, words

NEST = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
BIGINT = '{"text": 1' + "0" * 5000 + "}\n"
BAD_LINES = [("nested-100000-deep", NEST, "nested too deeply"),
             ("an-integer-of-5001-digits", BIGINT, "an integer of 5001 digits")]


# ----------------------------------------------------------------------------------------------------------
# store records checked field by field


def _good_fingerprint():
    return {"tokens": 100, "records": 3, "sha256": "ab" * 32, "blocks": 16, "block_bytes": 65536}


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=8)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["tokens", "records", "sha256", "blocks", "block_bytes", None]), json_values)
def test_any_fingerprint_reads_to_a_valid_one_or_names_its_field(key, value):
    d = _good_fingerprint()
    if key is None:
        d = value
    else:
        d[key] = value
    try:
        fp = Fingerprint.from_dict(d, "m.json")
    except ELFError as e:
        assert str(e).startswith("m.json: fingerprint") and "\n" not in str(e)
        assert key is None or f"fingerprint.{key}" in str(e)
    else:
        assert 1 <= fp.blocks <= integrity.MAX_BLOCKS and 1 <= fp.block_bytes <= integrity.MAX_BLOCK_BYTES
        assert fp.tokens >= 0 and fp.records >= 0 and len(fp.sha256) == 64
        assert all(type(v) is int for v in (fp.tokens, fp.records, fp.blocks, fp.block_bytes))
        spans = block_spans(10**6, 2, fp.blocks, fp.block_bytes)  # usable: no division by zero, no index error
        assert spans and all(0 <= a <= b <= 10**6 for a, b in spans)


MANIFEST_KEYS = ["kind", "layout", "dtype", "records", "tokens", "source_length", "bytes", "fingerprint", "source",
                 "build", ("tokenizer", "id"), ("tokenizer", "vocab_size"), ("tokenizer", "eos_id"),
                 ("tokenizer", "pad_id"), ("tokenizer", "space"), ("fingerprint", "blocks"), ("bytes", "ids.bin"),
                 ("source", "fingerprint"), ("source", "fingerprint", "sha256"), ("source", "fingerprint", "listing"),
                 ("source", "fingerprint", "bytes")]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(MANIFEST_KEYS), json_values)
def test_any_manifest_field_reads_or_is_refused_naming_it(small_manifest, key, value):
    m = json.loads(json.dumps(small_manifest))
    *parents, last = key if isinstance(key, tuple) else (key,)
    inner = m
    for k in parents:
        inner = inner[k]
    inner[last] = value
    try:
        check_manifest(m, "st/manifest.json")
        if m.get("fingerprint") is not None:
            Fingerprint.from_dict(m["fingerprint"], "st/manifest.json")
    except ELFError as e:
        assert str(e).startswith("st/manifest.json: ") and "\n" not in str(e)
        name = ".".join(key) if isinstance(key, tuple) else key
        assert name.split(".")[0] in str(e)


@pytest.fixture(scope="module")
def small_manifest(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m")
    (folder / "a.txt").write_text(words(50))
    return prepare_store(folder / "a.txt", CharSpace(), folder / "st", workers=1).manifest


def _edit_manifest(folder, edit):
    m = json.loads((folder / "manifest.json").read_text())
    edit(m)
    text = json.dumps(m)
    if "extra" in m:  # a value nested deeper than Python's own JSON module writes
        text = text.replace('"extra": "deep"', '"extra": ' + "[" * 100_000 + "]" * 100_000)
    (folder / "manifest.json").write_text(text)


MANIFEST_CASES = [
    ("fingerprint-blocks-1-block-bytes-1", lambda m: m["fingerprint"].update(blocks=1, block_bytes=1),
     ["its arrays are not those its manifest describes"]),
    ("fingerprint-blocks-0", lambda m: m["fingerprint"].update(blocks=0), ["fingerprint.blocks is 0, not a whole"]),
    ("fingerprint-blocks-infinity", lambda m: m["fingerprint"].update(blocks=float("inf")),
     ["corrupted or truncated", "Infinity"]),
    ("fingerprint-blocks-true", lambda m: m["fingerprint"].update(blocks=True), ["fingerprint.blocks is true"]),
    ("fingerprint-block-bytes-float", lambda m: m["fingerprint"].update(block_bytes=65536.0),
     ["fingerprint.block_bytes is 65536.0"]),
    ("an-extra-key-nested-100000-deep", lambda m: m.update(extra="deep"),
     ["corrupted or truncated", "nested too deeply"]),
    ("records-a-string", lambda m: m.update(records="20"), ['records is "20", not a whole number']),
]


@pytest.mark.parametrize("edit,needles", [c[1:] for c in MANIFEST_CASES], ids=[c[0] for c in MANIFEST_CASES])
def test_train_on_a_store_with_a_bad_manifest_is_one_line(capsys, tmp_path, space_flag, text_store, edit, needles):
    _edit_manifest(text_store, edit)
    code, _, err = cli(capsys, train_args(text_store, tmp_path / "run", space_flag, tmp_path / "cache"))
    assert_one_error(code, err, "train", str(text_store), *needles)
    assert not (tmp_path / "run").exists()


def _reseal(ck, edit):
    state = json.loads((ck / "state.json").read_text())
    edit(state)
    text = json.dumps(state, indent=2) + "\n"
    (ck / "state.json").write_text(text)
    (ck / "state.sha256").write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


@pytest.mark.parametrize("edit,needles", [
    (lambda s: s["data_store"]["fingerprint"].update(blocks=1, block_bytes=1),
     ["is not the token store this run was trained on"]),
    (lambda s: s["data_store"]["fingerprint"].update(blocks=0), ["data_store.fingerprint.blocks is 0"]),
    (lambda s: s["data_store"].update(fingerprint=[1, 2]), ["data_store.fingerprint is [1, 2], not an object"]),
], ids=["blocks-1-block-bytes-1", "blocks-0", "not-an-object"])
def test_resume_with_a_changed_record_of_its_store_is_one_line(capsys, tmp_path, space_flag, text_store, edit, needles):
    run, cache = tmp_path / "run", tmp_path / "cache"
    code, _, err = cli(capsys, train_args(text_store, run, space_flag, cache, "--steps", "1"))
    assert code == 0, err
    _reseal(run / "checkpoints" / "step_0000001", edit)
    before = snapshot_with_folders(run)
    code, _, err = cli(capsys, ["train", "--resume", "--out", run, "--steps", "2", "--cache-dir", cache, "--quiet"])
    assert_one_error(code, err, "train", *needles)
    assert snapshot_with_folders(run) == before


# ----------------------------------------------------------------------------------------------------------
# the source a store was prepared from, compared on resume


def _text(n_chars: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words_ = np.array(["the", "king", "of", "love", "sweet", "night", "lord", "heart", "well", "yes", "aside"])
    out, size = [], 0
    while size < n_chars:
        w = str(rng.choice(words_))
        out.append(w)
        size += len(w) + 1
    return " ".join(out) + "\n"


def test_a_store_prepared_again_from_edited_text_is_refused_on_resume_even_outside_the_sampled_blocks(tmp_path):
    src = tmp_path / "big.txt"
    text = _text(600_000)  # 600,000 ids of 4 bytes: the 16 sampled blocks of 64 KiB cover less than half
    src.write_text(text)
    old = prepare_store(src, CharSpace(), tmp_path / "st", workers=1, chunk_bytes=1 << 18)
    recorded = store_record(old.rows("packed", 64))
    assert recorded["source"]["sha256"] == hashlib.sha256(
        b"big.txt\0" + hashlib.sha256(text.encode()).hexdigest().encode() + b"\n").hexdigest()
    assert recorded["source"]["listing"][0][3] == hashlib.sha256(text.encode()).hexdigest()  # the file's own sha256
    spans = block_spans(old.ids.nbytes, 4)
    at = next(b for (_, b), (a, _) in itertools.pairwise(spans) if a - b > 1000) // 4 + 100  # between two blocks
    edited = text[:at] + ("Y" if text[at] != "Y" else "Z") + text[at + 1:]
    src.write_text(edited)
    new = prepare_store(src, CharSpace(), tmp_path / "st", workers=1, chunk_bytes=1 << 18, overwrite=True)
    assert new.fingerprint == old.fingerprint  # the sampled blocks alone cannot tell
    with pytest.raises(ELFError, match=r"big.txt is not the text this run was trained on \(the text of big.txt "
                                       r"changed \(still [0-9,]+ bytes; sha256"):
        check_same_store(recorded, new.rows("packed", 64), "state.json")
    src.write_text(text)  # the text as it was: the same store, resumable
    again = prepare_store(src, CharSpace(), tmp_path / "st", workers=1, overwrite=True)
    check_same_store(recorded, again.rows("packed", 64), "state.json")


@pytest.mark.slow
def test_train_data_file_edited_mid_way_then_resumed_says_the_data_changed(capsys, tmp_path, space_flag):
    src, run, cache = tmp_path / "corpus.txt", tmp_path / "run", tmp_path / "cache"
    text = _text(2_400_000)  # over 600,000 tokens of 2 bytes: the sampled blocks cover under a half
    src.write_text(text)
    code, _, err = cli(capsys, train_args(src, run, space_flag, cache, "--steps", "1"))
    assert code == 0, err
    (cached,) = (cache / "stores").glob("*/manifest.json")
    ids = TokenStore(cached.parent).ids
    spans = block_spans(ids.nbytes, 2)
    gap = max(itertools.pairwise(spans), key=lambda g: g[1][0] - g[0][1])
    middle = (gap[0][1] + gap[1][0]) // 4 * len(text) // len(ids)  # the gap's middle token, as a character
    at = next(i for i in range(middle, len(text)) if text[i] == " " and text[i + 1:].split(" ", 2)[0] !=
              text[i + 1:].split(" ", 2)[1])
    first, second, rest = text[at + 1:].split(" ", 2)
    src.write_text(text[:at + 1] + f"{second} {first} " + rest)  # two words swapped: as many tokens, others
    before = snapshot_with_folders(run)
    code, _, err = cli(capsys, ["train", "--resume", "--out", run, "--steps", "2", "--cache-dir", cache, "--quiet"])
    assert_one_error(code, err, "train", f"{src} is not the text this run was trained on", "corpus.txt changed")
    assert snapshot_with_folders(run) == before


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["sha256", "listing", "files", "bytes", None]), json_values)
def test_any_recorded_source_is_compared_or_refused_naming_its_field(store_rows, key, value):
    recorded = json.loads(json.dumps(store_record(store_rows)))
    if key is None:
        recorded["source"] = value
    else:
        recorded["source"][key] = value
    try:
        check_same_store(recorded, store_rows, "state.json")
    except ELFError as e:
        assert "\n" not in str(e)
        assert str(e).startswith("state.json: data_store.source") or "is not the text this run was trained on" in str(e)


@pytest.fixture(scope="module")
def store_rows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("r")
    (folder / "a.txt").write_text(words(50))
    return prepare_store(folder / "a.txt", CharSpace(), folder / "st", workers=1).rows("packed", 8)


def test_a_missing_store_is_named_before_any_lookup(tmp_path, text_store):
    rows = TokenStore(text_store).rows("packed", 8)
    recorded = store_record(rows)
    check_recorded_store(recorded, str(text_store), "state.json")  # there: nothing to say
    gone = tmp_path / "moved"
    os.replace(text_store, gone)
    with pytest.raises(ELFError, match=f"{text_store}: the token store this run was trained on .* is missing"):
        check_recorded_store(recorded, str(text_store), "state.json")
    # a hub set's store, in the cache (its source lists no local files): prepared again
    hub_source = {k: v for k, v in (recorded.get("source") or {}).items() if k != "files"} or None
    cached = {**recorded, "folder": str(tmp_path / "cache" / "stores" / ("0" * 24)), "source": hub_source}
    check_recorded_store(cached, "someone/dataset", "state.json")
    with pytest.raises(ELFError, match="data_store.fingerprint.blocks is 0"):
        check_recorded_store({**recorded, "fingerprint": {**recorded["fingerprint"], "blocks": 0}}, "x", "state.json")

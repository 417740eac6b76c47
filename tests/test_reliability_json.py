"""Every JSON and JSONL file elflow reads, read by the one bounded reader: a line nested too deeply or holding a
huge integer is one line naming the file and the line, for every command that reads such a file (or skipped
with its warning under --on-bad skip); a store's manifest, its fingerprint and a checkpoint's record of its
store are checked field by field; the source a store was prepared from is compared on resume by its sha256; a
prepare worker that dies ends the command in seconds with one line and no child left."""

import hashlib
import itertools
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import CharSpace, assert_one_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reliability_store import _gone, _slow_prepare, _workers_of, cli, snapshot, train_args, words

from elflow.data import corpus, integrity
from elflow.data.corpus import jsonl_object, read_pairs, read_sources
from elflow.data.datasets import check_recorded_store, check_same_store, store_record
from elflow.data.ingest import prepare_store
from elflow.data.integrity import Fingerprint, block_spans
from elflow.data.store import TokenStore, check_manifest
from elflow.eval.metrics import read_references, read_texts
from elflow.util.errors import ELFError

NEST = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
BIGINT = '{"text": 1' + "0" * 5000 + "}\n"
BAD_LINES = [("nested-100000-deep", NEST, "nested too deeply"),
             ("an-integer-of-5001-digits", BIGINT, "an integer of 5001 digits")]


@pytest.fixture(scope="module")
def t5_flag(tiny_t5_dir):
    return f"t5:{tiny_t5_dir}"


@pytest.fixture
def text_store(tmp_path, t5_flag, capsys):
    """A text store of 20 documents prepared from a .jsonl."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": words(30, i)}) + "\n" for i in range(20)))
    out = tmp_path / "st"
    code, err = cli(capsys, ["prepare", src, "--space", t5_flag, "--out", out, "--quiet"])
    assert code == 0, err
    return out


def _bad_file(tmp_path, line, name="bad.jsonl"):
    path = tmp_path / name
    path.write_text(json.dumps({"text": words(20)}) + "\n" + line + json.dumps({"text": words(20, 1)}) + "\n")
    return path


# ----------------------------------------------------------------------------------------------------------
# one class of input: a JSONL line the reader refuses, for every command that reads JSONL


def _commands(path, tmp, t5_flag):
    cache = tmp / "cache"
    return {
        "eval": ["eval", path, "--judge", "none"],
        "prepare": ["prepare", path, "--space", t5_flag, "--out", tmp / "st", "--quiet", "--workers", "1"],
        "prepare-2-workers": ["prepare", path, "--space", t5_flag, "--out", tmp / "st", "--quiet", "--workers", "2"],
        "train": train_args(path, tmp / "run", t5_flag, cache),
        "train-encoder": ["train-encoder", "--steps", "1", "--data", path, "--vocab", "80", "--out", tmp / "enc"],
    }


@pytest.mark.parametrize("command", ["eval", "prepare", "prepare-2-workers", "train", "train-encoder"])
@pytest.mark.parametrize("case,line,needle", BAD_LINES, ids=[c[0] for c in BAD_LINES])
def test_a_bad_jsonl_line_is_one_line_naming_it_for_every_command(capsys, tmp_path, t5_flag, command, case, line,
                                                                  needle):
    path = _bad_file(tmp_path, line)
    args = _commands(path, tmp_path, t5_flag)[command]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = cli(capsys, args)
    assert_one_error(code, err, args[0], f"{path} line 2: {needle}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == before  # nothing written


@pytest.mark.parametrize("workers", ["1", "2"])
def test_on_bad_skip_passes_over_such_a_line_with_its_warning(capsys, tmp_path, t5_flag, workers):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"text": words(20)}) + "\n" + NEST + BIGINT + json.dumps({"text": words(20, 1)}) + "\n")
    code, err = cli(capsys, ["prepare", path, "--space", t5_flag, "--out", tmp_path / "st", "--quiet",
                             "--on-bad", "skip", "--workers", workers])
    assert code == 0, err
    assert f"skipping: {path} line 2: nested too deeply" in err
    assert f"skipping: {path} line 3: an integer of 5001 digits" in err
    skipped = len(NEST) + len(BIGINT)
    assert f"{skipped:,} bytes of {path} were bad input and were skipped" in err
    store = TokenStore(tmp_path / "st")
    assert store.count == 2 and store.manifest["source"]["skipped_bytes"] == skipped


def test_an_old_store_is_kept_when_its_replacement_meets_a_bad_line(capsys, tmp_path, t5_flag, text_store):
    before = snapshot(text_store)
    path = _bad_file(tmp_path, NEST)
    code, err = cli(capsys, ["prepare", path, "--space", t5_flag, "--out", text_store, "--overwrite", "--quiet",
                             "--workers", "2"])
    assert_one_error(code, err, "prepare", f"{path} line 2: nested too deeply")
    assert snapshot(text_store) == before


@pytest.mark.parametrize("case,line,needle", BAD_LINES, ids=[c[0] for c in BAD_LINES])
def test_sources_pairs_and_references_read_the_same_way(tmp_path, case, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"input": "a", "output": "b", "text": "c"}) + "\n" + line)
    for read in (read_sources, read_pairs, lambda p: read_references(p, "text"), read_texts):
        with pytest.raises(ELFError, match=f"bad.jsonl line 2: {needle}"):
            read(str(path))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"input": "a", "output": "b"}) + "\n" + line)
    assert read_pairs(pairs, on_bad="skip") == [("a", "b")]


def test_a_trajectory_with_a_huge_integer_is_one_line(capsys, tmp_path):
    path = tmp_path / "big.trajectory.json"
    path.write_text('{"format": "elflow-trajectory", "version": 2, "steps": [{"step": 1' + "0" * 5000 + "}]}")
    code, err = cli(capsys, ["view", path, "--out", tmp_path / "page.html"])
    assert_one_error(code, err, "view", str(path), "an integer of 5001 digits")
    assert not (tmp_path / "page.html").exists()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=80).map(str.encode)
       | st.sampled_from([NEST, BIGINT, "[NaN]", "7"]).map(str.encode))
def test_any_line_is_a_record_nothing_or_one_error(raw):
    """A .jsonl line of any bytes is an object, nothing (blank, or skipped with a warning) or one ELFError."""
    assert jsonl_object(raw, "f.jsonl", 1, "skip") is None or isinstance(jsonl_object(raw, "f.jsonl", 1, "skip"), dict)
    try:
        got = jsonl_object(raw, "f.jsonl", 7, "stop")
    except ELFError as e:
        assert str(e).startswith("f.jsonl line 7: ") and "\n" not in str(e)
    else:
        assert got is None or isinstance(got, dict)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(max_size=60) | st.sampled_from([NEST.encode(), BIGINT.encode(), b"[NaN]", b"{}"]),
                max_size=5))
def test_a_samples_file_of_any_lines_is_texts_or_one_error(tmp_path, lines):
    path = tmp_path / "s.jsonl"
    path.write_bytes(b"\n".join(lines))
    try:
        texts = read_texts(path)
    except ELFError as e:
        assert "\n" not in str(e)
    else:
        assert all(isinstance(t, str) for t in texts)


def test_a_link_loop_is_named_as_one(capsys, tmp_path, t5_flag):
    (tmp_path / "lp1.txt").symlink_to("lp2.txt")
    (tmp_path / "lp2.txt").symlink_to("lp1.txt")
    (tmp_path / "gone.txt").symlink_to("nothing-here.txt")
    for src, needle in ((tmp_path / "lp1.txt", "is a loop of symbolic links"),
                        (tmp_path / "gone.txt", "is a symbolic link to nothing-here.txt, which leads to nothing")):
        code, err = cli(capsys, ["prepare", src, "--space", t5_flag, "--out", tmp_path / "st", "--quiet"])
        assert_one_error(code, err, "prepare", str(src), needle)
        assert not (tmp_path / "st").exists()


def test_a_skipped_long_line_is_said_and_does_not_make_the_store_look_useless(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(corpus, "MAX_LINE_BYTES", 200)
    src = tmp_path / "long.jsonl"
    long_line = json.dumps({"text": "x" * 5000}) + "\n"
    src.write_text(json.dumps({"text": "a short one"}) + "\n" + long_line + json.dumps({"text": "after it"}) + "\n")
    store = prepare_store(src, CharSpace(), tmp_path / "st", workers=1, on_bad="skip")
    err = capsys.readouterr().err
    assert "line 2: longer than 200 bytes" in err
    assert f"{len(long_line):,} bytes of {src} were bad input and were skipped" in err
    assert "likely useless" not in err  # 5,000 bytes skipped are not 5,000 bytes that gave no token
    assert store.count == 2 and store.manifest["source"]["skipped_bytes"] == len(long_line)


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
def test_train_on_a_store_with_a_bad_manifest_is_one_line(capsys, tmp_path, t5_flag, text_store, edit, needles):
    _edit_manifest(text_store, edit)
    code, err = cli(capsys, train_args(text_store, tmp_path / "run", t5_flag, tmp_path / "cache"))
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
def test_resume_with_a_changed_record_of_its_store_is_one_line(capsys, tmp_path, t5_flag, text_store, edit, needles):
    run, cache = tmp_path / "run", tmp_path / "cache"
    code, err = cli(capsys, train_args(text_store, run, t5_flag, cache, "--steps", "1"))
    assert code == 0, err
    _reseal(run / "checkpoints" / "step_0000001", edit)
    before = snapshot(run)
    code, err = cli(capsys, ["train", "--resume", "--out", run, "--steps", "2", "--cache-dir", cache, "--quiet"])
    assert_one_error(code, err, "train", *needles)
    assert snapshot(run) == before


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
def test_train_data_file_edited_mid_way_then_resumed_says_the_data_changed(capsys, tmp_path, t5_flag):
    src, run, cache = tmp_path / "corpus.txt", tmp_path / "run", tmp_path / "cache"
    text = _text(2_400_000)  # over 600,000 tokens of 2 bytes: the sampled blocks cover under a half
    src.write_text(text)
    code, err = cli(capsys, train_args(src, run, t5_flag, cache, "--steps", "1"))
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
    before = snapshot(run)
    code, err = cli(capsys, ["train", "--resume", "--out", run, "--steps", "2", "--cache-dir", cache, "--quiet"])
    assert_one_error(code, err, "train", f"{src} is not the text this run was trained on", "corpus.txt changed")
    assert snapshot(run) == before


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
    cached = {**recorded, "folder": str(tmp_path / "cache" / "stores" / ("0" * 24))}  # a hub set's: prepared again
    check_recorded_store(cached, "someone/dataset", "state.json")
    with pytest.raises(ELFError, match="data_store.fingerprint.blocks is 0"):
        check_recorded_store({**recorded, "fingerprint": {**recorded["fingerprint"], "blocks": 0}}, "x", "state.json")


# ----------------------------------------------------------------------------------------------------------
# a prepare worker that dies


def _children(pid: int) -> set:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("then", ["nothing", "sigterm"])
def test_a_worker_killed_ends_prepare_in_seconds_with_one_line_and_no_child(tmp_path, then):
    out, log = tmp_path / "st", tmp_path / "calls.log"
    proc = _slow_prepare(tmp_path, out, log, "--workers", "2", delay=0.2)
    try:
        workers = _workers_of(proc, log)
        victim = min(workers)
        t = time.time()
        os.kill(victim, signal.SIGKILL)  # what the OOM killer does
        if then == "sigterm":
            time.sleep(0.2)
            os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        took = time.time() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 20 and _gone(workers) and not _children(proc.pid)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    if lines[0].startswith("elflow prepare: error: "):
        assert lines[0].startswith(f"elflow prepare: error: a prepare worker process (pid {victim}) died (killed "
                                   "by SIGKILL"), lines[0]
        # a SIGTERM that comes once the command has said so ends it at once
        assert proc.returncode in ((2, -signal.SIGTERM) if then == "sigterm" else (2,)), err
    else:  # SIGTERM came first
        assert then == "sigterm" and proc.returncode == 128 + signal.SIGTERM, err
        assert lines[0].startswith("elflow prepare: stopped by SIGTERM"), lines[0]
    assert not out.exists()  # the partial store went with it

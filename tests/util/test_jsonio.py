"""The one JSON reader: what it reads back exactly (a round trip of any value within its bounds) and what it
refuses in one line naming the file (deep nesting, huge integers, NaN, non-regular files, links where elflow
owns the file, oversized files and lines)."""

import json
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elflow.util.errors import ELFError
from elflow.util.jsonio import MAX_DEPTH, MAX_INT_DIGITS, BadJSON, iter_jsonl, parse, read_json, read_limited

finite = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.none() | st.booleans() | st.integers(-10**30, 10**30) | finite | st.text(max_size=20)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                          inner, max_size=4),
                      max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(values)
def test_every_value_within_the_bounds_reads_back_exactly(value):
    assert parse(json.dumps(value), "x.json") == value


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=MAX_DEPTH + 1, max_value=5000), st.sampled_from(["[", '{"a":']))
def test_nesting_past_the_limit_is_one_line_naming_the_file(depth, opener):
    closer = "]" if opener == "[" else "}"
    with pytest.raises(BadJSON, match=r"^x\.json: nested too deeply"):
        parse(opener * depth + "1" + closer * depth, "x.json")


def test_nesting_deeper_than_pythons_recursion_is_one_line():
    with pytest.raises(BadJSON, match="nested too deeply"):
        parse("[" * 100_000 + "]" * 100_000, "deep.json")


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=MAX_INT_DIGITS + 1, max_value=6000))
def test_integers_of_too_many_digits_are_refused(digits):
    with pytest.raises(BadJSON, match=f"an integer of {digits} digits"):
        parse('{"n": ' + "9" * digits + "}", "big.json")


@pytest.mark.parametrize("text", ['{"a": NaN}', "[Infinity]", "[-Infinity]", "[1e400]"])
def test_non_finite_numbers_are_refused_unless_allowed(text):
    with pytest.raises(BadJSON):
        parse(text, "x.json")
    v = parse(text, "x.json", allow_nonfinite=True)
    assert not math.isfinite((list(v.values()) if isinstance(v, dict) else v)[0])


def test_files_are_read_as_regular_files_only_and_within_their_size(tmp_path):
    good = tmp_path / "a.json"
    good.write_text('{"a": 1}')
    assert read_json(good) == {"a": 1}
    with pytest.raises(BadJSON, match="a JSON array was expected, found object"):
        read_json(good, kind=list)
    os.mkfifo(tmp_path / "fifo")
    for path, needle in ((tmp_path / "fifo", "a fifo"), ("/dev/zero", "a character device"), (tmp_path, "a folder"),
                         (tmp_path / "none.json", "missing")):
        with pytest.raises(ELFError, match=needle):
            read_json(path)
    with pytest.raises(ELFError, match="8 bytes, more than the 4 elflow reads"):
        read_limited(good, 4)
    link = tmp_path / "link.json"
    link.symlink_to(good)
    assert read_json(link) == {"a": 1}  # a file the user names may be a link
    with pytest.raises(ELFError, match="symbolic link"):
        read_json(link, own=True)  # never a file elflow owns


def test_jsonl_bad_lines_name_their_line_or_are_skipped(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"text": "a"}\n\n{"text": ' + b"1" * 5001 + b"}\n" + b"[" * 160 + b"\n\xff\n" + b'{"text": "b"}\n')
    with pytest.raises(BadJSON, match=r"s\.jsonl line 3: an integer of 5001 digits"):
        list(iter_jsonl(path))
    bad = []
    rows = list(iter_jsonl(path, on_bad=lambda n, msg: bad.append(n)))
    assert rows == [(1, {"text": "a"}), (6, {"text": "b"})] and bad == [3, 4, 5]


def test_a_line_longer_than_the_limit_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text('{"text": "' + "x" * 5000 + '"}\n{"text": "ok"}\n')
    with pytest.raises(BadJSON, match="line 1: longer than 1,000 bytes"):
        list(iter_jsonl(path, max_line_bytes=1000))
    assert list(iter_jsonl(path, max_line_bytes=1000, on_bad=lambda n, m: None)) == [(2, {"text": "ok"})]

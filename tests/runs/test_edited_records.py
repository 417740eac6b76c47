"""Stored documents edited at random (run.json and state.json of every layout in the committed fixtures, and
the same documents in today's layout): each reads whole or is refused with one line naming the file, never
another exception; and a field deleted from today's record or training settings is always refused naming
it, never filled in with today's default."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elflow.config import TrainConfig
from elflow.runs.migrate import document
from elflow.runs.record import RunRecord
from elflow.util.errors import ELFError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
WHERE = "edited.json"


def _stored() -> list[dict]:
    docs = []
    for root in ("legacy", "record2", "record5", "record8", "record9", "record10"):
        for name in ("run.json", "state.json"):
            for f in sorted((FIXTURES / root).rglob(name)):
                doc = json.loads(f.read_text())
                if "expected" not in f.parts and ("record" in doc or name == "run.json"):  # (a state.json of
                    docs.append(doc)  # version 7 on holds no record: it names its run's by digest)
    return docs


STORED = _stored()
TODAY = [document(copy.deepcopy(d), WHERE) for d in STORED]

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=5)


def key_paths(doc, prefix=()) -> list[tuple]:
    """Every path of keys into the nested objects of `doc`."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*prefix, k))
            out += key_paths(v, (*prefix, k))
    return out


def read(doc) -> None:
    """What a reader does with a stored document: today's layout, its record, its training settings."""
    today = document(doc, WHERE)
    record = RunRecord.from_dict(today.get("record"), WHERE)
    if today.get("train") is not None:
        TrainConfig.of_run(record, today["train"], WHERE)


def edited(doc: dict, path: tuple, value, delete: bool) -> dict:
    doc = copy.deepcopy(doc)
    node = doc
    for k in path[:-1]:
        node = node[k]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_an_edited_document_reads_whole_or_is_refused_in_one_line(data):
    doc = data.draw(st.sampled_from(STORED + TODAY), label="document")
    path = data.draw(st.sampled_from(key_paths(doc)), label="path")
    delete = data.draw(st.booleans(), label="delete")
    value = None if delete else data.draw(JSON, label="value")
    try:
        read(edited(doc, path, value, delete))
    except ELFError as e:
        text = str(e)
        assert "\n" not in text and text.startswith(WHERE), text


def _required_paths() -> list[tuple[int, tuple]]:
    """(document, path) of every field today's record part or today's training settings must hold: the fields
    a part writes (`options` is written only where one is on, and a space spec leaves out what is unset)."""
    out = []
    for i, doc in enumerate(TODAY):
        record = doc["record"]
        for key, value in record.items():
            if key in ("options", "space"):
                continue
            out.append((i, ("record", key)))
            if isinstance(value, dict) and key != "params":
                out += [(i, ("record", key, sub)) for sub in value]
        for key in doc.get("train") or {}:
            out.append((i, ("train", key)))
    return out


REQUIRED = _required_paths()


@pytest.mark.parametrize("index, path", REQUIRED[:: max(1, len(REQUIRED) // 400)],
                         ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_a_field_deleted_from_todays_layout_is_refused_naming_it(index, path):
    with pytest.raises(ELFError) as e:
        read(edited(TODAY[index], path, None, delete=True))
    assert re.search(rf"\b{re.escape(path[-1])}\b", str(e.value)), str(e.value)


def test_a_drawn_tables_space_without_its_seed_stream_or_id_is_refused():
    drawn = next(d for d in TODAY if d["record"]["space"].get("kind") == "random-table")
    for key in ("seed", "stream", "id", "dim"):
        with pytest.raises(ELFError, match=f"space.{key}"):
            read(edited(drawn, ("record", "space", key), None, delete=True))

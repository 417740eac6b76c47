"""The record's migration chain: a record of an earlier version reads as today's, gaining exactly what its
version lacked, with the value the code of that version used."""

import json
from pathlib import Path

import pytest

from elflow.runs.migrate import RECORD_VERSION, current
from elflow.runs.record import RunRecord
from elflow.util.errors import ELFError

RECORD2 = Path(__file__).resolve().parents[1] / "fixtures" / "record2"


def stored_record(run: str) -> dict:
    return json.loads((RECORD2 / run / "run.json").read_text())["record"]


def test_a_version_2_record_gains_the_schedule_its_runs_used():
    old = stored_record("elf")
    assert old["version"] == 2 and "lr_schedule" not in old["train"]
    new = current(old)
    assert new["version"] == RECORD_VERSION == 3
    assert new["train"]["lr_schedule"] == "one-ahead"
    assert {k: v for k, v in new["train"].items() if k != "lr_schedule"} == old["train"]  # nothing else moves
    assert {k: v for k, v in new.items() if k not in ("train", "version")} == \
        {k: v for k, v in old.items() if k not in ("train", "version")}
    assert RunRecord.from_dict(old).train.lr_schedule == "one-ahead"


def test_a_record_of_today_and_what_is_no_record_pass_unchanged():
    today = {**current(stored_record("elf"))}
    assert current(today) == today
    for odd in (None, [1, 2], "text", {"version": 99}, {"version": True}):
        assert current(odd) == odd


def test_a_new_run_records_the_released_schedule(trained):
    record = RunRecord.read(trained)
    assert record.version == RECORD_VERSION and record.train.lr_schedule == "released"


def test_a_record_from_a_newer_elflow_is_refused_in_one_line():
    with pytest.raises(ELFError, match="newer elflow"):
        RunRecord.from_dict({**stored_record("elf"), "version": RECORD_VERSION + 1}, "x")

"""Records of earlier versions read as today's: one linear chain of small steps, version N -> N + 1.

A stored record carries its version; `current` applies the steps from that version on, each of which fills in
exactly what its version lacked, with the value that the code of that version used (never today's default), so
that an older run samples the same texts and resumes bit for bit."""

from __future__ import annotations

RECORD_VERSION = 3


def _v2_to_v3(record: dict) -> dict:
    """Version 3 records the learning-rate schedule's warm-up start (TrainConfig.lr_schedule). Version 2 runs
    stepped at lr (k + 1) / W: "one-ahead"."""
    train = record.get("train")
    if isinstance(train, dict):
        record = {**record, "train": {"lr_schedule": "one-ahead", **train}}
    return record


# version -> the step that makes a record of that version one version newer
STEPS = {2: _v2_to_v3}


def current(record):
    """`record` (a stored record's JSON object) in today's layout: the steps from its version on, in order.
    A record that is not an object, or whose version is not one of the chain's, is returned unchanged for the
    record's own checks to name."""
    if not isinstance(record, dict):
        return record
    version = record.get("version")
    while isinstance(version, int) and not isinstance(version, bool) and version in STEPS:
        record = {**STEPS[version](record), "version": version + 1}
        version += 1
    return record

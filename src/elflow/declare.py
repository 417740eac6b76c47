"""How a training setting is declared: a TrainConfig field's `setting(...)` (its help, choices, range, flag and
whether --resume may change it), a typed part's field's `NestedFlag` (its flag and help; its range and
choices are the part's own declaration, its DECLARED) and the ranges of training's sizes. Each is checked by
elflow.util.errors.check_value (elflow.config.TrainConfig.validate runs it on every field, however the value
was given: a flag, a stored file, a Python call)."""

from __future__ import annotations

from dataclasses import field
from typing import NamedTuple

from elflow.util.budget import LENGTH_BOUND, MAX_BATCH, MAX_LENGTH, MAX_TRAINING_STEPS, TRAINING_STEPS_BOUND
from elflow.util.errors import check_value, finite

MAX_EPOCHS = 1_000_000  # passes over the data: the paper's runs make a few


LENGTH = (lambda v: 1 <= v <= MAX_LENGTH, f"from 1 to {MAX_LENGTH:,} ({LENGTH_BOUND[1]})")


ROWS = (lambda v: 1 <= v <= MAX_BATCH, f"from 1 to {MAX_BATCH:,} (the paper's batch is 512)")


STEPS = (lambda v: 1 <= v <= MAX_TRAINING_STEPS, f"from 1 to {MAX_TRAINING_STEPS:,} ({TRAINING_STEPS_BOUND[1]})")


EPOCHS = (lambda v: finite(v) and 0 < v <= MAX_EPOCHS, f"in (0, {MAX_EPOCHS:,}]")


MINUTES = (lambda v: finite(v) and 0 < v <= 7 * 24 * 60, "in (0, 10,080] (a week)")


def setting(default=None, help: str = "", *, default_help: str | None = None, choices=None, check=None,
            flag: str | None = None, mutable: bool = False, cli: bool = True, default_factory=None,
            held: str | None = None, kept: bool = False, path: bool = False):
    """A TrainConfig field with what the CLI needs: help, choices, a value check (predicate, description),
    its flag name if not --<name>, whether `--resume` may change it (`mutable`), which records hold it
    (`held`: "record", every record; "elf", an ELF network's; None, none: it is stored beside the record) and
    whether a run that continues keeps its stored value where a newer elflow's default differs (`kept`: how
    it steps, elflow.config.kept_from), and whether it names a file or folder (`path`: a run records it
    absolute, elflow.lifecycle.claim.absolute_paths)."""
    meta = {"help": help, "default_help": default_help, "choices": choices, "check": check, "flag": flag,
            "mutable": mutable, "cli": cli, "held": held, "kept": kept, "path": path}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


class NestedFlag(NamedTuple):
    """A flag that sets one field of a typed part of TrainConfig: the field's type (a tuple: its choices), its
    help, its range check (predicate, description) or None, its default in words, and its flag where that is
    not --<field>."""

    type: object
    help: str
    check: tuple | None
    default_help: str
    flag: str | None = None
    fields: object = None  # the flag's value -> the fields it sets (one flag naming several); None: its own

    def check_value(self, v) -> None:
        """ELFError naming the flag when `v` is not a value of the field (`check_value`; a type that is a
        function reads the flag's text, and the field's values pass its range check alone)."""
        typ = self.type
        kind = str if isinstance(typ, tuple) else typ if typ in (bool, str, int, float) else None
        check_value(self.flag, kind, v, typ if isinstance(typ, tuple) else None, self.check)


def nested_flag(part: str, field_name: str, typ, help: str, check=None, default_help: str = "the preset's",
            flag: str | None = None, fields=None) -> tuple[tuple[str, str], NestedFlag]:
    return (part, field_name), NestedFlag(typ, help, check, default_help,
                                          flag or "--" + field_name.replace("_", "-"), fields)

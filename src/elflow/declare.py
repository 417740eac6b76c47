"""How a training setting is declared and checked: a TrainConfig field's `setting(...)` (its help, choices,
range, flag and whether --resume may change it), a typed part's field's `NestedFlag`, the ranges they name,
and `check_value`, the one check of a value against its declaration (elflow.config.TrainConfig.validate runs it
on every field, however the value was given: a flag, a stored file, a Python call)."""

from __future__ import annotations

import math
from dataclasses import field
from typing import NamedTuple

from elflow.util.budget import LENGTH_BOUND, MAX_BATCH, MAX_LENGTH, MAX_TRAINING_STEPS, TRAINING_STEPS_BOUND
from elflow.util.errors import SEED_MAX, ELFError

MAX_EPOCHS = 1_000_000  # passes over the data: the paper's runs make a few


def positive(v) -> bool:
    return math.isfinite(v) and v > 0


def _at_least(lo):
    return lambda v: math.isfinite(v) and v >= lo


POSITIVE = (positive, "> 0")


AT_LEAST_0 = (_at_least(0), ">= 0")


AT_LEAST_1 = (_at_least(1), ">= 1")


UNIT = (lambda v: 0 <= v < 1, "in [0, 1)")


SEED = (lambda v: isinstance(v, int) and 0 <= v <= SEED_MAX, f"an integer from 0 to {SEED_MAX}")


PROBABILITY = (lambda v: 0 <= v <= 1, "in [0, 1]")


ANY = (math.isfinite, "(finite)")


LENGTH = (lambda v: 1 <= v <= MAX_LENGTH, f"from 1 to {MAX_LENGTH:,} ({LENGTH_BOUND[1]})")


ROWS = (lambda v: 1 <= v <= MAX_BATCH, f"from 1 to {MAX_BATCH:,} (the paper's batch is 512)")


STEPS = (lambda v: 1 <= v <= MAX_TRAINING_STEPS, f"from 1 to {MAX_TRAINING_STEPS:,} ({TRAINING_STEPS_BOUND[1]})")


EPOCHS = (lambda v: math.isfinite(v) and 0 < v <= MAX_EPOCHS, f"in (0, {MAX_EPOCHS:,}]")


MINUTES = (lambda v: math.isfinite(v) and 0 < v <= 7 * 24 * 60, "in (0, 10,080] (a week)")


def out_of_range(flag: str, what: str, value, whole: bool = False) -> ELFError:
    """The one-line error of a setting whose value fails its range check (`what`: the check's description, a
    range such as ">= 1", or a whole phrase such as "an integer from 1 to ..."; `whole`: a whole number)."""
    must = what if what.startswith(("a ", "an ")) else f"a {'whole ' if whole else ''}number {what}".rstrip()
    return ELFError(f"{flag} must be {must}, got {value!r}")


# a field's declared type (as the dataclass holds it: a string) -> the type of its values; None: a typed part
KINDS = {"bool": bool, "str": str, "str | None": str, "int": int, "int | None": int, "float": float,
         "float | None": float}


def check_value(flag: str, kind, v, choices=None, check=None) -> None:
    """The one check of a setting's value against its declaration (a TrainConfig field's `setting`, a typed
    part's field's NestedFlag): its type (`kind`: bool, str, int or float; None: any its check accepts), its
    choices, its range (`check`: a predicate and its description). ELFError naming `flag` (the flag, or the
    stored file's setting)."""
    if kind is bool:
        if not isinstance(v, bool):
            raise ELFError(f"{flag} must be true or false, got {v!r}")
    elif choices:
        if v not in choices:
            raise ELFError(f"{flag} must be one of {', '.join(choices)}, got {v!r}")
    elif kind is str:
        if not isinstance(v, str):
            raise ELFError(f"{flag} must be a string, got {v!r}")
    elif kind in (int, float):
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not number or kind is int and not isinstance(v, int) or check and not check[0](v):
            whole = kind is int and number and not isinstance(v, int)  # 2.5 for a count
            raise out_of_range(flag, "" if whole else check[1] if check else "", v, whole)
    elif check and not check[0](v):  # a value of several types (a number or a word), its range check alone
        raise out_of_range(flag, check[1], v)


def setting(default=None, help: str = "", *, default_help: str | None = None, choices=None, check=None,
            flag: str | None = None, mutable: bool = False, cli: bool = True, default_factory=None,
            held: str | None = None):
    """A TrainConfig field with what the CLI needs: help, choices, a value check (predicate, description),
    its flag name if not --<name>, whether `--resume` may change it (`mutable`), and which records hold it
    (`held`: "record", every record; "elf", an ELF network's; None, none: it is stored beside the record)."""
    meta = {"help": help, "default_help": default_help, "choices": choices, "check": check, "flag": flag,
            "mutable": mutable, "cli": cli, "held": held}
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

"""The error type of bad input (printed as one line, never a traceback), the one check of a value against its
declaration (a type, choices, a range: `check_value`), the settings record every config dataclass shares (its
fields' declarations checked by the same function) and the seed check."""

from __future__ import annotations

import math
from dataclasses import asdict, fields, replace


class ELFError(Exception):
    """An error caused by the user's input: printed as one clear message, without a traceback."""


# ----------------------------------------------------------------------------------------------------------
# a value's range: (predicate, description); the predicate sees a number of the declared type
def finite(v) -> bool:
    """Whether a number is finite (an integer always is, however long: math.isfinite would overflow on it)."""
    return isinstance(v, int) or math.isfinite(v)


def positive(v) -> bool:
    return finite(v) and v > 0


def _at_least(lo):
    return lambda v: finite(v) and v >= lo


POSITIVE = (positive, "> 0")


AT_LEAST_0 = (_at_least(0), ">= 0")


AT_LEAST_1 = (_at_least(1), ">= 1")


UNIT = (lambda v: 0 <= v < 1, "in [0, 1)")


FINITE = (finite, "a finite number")


SEED_MAX = 2**32 - 1


SEED = (lambda v: isinstance(v, int) and 0 <= v <= SEED_MAX, f"from 0 to {SEED_MAX}")


# a field's declared type (as a dataclass holds it under postponed annotations: a string) -> its values' type
KINDS = {"bool": bool, "str": str, "str | None": str, "int": int, "int | None": int, "float": float,
         "float | None": float}


def out_of_range(flag: str, what: str, value, whole: bool = False, null: bool = False) -> ELFError:
    """The one-line error of a value outside its range (`what`: the range's description, such as ">= 1", or a
    whole phrase such as "a positive number"; `whole`: the value must be an integer; `null`: it may be null)."""
    must = what if what.startswith(("a ", "an ")) else f"{'an integer' if whole else 'a number'} {what}".rstrip()
    return _refused(flag, must, value, null)


def _refused(flag: str, must: str, value, null: bool) -> ELFError:
    return ELFError(f"{flag} must be {must}{' or null' if null else ''}, got {short_repr(value)}")


def short_repr(v) -> str:
    """A value in an error line, cut to 40 characters (a depth of 10^100 is 101 digits; an integer too long for
    Python to write out is told by its size)."""
    try:
        text = repr(v)
    except ValueError:  # (more digits than int -> str converts)
        return f"an integer of about {int(v.bit_length() * math.log10(2)) + 1:,} digits"
    return text if len(text) <= 40 else text[:37] + "..."


def check_value(flag: str, kind, v, choices=None, check=None, null: bool = False) -> None:
    """The one check of a value against its declaration (a TrainConfig field's `setting`, a typed part's
    field's NestedFlag, a record type's DECLARED): its type (`kind`: bool, str, int or float; None: any its
    check accepts), its choices, its range (`check`: a predicate and its description). ELFError naming `flag`
    (the flag, the stored file's setting, or the field) and, where `null`, that it may be null too."""
    if kind is bool:
        if not isinstance(v, bool):
            raise _refused(flag, "true or false", v, null)
    elif choices:
        if not any(v == c and type(v) is type(c) for c in choices):  # (True is no 1, 1.0 no 1)
            raise _refused(flag, f"one of {', '.join(map(str, choices))}", v, null)
    elif kind is str:
        if not isinstance(v, str):
            raise _refused(flag, "a string", v, null)
    elif kind in (int, float):
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not number or kind is int and not isinstance(v, int) or check and not check[0](v):
            raise out_of_range(flag, check[1] if check else "", v, kind is int, null)
    elif check and not check[0](v):  # a value of several types (a number or a word), its range check alone
        raise out_of_range(flag, check[1], v, null=null)


class Record:
    """The serialisation of a settings dataclass: `to_dict`, `from_dict` (missing keys take their defaults,
    unknown ones are a ValueError naming them) and `replace`. A subclass declares its fields' ranges and
    choices once, in DECLARED (field -> (range or None, choices or None)), which `check_declared` checks (a
    field whose type allows None may be None) and the flags that set those fields read."""

    DECLARED: dict = {}

    def check_declared(self, prefix: str = "") -> None:
        """ValueError naming the first declared field (after `prefix`) whose value its declaration refuses
        (`check_value`)."""
        types = {f.name: f.type for f in fields(self)}
        for name, (check, choices) in self.DECLARED.items():
            v, null = getattr(self, name), "None" in types[name]
            if v is None and null:
                continue
            try:
                check_value(prefix + name, KINDS.get(types[name]), v, choices, check, null)
            except ELFError as e:
                raise ValueError(str(e)) from None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {unknown}")
        return cls(**d)

    def replace(self, **kw):
        return replace(self, **kw)


def first_line(e: BaseException, width: int = 200) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = [line.strip() for line in str(e).splitlines() if line.strip()]
    if len(text) > 1 and text[0].endswith(":"):  # a heading ("Error(s) in loading state_dict for ELF:")
        text = [f"{text[0]} {text[1]}"]
    return f"{type(e).__name__}: {text[0][:width] if text else ''}"


# ----------------------------------------------------------------------------------------------------------
# seeds
def check_seed(seed, flag: str = "--seed") -> int:
    """A seed elflow can use everywhere (every derived generator seed stays in torch's range): an integer in
    0 .. 2**32 - 1."""
    check_value(flag, int, seed, check=SEED)
    return seed

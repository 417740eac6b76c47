"""The error type of bad input (printed as one line, never a traceback), the settings record every config
dataclass shares, and the seed check."""

from __future__ import annotations

from dataclasses import asdict, fields, replace


class ELFError(Exception):
    """An error caused by the user's input: printed as one clear message, without a traceback."""


class Record:
    """The serialisation of a settings dataclass: `to_dict`, `from_dict` (missing keys take their defaults,
    unknown ones are a ValueError naming them) and `replace`."""

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
# seeds and sizes
SEED_MAX = 2**32 - 1


def check_seed(seed, flag: str = "--seed") -> int:
    """A seed elflow can use everywhere (every derived generator seed stays in torch's range): an integer in
    0 .. 2**32 - 1."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ELFError(f"{flag} must be an integer from 0 to {SEED_MAX}, got {seed!r}")
    return seed

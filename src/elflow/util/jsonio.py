"""The one reader of every JSON and JSONL file elflow reads: bounded in bytes, in nesting depth and in the
digits of an integer, with one policy for NaN and Infinity, and one line naming the file (and the line of a
JSONL file) for anything it refuses. Files a run, a checkpoint, a model folder or a store owns are read with
`own=True`: a regular file only, never through a symbolic link.

    parse(text, where)                  one JSON value from text
    read_json(path, what, kind)         one JSON file, whole
    iter_jsonl(path, what)              (line number, value) of each non-blank line of a JSONL file
    read_limited(path, max_bytes)       the bytes of a regular file, bounded (the reads above use it)
"""

from __future__ import annotations

import json
import math
import os
import stat

from elflow.util.errors import ELFError

MAX_DEPTH = 64  # arrays and objects nested in one another; elflow's own files nest 4 deep
MAX_INT_DIGITS = 40  # an integer of more digits is no count, size or seed elflow uses
MAX_JSON_BYTES = 256 << 20  # a whole JSON file (a trajectory of many samples and steps is the largest)
MAX_LINE_BYTES = 64 << 20  # one line of a JSONL file
MAX_JSONL_BYTES = 16 << 30  # a whole JSONL file read line by line (a corpus)
RECORD_BYTES = 16 << 20  # a file elflow writes about a run (state.json, run.json, a manifest)

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"))


class BadJSON(ELFError):
    """A JSON text or file that elflow refuses to read (malformed, too large, too deep, a huge integer, a
    non-finite number where none is allowed)."""


def _name(path, what: str = "") -> str:
    return f"{path}" + (f" ({what})" if what else "")


def _check_int(text: str):
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are read)")
    return int(text)


class _Refused(ValueError):
    pass


def _refuse_constant(name: str):
    raise _Refused(f"{name} is not a number elflow reads (no NaN or Infinity)")


def _check_float_finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is too large to be finite")
    return value


def _depth_ok(value, limit: int) -> bool:
    """Whether `value` nests at most `limit` containers deep (iterative: no recursion on deep input)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if d > limit:
            return False
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return True


def parse(text: str | bytes, where: str, *, allow_nonfinite: bool = False, max_depth: int = MAX_DEPTH):
    """One JSON value from `text`; BadJSON naming `where` for text that is not UTF-8 or not JSON, nested deeper
    than `max_depth`, with an integer of more than MAX_INT_DIGITS digits, or with NaN / Infinity (unless
    `allow_nonfinite`, which reads them as floats)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadJSON(f"{where}: not UTF-8 text (byte 0x{text[e.start]:02x} at offset {e.start})") from None
    hooks = {"parse_int": _check_int}
    if not allow_nonfinite:
        hooks.update(parse_constant=_refuse_constant, parse_float=_check_float_finite)
    try:
        value = json.loads(text, **hooks)
    except RecursionError:
        raise BadJSON(f"{where}: nested deeper than {max_depth} levels; not a file elflow reads") from None
    except _Refused as e:
        raise BadJSON(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        line = f" at line {e.lineno}, column {e.colno}" if "\n" in text else f" at character {e.pos}"
        raise BadJSON(f"{where}: not valid JSON ({e.msg}{line})") from None
    except ValueError as e:  # Python's own limit on integer digits, reached before the hook in some versions
        raise BadJSON(f"{where}: not valid JSON ({e})") from None
    if not _depth_ok(value, max_depth):
        raise BadJSON(f"{where}: nested deeper than {max_depth} levels; not a file elflow reads")
    return value


def _kind_of(mode: int) -> str | None:
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return None


def read_limited(path: str | os.PathLike, max_bytes: int, what: str = "", own: bool = False) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes`. A missing file, a folder, a device, a fifo or
    a socket, a file larger than the limit, and (with `own`: a file elflow wrote and owns) a symbolic link are
    each one ELFError naming the file; nothing blocks, nothing is read past the limit."""
    name = _name(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (getattr(os, "O_NOFOLLOW", 0) if own else 0)
    try:
        st = os.lstat(path) if own else os.stat(path)
    except FileNotFoundError:
        raise ELFError(f"{name}: missing") from None
    except OSError as e:
        raise ELFError(f"{name}: cannot be read ({e.strerror or e})") from None
    if own and stat.S_ISLNK(st.st_mode):
        raise ELFError(f"{name}: a symbolic link where elflow wrote a file; refused (elflow reads its own files "
                       "only as regular files, never through links)")
    kind = _kind_of(st.st_mode)
    if kind is not None:
        raise ELFError(f"{name}: {kind}, not a regular file; refused")
    if st.st_size > max_bytes:
        raise ELFError(f"{name}: {st.st_size:,} bytes, more than the {max_bytes:,} elflow reads from such a file")
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ELFError(f"{name}: cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped after the check
            raise ELFError(f"{name}: not a regular file; refused")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ELFError(f"{name}: more than the {max_bytes:,} bytes elflow reads from such a file")
    return data


def read_json(path: str | os.PathLike, what: str = "", kind: type | tuple = dict, *, max_bytes: int = MAX_JSON_BYTES,
              own: bool = False, allow_nonfinite: bool = False):
    """The value of the JSON file `path`, which must be a `kind` (dict by default; None: any). One ELFError
    naming the file for one that is missing, not a regular file, too large, not UTF-8, not JSON, too deep, or
    of another type."""
    data = read_limited(path, max_bytes, what, own)
    try:
        value = parse(data, _name(path, what), allow_nonfinite=allow_nonfinite)
    except BadJSON as e:
        if not own:
            raise
        detail = str(e).split(": ", 1)[-1] if str(e).startswith(_name(path, what)) else str(e)
        raise BadJSON(f"{_name(path, what)}: corrupted or truncated ({detail})") from None
    if kind is not None and not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadJSON(f"{_name(path, what)}: a JSON {_json_type(want)} was expected, found "
                      f"{_json_type(type(value).__name__)}")
    return value


def _json_type(py: str) -> str:
    return {"dict": "object", "list": "array", "str": "string", "int": "number", "float": "number",
            "NoneType": "null", "bool": "true/false"}.get(py, py)


def iter_jsonl(path: str | os.PathLike, what: str = "", *, max_line_bytes: int = MAX_LINE_BYTES,
               max_bytes: int = MAX_JSONL_BYTES, allow_nonfinite: bool = False, on_bad=None):
    """(line number, value) of each non-blank line of the JSONL file `path`, read line by line, each line at
    most `max_line_bytes` and the file at most `max_bytes`. A bad line (not UTF-8, not JSON, too deep, too
    long, a huge integer) is a BadJSON naming the file and the line, or, when `on_bad(line_number, message)`
    is given, reported to it and skipped. A file that is not a regular file is one ELFError."""
    name = _name(path, what)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ELFError(f"{name}: missing") from None
    except OSError as e:
        raise ELFError(f"{name}: cannot be read ({e.strerror or e})") from None
    kind = _kind_of(st.st_mode)
    if kind is not None:
        raise ELFError(f"{name}: {kind}, not a regular file; refused")
    if st.st_size > max_bytes:
        raise ELFError(f"{name}: {st.st_size:,} bytes, more than the {max_bytes:,} elflow reads from such a file")
    with open(path, "rb") as f:
        number = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            number += 1
            where = f"{name} line {number}"
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # the rest of the long line, read and dropped in chunks
                    raw = f.readline(max_line_bytes + 1)
                message = f"{where}: longer than {max_line_bytes:,} bytes"
                if on_bad is None:
                    raise BadJSON(message)
                on_bad(number, message)
                continue
            if not raw.strip():
                continue
            try:
                yield number, parse(raw, where, allow_nonfinite=allow_nonfinite)
            except BadJSON as e:
                if on_bad is None:
                    raise
                on_bad(number, str(e))


__all__ = ["BadJSON", "MAX_DEPTH", "MAX_INT_DIGITS", "parse", "read_json", "iter_jsonl", "read_limited",
           "RECORD_BYTES"]

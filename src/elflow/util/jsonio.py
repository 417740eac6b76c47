"""The one reader of every JSON and JSONL file elflow reads: bounded in bytes, in nesting depth and in the
digits of an integer, with one policy for NaN and Infinity, and one line naming the file (and the line of a
JSONL file) for anything it refuses. Files a run, a checkpoint, a model folder or a store owns are read with
`own=True`: a regular file only, never through a symbolic link.

    parse(text, where)                  one JSON value from text
    read_json(path, what, kind)         one JSON file, whole
    iter_jsonl(path, what)              (line number, value) of each non-blank line of a JSONL file
    jsonl_lines(path, what)             (line number, raw bytes) of each line of a JSONL file, for a reader that
                                        parses them elsewhere (a worker process)
    read_limited(path, max_bytes)       the bytes of a regular file, bounded (the reads above use it)
    open_regular(path)                  a regular file opened for reading, for a reader that streams it
    json_safe(value)                    a copy of a value as plain JSON data (NaN and Infinity as null)
"""

from __future__ import annotations

import errno
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


def size_text(n: int) -> str:
    """A size in words: whole MiB, else bytes."""
    return f"{n >> 20:,} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n:,} bytes"


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
    """One JSON value from `text`; BadJSON naming `where` for text that is binary, not UTF-8 or not JSON, nested
    deeper than `max_depth`, with an integer of more than MAX_INT_DIGITS digits, or with NaN / Infinity
    (unless `allow_nonfinite`, which reads them as floats)."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadJSON(f"{where}: not UTF-8 text (byte 0x{text[e.start]:02x} at offset {e.start}); elflow reads "
                          "UTF-8: convert the file (iconv -f latin1 -t utf-8)") from None
    nul = text.find("\x00")
    if nul >= 0:
        raise BadJSON(f"{where}: not valid JSON (a NUL character at offset {nul}: binary data?)")
    hooks = {"parse_int": _check_int}
    if not allow_nonfinite:
        hooks.update(parse_constant=_refuse_constant, parse_float=_check_float_finite)
    try:
        value = json.loads(text, **hooks)
    except RecursionError:
        raise BadJSON(f"{where}: nested too deeply (deeper than {max_depth} levels)") from None
    except _Refused as e:
        raise BadJSON(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        line = f" at line {e.lineno}, column {e.colno}" if "\n" in text else f" at character {e.pos}"
        raise BadJSON(f"{where}: not valid JSON ({e.msg}{line})") from None
    except ValueError as e:  # Python's own limit on integer digits, reached before the hook in some versions
        raise BadJSON(f"{where}: not valid JSON ({e})") from None
    if not _depth_ok(value, max_depth):
        raise BadJSON(f"{where}: nested too deeply (deeper than {max_depth} levels)")
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
        raise ELFError(_link_refusal(name))
    kind = _kind_of(st.st_mode)
    if kind is not None:
        raise ELFError(_kind_refusal(name, kind, own))
    if st.st_size > max_bytes:
        raise ELFError(f"{name}: {st.st_size:,} bytes, more than the {max_bytes:,} elflow reads from such a file")
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ELFError(f"{name}: cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):  # swapped after the check
            raise ELFError(_kind_refusal(name, "not a regular file", own))
        data = f.read(min(max_bytes, st.st_size) + 1)  # one byte more than it holds: a file that grew shows
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


def open_regular(path: str | os.PathLike, what: str = "", max_bytes: int | None = None, own: bool = False):
    """`path` opened for reading in binary, which must be a regular file of at most `max_bytes` (None: any size,
    for a reader that streams it); never blocks on a fifo. With `own` (a file elflow wrote and owns) a symbolic
    link is refused too. One ELFError naming the file otherwise."""
    name = _name(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (getattr(os, "O_NOFOLLOW", 0) if own else 0)
    if own and os.path.islink(path):
        raise ELFError(_link_refusal(name))
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ELFError(f"{name}: missing") from None
    except OSError as e:
        if own and e.errno == errno.ELOOP:  # made a link after the check
            raise ELFError(_link_refusal(name)) from None
        raise ELFError(f"{name}: cannot be read ({e.strerror or e})") from None
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    kind = _kind_of(st.st_mode) or (None if stat.S_ISREG(st.st_mode) else "not a regular file")
    if kind is not None:
        f.close()
        raise ELFError(_kind_refusal(name, kind, own))
    if max_bytes is not None and st.st_size > max_bytes:
        f.close()
        raise ELFError(f"{name}: {st.st_size:,} bytes, more than the {max_bytes:,} elflow reads from such a file")
    return f


def _kind_refusal(name: str, kind: str, own: bool) -> str:
    kind = kind if kind == "not a regular file" else f"{kind}, not a regular file"
    if own:
        return (f"{name}: {kind}; refused (elflow reads its own files only as regular files): move it away, then "
                "run again")
    return f"{name}: {kind}; refused: pass a regular file"


def _link_refusal(name: str) -> str:
    return (f"{name}: a symbolic link where elflow wrote a file; refused (elflow reads its own files only as "
            "regular files, never through links): move it away, then run again")


def jsonl_lines(path: str | os.PathLike, what: str = "", *, max_line_bytes: int = MAX_LINE_BYTES,
                max_bytes: int | None = MAX_JSONL_BYTES, on_bad=None, digest=None):
    """(line number, raw bytes) of every line of the JSONL file `path`, blank ones included, read line by
    line: memory holds one line of at most `max_line_bytes`. A longer line is a BadJSON naming the file and
    the line or, when `on_bad(line_number, message)` is given, reported to it and passed over (read and
    dropped in pieces). The file must be a regular file of at most `max_bytes` (None: a stream of any
    length, read in constant memory). `digest` (a hashlib object) is fed every byte read, the passed-over
    lines included, so a caller has the file's hash without reading it twice."""
    name = _name(path, what)
    read = 0
    with open_regular(path, what, max_bytes) as f:
        number = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            number += 1
            read += len(raw)
            if digest is not None:
                digest.update(raw)
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # the rest of the long line, read and dropped in chunks
                    raw = f.readline(max_line_bytes + 1)
                    read += len(raw)
                    if digest is not None:
                        digest.update(raw)
                if max_bytes is not None and read > max_bytes:
                    raise _grew(name, max_bytes)
                message = (f"{name} line {number}: longer than {size_text(max_line_bytes)}, the longest .jsonl line "
                           "elflow reads (each line is read whole); split the record")
                if on_bad is None:
                    raise BadJSON(message)
                on_bad(number, message)
                continue
            if max_bytes is not None and read > max_bytes:
                raise _grew(name, max_bytes)
            yield number, raw


def _grew(name: str, max_bytes: int) -> ELFError:
    return ELFError(f"{name}: more than the {max_bytes:,} bytes elflow reads from such a file (it grew while it "
                    "was read)")


def iter_jsonl(path: str | os.PathLike, what: str = "", *, max_line_bytes: int = MAX_LINE_BYTES,
               max_bytes: int | None = MAX_JSONL_BYTES, allow_nonfinite: bool = False, on_bad=None):
    """(line number, value) of each non-blank line of the JSONL file `path`, read line by line (`jsonl_lines`:
    each line at most `max_line_bytes`, the file at most `max_bytes`). A bad line (not UTF-8, not JSON, too
    deep, too long, a huge integer) is a BadJSON naming the file and the line, or, when `on_bad(line_number,
    message)` is given, reported to it and skipped. A file that is not a regular file is one ELFError."""
    name = _name(path, what)
    for number, raw in jsonl_lines(path, what, max_line_bytes=max_line_bytes, max_bytes=max_bytes, on_bad=on_bad):
        if not raw.strip():
            continue
        try:
            yield number, parse(raw, f"{name} line {number}", allow_nonfinite=allow_nonfinite)
        except BadJSON as e:
            if on_bad is None:
                raise
            on_bad(number, str(e))


def json_safe(value):
    """A copy of `value` as plain JSON data, for a report: NaN and Infinity become null, an object JSON has no
    type for becomes its str."""
    return json.loads(json.dumps(value, default=str), parse_constant=lambda _: None)


__all__ = [
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "RECORD_BYTES",
    "BadJSON",
    "iter_jsonl",
    "json_safe",
    "jsonl_lines",
    "open_regular",
    "parse",
    "read_json",
    "read_limited",
    "size_text",
]

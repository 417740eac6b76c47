"""A local source as bytes: where it is, its fingerprint, its .jsonl lines in batches and its large .txt files in
pieces cut before a whitespace run, each read within bounds (`elflow.data.reading` makes tasks of them)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterator

from elflow.data.corpus import (
    BUILTIN_NAMES,
    CLEAN_VERSION,
    SHAKESPEARE_SHA256,
    _warn,
    builtin_corpus,
    check_regular,
    jsonl_lines,
    local_files,
    size_text,
)
from elflow.util.errors import ELFError
from elflow.util.files import sha256_file

WINDOW = 2  # tasks in flight per worker


RUN_BYTES = 16 << 20  # the longest run without whitespace that a piece of a large .txt file waits for


_CUT = re.compile(rb"(?<=[!-~])[ \t\n\r\f\v]")  # just before an ASCII whitespace run that follows a visible char


NEWLINE = b"\n"


CUT_TEXT = re.compile(r"(?<=[!-~])[ \t\n\r\f\v]")


# ----------------------------------------------------------------------------------------------------
# Sources: fingerprints and what they are
def resolve_source(source, cache_dir) -> Path | None:
    """The local path a source names (the built-in corpus's folder for 'builtin'), or None for a hub name."""
    if str(source) in BUILTIN_NAMES:
        return builtin_corpus(cache_dir)
    path = Path(str(source)).expanduser()
    if not path.exists():
        return None
    if not path.is_dir():
        check_regular(path)
    return path


def _source_files(path: Path) -> list[Path]:
    if path.is_dir() and not any(path.rglob("*.txt")):  # a saved `datasets` folder: all its files
        return sorted(p for p in path.rglob("*") if p.is_file())
    return local_files(path)


def source_fingerprint(source, cache_dir=None, full_hash: bool = False) -> dict:
    """What identifies a source's content cheaply: the built-in corpus's checksum, the names, sizes and mtimes
    of local files (with `full_hash`, a sha256 of their contents as well), or a hub dataset's name."""
    if str(source) in BUILTIN_NAMES:
        return {"builtin": SHAKESPEARE_SHA256, "clean": CLEAN_VERSION}
    path = resolve_source(source, cache_dir)
    if path is None:
        return {"hub": str(source)}
    files = _source_files(path)
    listing = [[str(f.relative_to(path)) if path.is_dir() else f.name, f.stat().st_size, f.stat().st_mtime_ns]
               for f in files]
    out = {"files": len(files), "bytes": sum(x[1] for x in listing),
           "digest": hashlib.sha256(json.dumps(listing).encode()).hexdigest()}
    if full_hash:
        h = hashlib.sha256()
        for name, f in zip(listing, files):
            h.update(name[0].encode() + b"\0" + sha256_file(f).encode())
        out["sha256"] = h.hexdigest()
    return out


# ----------------------------------------------------------------------------------------------------
# Reading within bounds
def cut_pieces(data, size: int, pattern, longest: int | None = None) -> list:
    """`data` (bytes or str) cut into pieces of at least `size`, each cut just before a whitespace run; with
    `longest`, a piece that would be longer is cut at that length."""
    pieces, start = [], 0
    while len(data) - start > size:
        m = pattern.search(data, start + size)
        if m is not None and (longest is None or m.start() - start <= longest):
            cut = m.start()
        elif longest is not None and len(data) - start > longest:
            cut = start + longest
        else:
            break
        pieces.append(data[start:cut])
        start = cut
    pieces.append(data[start:])
    return pieces


def line_batches(path: Path, chunk_bytes: int, on_bad: str) -> Iterator[tuple[int, list[bytes], int]]:
    """(first line number, raw lines, bytes) of a .jsonl file, about `chunk_bytes` at a time, each batch of
    consecutive lines (a line too long to read is passed over between two batches)."""
    lines, size, first, following = [], 0, 1, 1
    for lineno, raw in jsonl_lines(path, on_bad):
        if lines and lineno != following:
            yield first, lines, size
            lines, size = [], 0
        if not lines:
            first = lineno
        lines.append(raw)
        size += len(raw)
        following = lineno + 1
        if size >= chunk_bytes:
            yield first, lines, size
            lines, size = [], 0
    if lines:
        yield first, lines, size


def _char_start(data: bytes, i: int) -> int:
    """The start of the UTF-8 character at byte i of `data` (i itself unless it is a continuation byte)."""
    while 0 < i < len(data) and data[i] & 0xC0 == 0x80:
        i -= 1
    return i


def file_pieces(path: Path, chunk_bytes: int) -> Iterator[tuple[int, bytes, bool]]:
    """(first line, bytes, at_start) pieces of a large text file, each at least `chunk_bytes` long (the last
    may be shorter), cut just before a whitespace run; a run of more than RUN_BYTES without whitespace is cut
    (between two UTF-8 characters) with a warning. Memory: a few chunks and RUN_BYTES."""
    line, at_start, buf, searched, warned = 1, True, b"", 0, False
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            buf += block
            while len(buf) > 2 * chunk_bytes or (not block and buf):
                m = _CUT.search(buf, max(chunk_bytes, searched)) if block else None
                if m is not None or not block:
                    piece, buf = (buf[:m.start()], buf[m.start():]) if m is not None else (buf, b"")
                    searched = 0
                elif len(buf) < chunk_bytes + RUN_BYTES:
                    searched = len(buf)  # no cut point up to here: read more
                    break
                else:
                    if not warned:
                        at = line + buf[:chunk_bytes].count(NEWLINE)
                        _warn(f"warning: {path}: more than {size_text(RUN_BYTES)} without whitespace from "
                              f"line {at}; it is cut into pieces there (the tokens at each cut may differ from "
                              "those of the uncut text)")
                        warned = True
                    cut = _char_start(buf, chunk_bytes)
                    piece, buf = buf[:cut], buf[cut:]
                    searched = len(buf)
                yield line, piece, at_start
                line += piece.count(b"\n")
                at_start = False
            if not block:
                return


def read_small_file(path: Path, size: int) -> bytes:
    """The bytes of a file of `size` bytes (as it was listed), reading at most one byte more: a file that
    grew meanwhile is an error, not a read without end."""
    with open(path, "rb") as f:
        raw = f.read(size + 1)
    if len(raw) > size:
        raise source_changed(path, f"it grew past the {size:,} bytes it had when it was listed")
    return raw


def source_changed(source, detail: str) -> ELFError:
    """The error of a source that changed while a store was prepared from it."""
    return ELFError(f"{source} changed while it was read ({detail}); nothing of it was kept: prepare the store "
                    "again once the source no longer changes")

"""A local data origin (the file or folder of text a store is prepared from; "source" is reserved for the
input of a conditional model) as bytes: where it is, its fingerprint (with the sha256 of each file, taken as
the file is read for tokenizing), its .jsonl lines in batches and its large .txt files in pieces cut before a
whitespace run, each read within bounds (`elflow.data.reading` makes tasks of them)."""

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
    local_source,
    size_text,
)
from elflow.util.errors import ELFError
from elflow.util.files import sha256_file

WINDOW = 2  # tasks in flight per worker


RUN_BYTES = 16 << 20  # the longest run without whitespace that a piece of a large .txt file waits for


_CUT = re.compile(rb"(?<=[!-~])[ \t\n\r\f\v]")  # just before an ASCII whitespace run that follows a visible char


NEWLINE = b"\n"


CUT_TEXT = re.compile(r"(?<=[!-~])[ \t\n\r\f\v]")
PIECE_CHARS = 1 << 16  # the length of the pieces a tokenizer call sees (cut before whitespace)
RUN_CHARS = 1 << 20  # the longest piece: a run without whitespace longer than this is cut


# ----------------------------------------------------------------------------------------------------
# Sources: fingerprints and what they are
LISTED = 256  # files whose own size, mtime and sha256 a fingerprint lists (a larger folder: the totals only)


def resolve_origin(source, cache_dir) -> Path | None:
    """The local path a source names (the built-in corpus's folder for 'builtin'), or None for a hub name; a
    link loop or a link to nothing is an ELFError saying so."""
    if str(source) in BUILTIN_NAMES:
        return builtin_corpus(cache_dir)
    path = local_source(source)
    if path is None:
        return None
    if not path.is_dir():
        check_regular(path)
    return path


def _source_files(path: Path) -> list[Path]:
    if path.is_dir() and not any(path.rglob("*.txt")):  # a saved `datasets` folder: all its files
        return sorted(p for p in path.rglob("*") if p.is_file())
    return local_files(path)


class OriginHashes:
    """The sha256 of each file of a local source, fed by the readers as they read it for tokenizing (so that
    hashing costs no second read); a file no reader read to its end is hashed whole when asked for."""

    def __init__(self):
        self._reading: dict[str, object] = {}
        self._done: dict[str, str] = {}

    def reader(self, file) -> object:
        """The hash object a reader of `file` feeds with every byte it reads, from the first."""
        h = hashlib.sha256()
        self._reading[str(file)] = h
        return h

    def finished(self, file) -> None:
        """`file` was read to its end."""
        self._done[str(file)] = self._reading.pop(str(file)).hexdigest()

    def of(self, file) -> str:
        done = self._done.get(str(file))
        return done if done is not None else sha256_file(file)


def origin_fingerprint(source, cache_dir=None, hashes: OriginHashes | None = None) -> dict:
    """What identifies a source: the built-in corpus's checksum, a hub dataset's name, or for local files
    their count, bytes and a digest of their names, sizes and mtimes (cheap: nothing is read). With `hashes`
    (after the files were read), the content too: `sha256` of the whole source (of each file's name and
    sha256) and, for up to LISTED files, `listing` of each file's [name, bytes, mtime_ns, sha256]."""
    if str(source) in BUILTIN_NAMES:
        return {"builtin": SHAKESPEARE_SHA256, "clean": CLEAN_VERSION}
    path = resolve_origin(source, cache_dir)
    if path is None:
        return {"hub": str(source)}
    files = _source_files(path)
    listing = [[str(f.relative_to(path)) if path.is_dir() else f.name, f.stat().st_size, f.stat().st_mtime_ns]
               for f in files]
    out = {"files": len(files), "bytes": sum(x[1] for x in listing),
           "digest": hashlib.sha256(json.dumps(listing).encode()).hexdigest()}
    if hashes is not None:
        whole = hashlib.sha256()
        for entry, f in zip(listing, files):
            entry.append(hashes.of(f))
            whole.update(entry[0].encode("utf-8", "surrogateescape") + b"\0" + entry[3].encode() + b"\n")
        out["sha256"] = whole.hexdigest()
        if len(listing) <= LISTED:
            out["listing"] = listing
    return out


CONTENT_KEYS = ("sha256", "listing")  # what a fingerprint holds of the content, beside the cheap listing


def cheap_part(fingerprint: dict) -> dict:
    """A source fingerprint without its content hashes: what `origin_fingerprint` gives before a read."""
    return {k: v for k, v in fingerprint.items() if k not in CONTENT_KEYS}


def origin_difference(before: dict, after: dict) -> str | None:
    """How the source of fingerprint `after` differs from that of `before` (None: the same text). Content is
    compared where both hold its sha256 (a file touched but not changed is the same), else names, sizes and
    modification times."""
    if "sha256" in before and "sha256" in after:
        if before["sha256"] == after["sha256"]:
            return None
        then = {e[0]: e for e in before.get("listing") or []}
        now = {e[0]: e for e in after.get("listing") or []}
        if then and now:
            for name in sorted(set(then) | set(now)):
                a, b = then.get(name), now.get(name)
                if a is None or b is None:
                    return f"{name} was {'added' if a is None else 'removed'}"
                if a[3] != b[3]:
                    sizes = f"{a[1]:,} bytes then, {b[1]:,} now" if a[1] != b[1] else f"still {a[1]:,} bytes"
                    return f"the text of {name} changed ({sizes}; sha256 {a[3][:12]}... then, {b[3][:12]}... now)"
        return f"its text changed (sha256 {before['sha256'][:12]}... then, {after['sha256'][:12]}... now)"
    a, b = cheap_part(before), cheap_part(after)
    if a == b:
        return None
    if a.get("files") != b.get("files"):
        return f"{a.get('files')} files then, {b.get('files')} now"
    if a.get("bytes") != b.get("bytes"):
        return f"{a.get('bytes')} bytes then, {b.get('bytes')} now"
    if "hub" in a or "hub" in b or "builtin" in a or "builtin" in b:
        return f"{a.get('hub') or 'the built-in corpus'} then, {b.get('hub') or 'the built-in corpus'} now"
    return "a file's name or modification time changed"


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


def line_batches(path: Path, chunk_bytes: int, on_bad: str, digest=None) -> Iterator[tuple[int, list[bytes], int]]:
    """(first line number, raw lines, bytes) of a .jsonl file, about `chunk_bytes` at a time, each batch of
    consecutive lines (a line too long to read is passed over between two batches). The file is read at
    most to the size it has when it is opened (one that grows meanwhile is an error); `digest` is fed every
    byte read."""
    lines, size, first, following = [], 0, 1, 1
    for lineno, raw in jsonl_lines(path, on_bad, max_bytes=path.stat().st_size, digest=digest):
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


def file_pieces(path: Path, chunk_bytes: int, digest=None) -> Iterator[tuple[int, bytes, bool]]:
    """(first line, bytes, at_start) pieces of a large text file, each at least `chunk_bytes` long (the last
    may be shorter), cut just before a whitespace run; a run of more than RUN_BYTES without whitespace is cut
    (between two UTF-8 characters) with a warning. Memory: a few chunks and RUN_BYTES. `digest` is fed every
    byte read."""
    line, at_start, buf, searched, warned = 1, True, b"", 0, False
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if digest is not None:
                digest.update(block)
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


def read_small_file(path: Path, size: int, digest=None) -> bytes:
    """The bytes of a file of `size` bytes (as it was listed), reading at most one byte more: a file that
    grew meanwhile is an error, not a read without end. `digest` is fed the bytes."""
    with open(path, "rb") as f:
        raw = f.read(size + 1)
    if len(raw) > size:
        raise origin_changed(path, f"it grew past the {size:,} bytes it had when it was listed")
    if digest is not None:
        digest.update(raw)
    return raw


def origin_changed(source, detail: str) -> ELFError:
    """The error of a source that changed while a store was prepared from it."""
    return ELFError(f"{source} changed while it was read ({detail}); nothing of it was kept: prepare the store "
                    "again once the source no longer changes")

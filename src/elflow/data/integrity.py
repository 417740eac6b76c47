"""A token store's records and arrays checked: a fingerprint or a manifest read field by field, each value of
its type and in its range (`Fingerprint.from_dict`, `check_fields`); the arrays against the manifest: ids
below the vocabulary, offsets from 0 to the ids' count and never decreasing. Every element is checked when a
store is written (`check_arrays`), sampled blocks when it is opened (`sampled_check`); the blocks' sha256 is
the store's fingerprint (`Fingerprint`)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np

from elflow.util.errors import ELFError

DTYPES = ("uint16", "uint32")  # what ids.bin may hold


BLOCKS = 16  # blocks a sampled check reads from each array (each a disk seek when the store is not cached)


BLOCK_BYTES = 1 << 16  # bytes per block (an array of at most BLOCKS * BLOCK_BYTES is read whole)


FULL_BYTES = 1 << 23  # bytes per step of the full check


MAX_BLOCKS = 1 << 12  # the most blocks a recorded fingerprint may ask a check to read from each array


MAX_BLOCK_BYTES = 1 << 26  # the largest block it may ask for


MAX_COUNT = 1 << 62  # tokens, records or bytes a record may name


MAX_VOCAB = 1 << 32  # ids.bin holds uint32 at most


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _shown(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def whole(d: dict, key: str, where, low: int, high: int, advice: str, name: str | None = None) -> int:
    """d[key], which must be an integer (not a bool, not a float) from `low` to `high`; an ELFError naming
    `where` and the field (`name`, else `key`) with `advice` otherwise."""
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        what = "missing" if key not in d else f"{_shown(v)}, not a whole number from {low:,} to {high:,}"
        raise ELFError(f"{where}: {name or key} is {what}; {advice}")
    return v


def field_of(d: dict, key: str, kind, where, advice: str, name: str | None = None, optional: bool = False):
    """d[key], which must be a `kind` (None allowed where `optional`); an ELFError naming the field otherwise."""
    v = d.get(key)
    if (v is None and optional) or (isinstance(v, kind) and not isinstance(v, bool)):
        return v
    want = {str: "a string", dict: "an object", list: "an array"}.get(kind, getattr(kind, "__name__", str(kind)))
    what = "missing" if key not in d else f"{_shown(v)}, not {want}"
    raise ELFError(f"{where}: {name or key} is {what}; {advice}")


def ids_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type holding every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def check_dtype(name, vocab_size: int, where) -> np.dtype:
    """The ids' dtype a manifest names, which must be the one elflow writes for its vocabulary size."""
    if name not in DTYPES:
        raise ELFError(f"{where}: its dtype {name!r} is not a token store's (uint16 or uint32); the manifest was "
                       "changed or damaged: prepare the store again with --overwrite")
    want = ids_dtype(vocab_size)
    if np.dtype(name) != want:
        raise ELFError(f"{where}: its dtype {name} does not fit its vocabulary of {vocab_size:,} ids (a store of that "
                       f"vocabulary holds {want.name}); the manifest was changed: prepare the store again with "
                       "--overwrite")
    return want


def check_source_fingerprint(fp, where, advice: str, name: str) -> dict:
    """A source's fingerprint as a record holds it (`sources.origin_fingerprint`: a manifest's, a checkpoint's),
    its content fields checked: `sha256` 64 hex digits, `listing` entries [name, bytes, mtime_ns, sha256],
    `files` and `bytes` counts. One ELFError naming `where` and the field (`name`.field) otherwise."""
    if not isinstance(fp, dict):
        raise ELFError(f"{where}: {name} is {_shown(fp)}, not an object; {advice}")
    for key in ("files", "bytes"):
        if key in fp:
            whole(fp, key, where, 0, MAX_COUNT, advice, f"{name}.{key}")
    if "sha256" in fp and not (isinstance(fp["sha256"], str) and _SHA256.fullmatch(fp["sha256"])):
        raise ELFError(f"{where}: {name}.sha256 is {_shown(fp['sha256'])}, not a sha256 (64 hex digits); {advice}")
    listing = fp.get("listing")
    if listing is not None:
        ok = isinstance(listing, list) and all(
            isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and isinstance(e[3], str)
            and _SHA256.fullmatch(e[3]) is not None and all(type(v) is int and v >= 0 for v in e[1:3])
            for e in listing)
        if not ok:
            raise ELFError(f"{where}: {name}.listing is not a list of [name, bytes, mtime, sha256] entries; "
                           f"{advice}")
    return fp


def block_spans(nbytes: int, itemsize: int, blocks: int = BLOCKS, block_bytes: int = BLOCK_BYTES) -> list:
    """(start, stop) byte spans of the blocks a sampled check reads: the whole array when it is small, else
    `blocks` blocks spread evenly from its first byte to its last (one block: the first), each aligned to the
    item size. `blocks` and `block_bytes` are at least 1."""
    if blocks < 1 or block_bytes < 1:
        raise ValueError(f"blocks and block_bytes must be at least 1, got {blocks} and {block_bytes}")
    if nbytes <= blocks * block_bytes:
        return [(0, nbytes)]
    if blocks == 1:
        return [(0, block_bytes)]
    step = (nbytes - block_bytes) / (blocks - 1)
    spans = []
    for i in range(blocks):
        start = int(i * step) // itemsize * itemsize
        spans.append((start, min(start + block_bytes, nbytes)))
    spans[-1] = (nbytes - block_bytes, nbytes)
    return spans


def _bad_ids(block: np.ndarray, vocab_size: int, first: int, where) -> None:
    if block.size and int(block.max()) >= vocab_size:
        at = int(np.argmax(block >= vocab_size))
        raise ELFError(f"{where}: ids.bin holds id {int(block[at]):,} at position {first + at:,}, outside the "
                       f"vocabulary of {vocab_size:,} ids its manifest names; the store was changed or damaged: "
                       "prepare it again with --overwrite")


class _Offsets:
    """The running check of offsets read in order (whole or in blocks): each within 0..tokens, none below the
    one before it, the first 0 and the last `tokens`."""

    def __init__(self, tokens: int, where):
        self.tokens, self.where, self.last = tokens, where, None

    def fail(self, why: str):
        raise ELFError(f"{self.where}: offsets.bin {why}; the store was changed or damaged: prepare it again with "
                       "--overwrite")

    def block(self, o: np.ndarray, first: int) -> None:
        """Offsets `first` .. of the file, after (not necessarily right after) those of the previous block."""
        if not o.size:
            return
        if first == 0 and int(o[0]) != 0:
            self.fail(f"starts at {int(o[0]):,}, not 0")
        low, high = int(o.min()), int(o.max())
        if low < 0 or high > self.tokens:
            at = int(np.argmax((o < 0) | (o > self.tokens)))
            self.fail(f"holds {int(o[at]):,} at entry {first + at:,}, outside 0..{self.tokens:,} (the ids' count)")
        down = np.flatnonzero(np.diff(o) < 0)
        if down.size:
            at = int(down[0])
            self.fail(f"decreases at entry {first + at + 1:,} ({int(o[at]):,} then {int(o[at + 1]):,})")
        if self.last is not None and int(o[0]) < self.last:
            self.fail(f"decreases before entry {first:,} ({self.last:,}, later {int(o[0]):,})")
        self.last = int(o[-1])

    def end(self, o_last: int) -> None:
        if o_last != self.tokens:
            self.fail(f"ends at {o_last:,}, not at the {self.tokens:,} ids of ids.bin")


@dataclass(frozen=True)
class Fingerprint:
    """What identifies a store's content cheaply: its counts and a sha256 of the sampled blocks of both arrays
    (with the kind and dtype), the same for any store of the same content; `blocks` and `block_bytes` say how
    it was sampled."""

    tokens: int
    records: int
    sha256: str
    blocks: int = BLOCKS
    block_bytes: int = BLOCK_BYTES

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "records": self.records, "sha256": self.sha256, "blocks": self.blocks,
                "block_bytes": self.block_bytes}

    @classmethod
    def from_dict(cls, d, where, advice: str = "prepare the store again with --overwrite",
                  name: str = "fingerprint") -> "Fingerprint":
        """The fingerprint a record holds (a manifest's, a checkpoint's), checked field by field: counts from 0,
        a sha256 of 64 hex digits, 1 to MAX_BLOCKS blocks of 1 to MAX_BLOCK_BYTES bytes (absent: the
        defaults). Anything else is one ELFError naming `where` and the field (`name`.field) with `advice`."""
        if not isinstance(d, dict):
            raise ELFError(f"{where}: {name} is {_shown(d)}, not an object; {advice}")
        tokens = whole(d, "tokens", where, 0, MAX_COUNT, advice, f"{name}.tokens")
        records = whole(d, "records", where, 0, MAX_COUNT, advice, f"{name}.records")
        digest = d.get("sha256")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ELFError(f"{where}: {name}.sha256 is {_shown(digest) if 'sha256' in d else 'missing'}, not a "
                           f"sha256 (64 hex digits); {advice}")
        given = {k: d[k] for k in ("blocks", "block_bytes") if k in d}
        blocks = whole({"blocks": BLOCKS, **given}, "blocks", where, 1, MAX_BLOCKS, advice, f"{name}.blocks")
        block_bytes = whole({"block_bytes": BLOCK_BYTES, **given}, "block_bytes", where, 1, MAX_BLOCK_BYTES, advice,
                            f"{name}.block_bytes")
        return cls(tokens, records, digest, blocks, block_bytes)

    def difference(self, other: "Fingerprint") -> str:
        """How `other` differs from this one, in words."""
        if (self.tokens, self.records) != (other.tokens, other.records):
            return (f"it holds {other.tokens:,} tokens in {other.records:,} records, not {self.tokens:,} in "
                    f"{self.records:,}")
        return "it holds as many tokens, but other ids (it was prepared again from other text, or edited in place)"


def sampled_check(ids: np.ndarray, offsets: np.ndarray, kind: str, records: int, vocab_size: int, where,
                  blocks: int = BLOCKS, block_bytes: int = BLOCK_BYTES) -> Fingerprint:
    """Check sampled blocks of `ids` (below `vocab_size`) and of `offsets` (within 0..len(ids), never
    decreasing, the first 0 and the last len(ids)) and return the store's fingerprint. Reads at most
    2 * blocks * block_bytes bytes."""
    tokens = int(ids.shape[0])
    h = hashlib.sha256(f"{kind}:{ids.dtype.name}:{tokens}:{offsets.shape[0]}".encode())
    for start, stop in block_spans(ids.nbytes, ids.itemsize, blocks, block_bytes):
        block = np.asarray(ids[start // ids.itemsize: stop // ids.itemsize])
        _bad_ids(block, vocab_size, start // ids.itemsize, where)
        h.update(block.tobytes())
    check = _Offsets(tokens, where)
    for start, stop in block_spans(offsets.nbytes, 8, blocks, block_bytes):
        block = np.asarray(offsets[start // 8: stop // 8])
        check.block(block, start // 8)
        h.update(block.tobytes())
    check.end(int(offsets[-1]))
    return Fingerprint(tokens, records, h.hexdigest(), blocks, block_bytes)


def check_arrays(ids: np.ndarray, offsets: np.ndarray, vocab_size: int, where, count_id: int | None = None) -> int:
    """Check every id and every offset (as `sampled_check` checks its blocks), FULL_BYTES at a time; returns
    how many ids equal `count_id` (0 without one)."""
    count = 0
    step = FULL_BYTES // ids.itemsize
    for first in range(0, ids.shape[0], step):
        block = np.asarray(ids[first:first + step])
        _bad_ids(block, vocab_size, first, where)
        if count_id is not None:
            count += int(np.count_nonzero(block == count_id))
    check = _Offsets(int(ids.shape[0]), where)
    step = FULL_BYTES // 8
    for first in range(0, offsets.shape[0], step):
        check.block(np.asarray(offsets[first:first + step]), first)
    check.end(int(offsets[-1]))
    return count

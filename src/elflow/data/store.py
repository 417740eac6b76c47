"""The token store: a corpus tokenized once into flat arrays on disk (ids.bin, offsets.bin, manifest.json),
written by `StoreWriter` and read through a memory map (`TokenStore`, `StoreRows`), both checked against the
manifest (`elflow.data.integrity`). docs/data.md has the format."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from elflow.data.integrity import (
    MAX_COUNT,
    MAX_VOCAB,
    Fingerprint,
    check_arrays,
    check_dtype,
    check_source_fingerprint,
    field_of,
    ids_dtype,
    sampled_check,
    whole,
)
from elflow.data.layout import DOCUMENT, LAYOUTS, PACKED
from elflow.data.store_folder import (  # noqa: F401  (the folder's names and locks, read from here too)
    IDS,
    LOCK,
    MANIFEST,
    OFFSETS,
    PARTIAL,
    STAGE,
    STORE_FILES,
    file_lock,
    folder_flock,
    locked_by_other,
    recover,
    store_lock,
)
from elflow.util import jsonio
from elflow.util.errors import ELFError
from elflow.util.files import atomic_write_json

FORMAT = "elflow-token-store"


VERSION = 1


PARTS = {"text": 1, "pairs": 2}  # offsets per record


WRITE_BUFFER = 8 << 20


def is_store(path) -> bool:
    """Whether `path` is a store folder: its manifest names the format, or it holds a store's arrays."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return False
    if any((path / name).exists() for name in (IDS, OFFSETS, IDS + PARTIAL, OFFSETS + PARTIAL, STAGE)):
        return True
    if not os.path.lexists(path / MANIFEST):
        return False
    try:
        return jsonio.read_json(path / MANIFEST, max_bytes=jsonio.RECORD_BYTES).get("format") == FORMAT
    except ELFError:
        return False


# ----------------------------------------------------------------------------------------------------
# Writing
class StoreWriter:
    """Appends records to a store folder's `.partial` arrays; `finish` renames them and writes the manifest
    last, `abort` removes them. Memory: the write buffers only.

    A text record is one document (its ids end with EOS: `add`); a long document may also arrive in pieces
    (`extend` ... `end_record`, or `drop_record` to forget it). A pair record is (source ids, target ids).
    Ids must lie in [0, vocab_size)."""

    def __init__(self, folder, kind: str, vocab_size: int):
        if kind not in PARTS:
            raise ValueError(f"kind must be one of {', '.join(PARTS)}, got {kind!r}")
        self.folder = Path(folder)
        self.kind, self.vocab_size = kind, int(vocab_size)
        self.dtype = ids_dtype(self.vocab_size)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._ids = open(self.folder / (IDS + PARTIAL), "wb", buffering=WRITE_BUFFER)
        self._offsets = open(self.folder / (OFFSETS + PARTIAL), "wb", buffering=WRITE_BUFFER)
        self._offsets.write(np.zeros(1, np.int64).tobytes())
        self._named: list[str] = []  # arrays already given their final names (removed by `abort`)
        self.tokens = 0  # ids written, the record in progress included
        self.committed = 0  # ids of finished records
        self.records = 0

    def _write_ids(self, ids) -> None:
        ids = np.asarray(ids)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
            raise ELFError(f"token id {bad} lies outside the tokenizer's vocabulary of {self.vocab_size} ids: the ids "
                           "were made with another tokenizer; prepare the store with the --space they belong to")
        self._ids.write(ids.astype(self.dtype, copy=False).tobytes())
        self.tokens += int(ids.size)

    def add(self, *parts) -> None:
        """One whole record: a document's ids, or a pair's (source ids, target ids)."""
        if len(parts) != PARTS[self.kind]:
            raise ValueError(f"a {self.kind} record has {PARTS[self.kind]} part(s), got {len(parts)}")
        ends = []
        for ids in parts:
            self._write_ids(ids)
            ends.append(self.tokens)
        self._offsets.write(np.asarray(ends, np.int64).tobytes())
        self.committed = self.tokens
        self.records += 1

    def add_documents(self, docs: list) -> None:
        """Many whole documents at once (a text store)."""
        if not docs:
            return
        lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
        self._write_ids(np.concatenate([np.asarray(d) for d in docs]))
        self._offsets.write((self.committed + np.cumsum(lengths)).tobytes())
        self.committed = self.tokens
        self.records += len(docs)

    def extend(self, ids) -> None:
        """Append ids to the document in progress (a text store)."""
        self._write_ids(ids)

    def end_record(self) -> None:
        self._offsets.write(np.asarray([self.tokens], np.int64).tobytes())
        self.committed = self.tokens
        self.records += 1

    def drop_record(self) -> None:
        """Forget the document in progress: the ids file goes back to the last finished record."""
        self._ids.flush()
        self._ids.truncate(self.committed * self.dtype.itemsize)
        self._ids.seek(self.committed * self.dtype.itemsize)
        self.tokens = self.committed

    def finish(self, manifest: dict, count_id: int | None = None) -> int:
        """Close the arrays (synced to disk), check every id and offset as written, give the arrays their
        names, then write the manifest with the store's fingerprint. Returns how many ids equal `count_id`."""
        if self.tokens != self.committed:
            raise RuntimeError("a document is still in progress")
        for f in (self._ids, self._offsets):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        parts = PARTS[self.kind] * self.records + 1
        ids = _map(self.folder / (IDS + PARTIAL), self.dtype, self.tokens)
        offsets = _map(self.folder / (OFFSETS + PARTIAL), np.dtype("<i8"), parts)
        count = check_arrays(ids, offsets, self.vocab_size, self.folder, count_id)
        fingerprint = sampled_check(ids, offsets, self.kind, self.records, self.vocab_size, self.folder)
        del ids, offsets
        for name in (IDS, OFFSETS):
            os.replace(self.folder / (name + PARTIAL), self.folder / name)
            self._named.append(name)
        full = {"format": FORMAT, "version": VERSION, "kind": self.kind, **manifest, "dtype": self.dtype.name,
                "records": self.records, "tokens": self.tokens,
                "bytes": {IDS: self.tokens * self.dtype.itemsize, OFFSETS: parts * 8},
                "fingerprint": fingerprint.to_dict()}
        atomic_write_json(self.folder / MANIFEST, full)
        os.chmod(self.folder / MANIFEST, 0o644)  # readable like the arrays (a temporary file is private)
        return count

    def abort(self) -> None:
        """Close and remove what this writer wrote (its arrays, under either name)."""
        for f in (self._ids, self._offsets):
            try:
                f.close()
            except OSError:
                pass
        for name in (IDS + PARTIAL, OFFSETS + PARTIAL, *self._named):
            try:
                os.unlink(self.folder / name)
            except FileNotFoundError:
                pass


def upgrade_manifest(m: dict) -> dict:
    """A manifest of an earlier elflow in today's layout: one written before stores recorded their
    fingerprint has none (its arrays are checked in sampled blocks, and compared with nothing)."""
    return m if "fingerprint" in m else {**m, "fingerprint": None}


AGAIN = "the manifest was changed or damaged: prepare the store again with --overwrite"


STORE_LAYOUTS = (*LAYOUTS, "pairs")  # a store of text rows, or of (source, target) pairs


def check_manifest(m: dict, path) -> dict:
    """A store's manifest (read from `path`) checked field by field, each value of its type and in its range;
    one ELFError naming the file and the field otherwise. The dtype is checked against the vocabulary
    apart (`integrity.check_dtype`), the fingerprint by `Fingerprint.from_dict`."""
    kind = field_of(m, "kind", str, path, AGAIN)
    if kind not in PARTS:
        raise ELFError(f"{path}: kind is {kind!r}, not one of {', '.join(PARTS)}; {AGAIN}")
    layout = field_of(m, "layout", str, path, AGAIN, optional=True)
    if layout is not None and layout not in STORE_LAYOUTS:
        raise ELFError(f"{path}: layout is {layout!r}, not one of {', '.join(STORE_LAYOUTS)}; {AGAIN}")
    tok = field_of(m, "tokenizer", dict, path, AGAIN)
    field_of(tok, "id", str, path, AGAIN, "tokenizer.id")
    field_of(tok, "space", str, path, AGAIN, "tokenizer.space", optional=True)
    vocab = whole(tok, "vocab_size", path, 1, MAX_VOCAB, AGAIN, "tokenizer.vocab_size")
    for key in ("eos_id", "pad_id"):
        whole(tok, key, path, 0, vocab - 1, AGAIN, f"tokenizer.{key}")
    field_of(m, "dtype", str, path, AGAIN)  # which one: integrity.check_dtype, against the vocabulary
    whole(m, "records", path, 1, MAX_COUNT, AGAIN)
    whole(m, "tokens", path, 1, MAX_COUNT, AGAIN)
    if "source_length" in m and m["source_length"] is not None:
        whole(m, "source_length", path, 1, MAX_COUNT, AGAIN)
    if "bytes" in m:  # the files' sizes themselves are compared with the counts (`TokenStore._check_sizes`)
        sizes = field_of(m, "bytes", dict, path, AGAIN)
        for name in (IDS, OFFSETS):
            whole(sizes, name, path, 0, MAX_COUNT, AGAIN, f"bytes.{name}")
    if m.get("fingerprint") is not None:
        Fingerprint.from_dict(m["fingerprint"], path, AGAIN)
    source = field_of(m, "source", dict, path, AGAIN, optional=True)
    if source is not None and source.get("fingerprint") is not None:
        check_source_fingerprint(source["fingerprint"], path, AGAIN, "source.fingerprint")
    field_of(m, "build", dict, path, AGAIN, optional=True)
    return m


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """A read-only memory map of `count` items of `dtype` in `path` (an empty array for an empty file)."""
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


# ----------------------------------------------------------------------------------------------------
# Reading
class TokenStore:
    """An opened store: its manifest, checked, and its arrays as read-only memory maps (nothing is loaded),
    checked in sampled blocks and against the fingerprint the manifest records (`fingerprint`)."""

    def __init__(self, folder):
        self.folder = Path(folder).expanduser()
        if os.path.lexists(self.folder / STAGE):
            recover(self.folder)
        with folder_flock(self.folder, exclusive=False):
            self.manifest = upgrade_manifest(self._read_manifest())
            m = self.manifest
            self.kind = m["kind"]
            self.layout = m.get("layout")
            tok = m["tokenizer"]
            self.tokenizer_id, self.vocab_size = tok["id"], int(tok["vocab_size"])
            self.eos_id, self.pad_id = int(tok["eos_id"]), int(tok["pad_id"])
            self.count, self.num_tokens = int(m["records"]), int(m["tokens"])
            self.dtype = check_dtype(m["dtype"], self.vocab_size, self.folder / MANIFEST)
            self._check_sizes()
            self.ids = _map(self.folder / IDS, self.dtype, self.num_tokens)
            self.offsets = _map(self.folder / OFFSETS, np.dtype("<i8"), PARTS[self.kind] * self.count + 1)
        recorded = None if m["fingerprint"] is None else Fingerprint.from_dict(m["fingerprint"],
                                                                               self.folder / MANIFEST)
        self.fingerprint = self.sampled(*((recorded.blocks, recorded.block_bytes) if recorded else ()))
        if m["fingerprint"] is not None and recorded != self.fingerprint:
            raise ELFError(f"{self.folder}: its arrays are not those its manifest describes (their fingerprint "
                           "differs: they were changed after `elflow prepare` wrote them); prepare the store again "
                           "with --overwrite")

    def sampled(self, *sampling) -> Fingerprint:
        """The arrays checked in sampled blocks (`integrity.sampled_check`; `sampling`: blocks and block bytes
        other than the default) and the fingerprint of those blocks."""
        return sampled_check(self.ids, self.offsets, self.kind, self.count, self.vocab_size, self.folder, *sampling)

    def _read_manifest(self) -> dict:
        f = self.folder
        if not f.is_dir():
            raise ELFError(f"{f} is not a token store folder (it does not exist); make one with `elflow prepare`")
        path = f / MANIFEST
        if not os.path.lexists(path):
            if locked_by_other(f):
                state = "it is being written by a running `elflow prepare`; wait for it to finish"
            elif any((f / n).exists() for n in (IDS, OFFSETS, IDS + PARTIAL, OFFSETS + PARTIAL)):
                state = ("its prepare was stopped before it finished, or the manifest was removed; run `elflow "
                         "prepare` again with --overwrite")
            else:
                state = "it holds no store; make one with `elflow prepare`"
            raise ELFError(f"{f} has no {MANIFEST}: {state}")
        try:
            m = jsonio.read_json(path, kind=None, max_bytes=jsonio.RECORD_BYTES, own=True)
        except ELFError as e:
            raise ELFError(f"{e}; prepare the store again with --overwrite") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ELFError(f"{path} is not the manifest of an elflow token store")
        version = m.get("version")
        if isinstance(version, bool) or version != VERSION:
            shown = version if isinstance(version, (int, str)) and len(str(version)) < 20 else "unknown"
            raise ELFError(f"{f} is a token store of format version {shown}; this elflow reads version {VERSION}: "
                           "prepare it again")
        return check_manifest(m, path)

    def _check_sizes(self) -> None:
        expected = {IDS: self.num_tokens * self.dtype.itemsize, OFFSETS: (PARTS[self.kind] * self.count + 1) * 8}
        for name, size in expected.items():
            path = self.folder / name
            have = path.stat().st_size if path.is_file() else None
            if have != size:
                what = "is missing" if have is None else f"holds {have:,} bytes"
                raise ELFError(f"{path} {what}, but the manifest says {size:,} ({self.num_tokens:,} tokens in "
                               f"{self.count:,} records): the store is truncated or was changed; prepare it again "
                               "with --overwrite")

    # --- identity -------------------------------------------------------------------------------------
    def describe_tokenizer(self) -> str:
        space = self.manifest["tokenizer"].get("space")
        return f"the tokenizer of {space!r} ({self.tokenizer_id})" if space else f"tokenizer {self.tokenizer_id}"

    def check_space(self, space, flag: str = "--space") -> None:
        """Refuse a space whose tokenizer is not the one the store was made with."""
        mine = getattr(space, "tokenizer_id", None)
        if mine != self.tokenizer_id:
            name = getattr(space, "name", None) or getattr(space, "label", "this space")
            raise ELFError(f"{self.folder} was prepared with {self.describe_tokenizer()}, but {flag} uses the "
                           f"tokenizer of {name!r} ({mine}): train with the space the store was made for, or "
                           "prepare the store again with `elflow prepare ... --space` of this run")
        theirs = getattr(space, "vocab_size", None)
        if theirs is not None and int(theirs) != self.vocab_size:
            raise ELFError(f"{self.folder / MANIFEST} names a vocabulary of {self.vocab_size:,} ids, but its "
                           f"tokenizer has {int(theirs):,}; the manifest was changed: prepare the store again with "
                           "--overwrite")

    # --- records --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.count

    def record(self, i: int) -> list[np.ndarray]:
        """Record i's parts (a document, or a pair's source and target) as arrays read from the map."""
        p = PARTS[self.kind]
        o = self.offsets[p * i: p * i + p + 1]
        return [np.asarray(self.ids[o[k]:o[k + 1]]) for k in range(p)]

    def part_lengths(self, part: int = 0) -> np.ndarray:
        """(records,) lengths of each record's part `part` (0: documents or sources, 1: targets)."""
        p = PARTS[self.kind]
        return np.asarray(self.offsets[part + 1::p]) - np.asarray(self.offsets[part:-1:p])

    def rows(self, layout: str | None = None, length: int = 64, pad_in_loss: bool = True,
             source_length: int | None = None, fixed_slot: bool = False) -> "StoreRows":
        return StoreRows(self, layout or self.layout, length, pad_in_loss, source_length, fixed_slot=fixed_slot)


def _as_index(idx) -> np.ndarray:
    if isinstance(idx, torch.Tensor):
        return idx.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(idx, dtype=np.int64)


class StoreRows:
    """(N, L) rows of a store in one layout, read on demand from its memory map.

    The interface of `data.TokenDataset`: `len`, `length`, `batch(idx)` (dict of tokens (B, L) long, mask,
    attention_mask and, for pairs, known (B, L) bool), `subset(idx)` (an index array, no copy) and `info`.
    `tokens`, `mask`, `attention_mask` and `known` gather every row of the set: meant for small sets."""

    def __init__(self, store: TokenStore, layout: str, length: int, pad_in_loss: bool = True,
                 source_length: int | None = None, index: np.ndarray | None = None, info: dict | None = None,
                 fixed_slot: bool = False):
        layouts = ("pairs",) if store.kind == "pairs" else LAYOUTS
        if layout not in layouts:
            other = ("it holds (source, target) pairs: train on it with --source-length" if store.kind == "pairs"
                     else "it holds text: pairs need a store prepared with --source-length")
            raise ELFError(f"{store.folder} cannot be read in the {layout!r} layout: {other}")
        if length < 2:
            raise ELFError(f"sequence length must be at least 2, got {length}")
        if layout == "pairs" and not (source_length and 0 < source_length < length):
            raise ELFError(f"the source length {source_length} must be between 1 and the sequence length "
                           f"{length} - 1, so that a target fits")
        self.store, self.layout, self._length = store, layout, int(length)
        self.pad_in_loss, self.source_length, self.fixed_slot = pad_in_loss, source_length, bool(fixed_slot)
        if layout == PACKED:
            self.num_rows = store.num_tokens // self._length
            if self.num_rows == 0:
                raise ELFError(f"the store {store.folder} holds only {store.num_tokens} tokens, shorter than one "
                               f"sequence of {length}: use a smaller --length or more text")
        else:
            self.num_rows = store.count
        self.index = index  # rows of the store this set holds (None: all, in order)
        self.info = dict(info or {})

    def __len__(self) -> int:
        return self.num_rows if self.index is None else int(len(self.index))

    @property
    def length(self) -> int:
        return self._length

    def subset(self, idx) -> "StoreRows":
        idx = _as_index(idx)
        index = idx if self.index is None else self.index[idx]
        if len(index) and int(index.max()) < 2**31:
            index = index.astype(np.int32)  # 4 bytes a row
        return StoreRows(self.store, self.layout, self._length, self.pad_in_loss, self.source_length, index,
                         self.info, self.fixed_slot)

    def batch(self, idx) -> dict:
        rows = _as_index(idx)
        if self.index is not None:
            rows = self.index[rows].astype(np.int64)
        L, s = self._length, self.store
        pos = np.arange(L, dtype=np.int64)[None, :]  # (1, L)
        if self.layout == PACKED:
            tokens = np.asarray(s.ids[rows[:, None] * L + pos]).astype(np.int64)  # (B, L)
            out = {"tokens": tokens, "mask": np.ones(tokens.shape, bool), "attention_mask": np.ones(tokens.shape, bool)}
        elif self.layout == DOCUMENT:
            start, end = np.asarray(s.offsets[rows])[:, None], np.asarray(s.offsets[rows + 1])[:, None]
            self._check_bounds(rows, start, end)
            real = pos < np.minimum(end - start, L)  # (B, L): the document's tokens, its EOS included
            tokens = np.where(real, s.ids[np.where(real, start + pos, 0)], s.pad_id).astype(np.int64)
            tokens[(end - start)[:, 0] > L, L - 1] = s.eos_id  # a cut document keeps its EOS
            out = {"tokens": tokens, "mask": np.ones(real.shape, bool) if self.pad_in_loss else real.copy(),
                   "attention_mask": real}
        else:
            s0 = np.asarray(s.offsets[2 * rows])[:, None]
            s1 = np.asarray(s.offsets[2 * rows + 1])[:, None]
            end = np.asarray(s.offsets[2 * rows + 2])[:, None]
            self._check_bounds(rows, s0, s1, end)
            given = np.minimum(s1 - s0, self.source_length)  # (B, 1): the source's ids in the row
            src = np.full_like(given, self.source_length) if self.fixed_slot else given  # where the target starts
            known, valid = pos < src, pos < np.minimum(src + end - s1, L)
            where = np.where(known, s0 + pos, s1 + pos - src)
            real = valid & ((pos < given) | ~known)  # a fixed slot's tail past its source holds padding
            tokens = np.where(real, s.ids[np.where(real, where, 0)], s.pad_id).astype(np.int64)
            out = {"tokens": tokens, "mask": np.ones(valid.shape, bool), "attention_mask": valid, "known": known}
        if out["tokens"].size and int(out["tokens"].max()) >= s.vocab_size:
            raise ELFError(f"{s.folder}: a row read from it holds id {int(out['tokens'].max()):,}, outside its "
                           f"vocabulary of {s.vocab_size:,} ids; the store was changed or damaged: prepare it again "
                           "with --overwrite")
        return {k: torch.from_numpy(v) for k, v in out.items()}  # numpy does the work: no thread pool

    def _check_bounds(self, rows: np.ndarray, *bounds: np.ndarray) -> None:
        """The offsets a batch reads lie in the ids and never decrease (checked in full when the store was
        written, in samples when it was opened)."""
        b = np.concatenate(bounds, axis=1)  # (B, parts + 1)
        bad = (b[:, 0] < 0) | (b[:, -1] > self.store.num_tokens) | (np.diff(b, axis=1) < 0).any(axis=1)
        if bad.any():
            i = int(np.argmax(bad))
            raise ELFError(f"{self.store.folder}: offsets.bin gives record {int(rows[i]):,} the bounds "
                           f"{b[i].tolist()}, outside the {self.store.num_tokens:,} ids or decreasing; the store was "
                           "changed or damaged: prepare it again with --overwrite")

    def _all(self, key: str):
        return self.batch(np.arange(len(self)))[key]

    @property
    def tokens(self) -> torch.Tensor:
        return self._all("tokens")

    @property
    def mask(self) -> torch.Tensor:
        return self._all("mask")

    @property
    def attention_mask(self) -> torch.Tensor:
        return self._all("attention_mask")

    @property
    def known(self) -> torch.Tensor | None:
        return self._all("known") if self.layout == "pairs" else None

    def sources_cut(self) -> int:
        """How many pairs have a source longer than `source_length` (cut in their rows)."""
        lengths = self.store.part_lengths(0)
        if self.index is not None:
            lengths = lengths[self.index]
        return int((lengths > self.source_length).sum()) if self.layout == "pairs" else 0
